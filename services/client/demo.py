"""``make demo``: a real pretrained text detector (PP-OCRv4 det, a DBNet
CNN whose weights ship inside the rapidocr-onnxruntime wheel) on a rendered
page of text, compared in FP16 and in INT8 against its FP32 reference with
``layerdiff run`` and the embedded default services; then, where TensorFlow
is installed, a Keras network on the same page against its mixed_float16 run
(see layerdiff.client.tfdemo)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from layerdiff.common.errors import LayerdiffError

DET_MODEL = "ch_PP-OCRv4_det_infer.onnx"
REC_MODEL = "ch_PP-OCRv4_rec_infer.onnx"

PAGE_TEXT = [
    "INVOICE No. 2026-1122   Date: 22 Nov 2026",
    "Item            Qty    Unit price     Total",
    "NPU board        2       1,250.00   2,500.00",
    "FP16 kernel      1         480.00     480.00",
    "Support (1 yr)   1         300.00     300.00",
    "Subtotal                            3,280.00",
    "VAT 20%                               656.00",
    "TOTAL DUE                         3,936.00 EUR",
]


def packaged_model(filename: str = DET_MODEL) -> Path:
    """Path of a model file shipped inside the rapidocr-onnxruntime wheel
    (found without importing the package, whose runtime needs OpenCV)."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise LayerdiffError("the demo model package is not installed; run `make setup`",
                             field="rapidocr-onnxruntime")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / filename
    if not path.exists():
        raise LayerdiffError("is missing from the installed package", file=str(path))
    return path


def render_page(height: int = 320, width: int = 480) -> np.ndarray:
    """An RGB uint8 image of a printed page: dark text lines on light paper."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (width, height), (246, 244, 238))
    draw = ImageDraw.Draw(img)
    size = max(10, height // 22)
    try:
        font = ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizes
        font = ImageFont.load_default()
    y = size
    for line in PAGE_TEXT:
        draw.text((size, y), line, fill=(25, 25, 30), font=font)
        y += int(size * 1.8)
        if y > height - size:
            break
    rng = np.random.default_rng(7)
    arr = np.asarray(img, dtype=np.float32) + rng.normal(0, 3.0, (height, width, 3))  # scanner noise
    return np.clip(arr, 0, 255).astype(np.uint8)


def det_input(height: int = 320, width: int = 480) -> np.ndarray:
    """The detector's preprocessing: scale to [0,1], ImageNet mean/std, NCHW."""
    img = render_page(height, width).astype(np.float32) / 255.0
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    x = (img - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def write_inputs(path: Path, height: int = 320, width: int = 480) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=det_input(height, width))
    return path


def main(argv: list[str] | None = None) -> int:
    from layerdiff.client.cli import main as cli

    out = Path(argv[0] if argv else "demo-out")
    model = packaged_model()
    inputs = write_inputs(out / "page.npz")
    status = 0
    for precision in ("fp16", "int8"):
        args = ["run", str(model), "--inputs", str(inputs), "--device", "cpu", "--precision", precision,
                "--out", str(out / precision)]
        print(f"\n$ layerdiff {' '.join(args)}", flush=True)
        # the demo shows failing nodes (exit status 1); only no answer is a failure
        code = cli(args)
        status = max(status, code if code not in (0, 1) else 0)
    if importlib.util.find_spec("tensorflow") is not None:
        from layerdiff.client import tfdemo

        status |= tfdemo.main(out)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
