"""The device graph a dump's manifest describes.

Runtimes that dump node outputs often know their graph as well: a manifest
entry may say which tensors its node read (``inputs``) besides its
``op_type``, and carry the node's attributes (``attrs``)::

    {"inputs": ["images"],
     "nodes": [{"name": "t17", "node": "conv_0", "op_type": "Conv2D",
                "inputs": ["images"], "attrs": {"activation": "Relu"}, "file": "t17.npy"},
               {"name": "t18", "node": "pool_0", "op_type": "MaxPool", "inputs": ["t17"], "file": "t18.npy"}]}

``inputs`` name other entries (or the graph's inputs, listed at the top
level where the manifest knows them); weights may be named or left out.
The analyzer pairs this graph with the reference by structure, as it does a
device model. A manifest without ``inputs`` describes no graph, and names
(then values) pair its tensors. Only the manifest and the ``.npy`` headers
are read here, never a tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.collector.dumps.manifest import MANIFEST, check_node_name, resolve_inside
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import ROLE_INPUT
from layerdiff.common.sizes import MAX_MESSAGE_BYTES
from layerdiff.v1 import layerdiff_pb2 as pb

log = logging.getLogger(__name__)

_MAX_INPUTS = 4096


def dump_graph(source: pb.DumpSource, d: DumpDirectory | None = None) -> pb.DeviceGraph:
    """The graph of the dump's manifest (no nodes where the manifest names no
    inputs, or there is no manifest) and where its execution order came
    from (always). ``d``: the dump as listed already (else listed here)."""
    if d is None:
        d = DumpDirectory(source.path, fmt=source.format, default_concat_dim=source.default_concat_dim)
    order = pb.DeviceGraph(order_from=d.order_from, order_unknown=d.order_unknown)
    mpath = d.root / MANIFEST
    if d.ascend_files is not None or d.single is not None or not mpath.exists():
        return order
    entries = [(i, e) for i, e in enumerate(d.entries) if isinstance(e, dict)]
    if not any("inputs" in e for _, e in entries):
        return order
    graph = pb.DeviceGraph(source=str(mpath))
    graph.MergeFrom(order)
    nodes: dict[str, pb.DeviceNode] = {}
    outputs: dict[str, dict[int, pb.DeviceTensor]] = {}
    for _, entry in sorted(entries, key=lambda ie: _order(ie[1], ie[0])):
        try:
            _add_entry(d, entry, nodes, outputs)
        except LayerdiffError as e:    # this node drops out of the graph; its tensor still streams
            log.warning("%s: %s", mpath, e)
    for name, node in nodes.items():
        slots = outputs.get(name, {})
        if slots:
            for k in range(max(slots) + 1):
                node.outputs.append(slots.get(k, pb.DeviceTensor()))
    graph.nodes.extend(n for n in nodes.values() if n.outputs)
    graph.inputs.extend(d.graph_inputs)
    if graph.ByteSize() > MAX_MESSAGE_BYTES // 2:
        raise LayerdiffError(f"describes a graph of {graph.ByteSize()} bytes, more than one message carries",
                             file=str(mpath), field="inputs")
    return graph


def _order(entry: dict, i: int) -> int:
    order = entry.get("order", i)
    return order if isinstance(order, int) and not isinstance(order, bool) else i


def _add_entry(d: DumpDirectory, entry: dict, nodes: dict, outputs: dict) -> None:
    name = check_node_name(entry.get("name"))
    if entry.get("role", "output") == ROLE_INPUT:
        return
    node_name = entry.get("node", name)
    node_name = check_node_name(node_name) if node_name != name else name
    slot = entry.get("slot", 0)
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 1 << 10:
        raise LayerdiffError(f"slot {slot!r} is not an output index", node=name, field="slot")
    node = nodes.get(node_name)
    if node is None:
        node = nodes[node_name] = pb.DeviceNode(name=node_name)
    op_type = entry.get("op_type")
    if isinstance(op_type, str) and op_type and not node.op_type:
        node.op_type = op_type
    if "inputs" in entry and not node.inputs:
        node.inputs.extend(_inputs(entry["inputs"], name))
    attrs = entry.get("attrs")
    if attrs is not None:
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise LayerdiffError("attrs must be an object of attribute values", node=name, field="attrs")
        for key, value in attrs.items():
            node.attributes[key] = json.dumps(value)
    outputs.setdefault(node_name, {})[slot] = _tensor(d, entry, name)


def _inputs(value: object, name: str) -> list[str]:
    if not isinstance(value, list) or len(value) > _MAX_INPUTS or not all(isinstance(v, str) for v in value):
        raise LayerdiffError("inputs must be a list of tensor names", node=name, field="inputs")
    return value


def _tensor(d: DumpDirectory, entry: dict, name: str) -> pb.DeviceTensor:
    t = pb.DeviceTensor(name=name)
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if shape is None and "slices" not in entry and d._format(entry) == "npy":
        shape, dtype = _npy_header(d.root, entry.get("file"), name)
    if isinstance(shape, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        t.shape.extend(shape)
        t.has_shape = True
    if isinstance(dtype, str):
        t.dtype = dtype
    return t


def _npy_header(root: Path, rel: object, name: str) -> tuple[list | None, str | None]:
    """Shape and dtype from a .npy header (None, None where it cannot be read:
    the tensor's own record says why)."""
    try:
        with open(resolve_inside(root, rel, name), "rb") as f:
            fmt = np.lib.format
            read = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
    except (LayerdiffError, OSError, ValueError):
        return None, None
    return list(shape), dtype.name

