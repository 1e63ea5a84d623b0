"""Golden runs from PyTorch: every module's (or every operator's) inputs and
outputs of a model, written as the seed's HDF5 dump layout
``/op/seqid/{input,output}/N``, which layerdiff reads as a dump (``--dump
run.h5``; the first call of ``op`` is the node ``op``, later calls
``op@k``, output N > 0 is ``op:N``; each call's execution order is its
group's ``order`` attribute).

    from layerdiff.torch import capture

    with capture(model, "cpu.h5"):          # on the reference device
        model(x)
    with capture(npu_model, "npu.h5"):      # and the same on the device
        npu_model(x.to("npu"))

``level="module"`` (default) hooks every leaf module (``layer1.0.conv1``);
``level="operator"`` records every ATen operator the forward dispatches
(``aten.convolution.default``). Tensors are written as they came (moved to
the CPU; bfloat16 and the float8 types, which NumPy lacks, as float32 with
the original dtype in the dataset's ``dtype`` attribute; a float32 output of
a convolution or matrix product a CUDA device computed with TF32 allowed,
as ``tfloat32``).

A call's inputs are copied before it runs (an in-place op overwrites
them: the file holds what it read). The call that wrote the model's result
says so: a ``model_output`` attribute, the JSON list of its output indices,
which a comparison without the model's graph judges the run by.

What a re-run of the call needs is written beside its tensors, as JSON
attributes of the call's group (never pickled):

- module level: ``class`` (``Conv2d``) and ``attrs``, the module's
  configuration (``in_channels``, ``kernel_size``, ``groups``, ``eps``...):
  what the error model reads a reduction length from;
- operator level: ``op`` (``aten.convolution.default``) and ``args``, the
  operator's arguments with each tensor replaced by ``{"tensor": N}``, its
  index among the call's inputs (stride, padding, dims, dtypes as written):
  the analyzer replays the operator in FP32 on the CPU with the device's
  recorded inputs.

Only this module imports torch, and only when used.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

LEVELS = ("module", "operator")


class _Writer:
    """The HDF5 file being written; owns the per-op call counters."""

    def __init__(self, path: Path, max_calls: int) -> None:
        import h5py

        self.file = h5py.File(path, "w", track_order=True)
        self.calls: dict[str, int] = {}
        self.order = 0      # calls recorded so far, of every op: the execution order
        self.max_calls = max_calls
        self.dropped = 0
        # the call output that last held each tensor's storage: which calls
        # wrote the model's outputs (model_outputs)
        self.produced: dict[tuple, tuple] = {}

    # what a CUDA device computes a convolution or a matrix product in when
    # TF32 is allowed (cuDNN allows it for convolutions by default): float32
    # tensors, 11-bit products; set by capture() from torch.backends
    tf32_ops: frozenset = frozenset()

    def full(self, op: str) -> bool:
        """Whether ``op``'s calls are all kept already (the next is dropped)."""
        return self.calls.get(op, 0) >= self.max_calls

    def snapshot(self, values) -> list:
        """The tensors of a call's inputs, copied now: an in-place op (a
        ``ReLU(inplace=True)``, ``aten.relu_``) overwrites them before the
        call returns."""
        return [_to_numpy(t, copy=True) for t in _tensors(values)]

    def record(self, op: str, inputs: list, outputs, about: dict | None = None) -> None:
        """One call: its inputs (``snapshot``-ed before it ran) and outputs,
        and ``about`` it (JSON-able attributes of the call's group: class and
        attrs, or op and args)."""
        import json

        seq = self.calls.get(op, 0)
        if seq >= self.max_calls:      # a training loop: the first calls are what a comparison needs
            self.dropped += 1
            return
        self.calls[op] = seq + 1
        key = op.replace("/", ".")
        op_group = self.file[key] if key in self.file else self.file.create_group(key, track_order=True)
        group = op_group.create_group(str(seq), track_order=True)
        group.attrs["order"] = self.order
        for name, value in (about or {}).items():
            group.attrs[name] = value if isinstance(value, str) else json.dumps(value)
        self.order += 1
        kind = (about or {}).get("class") or (about or {}).get("op") or ""
        side = group.create_group("input", track_order=True)
        for n, (arr, dtype) in enumerate(inputs):
            ds = side.create_dataset(str(n), data=arr)
            if dtype:
                ds.attrs["dtype"] = dtype
        side = group.create_group("output", track_order=True)
        for n, t in enumerate(_tensors(outputs)):
            arr, dtype = _to_numpy(t)
            ds = side.create_dataset(str(n), data=arr)
            if not dtype and arr.dtype == np.float32 and t.is_cuda and _base_op(kind) in self.tf32_ops:
                dtype = "tfloat32"      # float32 storage, TF32 products
            if dtype:
                ds.attrs["dtype"] = dtype
            self.produced[_identity(t)] = (group, n)

    def model_outputs(self, outputs) -> None:
        """Mark the recorded outputs that are the model's own (the root
        module's result): a ``model_output`` attribute on their call's group,
        the JSON list of their output indices. What a comparison without
        the model's graph judges the run's outcome by."""
        import json

        marks: dict = {}
        for t in _tensors(outputs):
            hit = self.produced.get(_identity(t))
            if hit is not None:
                marks.setdefault(hit[0].name, (hit[0], []))[1].append(hit[1])
        for group, idx in marks.values():
            group.attrs["model_output"] = json.dumps(sorted(set(idx)))

    def close(self) -> None:
        self.file.attrs["calls_dropped"] = self.dropped
        self.file.close()


