"""Execution providers: the live "device" is an onnxruntime provider chosen by name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from layerdiff.common.errors import LayerdiffError

if TYPE_CHECKING:
    import onnxruntime as ort
else:
    from layerdiff.common.lazy import ort

ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "gpu": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "rocm": "ROCMExecutionProvider",
}


def resolve_provider(device: str) -> list[str]:
    """Provider list for a device name; CPU is kept as the fallback for ops the
    accelerator does not implement, as onnxruntime does on real hosts."""
    name = ALIASES.get((device or "cpu").lower(), device)
    available = ort.get_available_providers()
    if name not in available:
        raise LayerdiffError(f"execution provider {name!r} is not available on this collector "
                             f"(available: {', '.join(available)})", field="device")
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]
