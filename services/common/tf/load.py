"""TensorFlow model files loaded into a TFGraph.

Three kinds of file are read, each turned into one frozen GraphDef whose op
outputs can all be fetched:

- a TF1 frozen ``GraphDef`` (``.pb``), taken as it is;
- a TF2 / TF1 SavedModel directory, uploaded as one tar or zip archive and
  unpacked with path and size checks; the named signature (default
  ``serving_default``) is frozen, and the call wrapper TensorFlow adds when it
  inlines the signature (``StatefulPartitionedCall/``) is taken off the names
  so that they read as in the traced function;
- a Keras ``.keras`` file, loaded with ``safe_mode`` on (no Lambda code is
  deserialized) and traced into a graph; ``precision="fp16"`` rebuilds it
  under the ``mixed_float16`` policy first (a real FP16 execution).

The frozen graph is then analysed into sites by layerdiff.common.tf.sites.

Trust: restoring a SavedModel and running any graph executes what the file
describes, so TensorFlow model files are trusted input. What is checked
anyway: archive members (no absolute paths, no ``..``, no links, bounded
sizes), Keras safe_mode, ops that are not registered, graphs that still hold
variables, and ops that read or write files or run Python code, which are
refused by name.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.tf.archive import check_zip_members, savedmodel_root, unpack_archive
from layerdiff.common.tf.format import FORMAT_GRAPHDEF, FORMAT_KERAS, FORMAT_SAVEDMODEL, model_format
from layerdiff.common.tf.graph import TFGraph
from layerdiff.common.tf.runtime import import_tf, on_tf_thread, tf_message
from layerdiff.common.tf.sites import analyse

DEFAULT_SIGNATURE = "serving_default"

# Ops that reach outside the graph: files, Python callbacks, memory-mapped
# regions of a path. An inference graph never needs them; a crafted one could
# read or write the service's files.
DENIED_OPS = frozenset({
    "ReadFile", "WriteFile", "MatchingFiles", "MatchingFilesDataset", "ImmutableConst",
    "Save", "SaveV2", "SaveSlices", "Restore", "RestoreV2", "RestoreSlice", "MergeV2Checkpoints",
    "ShardedFilename", "ShardedFilespec",
    "PyFunc", "PyFuncStateless", "EagerPyFunc",
    "TextLineReader", "TextLineReaderV2", "TFRecordReader", "TFRecordReaderV2", "WholeFileReader",
    "WholeFileReaderV2", "FixedLengthRecordReader", "FixedLengthRecordReaderV2", "LMDBReader",
    "TextLineDataset", "TFRecordDataset", "TFRecordDatasetV2", "FixedLengthRecordDataset",
    "FixedLengthRecordDatasetV2", "LMDBDataset", "SnapshotDataset", "SnapshotDatasetV2", "SaveDataset",
    "SaveDatasetV2", "LoadDataset", "InitializeTableFromTextFile", "InitializeTableFromTextFileV2",
    "LoadAndRemapMatrix", "CreateSummaryFileWriter", "CreateSummaryDbWriter", "WriteSummary",
    "WriteRawProtoSummary", "DebugIdentity", "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount",
    "DebugNumericSummary", "DebugNumericSummaryV2",
})
VARIABLE_OPS = frozenset({"Variable", "VariableV2", "VarHandleOp", "TemporaryVariable"})
_CALL_PREFIX = re.compile(r"^(?:Stateful)?PartitionedCall(?:_\d+)?/")


@on_tf_thread
def load_tf_model(data: bytes, name: str, *, fmt: str | None = None, signature: str = "",
                  precision: str = "fp32", graph_def=None) -> TFGraph:
    """Any of the three TensorFlow files as a TFGraph. ``precision="fp16"``
    rebuilds a Keras model under the mixed_float16 policy; ``graph_def`` (a
    GraphDef object) is used instead of the file's bytes, as the seed's
    ``tf_dump_fmap`` allows."""
    tf = import_tf()
    fmt = fmt or (FORMAT_GRAPHDEF if graph_def is not None else model_format(name, data))
    precision = (precision or "fp32").lower()
    if precision not in ("fp32", "fp16"):
        raise LayerdiffError(f"precision {precision!r} is not available for TensorFlow models (fp32, or fp16 for "
                             "Keras models; int8 is for ONNX models)", field="precision")
    if precision == "fp16" and fmt != FORMAT_KERAS:
        raise LayerdiffError("precision fp16 rebuilds a Keras model under the mixed_float16 policy; for a "
                             f"{'frozen GraphDef' if fmt == FORMAT_GRAPHDEF else 'SavedModel'} give its "
                             "mixed-precision export as the device model", file=name, field="precision")
    if not data and graph_def is None:
        raise LayerdiffError("is empty, not a TensorFlow model", file=name)
    outputs: list[str] = []
    layers: list[str] = []
    strip_calls = False
    if fmt == FORMAT_GRAPHDEF:
        if graph_def is not None:
            gd = tf.compat.v1.GraphDef()
            gd.CopyFrom(graph_def)
        else:
            gd = _parse_graphdef(data, name)
    elif fmt == FORMAT_SAVEDMODEL:
        gd, outputs = _freeze_savedmodel(data, name, signature)
        strip_calls = True
    elif fmt == FORMAT_KERAS:
        gd, outputs, layers = _freeze_keras(data, name, precision)
    else:
        raise LayerdiffError(f"is not a TensorFlow model (format {fmt!r})", file=name, field="model")
    check_graph(gd, name)
    if strip_calls:
        outputs = _strip_call_prefix(gd, outputs)
    return analyse(gd, name, fmt, set(outputs), layers)


def _parse_graphdef(data: bytes, name: str):
    tf = import_tf()
    gd = tf.compat.v1.GraphDef()
    try:
        gd.ParseFromString(data)
    except Exception as e:
        raise LayerdiffError(f"is not a TensorFlow GraphDef ({type(e).__name__}: {e})", file=name,
                             field="model") from e
    if not gd.node or any(not n.name or not n.op for n in gd.node):
        raise LayerdiffError("is not a TensorFlow GraphDef (no nodes with a name and an op)", file=name,
                             field="model")
    return gd


def _freeze(fn, name: str) -> tuple[Any, list[str]]:
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    try:
        frozen = convert_variables_to_constants_v2(fn)
    except Exception as e:
        raise LayerdiffError(f"cannot be frozen into a graph: {tf_message(e)}", file=name, field="model") from e
    return frozen.graph.as_graph_def(), [t.op.name for t in frozen.outputs]


def _freeze_savedmodel(data: bytes, name: str, signature: str) -> tuple[Any, list[str]]:
    tf = import_tf()
    with tempfile.TemporaryDirectory(prefix="layerdiff-savedmodel-") as tmp:
        unpack_archive(data, Path(tmp), name)
        root = savedmodel_root(Path(tmp), name)
        try:
            obj = tf.saved_model.load(str(root))
        except Exception as e:
            raise LayerdiffError(f"is not a loadable SavedModel: {tf_message(e)}", file=name, field="model") from e
        sigs = dict(getattr(obj, "signatures", {}) or {})
        wanted = signature or (DEFAULT_SIGNATURE if DEFAULT_SIGNATURE in sigs or len(sigs) != 1 else next(iter(sigs)))
        if wanted not in sigs:
            raise LayerdiffError(f"has no signature {wanted!r} (signatures: {sorted(sigs)})", file=name,
                                 field="signature")
        # ``obj`` must outlive the freezing: the signature refers to its variables.
        gd, outputs = _freeze(sigs[wanted], name)
        del obj
        return gd, outputs


def _freeze_keras(data: bytes, name: str, precision: str) -> tuple[Any, list[str], list[str]]:
    tf = import_tf()
    import keras

    check_zip_members(data, name)
    with tempfile.TemporaryDirectory(prefix="layerdiff-keras-") as tmp:
        path = Path(tmp) / "model.keras"
        path.write_bytes(data)
        try:
            model = keras.saving.load_model(str(path), compile=False, safe_mode=True)
        except Exception as e:
            raise LayerdiffError(f"cannot be loaded as a Keras model with safe_mode on: {type(e).__name__}: {e}",
                                 file=name, field="model") from e
    if precision == "fp16":
        model = mixed_float16(model, name)
    try:
        specs = [tf.TensorSpec(tuple(t.shape), t.dtype, name=_spec_name(t, i)) for i, t in enumerate(model.inputs)]
    except (AttributeError, ValueError, TypeError) as e:
        raise LayerdiffError(f"has no defined inputs (a Functional or Sequential model is needed): {e}", file=name,
                             field="model") from e
    single = len(specs) == 1

    @tf.function
    def call(*xs):
        return model(xs[0] if single else list(xs), training=False)

    try:
        fn = call.get_concrete_function(*specs)
    except Exception as e:
        raise LayerdiffError(f"cannot be traced into a graph: {type(e).__name__}: {e}", file=name,
                             field="model") from e
    gd, outputs = _freeze(fn, name)
    return gd, outputs, _layer_names(model)


def _spec_name(t, i: int) -> str:
    raw = getattr(t, "name", "") or f"input_{i}"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", raw.split(":")[0]) or f"input_{i}"


def _layer_names(model) -> list[str]:
    out: list[str] = []
    stack = list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop(0)
        out.append(layer.name)
        stack.extend(getattr(layer, "layers", []) or [])
    return out


def mixed_float16(model, name: str):
    """The same Keras network under the mixed_float16 policy (FP16 compute,
    FP32 variables), with the same weights. Layers whose policy is not plain
    float32 (integer inputs, explicit policies) keep theirs."""
    config = model.get_config()

    def convert(cfg):
        if isinstance(cfg, dict):
            if cfg.get("class_name") == "InputLayer":
                return
            layer_cfg = cfg.get("config")
            if isinstance(layer_cfg, dict):
                dt = layer_cfg.get("dtype")
                policy = dt.get("config", {}).get("name") if isinstance(dt, dict) else dt
                if policy == "float32" and "layers" not in layer_cfg:
                    layer_cfg["dtype"] = "mixed_float16"
                for sub in layer_cfg.get("layers", []) or []:
                    convert(sub)
        elif isinstance(cfg, list):
            for c in cfg:
                convert(c)

    for layer_cfg in config.get("layers", []):
        convert(layer_cfg)
    try:
        clone = model.__class__.from_config(config)
        clone.set_weights(model.get_weights())
    except Exception as e:
        raise LayerdiffError(f"cannot be rebuilt under the mixed_float16 policy ({type(e).__name__}: {e}); give "
                             "a mixed-precision export as the device model", file=name, field="precision") from e
    return clone


def check_graph(gd, name: str) -> None:
    """Refuse what cannot or must not run: ops this TensorFlow does not know,
    ops that reach files or Python, variables (the graph is not frozen)."""
    from tensorflow.python.framework import op_def_registry

    functions = {f.signature.name for f in gd.library.function}
    nodes = [(n, None) for n in gd.node] + [(n, f.signature.name) for f in gd.library.function for n in f.node_def]
    for node, fn in nodes:
        where = f"{fn}/{node.name}" if fn else node.name
        if node.op in DENIED_OPS or (node.op == "PrintV2" and
                                     node.attr["output_stream"].s.decode("utf-8", "replace").startswith("file://")):
            raise LayerdiffError(f"op type {node.op!r} reads or writes files or runs Python code; layerdiff does "
                                 "not run such graphs", file=name, node=where)
        if node.op in VARIABLE_OPS:
            raise LayerdiffError(f"is a variable ({node.op}): the graph is not frozen; freeze it (variables to "
                                 "constants) or upload the SavedModel", file=name, node=where)
        if node.op not in functions and op_def_registry.get(node.op) is None:
            raise LayerdiffError(f"op type {node.op!r} is not registered in this TensorFlow (a custom op, or an "
                                 "op of another TensorFlow version)", file=name, node=where)


def _strip_call_prefix(gd, outputs: list[str]) -> list[str]:
    """Take the ``StatefulPartitionedCall/`` of an inlined signature call off
    node names, so that they read as in the traced function; a node whose
    shorter name is taken keeps its own."""
    taken = {n.name for n in gd.node}
    renamed: dict[str, str] = {}
    for node in gd.node:
        new = node.name
        while _CALL_PREFIX.match(new):
            new = _CALL_PREFIX.sub("", new, count=1)
        if new != node.name and new not in taken:
            renamed[node.name] = new
            taken.add(new)
    if not renamed:
        return outputs

    def fix(ref: str) -> str:
        ctrl = ref.startswith("^")
        base = ref[1:] if ctrl else ref
        op, sep, port = base.partition(":")
        return ("^" if ctrl else "") + renamed.get(op, op) + (sep + port if sep else "")

    for node in gd.node:
        node.name = renamed.get(node.name, node.name)
        node.input[:] = [fix(i) for i in node.input]
    return [renamed.get(o, o) for o in outputs]