def _tensors(values) -> list:
    """The tensors of a hook's or operator's arguments, flattened in order."""
    import torch

    out = []
    stack = [values]
    while stack:
        v = stack.pop(0)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack[:0] = list(v)
        elif isinstance(v, dict):
            stack[:0] = list(v.values())
    return out


def _spec(values) -> object:
    """``values`` (an operator's args and kwargs) as JSON, each tensor
    replaced by {"tensor": N}, N counting tensors in the order ``_tensors``
    lists them; what JSON cannot hold (a dtype, a device, a memory format)
    as its name."""
    import torch

    count = 0

    def walk(v):
        nonlocal count
        if isinstance(v, torch.Tensor):
            count += 1
            return {"tensor": count - 1}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {str(k): walk(x) for k, x in v.items()}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v if not (isinstance(v, float) and v != v) else "nan"
        return {"repr": str(v)}

    return walk(values)


_CONV_OPS = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "convolution", "_convolution", "cudnn_convolution")
_MATMUL_OPS = ("Linear", "mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "addmv", "mv")


def _base_op(kind: str) -> str:
    return kind.split(".")[1] if kind.startswith("aten.") and kind.count(".") >= 1 else kind


def _tf32_ops() -> frozenset:
    """The ops a CUDA device computes in TF32 as torch.backends allows now."""
    import torch

    ops: tuple = ()
    if torch.backends.cudnn.allow_tf32:
        ops += _CONV_OPS
    if torch.backends.cuda.matmul.allow_tf32:
        ops += _MATMUL_OPS
    return frozenset(ops)


# what a module's configuration says of its arithmetic (the error model's reduction length)
_MODULE_ATTRS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                 "in_features", "out_features", "normalized_shape", "eps", "dim", "num_heads", "embed_dim",
                 "output_size", "negative_slope", "approximate", "num_groups", "num_features", "affine")


def _module_attrs(module) -> dict:
    out = {}
    for name in _MODULE_ATTRS:
        v = getattr(module, name, None)
        if isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(isinstance(x, int) for x in v)):
            out[name] = list(v) if isinstance(v, tuple) else v
    return out


# NumPy has no such types: written as float32, the original named in the dataset's dtype attribute
_WIDENED = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _to_numpy(t, copy: bool = False) -> tuple[np.ndarray, str]:
    """The tensor on the host (``copy``: never sharing its storage), and the
    dtype it had where NumPy lacks it."""
    import torch

    t = t.detach()
    if t.layout != torch.strided:      # sparse: the values as a dense tensor
        t = t.to_dense()
    name = str(t.dtype).replace("torch.", "")
    if name in _WIDENED:
        return t.to(device="cpu", dtype=torch.float32).contiguous().numpy(), name
    arr = t.to("cpu").contiguous().numpy()
    return (arr.copy() if copy and t.device.type == "cpu" else arr), ""


def _identity(t) -> tuple:
    """What tells a tensor from the others alive with it: its storage,
    shape, strides, dtype and device."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))


@contextmanager
def capture(model, path, *, level: str = "module", max_calls: int = 64):
    """Record ``model``'s forward passes made inside the block into the HDF5
    file ``path`` (replaced). ``max_calls``: calls kept per op (the rest are
    counted in the file's ``calls_dropped`` attribute)."""
    import torch

    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    writer = _Writer(Path(path), max_calls)
    writer.tf32_ops = _tf32_ops()
    handles = []
    try:
        # the model's result, matched to the call that wrote it
        handles.append(model.register_forward_hook(lambda mod, inputs, outputs: writer.model_outputs(outputs)))
        if level == "module":
            pending: dict[str, list] = {}       # name -> the inputs of its calls under way

            def before(mod, inputs, name):
                pending.setdefault(name, []).append(None if writer.full(name) else writer.snapshot(inputs))

            def after(mod, inputs, outputs, name, about):
                taken = pending[name].pop()
                if taken is None:
                    writer.dropped += 1
                else:
                    writer.record(name, taken, outputs, about)

            for name, module in model.named_modules():
                if name and not any(True for _ in module.children()):
                    about = {"class": type(module).__name__, "attrs": _module_attrs(module)}
                    handles.append(module.register_forward_pre_hook(
                        lambda mod, inputs, name=name: before(mod, inputs, name)))
                    handles.append(module.register_forward_hook(
                        lambda mod, inputs, outputs, name=name, about=about: after(mod, inputs, outputs, name,
                                                                                   about)))
            with torch.no_grad():
                yield writer
        else:
            from torch.utils._python_dispatch import TorchDispatchMode

            class _Record(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    op = str(func)
                    call = (args, kwargs or {})
                    taken = None if writer.full(op) else writer.snapshot(call)
                    out = func(*args, **(kwargs or {}))
                    if taken is None:
                        writer.dropped += 1
                    else:
                        writer.record(op, taken, out, {"op": op, "args": _spec(call)})
                    return out

            with torch.no_grad(), _Record():
                yield writer
    finally:
        for h in handles:
            h.remove()
        writer.close()
