"""The TensorFlow part of ``make demo``: a small Keras segmentation network
(stem, two branches, a residual add, an upsampled probability map) on the
rendered page, kept as a Keras file and as a SavedModel, compared

- as a Keras file against its ``mixed_float16`` run (``--precision fp16``:
  the collector rebuilds the network under that policy, a real FP16
  execution on TensorFlow), and
- as a SavedModel against a mixed-precision SavedModel export of the same
  network given as ``--device-model``, one of whose kernels is damaged, as a
  faulty converter would: the report names that layer's convolution first.

The weights are the network's seeded initialization (no download needed);
what is compared is the arithmetic, which does not care."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")   # as layerdiff.common.tf.graph: no start-up chatter

DAMAGED_LAYER = "branch_wide"


def page_nhwc(height: int = 96, width: int = 128) -> np.ndarray:
    from layerdiff.client.demo import render_page

    img = render_page(height, width).astype(np.float32) / 255.0
    return ((img - 0.5) / 0.25)[None]


def build(policy: str = "float32"):
    import keras
    from keras import layers

    inp = keras.Input((96, 128, 3), name="page")
    x = layers.Conv2D(16, 3, strides=2, padding="same", name="stem", dtype=policy)(inp)
    x = layers.BatchNormalization(name="stem_bn", dtype=policy)(x)
    x = layers.ReLU(name="stem_relu", dtype=policy)(x)
    a = layers.Conv2D(16, 3, padding="same", activation="relu", name="branch_narrow", dtype=policy)(x)
    b = layers.Conv2D(16, 5, padding="same", activation="relu", name="branch_wide", dtype=policy)(x)
    m = layers.Concatenate(name="merge", dtype=policy)([a, b])
    m = layers.Conv2D(16, 1, name="fuse", dtype=policy)(m)
    r = layers.Add(name="residual", dtype=policy)([m, x])
    r = layers.ReLU(name="residual_relu", dtype=policy)(r)
    up = layers.UpSampling2D(2, interpolation="bilinear", name="upsample", dtype=policy)(r)
    out = layers.Conv2D(1, 3, padding="same", activation="sigmoid", name="prob_map", dtype=policy)(up)
    return keras.Model(inp, out, name="pagenet")


def write_models(out: Path) -> dict:
    import keras

    out.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(11)
    ref = build()
    ref(page_nhwc())   # settle the BatchNormalization statistics at their initial values
    dev = build("mixed_float16")
    dev.set_weights(ref.get_weights())
    kernel, bias = dev.get_layer(DAMAGED_LAYER).get_weights()
    dev.get_layer(DAMAGED_LAYER).set_weights([kernel[::-1], bias])   # flipped kernel rows
    ref.save(out / "pagenet.keras")
    ref.export(out / "pagenet_savedmodel", verbose=False)
    dev.export(out / "pagenet_fp16_savedmodel", verbose=False)
    np.savez(out / "page_nhwc.npz", page=page_nhwc())
    return {"keras": out / "pagenet.keras", "savedmodel": out / "pagenet_savedmodel",
            "device": out / "pagenet_fp16_savedmodel", "inputs": out / "page_nhwc.npz"}


def main(out: Path) -> int:
    from layerdiff.client.cli import main as cli

    files = write_models(out / "tf-models")
    status = 0
    for args in (["run", str(files["keras"]), "--inputs", str(files["inputs"]), "--precision", "fp16",
                  "--out", str(out / "keras-fp16")],
                 ["run", str(files["savedmodel"]), "--inputs", str(files["inputs"]), "--device-model",
                  str(files["device"]), "--out", str(out / "savedmodel-device")]):
        print(f"\n$ layerdiff {' '.join(args)}", flush=True)
        # the demo shows failing nodes (exit status 1); only no answer is a failure
        code = cli(args)
        status = max(status, code if code not in (0, 1) else 0)
    return status
