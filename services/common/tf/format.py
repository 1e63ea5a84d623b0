"""Which kind of model file a model is, from its name and first bytes,
without importing TensorFlow: an ONNX model, or one of the TensorFlow files
(frozen GraphDef, SavedModel archive, Keras file) that
layerdiff.common.tf.load reads."""
from __future__ import annotations

import io
import zipfile

FORMAT_ONNX = "onnx"
FORMAT_GRAPHDEF = "graphdef"
FORMAT_SAVEDMODEL = "savedmodel"
FORMAT_KERAS = "keras"
TF_FORMATS = (FORMAT_GRAPHDEF, FORMAT_SAVEDMODEL, FORMAT_KERAS)


def onnx_by_name(name: str) -> bool:
    """A file whose name alone says it is ONNX (model_format needs none of
    its bytes): it can be parsed, or found parsed (onnxgraph.PARSED),
    without reading it first."""
    return (name or "").lower().endswith(".onnx")


def model_format(name: str, data: bytes) -> str:
    """Which kind of model a file is, from its name and first bytes (no
    TensorFlow import): onnx, graphdef, savedmodel or keras. Anything not
    recognized is left to the ONNX reader, whose error names the file."""
    lower = (name or "").lower()
    if onnx_by_name(name):
        return FORMAT_ONNX
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                names = z.namelist()
        except Exception:     # BadZipFile, a damaged directory ("zip file version 6.4"...)
            return FORMAT_KERAS if lower.endswith(".keras") else FORMAT_ONNX
        if any(n.rstrip("/").split("/")[-1] in ("saved_model.pb", "saved_model.pbtxt") for n in names):
            return FORMAT_SAVEDMODEL
        if lower.endswith(".keras") or "config.json" in names:
            return FORMAT_KERAS
        return FORMAT_SAVEDMODEL if lower.endswith(".zip") else FORMAT_ONNX
    if _is_tar(data):
        return FORMAT_SAVEDMODEL
    if lower.endswith(".keras"):
        return FORMAT_KERAS
    if lower.endswith((".pb", ".graphdef")):
        # An ONNX ModelProto starts with its ir_version (field 1, varint: 0x08);
        # a GraphDef never does (its field 1 is a message).
        return FORMAT_ONNX if data[:1] == b"\x08" else FORMAT_GRAPHDEF
    if lower.endswith((".tar", ".tgz", ".tar.gz", ".savedmodel")):
        return FORMAT_SAVEDMODEL
    return FORMAT_ONNX


def shown_model(name: str | None) -> str:
    """A model as a person names it: a SavedModel travels as a tar archive
    (a directory is packed into ``NAME.tar``), shown as ``NAME (SavedModel)``."""
    name = name or ""
    for ext in (".tar.gz", ".tgz", ".tar"):
        if name.lower().endswith(ext) and len(name) > len(ext):
            return f"{name[:-len(ext)]} (SavedModel)"
    return name


def is_tensorflow(name: str, data: bytes) -> bool:
    return model_format(name, data) in TF_FORMATS


def _is_tar(data: bytes) -> bool:
    if data[:2] == b"\x1f\x8b":   # gzip: only a tar archive is expected here
        return True
    return len(data) > 262 and data[257:262] == b"ustar"
