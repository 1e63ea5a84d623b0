"""ONNX model handling shared by the collector (device runs) and the analyzer
(reference runs): safe loading, exposing every node output, node order."""
from __future__ import annotations

import io
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from layerdiff.common.errors import LayerdiffError, LimitError

if TYPE_CHECKING:
    import onnx
    from onnx import numpy_helper, shape_inference
else:
    from layerdiff.common.lazy import numpy_helper, onnx, shape_inference

# onnx.TensorProto's element types: numbers the ONNX standard fixes (written
# here so that onnx need not be imported to know them; a test holds them to onnx's)
FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, BOOL, FLOAT16, DOUBLE, UINT32, UINT64, BFLOAT16 = (
    1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16)
# onnx TensorProto element type -> numpy dtype name
ONNX_TO_NUMPY: dict[int, str] = {
    FLOAT: "float32", FLOAT16: "float16", DOUBLE: "float64", INT8: "int8", UINT8: "uint8", INT16: "int16",
    UINT16: "uint16", INT32: "int32", UINT32: "uint32", INT64: "int64", UINT64: "uint64", BOOL: "bool",
}
FLOAT_TYPES = frozenset({FLOAT, FLOAT16, DOUBLE, BFLOAT16})


@dataclass(frozen=True)
class GraphInput:
    name: str
    dtype: str            # numpy dtype name, "" if unknown
    shape: tuple | None   # ints for fixed dims, None for symbolic ones; () for scalars; None: unknown rank


# Ops whose output is a parameter (a weight), not a computation.
CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape"})


@dataclass(frozen=True)
class TensorSite:
    """Where a tensor comes from: the node that produces it and its position."""
    tensor: str
    node: str
    op_type: str
    order: int            # index of the producing node in execution order
    output_index: int

    @property
    def is_constant(self) -> bool:
        return self.op_type in CONSTANT_OPS


def node_runtime(sites: list[TensorSite]) -> list[dict]:
    """Nodes in execution order with their outputs (node_runtime.json)."""
    out: list[dict] = []
    for s in sites:
        if out and out[-1]["node"] == s.node:
            out[-1]["outputs"].append(s.tensor)
        else:
            out.append({"order": s.order, "node": s.node, "op_type": s.op_type, "outputs": [s.tensor]})
    return out


def load_model(data: bytes, name: str) -> onnx.ModelProto:
    """Parse ONNX bytes; a clear error naming the file when it is not ONNX or
    refers to external data (which would be a path outside the upload)."""
    if not data:
        raise LayerdiffError("is empty, not an ONNX model", file=name)
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise LayerdiffError(f"is not an ONNX model ({type(e).__name__}: {e})", file=name) from e
    if not model.graph.node and not model.graph.output:
        raise LayerdiffError("is not an ONNX model (no graph nodes)", file=name)
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise LayerdiffError(f"initializer {init.name!r} refers to external data; upload a model with the "
                                 "weights embedded", file=name, field="external_data")
    return model


def graph_inputs(model: onnx.ModelProto) -> list[GraphInput]:
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = ONNX_TO_NUMPY.get(tt.elem_type, "")
        # a negative size (-1, which some exporters write) is no size: any fits
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        out.append(GraphInput(vi.name, dtype, shape))
    return out


def node_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def tensor_sites(model: onnx.ModelProto) -> list[TensorSite]:
    """Every node output in execution order (ONNX graphs are stored
    topologically sorted)."""
    sites = []
    for i, node in enumerate(model.graph.node):
        for k, t in enumerate(node.output):
            if t:
                sites.append(TensorSite(t, node_name(node, i), node.op_type, i, k))
    return sites


def expose_all_outputs(model: onnx.ModelProto, only: set[str] | None = None) -> onnx.ModelProto:
    """Make every node output (or those in ``only``) a graph output, in place.
    Outputs are added without type information; onnxruntime infers it."""
    present = {o.name for o in model.graph.output}
    for site in tensor_sites(model):
        if site.tensor in present or (only is not None and site.tensor not in only):
            continue
        model.graph.output.append(onnx.ValueInfoProto(name=site.tensor))
        present.add(site.tensor)
    return model


