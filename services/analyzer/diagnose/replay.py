"""PyTorch operators replayed in FP32 on the CPU: the isolated re-run of a
node of a PyTorch capture (``layerdiff.torch``, level="operator"), from the
device's own recorded inputs and the operator's recorded arguments, as
msprobe's run_ut does for torch_npu.

The operator is called by its ATen name (``aten.convolution.default``) with
its arguments rebuilt from the capture's JSON: each ``{"tensor": N}`` is the
device's input N, in FP32 (a float16, bfloat16 or FP8 input is widened, so
the replay computes what the device should have from what it read); a
low-precision dtype argument (a cast to bfloat16) is FP32's, so the replay
is the FP32 version of the call. Nothing but JSON is read. torch is
imported only here, only when a replay is asked for; without it the node is
judged without a re-run, and said so.
"""
from __future__ import annotations

import numpy as np

from layerdiff.analyzer.diagnose.isolation import IsolationUnavailable

_NARROW = ("torch.float16", "torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.half")
# operators whose replay says nothing of the device: they make values, not compute on them
_NOT_REPLAYED = ("randn", "rand", "empty", "zeros", "ones", "full", "arange", "normal", "dropout", "bernoulli",
                 "native_dropout", "randint", "uniform")


def replay(op: str, args, inputs: dict[int, np.ndarray]) -> list[np.ndarray]:
    """The outputs of ATen operator ``op`` (``aten.name.overload``) called in
    FP32 with ``args`` (the capture's JSON: [positional, keyword]) and the
    device's inputs by index."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten" or not all(p.replace("_", "").isalnum() for p in parts[1:]):
        raise IsolationUnavailable(f"{op!r} is not an ATen operator name")
    if parts[1].rstrip("_") in _NOT_REPLAYED:
        raise IsolationUnavailable(f"{parts[1]} makes its values: a re-run says nothing of the device")
    try:
        import torch
    except ImportError:
        raise IsolationUnavailable("PyTorch is not installed on the analyzer: the operator is not replayed") \
            from None
    packet = getattr(torch.ops.aten, parts[1], None)
    func = getattr(packet, parts[2], None) if packet is not None else None
    if func is None:
        raise IsolationUnavailable(f"this PyTorch has no operator {op}")
    if not isinstance(args, list) or len(args) != 2 or not isinstance(args[0], list) or not isinstance(args[1], dict):
        raise IsolationUnavailable("the recorded arguments are not [positional, keyword]")

    def build(v):
        if isinstance(v, dict):
            if set(v) == {"tensor"} and isinstance(v["tensor"], int):
                k = v["tensor"]
                if k not in inputs:
                    raise IsolationUnavailable(f"the device value of its input {k} is not available")
                a = np.asarray(inputs[k])
                t = torch.from_numpy(np.ascontiguousarray(a))
                return t.float() if t.is_floating_point() else t
            if set(v) == {"repr"}:
                text = str(v["repr"])
                if text in _NARROW or text.startswith("torch.float"):
                    return torch.float32
                if text.startswith("torch.") and hasattr(torch, text[6:]):
                    return getattr(torch, text[6:])
                if text in ("cpu", "cuda", "npu") or text.startswith(("cuda:", "npu:")):
                    return torch.device("cpu")
                raise IsolationUnavailable(f"an argument {text!r} cannot be rebuilt")
            return {str(k): build(x) for k, x in v.items()}
        if isinstance(v, list):
            return [build(x) for x in v]
        if v == "nan":
            return float("nan")
        return v

    positional, keyword = build(args[0]), build(args[1])
    try:
        with torch.no_grad():
            out = func(*positional, **keyword)
    except Exception as e:      # an argument the operator refuses in this form: no replay, the node still judged
        raise IsolationUnavailable(f"the replay of {op} failed ({type(e).__name__})") from None
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [o.detach().float().numpy() if o.is_floating_point() else o.detach().numpy()
            for o in outs if isinstance(o, torch.Tensor)]
