"""The weights of the device model against the reference's, node by node.

Where both graphs are at hand (``--device-model``, or an FP16 build the
collector makes from the reference), every weight of a paired node is
compared directly, so a wrong parameter is named as the cause without a
dump of the node's inputs. Each weight gets one relation:

- ``equal``, ``rounded`` (within FP16 rounding), ``quantized`` (within half
  an INT8 step of the tensor's range), ``transposed`` (stored transposed),
  ``folded`` (scaled per output channel: a BatchNormalization folded in) -
  the device holds the reference's weight;
- ``clamped`` (values beyond some bound replaced by the bound, as FP16
  converters do with -3.4e38 masks and large variances), ``different``,
  ``shape differs`` - the device computes with another parameter: *cause:
  weight* for a computation error at that node;
- ``unknown``: a value the graph computes at run time, or a blocked layout.

An attribute of two paired nodes of the same op that differs (a negative
``epsilon``, another ``alpha``) is listed as a ``different`` parameter too.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

COLUMNS = ["reference_node", "reference_weight", "device_node", "device_weight", "relation", "elements",
           "differing", "max_abs_diff", "note"]
WRONG = frozenset({"clamped", "different", "shape differs"})
_FP16_EPS = 2.0 ** -10
_FP16_TINY = 2.0 ** -24      # FP16's smallest subnormal


def relation(dev: np.ndarray | None, ref: np.ndarray | None, blocked: bool = False,
             folding: bool = False) -> tuple[str, int, float, str]:
    """(relation, elements differing, largest absolute difference, note);
    ``folding``: the device node covers a BatchNormalization or affine
    constant, so a weight scaled per output channel is expected."""
    if blocked:
        return "unknown", 0, float("nan"), "stored in a blocked (NCHWc) layout"
    if dev is None or ref is None:
        return "unknown", 0, float("nan"), "computed at run time"
    if isinstance(dev, np.ndarray) and isinstance(ref, np.ndarray) and dev.dtype == ref.dtype \
            and dev.shape == ref.shape and np.array_equal(dev, ref):
        return "equal", 0, 0.0, ""      # most weights of a build: one pass, no float64 copies
    rounded = _fp16_rounding(dev, ref)
    if rounded is not None:
        return ("rounded", 0, rounded, "within FP16 rounding") if rounded else ("equal", 0, 0.0, "")
    note = ""
    dev, ref = np.atleast_1d(np.asarray(dev, np.float64)), np.atleast_1d(np.asarray(ref, np.float64))
    if dev.shape != ref.shape:
        if dev.ndim == 2 and dev.T.shape == ref.shape:
            dev, note = dev.T, "transposed"
        elif dev.size == ref.size:
            dev = dev.reshape(ref.shape)
        else:
            return "shape differs", ref.size, float("nan"), f"{list(dev.shape)} on the device, {list(ref.shape)} here"
    if ref.size == 0:
        return "equal", 0, 0.0, note
    with np.errstate(all="ignore"):
        diff = np.abs(dev - ref)
        diff[np.isnan(dev) & np.isnan(ref)] = 0.0
        same_inf = np.isinf(dev) & np.isinf(ref) & (np.sign(dev) == np.sign(ref))
        diff[same_inf] = 0.0
    worst = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("inf")
    if np.isnan(diff).any():
        worst = float("nan")
    if worst == 0.0:
        return ("transposed" if note else "equal"), 0, 0.0, note
    scale = float(np.max(np.abs(ref[np.isfinite(ref)]))) if np.isfinite(ref).any() else 1.0
    rounded = diff <= _FP16_EPS * np.abs(ref) + 6e-8
    if rounded.all():
        return ("transposed" if note else "rounded"), 0, worst, note or "within FP16 rounding"
    if worst <= scale / 254.0 * 1.01:
        return "quantized", 0, worst, "within half an INT8 step of the weight's range"
    off = ~rounded
    bound = float(np.max(np.abs(dev[off]))) if off.any() else 0.0
    if off.any() and bound > 0 and np.all(np.abs(ref[off]) > bound) and \
            np.allclose(np.abs(dev[off]), bound, rtol=1e-3) and np.all(np.sign(dev[off]) == np.sign(ref[off])):
        return "clamped", int(off.sum()), worst, f"{int(off.sum())} value(s) beyond ±{bound:.5g} clamped to it " \
                                                 f"(reference up to {float(np.max(np.abs(ref[off]))):.3g})"
    if folding and _scaled_per_channel(dev, ref):
        return "folded", 0, worst, "scaled per output channel (a BatchNormalization folded in)"
    tol = 1e-3 * np.abs(ref) + 1e-6 * scale
    return "different", int((diff > tol).sum()), worst, note


def _fp16_rounding(dev, ref) -> float | None:
    """For a float16 weight that is exactly a finite float32 weight rounded
    to FP16 (what an FP16 build stores), the largest difference; None for
    anything else, which the general comparison decides. The difference of
    a value and its rounding is exact in float32, so this is the float64
    figure, in a few passes over the stored types instead of a dozen over
    float64 copies."""
    if not (isinstance(dev, np.ndarray) and isinstance(ref, np.ndarray) and dev.dtype == np.float16
            and ref.dtype == np.float32 and dev.shape == ref.shape and ref.size):
        return None
    with np.errstate(over="ignore"):
        lifted = ref.astype(np.float16).view(np.uint16) != dev.view(np.uint16)
    diff = np.abs(dev.astype(np.float32) - ref)
    worst = 0.0
    if lifted.any():
        # only what converters do to magnitudes below FP16's smallest
        # subnormal (2**-24: lifted to it, sign kept) is a rounding too; its
        # difference is taken in float64, where float32 could round it
        r, d = ref[lifted].astype(np.float64), dev[lifted].astype(np.float64)
        if not (np.all(np.abs(r) < _FP16_TINY) and np.all(np.abs(d) == _FP16_TINY)
                and np.all(np.sign(d) == np.sign(r))):
            return None
        worst = float(np.max(np.abs(d - r)))
        diff[lifted] = 0.0
    worst = max(worst, float(diff.max()))
    return worst if np.isfinite(worst) else None


_NAMES = ("reference_node", "reference_weight", "device_node", "device_weight")


def compare(weights: list[dict]) -> list[dict]:
    """The rows of weights.csv from GraphAlignment.weights."""
    rows = []
    for w in weights:
        elements: int | str
        if "attribute" in w:
            ref_v, dev_v = w["attribute"]
            rel, elements, differing, worst = "different", 1, 1, float("nan")
            note = f"{dev_v!r} on the device, {ref_v!r} in the reference"
        elif "same_elements" in w:     # the same stored tensor (type, shape, bytes)
            rel, elements, differing, worst, note = "equal", w["same_elements"], 0, 0.0, ""
        else:
            try:
                rel, differing, worst, note = relation(w.get("device"), w.get("reference"), w.get("blocked", False),
                                                       w.get("folding", False))
            except (ValueError, TypeError, FloatingPointError) as e:     # a value of a kind not compared here
                rel, differing, worst, note = "unknown", 0, float("nan"), f"not compared ({type(e).__name__})"
            ref = w.get("reference")
            elements = int(np.size(ref)) if ref is not None else ""
        rows.append({**{k: w[k] for k in _NAMES}, "relation": rel, "elements": elements, "differing": differing,
                     "max_abs_diff": worst, "note": note})
    return rows


def issues(rows: list[dict], groups: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Reference node -> a sentence per weight the device holds wrongly; a
    node inside a fused group speaks for the whole group."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r["relation"] not in WRONG:
            continue
        text = f"{r['reference_weight']} {r['relation']} on the device"
        if r["relation"] == "different" and r["note"] and r["reference_weight"].endswith("(attribute)"):
            text += f" ({r['note']})"
        elif r["relation"] == "different":
            text += f" ({r['differing']}/{r['elements']} values, largest difference {r['max_abs_diff']:.3g})"
        elif r["note"]:
            text += f" ({r['note']})"
        out.setdefault(r["reference_node"], []).append(text)
    for nodes in (groups or {}).values():
        found = [t for n in nodes for t in out.get(n, [])]
        if found:
            for n in nodes:
                out[n] = list(dict.fromkeys(out.get(n, []) + found))
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            worst = r["max_abs_diff"]
            w.writerow([r["reference_node"], r["reference_weight"], r["device_node"], r["device_weight"],
                        r["relation"], r["elements"], r["differing"],
                        "" if worst != worst else f"{worst:.6g}", r["note"]])


def _scaled_per_channel(dev: np.ndarray, ref: np.ndarray) -> bool:
    # the graphs' package (its aligner) loaded by the jobs that pair weights only
    from layerdiff.analyzer.align.graph.weights import scaled_per_channel

    return scaled_per_channel(dev, ref, 0.9999)