def expose_only(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Make exactly these tensors the graph outputs, in place."""
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    return model


# Memory for every node output at once can outweigh the machine (a detector at
# 1088x1088 produces about 2 GB), so a run that must expose every node output
# is cut into segments of consecutive nodes, each run exposing only its own
# outputs and freed before the next. The price is recomputing the prefix of
# the graph for each later segment: at most MAX_SEGMENTS pieces (about 2.5x
# the compute for four), none smaller than MIN_SEGMENT_BYTES.
MIN_SEGMENT_BYTES = 256 * 1024**2
MAX_SEGMENTS = 4


# Float initializers above this many bytes travel without their data where only
# their shapes matter (see without_weight_data).
WEIGHT_DATA_BYTES = 4096


def without_weight_data(model: onnx.ModelProto, keep: bool = True) -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """A copy of the model whose large float initializers keep their name,
    type and dims but not their data, and that data by name. Shape inference
    and graph rewrites on the copy cost what the graph costs, not what its
    weights weigh (0.35 s -> 2 ms for a MiniLM); small initializers, and every
    integer one (shapes, axes: data propagation reads them), stay whole.
    Without ``keep`` the data is not read out at all (the dict is empty)."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    held: dict[str, bytes] = {}
    for init in model.graph.initializer:
        if init.data_type in FLOAT_TYPES and init.HasField("raw_data") and len(init.dims) \
                and int(np.prod(init.dims, dtype=np.int64)) * 2 > WEIGHT_DATA_BYTES \
                and init.data_location != onnx.TensorProto.EXTERNAL:
            t = light.graph.initializer.add()
            t.name, t.data_type = init.name, init.data_type
            t.dims.extend(init.dims)
            if keep:
                held[init.name] = init.raw_data
        else:
            light.graph.initializer.add().CopyFrom(init)
    return light, held


class ParsedModel:
    """A parsed model held for its users (see ParsedModels): keep this
    object, not only ``model``, while the model is read."""

    __slots__ = ("model", "__weakref__")

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model


class SharedMaking:
    """Things being made in this process, by key: a second asker waits for
    the first's instead of making its own. Nothing is kept once made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Future] = {}

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        if not key:
            return make()
        with self._lock:
            running = self._running.get(key)
            if running is None:
                mine: Future = Future()
                self._running[key] = mine
        if running is not None:
            return running.result()
        try:
            made = make()
            mine.set_result(made)
            return made
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._running[key]


class ParsedModels:
    """Models parsed in this process, by their file's sha256, for as long
    as someone holds them: the embedded analyzer (aligning a device model)
    and collector (running it) parse a 90 MB device model once and hold one
    copy of it, not two. Read a shared model, never change it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: weakref.WeakValueDictionary[str, ParsedModel] = weakref.WeakValueDictionary()
        self._parsing = SharedMaking()

    def hold(self, key: str, parse: Callable[[], onnx.ModelProto]) -> ParsedModel:
        """The model ``key`` names, parsed by ``parse`` unless another user
        holds it already, or is parsing it (then its parse is waited for)."""
        with self._lock:
            held = self._held.get(key) if key else None
        if held is not None:
            return held
        return self._parsing.get(key, lambda: self._keep(key, ParsedModel(parse())))

    def _keep(self, key: str, held: ParsedModel) -> ParsedModel:
        with self._lock:
            self._held[key] = held
        return held


PARSED = ParsedModels()


class WeightSplit:
    """One model's ``without_weight_data``, made once for every session and
    build made from it (the reference's run, its FP16 build, the impact
    re-runs): each would otherwise copy every weight out of the model again.
    Read it, never change it; thread-safe. ``of`` takes a model or a split."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._parts: tuple[onnx.ModelProto, dict[str, bytes]] | None = None

    @staticmethod
    def of(model: onnx.ModelProto | WeightSplit) -> WeightSplit:
        return model if isinstance(model, WeightSplit) else WeightSplit(model)

    @staticmethod
    def from_parts(light: onnx.ModelProto, held: dict[str, bytes]) -> WeightSplit:
        """The split of a model made from another split's parts (a graph cut
        out of it, the weights' data still held there)."""
        split = WeightSplit(light)
        split._parts = (light, held)
        return split

    def parts(self) -> tuple[onnx.ModelProto, dict[str, bytes]]:
        with self._lock:
            if self._parts is None:
                self._parts = without_weight_data(self.model)
            return self._parts

    def let_go(self) -> onnx.ModelProto:
        """The model without its weights' data, which stays here only: for
        an owner that reads the weights through this split alone, the whole
        model (a second copy of every weight) is let go."""
        shared, _ = self.parts()
        with self._lock:
            self.model = shared
        return shared

    def array(self, init: onnx.TensorProto) -> np.ndarray:
        """An initializer of the split model as an array, its data from here
        if it was taken out."""
        raw = self.parts()[1].get(init.name)
        if raw is not None:
            whole = onnx.TensorProto()
            whole.CopyFrom(init)
            whole.raw_data = raw
            init = whole
        return numpy_helper.to_array(init)


def lean_session(model: onnx.ModelProto | WeightSplit, options, providers: list, edit=None):
    """An onnxruntime session of the model (``edit``, given a copy of it
    without the weights' data, may change the graph: outputs exposed, say)
    whose large weights are handed to onnxruntime in memory instead of
    serialized with the graph and parsed back: a third of the time on a
    transformer, the same results. A ``WeightSplit`` given for the model
    is used as it is (its weights are not copied out again)."""
    import onnxruntime as ort

    shared, held = WeightSplit.of(model).parts()
    # Its threads sleep when idle instead of spinning: the reference, the
    # device run and the analysis share the cores (5-8 % of a small model's
    # CPU time went into spinning)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    light = onnx.ModelProto()
    light.CopyFrom(shared)
    if edit is not None:
        edit(light)
    names, values = [], []
    for init in light.graph.initializer:
        raw = held.get(init.name)
        if raw is None:
            continue
        dtype = ONNX_TO_NUMPY.get(init.data_type)
        if dtype is None:        # bfloat16: no numpy type to hand it over in
            init.raw_data = raw
            continue
        init.data_location = onnx.TensorProto.EXTERNAL
        entry = init.external_data.add()
        entry.key, entry.value = "location", "in-memory"
        names.append(init.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(np.frombuffer(raw, dtype).reshape(tuple(init.dims))))
    if names:
        options.add_external_initializers(names, values)
    sess = ort.InferenceSession(light.SerializeToString(), options, providers=providers)
    sess.layerdiff_weights = values      # onnxruntime reads them in place: they live as long as the session
    return sess


def _copy_fields(src, dst, skip: str) -> None:
    """Every field set in ``src`` but ``skip``, into ``dst``."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def infer_shapes(model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    """ONNX shape inference on the model's graph without its weights' data
    (the result's large float initializers are empty: read only shapes)."""
    return shape_inference.infer_shapes(without_weight_data(model, keep=False)[0], **kw)


def estimate_output_bytes(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Size of each tensor for these inputs, from ONNX shape inference;
    tensors whose shape stays unknown are left out."""
    m = without_weight_data(model, keep=False)[0]
    del m.graph.value_info[:]
    for vi in m.graph.input:
        if vi.name in feeds and vi.type.tensor_type.HasField("shape"):
            for d, size in zip(vi.type.tensor_type.shape.dim, feeds[vi.name].shape):
                d.ClearField("dim_param")
                d.dim_value = int(size)
    try:
        inferred = shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # an estimate only: without it the run is one segment
        return {}
    out: dict[str, int] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        dtype = ONNX_TO_NUMPY.get(tt.elem_type)
        if not dtype or not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if any(d < 0 for d in dims):
            continue
        out[vi.name] = int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
    return out


def plan_segments(names: list[str], sizes: dict[str, int], min_bytes: int = MIN_SEGMENT_BYTES,
                  max_segments: int = MAX_SEGMENTS) -> list[list[str]]:
    """Cut tensors (in execution order) into consecutive segments of about
    equal estimated size."""
    total = sum(sizes.get(n, 0) for n in names)
    return cut_segments([[n] for n in names], sizes, max(min_bytes, -(-total // max_segments)), max_segments)


def cut_segments(groups: list[list[str]], sizes: dict[str, int], budget: int,
                 max_segments: int = 0) -> list[list[str]]:
    """Consecutive groups of tensors (a node's outputs stay together) cut
    into segments of at most ``budget`` estimated bytes (a group larger than
    that is a segment alone), ``max_segments`` at most where given."""
    segments: list[list[str]] = [[]]
    used = 0
    for g in groups:
        b = sum(sizes.get(t, 0) for t in g)
        if segments[-1] and used + b > budget and (not max_segments or len(segments) < max_segments):
            segments.append([])
            used = 0
        segments[-1].extend(g)
        used += b
    return segments


def consumer_map(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Node name -> names of the nodes that consume its outputs."""
    producer = {}
    for i, node in enumerate(model.graph.node):
        for t in node.output:
            producer[t] = node_name(node, i)
    cmap: dict[str, list[str]] = {node_name(n, i): [] for i, n in enumerate(model.graph.node)}
    for i, node in enumerate(model.graph.node):
        for t in node.input:
            p = producer.get(t)
            if p is not None and node_name(node, i) not in cmap[p]:
                cmap[p].append(node_name(node, i))
    return cmap


MAX_INPUTS_BYTES_DEFAULT = 1 << 30


def max_inputs_bytes() -> int:
    """LAYERDIFF_MAX_INPUTS_BYTES: the most an inputs .npz may inflate to (1 GiB)."""
    from layerdiff.common.settings import env_limit

    return env_limit("LAYERDIFF_MAX_INPUTS_BYTES", MAX_INPUTS_BYTES_DEFAULT, size=True)


def _check_inflated_size(data: bytes, name: str) -> None:
    """An .npz's members are decompressed only if what they declare fits the
    limit (a member inflating past its declared size fails its own check)."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            total = sum(i.file_size for i in z.infolist())
    except Exception as e:
        raise LayerdiffError(f"is not a readable .npz of inputs ({type(e).__name__}: {e})", file=name) from e
    limit = max_inputs_bytes()
    if total > limit:
        raise LimitError(f"inflates to {total} bytes, over the limit of {limit} (LAYERDIFF_MAX_INPUTS_BYTES)",
                         file=name, field="inputs")


def load_inputs(data: bytes, name: str) -> dict[str, np.ndarray]:
    """Read an .npz (or a single .npy) of named inputs without pickles."""
    if data[:6] != b"\x93NUMPY" and data[:2] != b"PK":
        raise LayerdiffError("is not an .npz or .npy file of inputs", file=name)
    if data[:2] == b"PK":
        _check_inflated_size(data, name)
    try:
        if data[:6] == b"\x93NUMPY":
            arr = np.load(io.BytesIO(data), allow_pickle=False)
            return {"": arr}
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except ValueError as e:
        raise LayerdiffError(f"cannot be read without unpickling objects: {e}", file=name) from e
    except Exception as e:
        raise LayerdiffError(f"is not a readable .npz of inputs ({type(e).__name__}: {e})", file=name) from e


def check_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """Validate names, dtypes and shapes of the feeds against the graph inputs.
    A single unnamed array is accepted for a single-input model."""
    declared = graph_inputs(model)
    if "" in feeds and len(feeds) == 1 and len(declared) == 1:
        feeds = {declared[0].name: feeds[""]}
    by_name = {d.name: d for d in declared}
    for k in feeds:
        if k not in by_name:
            raise LayerdiffError(f"input {k!r} is not an input of the model (inputs: {sorted(by_name)})",
                                 file=name, field=k)
    for d in declared:
        if d.name not in feeds:
            raise LayerdiffError(f"model input {d.name!r} is missing from the inputs file", file=name, field=d.name)
        a = feeds[d.name]
        if d.dtype and a.dtype.name != d.dtype:
            raise LayerdiffError(f"input {d.name!r} has dtype {a.dtype.name}, the model expects {d.dtype}",
                                 file=name, field=d.name)
        if d.shape is not None:
            if len(d.shape) != a.ndim:
                raise LayerdiffError(f"input {d.name!r} has shape {a.shape}, the model expects rank {len(d.shape)} "
                                     f"{_fmt_shape(d.shape)}", file=name, field=d.name)
            for want, got in zip(d.shape, a.shape):
                if want not in (None, 0) and want != got:
                    raise LayerdiffError(f"input {d.name!r} has shape {a.shape}, the model expects "
                                         f"{_fmt_shape(d.shape)}", file=name, field=d.name)
    return feeds


def _fmt_shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"


def runtime_ready() -> str:
    """'' when onnxruntime can build and run a session here, else why not
    (what the services' readiness reports)."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ready",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:
        return f"cannot run a model ({type(e).__name__})"
    return ""
