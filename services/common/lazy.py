"""Modules loaded on first use. onnx and onnxruntime take a tenth of a
second to import, and a job that compares two dumps without a model uses
neither; pyarrow takes 40 ms, and two dumps compared in one process need it
only for their Parquet tables: the modules that need them import them from
here at run time (the real import stays for type checkers, under
TYPE_CHECKING):

    if TYPE_CHECKING:
        import onnx
    else:
        from layerdiff.common.lazy import onnx
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    """Stands for a module until an attribute of it is first read, then
    imports it (the import system's own lock makes that once) and passes
    every read on to it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, {'loaded' if self._module is not None else 'loaded on first use'}>"


def lazy_module(name: str) -> Any:
    """``name``, imported when first used."""
    return _LazyModule(name)


# the modules loaded so, each bound once under the name its users give it
onnx = lazy_module("onnx")
ort = lazy_module("onnxruntime")
helper = lazy_module("onnx.helper")
numpy_helper = lazy_module("onnx.numpy_helper")
shape_inference = lazy_module("onnx.shape_inference")
pa = lazy_module("pyarrow")
