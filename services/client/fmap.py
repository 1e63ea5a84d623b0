"""The seed tool's reference-dump calls, ``tf_dump_fmap`` and
``onnx_dump_fmap``, with its parameters, writing the FP32 CPU reference of
every node in layerdiff's dump format.

    from layerdiff import tf_dump_fmap, CUR_NPU_NODENAME_FILENAME
    tf_dump_fmap("model.pb", {"input_tensor": (1, 224, 224, 3)}, {"input_tensor:0": x},
                 CUR_NPU_NODENAME_FILENAME, "consumer_map.json")

What is written (``out_dir``, default ``$DUMP_MEMORY_PATH/cpu`` or ``./cpu``):
one ``.npy`` per node output, named after the node with ``/`` and other
separators as ``_`` (with ``_{shape}`` appended when ``dump_shape_flag``), a
``manifest.json`` that layerdiff's dump reader takes as it is (``layerdiff
run --dump``, ``layerdiff convert``), and beside ``consumer_map_filename``
the producer->consumer map and ``node_runtime.json`` (the node order), both
JSON: nothing is pickled.

``npu_nodename_filename`` lists the device's node names, one per line (a
report's ``dump_memory_nodename.log``); only the reference nodes those names
align to are written. ``None`` writes every node.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from layerdiff import CUR_NPU_NODENAME_FILENAME  # noqa: F401  (the seed imports it with the calls)
from layerdiff.client.api import read_artifact
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.names import safe_filename
from layerdiff.common.onnxgraph import GraphInput


def tf_dump_fmap(model_path, input_map: dict, feed_dict: dict, npu_nodename_filename=None,
                 consumer_map_filename="consumer_map.json", dump_shape_flag: bool = False, graph_def=None, *,
                 out_dir=None, signature: str = "") -> Path:
    """Dump every op output of a TensorFlow model (frozen GraphDef ``.pb``,
    SavedModel directory, Keras ``.keras``) computed on the CPU in FP32.

    ``input_map``: the model's inputs by name (``"x"`` or ``"x:0"``), each a
    placeholder, a ``tf.TensorSpec``, a shape tuple, or an array (then also
    the data); it declares the shape and dtype the data must have, and may
    name any tensor of the graph to feed it in place of what computes it.
    ``feed_dict``: the data by tensor name (``"x:0"``) or tensor.
    ``graph_def``: a GraphDef to use instead of reading ``model_path``.
    Returns the dump directory."""
    from layerdiff.analyzer.reference.tf import TFReference
    from layerdiff.common.tf.format import FORMAT_GRAPHDEF
    from layerdiff.common.tf.load import load_tf_model

    name = Path(model_path).name if model_path else "graph_def"
    if graph_def is not None:
        graph = load_tf_model(b"", name, fmt=FORMAT_GRAPHDEF, graph_def=graph_def)
    else:
        data, name = read_artifact(model_path, "model_path")
        graph = load_tf_model(data, name, signature=signature)
    known = {n.name for n in graph.graph_def.node}
    declared: dict[str, GraphInput] = {}
    feeds: dict[str, np.ndarray] = {}
    for key, value in (input_map or {}).items():
        op = _op_name(key)
        if op not in known:
            raise LayerdiffError(f"input_map names {key!r}, which is not a tensor of the model", file=name,
                                 field="input_map")
        declared[op] = _declaration(op, value, name)
        if isinstance(value, np.ndarray):
            feeds[op] = value
    for key, value in (feed_dict or {}).items():
        op = _op_name(key if isinstance(key, str) else getattr(key, "name", str(key)))
        if op not in known:
            raise LayerdiffError(f"feed_dict names {key!r}, which is not a tensor of the model", file=name,
                                 field="feed_dict")
        feeds[op] = np.asarray(value)
    feeds = graph.check_inputs(feeds, "feed_dict", extra=declared)
    return _write_reference_dump(TFReference(b"", name, graph=graph), feeds, npu_nodename_filename,
                                 consumer_map_filename, dump_shape_flag, out_dir)


def onnx_dump_fmap(model_path, input_map: dict, npu_nodename_filename=None,
                   consumer_map_filename="consumer_map.json", dump_shape_flag: bool = False, *,
                   out_dir=None) -> Path:
    """Dump every node output of an ONNX model computed with onnxruntime on
    the CPU in FP32 (graph optimizations off). ``input_map``: the input
    arrays by input name. Returns the dump directory."""
    from layerdiff.analyzer.reference.onnxrt import OnnxReference

    data, name = read_artifact(model_path, "model_path")
    reference = OnnxReference(data, name)
    feeds = reference.check_inputs({k: np.asarray(v) for k, v in (input_map or {}).items()}, "input_map")
    return _write_reference_dump(reference, feeds, npu_nodename_filename, consumer_map_filename, dump_shape_flag,
                                 out_dir)


# ---------------------------------------------------------------- helpers

def _op_name(key: str) -> str:
    key = str(key)
    return key[:-2] if key.endswith(":0") else key


def _declaration(op: str, value, model: str) -> GraphInput:
    """Shape and dtype an ``input_map`` entry declares."""
    if isinstance(value, np.ndarray):
        return GraphInput(op, value.dtype.name, tuple(value.shape))
    if isinstance(value, (tuple, list)) and all(isinstance(d, (int, type(None))) for d in value):
        return GraphInput(op, "", tuple(value))
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        raise LayerdiffError(f"input_map value for {op!r} is not a placeholder, TensorSpec, shape or array",
                             file=model, field="input_map")
    dims = shape.as_list() if getattr(shape, "rank", 0) is not None and hasattr(shape, "as_list") else None
    try:
        np_dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).name
    except TypeError:
        np_dtype = ""
    return GraphInput(op, np_dtype, tuple(dims) if dims is not None else None)


def _npu_names(path) -> list[str] | None:
    if path is None:
        return None
    p = Path(path)
    candidates = [p]
    if not p.is_absolute() and os.environ.get("DUMP_MEMORY_PATH"):
        candidates.append(Path(os.environ["DUMP_MEMORY_PATH"]) / "result" / p)
    for c in candidates:
        if c.is_file():
            return [ln.strip() for ln in c.read_text(encoding="utf-8").splitlines() if ln.strip()]
    raise LayerdiffError("does not exist (the device's node names, one per line; None dumps every node)",
                         file=str(p), field="npu_nodename_filename")


def _default_out_dir() -> Path:
    base = os.environ.get("DUMP_MEMORY_PATH")
    return Path(base) / "cpu" if base else Path("cpu")


def _write_reference_dump(reference, feeds, npu_nodename_filename, consumer_map_filename, dump_shape_flag,
                          out_dir) -> Path:
    from layerdiff.analyzer.align.names import Aligner

    names = _npu_names(npu_nodename_filename)
    sites = reference.sites
    if names is not None:
        aligner = Aligner(sites)
        wanted = {d.site.tensor for d in (aligner.match(n) for n in names) if d.site is not None}
        sites = [s for s in sites if s.tensor in wanted]
    out = Path(out_dir) if out_dir is not None else _default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    # Computed segment by segment, each tensor written and dropped at once.
    segments = reference.plan(feeds)
    keep = {s.tensor for s in sites}
    taken: set[str] = set()
    nodes: list[dict] = []
    by_tensor = {s.tensor: s for s in sites}
    for segment in segments:
        only = [t for t in segment if t in keep]
        if not only:
            continue
        values = reference.run(feeds, only=only)
        for t in only:
            arr = values.pop(t, None)
            if arr is None:
                continue
            s = by_tensor[t]
            stem = s.node if s.output_index == 0 else f"{s.node}:{s.output_index}"
            if dump_shape_flag:
                stem += "_" + ("x".join(str(d) for d in arr.shape) or "scalar")
            fname = safe_filename(stem, taken) + ".npy"
            np.save(out / fname, np.ascontiguousarray(arr), allow_pickle=False)
            nodes.append({"name": s.tensor, "node": s.node, "op_type": s.op_type, "order": s.order,
                          "file": fname, "dtype": arr.dtype.name, "shape": list(arr.shape)})
    nodes.sort(key=lambda n: n["order"])
    (out / "manifest.json").write_text(json.dumps({"model": reference.name, "source": "reference (FP32, CPU)",
                                                   "nodes": nodes}, indent=1), encoding="utf-8")
    cmap = Path(consumer_map_filename) if consumer_map_filename else out / "consumer_map.json"
    cmap.parent.mkdir(parents=True, exist_ok=True)
    cmap.write_text(json.dumps(reference.consumers, indent=1), encoding="utf-8")
    (cmap.parent / "node_runtime.json").write_text(json.dumps(reference.node_runtime(), indent=1),
                                                   encoding="utf-8")
    return out
