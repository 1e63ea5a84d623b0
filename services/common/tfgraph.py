"""TensorFlow model handling shared by the analyzer (reference runs) and the
collector (device runs).

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

Sites are the outputs of every op whose value depends on the graph inputs,
in execution order (a topological order, ties kept in GraphDef order): the
weights and what is computed from weights alone are parameters, as ONNX
initializers are, and the ops inside a TF1 while-loop frame have no single
value to fetch. Keras layers appear as the name scopes of their ops
(``model/layer/op:0``); ``layer_of`` names the layer an op belongs to.

TensorFlow is imported only inside the functions that need it, so that the
collector and the ONNX paths start without it.

Trust: restoring a SavedModel and running any graph executes what the file
describes, so TensorFlow model files are trusted input. What is checked
anyway: archive members (no absolute paths, no ``..``, no links, bounded
sizes), Keras safe_mode, ops that are not registered, graphs that still hold
variables, and ops that read or write files or run Python code, which are
refused by name.
"""
from __future__ import annotations

import io
import os
import re
import stat
import tarfile
import tempfile
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.common.errors import LayerdiffError, LimitError
from layerdiff.common.onnxgraph import GraphInput, TensorSite

FORMAT_ONNX = "onnx"
FORMAT_GRAPHDEF = "graphdef"
FORMAT_SAVEDMODEL = "savedmodel"
FORMAT_KERAS = "keras"
TF_FORMATS = (FORMAT_GRAPHDEF, FORMAT_SAVEDMODEL, FORMAT_KERAS)
DEFAULT_SIGNATURE = "serving_default"

MAX_ARCHIVE_MEMBERS = 100_000
MAX_UNPACKED_BYTES = 16 * 1024**3

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
INPUT_OPS = frozenset({"Placeholder", "PlaceholderWithDefault"})
# Ops with nothing to compare: no data value, or values that never cross the wire.
_NO_VALUE_OPS = frozenset({"NoOp", "Const", "Assert", "Print", "PrintV2"})
_LOOP_ENTER = frozenset({"Enter", "RefEnter"})
_LOOP_EXIT = frozenset({"Exit", "RefExit"})
_MERGE = frozenset({"Merge", "RefMerge"})
_CALL_PREFIX = re.compile(r"^(?:Stateful)?PartitionedCall(?:_\d+)?/")
# Identity ops function inlining puts at a call's boundary: copies, not computations.
_INLINE_BOUNDARY = re.compile(r"^Func/.+/(?:input|output)/_\d+$")


# ------------------------------------------------------------------ format

def model_format(name: str, data: bytes) -> str:
    """Which kind of model a file is, from its name and first bytes (no
    TensorFlow import): onnx, graphdef, savedmodel or keras. Anything not
    recognized is left to the ONNX reader, whose error names the file."""
    lower = (name or "").lower()
    if lower.endswith(".onnx"):
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


def is_tensorflow(name: str, data: bytes) -> bool:
    return model_format(name, data) in TF_FORMATS


def _is_tar(data: bytes) -> bool:
    if data[:2] == b"\x1f\x8b":   # gzip: only a tar archive is expected here
        return True
    return len(data) > 262 and data[257:262] == b"ustar"


# ------------------------------------------------------------------ archives

def pack_directory(path: str | os.PathLike) -> bytes:
    """A SavedModel directory as one tar archive (client side): regular files
    and directories only, names relative to the directory."""
    root = Path(path)
    if not (root / "saved_model.pb").is_file() and not (root / "saved_model.pbtxt").is_file():
        raise LayerdiffError("is a directory without saved_model.pb, not a SavedModel", file=str(root),
                             field="model")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise LayerdiffError(f"holds a link ({rel}); copy the files instead", file=str(root), field="model")
            if p.is_dir() or p.is_file():
                tar.add(p, arcname=rel, recursive=False)
    return buf.getvalue()


def _member_path(raw: str, archive: str) -> str:
    name = raw.replace("\\", "/")
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if not name or name == ".":
        return ""
    if "\x00" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise LayerdiffError(f"archive member {raw!r} has an absolute path", file=archive, field="model")
    if any(part == ".." for part in name.split("/")):
        raise LayerdiffError(f"archive member {raw!r} has a '..' path segment", file=archive, field="model")
    return name


def check_zip_members(data: bytes, archive: str, max_bytes: int = MAX_UNPACKED_BYTES) -> list[zipfile.ZipInfo]:
    """Validate every member of a zip (names, links, declared sizes) without
    unpacking it."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except Exception as e:    # BadZipFile, a damaged directory ("zip file version 6.4"...)
        raise LayerdiffError(f"is not a readable zip archive ({type(e).__name__}: {e})", file=archive,
                             field="model") from e
    infos = z.infolist()
    if len(infos) > MAX_ARCHIVE_MEMBERS:
        raise LimitError(f"archive has {len(infos)} members (limit {MAX_ARCHIVE_MEMBERS})", file=archive,
                         field="model")
    total = 0
    for info in infos:
        _member_path(info.filename, archive)
        if stat.S_ISLNK(info.external_attr >> 16):
            raise LayerdiffError(f"archive member {info.filename!r} is a link", file=archive, field="model")
        total += info.file_size
        if total > max_bytes:
            raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive, field="model")
    return infos


def unpack_archive(data: bytes, dest: Path, archive: str, max_bytes: int = MAX_UNPACKED_BYTES) -> None:
    """Unpack a tar (optionally gzip) or zip archive into ``dest``: regular
    files and directories only, every path inside ``dest``, at most
    ``max_bytes`` written whatever the headers declare."""
    dest = Path(dest)
    root = dest.resolve()
    written = 0

    def target(rel: str) -> Path:
        p = (dest / rel).resolve()
        if root != p and root not in p.parents:
            raise LayerdiffError(f"archive member {rel!r} lands outside the unpack directory", file=archive,
                                 field="model")
        return p

    def copy(src, rel: str) -> None:
        nonlocal written
        p = target(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "xb") as out:
            while True:
                piece = src.read(1 << 20)
                if not piece:
                    break
                written += len(piece)
                if written > max_bytes:
                    raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive,
                                     field="model")
                out.write(piece)

    if data[:4] == b"PK\x03\x04":
        infos = check_zip_members(data, archive, max_bytes)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in infos:
                rel = _member_path(info.filename, archive)
                if not rel:
                    continue
                if info.is_dir():
                    target(rel).mkdir(parents=True, exist_ok=True)
                    continue
                with z.open(info) as src:
                    copy(src, rel)
        return
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LayerdiffError(f"is not a readable tar archive ({e})", file=archive, field="model") from e
    with tar:
        count = 0
        try:
            for m in tar:
                count += 1
                if count > MAX_ARCHIVE_MEMBERS:
                    raise LimitError(f"archive has more than {MAX_ARCHIVE_MEMBERS} members", file=archive,
                                     field="model")
                rel = _member_path(m.name, archive)
                if m.issym() or m.islnk():
                    raise LayerdiffError(f"archive member {m.name!r} is a link", file=archive, field="model")
                if m.isdir():
                    if rel:
                        target(rel).mkdir(parents=True, exist_ok=True)
                    continue
                if not m.isfile():
                    raise LayerdiffError(f"archive member {m.name!r} is not a regular file", file=archive,
                                         field="model")
                if not rel:
                    continue
                if m.size > max_bytes - written:
                    raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive,
                                     field="model")
                src = tar.extractfile(m)
                if src is not None:
                    copy(src, rel)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise LayerdiffError(f"is not a readable tar archive ({e})", file=archive, field="model") from e


def savedmodel_root(directory: Path, archive: str) -> Path:
    """The one directory of an unpacked archive that holds saved_model.pb."""
    found = sorted({p.parent for pat in ("saved_model.pb", "saved_model.pbtxt") for p in directory.rglob(pat)})
    if not found:
        raise LayerdiffError("is not a SavedModel (no saved_model.pb in the archive)", file=archive, field="model")
    if len(found) > 1:
        rels = [p.relative_to(directory).as_posix() or "." for p in found]
        raise LayerdiffError(f"holds several SavedModels ({rels}); upload one", file=archive, field="model")
    return found[0]


# ------------------------------------------------------------------ TensorFlow

# TensorFlow keeps per-thread state, in C++ (thread_local) and in Python
# (threading.local). Arrow Flight runs the collector's handlers on gRPC's own
# threads, whose Python thread state is created and dropped around each call:
# the next call on the same OS thread then finds TensorFlow's C++ state
# pointing at freed Python objects, and the process crashes. So every
# TensorFlow call of this process runs on one long-lived Python thread.
_TF_THREAD_PREFIX = "layerdiff-tensorflow"
_tf_executor: ThreadPoolExecutor | None = None
_tf_executor_lock = threading.Lock()


def on_tf_thread(fn):
    """Run the decorated function on the thread that owns TensorFlow."""

    @wraps(fn)
    def call(*args, **kwargs):
        global _tf_executor
        if threading.current_thread().name.startswith(_TF_THREAD_PREFIX):
            return fn(*args, **kwargs)
        with _tf_executor_lock:
            if _tf_executor is None:
                _tf_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_TF_THREAD_PREFIX)
        return _tf_executor.submit(fn, *args, **kwargs).result()

    return call


@on_tf_thread
def import_tf():
    """TensorFlow, imported on first use with its start-up chatter kept to
    warnings and errors. oneDNN's custom kernels are off: they announce
    themselves on the terminal before any log level applies, and a
    reference computed in a fixed summation order is the one to compare
    against."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise LayerdiffError("TensorFlow is not installed here; install layerdiff with the [tf] extra",
                             field="model") from e
    return tf


@dataclass
class TFGraph:
    """A frozen TensorFlow graph with every op output reachable by name."""

    name: str
    format: str
    graph_def: Any                                   # tensorflow GraphDef
    inputs: list[GraphInput]
    sites: list[TensorSite]
    consumers: dict[str, list[str]]
    layers: dict[str, str] = field(default_factory=dict)   # op name -> Keras layer
    optional_inputs: frozenset = frozenset()                # PlaceholderWithDefault: may be left out
    # site op -> the tensors it reads (its data inputs, in order)
    node_inputs: dict[str, list[str]] = field(default_factory=dict)
    # tensors computed from weights alone that site ops read (parameters)
    params: frozenset = frozenset()
    _param_values: dict | None = field(default=None, repr=False)

    # ------------------------------------------------------------ inputs
    def check_inputs(self, feeds: dict[str, np.ndarray], inputs_name: str,
                     extra: dict[str, GraphInput] | None = None) -> dict[str, np.ndarray]:
        """Validate names, dtypes and shapes of the feeds; keys become tensor
        names (``x`` and ``x:0`` both name the input ``x:0``), as ONNX feeds
        are named by tensor. A single unnamed array is accepted for a
        single-input graph. ``extra`` declares further tensors that may be fed
        (the seed's ``input_map``), by op name."""
        declared = {d.name: d for d in self.inputs}
        declared.update(extra or {})
        required = [d.name for d in self.inputs if d.name not in self.optional_inputs]
        if "" in feeds and len(feeds) == 1 and len(required) == 1:
            feeds = {required[0]: feeds[""]}
        out: dict[str, np.ndarray] = {}
        for k, a in feeds.items():
            key = k[:-2] if k.endswith(":0") else k
            if key not in declared:
                raise LayerdiffError(f"input {k!r} is not an input of the model (inputs: {sorted(declared)})",
                                     file=inputs_name, field=k)
            out[key] = np.asarray(a)
        for name in required:
            if name not in out:
                raise LayerdiffError(f"model input {name!r} is missing from the inputs file", file=inputs_name,
                                     field=name)
        for key, a in out.items():
            d = declared[key]
            if d.dtype and a.dtype.name != d.dtype:
                raise LayerdiffError(f"input {key!r} has dtype {a.dtype.name}, the model expects {d.dtype}",
                                     file=inputs_name, field=key)
            if d.shape is not None:
                if len(d.shape) != a.ndim:
                    raise LayerdiffError(f"input {key!r} has shape {a.shape}, the model expects rank "
                                         f"{len(d.shape)} {_fmt_shape(d.shape)}", file=inputs_name, field=key)
                for want, got in zip(d.shape, a.shape):
                    if want is not None and want != got:
                        raise LayerdiffError(f"input {key!r} has shape {a.shape}, the model expects "
                                             f"{_fmt_shape(d.shape)}", file=inputs_name, field=key)
        return {f"{k}:0": a for k, a in out.items()}

    # ------------------------------------------------------------ order
    def node_runtime(self) -> list[dict]:
        """Ops in execution order with their outputs (node_runtime.json)."""
        out: list[dict] = []
        for s in self.sites:
            if out and out[-1]["node"] == s.node:
                out[-1]["outputs"].append(s.tensor)
                continue
            entry = {"order": s.order, "node": s.node, "op_type": s.op_type, "outputs": [s.tensor]}
            if s.node in self.layers:
                entry["layer"] = self.layers[s.node]
            out.append(entry)
        return out

    # ------------------------------------------------------------ running
    def _shaped(self, feeds: dict[str, np.ndarray]):
        """A copy of the GraphDef whose fed placeholders carry the feeds'
        concrete shapes, so that every static shape downstream is known."""
        tf = import_tf()
        gd = tf.compat.v1.GraphDef()
        gd.CopyFrom(self.graph_def)
        by_op = {_op_of(k): v for k, v in feeds.items()}
        for node in gd.node:
            if node.op in INPUT_OPS and node.name in by_op:
                shape = node.attr["shape"].shape
                shape.Clear()
                for s in by_op[node.name].shape:
                    shape.dim.add().size = int(s)
        return gd

    def _import(self, feeds: dict[str, np.ndarray]):
        tf = import_tf()
        g = tf.Graph()
        try:
            with g.as_default():
                tf.graph_util.import_graph_def(self._shaped(feeds), name="")
        except Exception as e:
            raise LayerdiffError(f"TensorFlow cannot import the graph: {_tf_message(e)}", file=self.name) from e
        return g

    @on_tf_thread
    def estimate_output_bytes(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, int]:
        """Size of each site's tensor (or of the tensors named) for these
        inputs, from static shapes; tensors whose shape stays unknown are
        left out."""
        try:
            g = self._import(feeds)
        except LayerdiffError:
            return {}
        out: dict[str, int] = {}
        for name in (names if names is not None else [s.tensor for s in self.sites]):
            t = g.get_tensor_by_name(name)
            if t.shape.is_fully_defined():
                try:
                    item = np.dtype(t.dtype.as_numpy_dtype).itemsize
                except TypeError:
                    continue
                out[name] = int(np.prod(t.shape.as_list(), dtype=np.int64)) * item
        return out

    @on_tf_thread
    def run(self, feeds: dict[str, np.ndarray], only: list[str] | None = None, *, optimize: bool = False,
            device: str = "cpu", field_name: str = "model") -> dict[str, np.ndarray]:
        """Values of the given tensors (default: every site) by tensor name.

        ``optimize=False`` (the reference) turns TensorFlow's graph rewrites
        off, so that no op is fused or folded away. A tensor of a TF1 cond
        branch that was not taken has no value and is left out of the result.
        """
        tf = import_tf()
        names = list(only) if only is not None else [s.tensor for s in self.sites]
        g = self._import(feeds)
        config = tf.compat.v1.ConfigProto()
        if not optimize:
            config.graph_options.rewrite_options.disable_meta_optimizer = True
            config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
            config.graph_options.optimizer_options.do_constant_folding = False
        if device == "cpu":
            config.device_count["GPU"] = 0
        try:
            fetches = [g.get_tensor_by_name(n) for n in names]
            feed_dict = {g.get_tensor_by_name(_tensor_of(k)): v for k, v in feeds.items()}
        except (KeyError, ValueError) as e:
            raise LayerdiffError(f"no such tensor in the graph: {e}", file=self.name, field=field_name) from e
        results: dict[str, np.ndarray] = {}
        with tf.compat.v1.Session(graph=g, config=config) as sess:
            # A TF1 cond's branch that is not taken has no value ("dead"):
            # fetching it fails the whole run, so it is left out first.
            dead = _dead_tensors(g, sess, feed_dict, self.name, field_name)
            pending = [(n, t) for n, t in zip(names, fetches) if n not in dead]
            try:
                values = sess.run([t for _, t in pending], feed_dict=feed_dict)
            except tf.errors.OpError as e:
                raise LayerdiffError(f"run failed: {_tf_message(e)}", file=self.name, field=field_name) from e
            for (n, _), v in zip(pending, values):
                a = np.asarray(v)
                if a.dtype.name == "bfloat16":   # not a wire dtype; exact in float32
                    a = a.astype(np.float32)
                results[n] = a
        return results

    # ------------------------------------------------------------ parameters
    @on_tf_thread
    def constant(self, tensor: str) -> np.ndarray | None:
        """The value of a parameter a site op reads (a weight, or what is
        computed from weights alone); None for anything computed from the
        inputs. All parameters are evaluated once, on first use."""
        if tensor not in self.params:
            return None
        if self._param_values is None:
            tf = import_tf()
            g = self._import({})
            config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
            names = sorted(self.params)
            with tf.compat.v1.Session(graph=g, config=config) as sess:
                try:
                    values = sess.run([g.get_tensor_by_name(n) for n in names])
                except tf.errors.OpError as e:
                    raise LayerdiffError(f"the weights cannot be evaluated: {_tf_message(e)}", file=self.name) from e
            self._param_values = {n: np.asarray(v) for n, v in zip(names, values)}
        return self._param_values.get(tensor)

    @on_tf_thread
    def run_isolated(self, node: str, device_inputs: dict[int, np.ndarray], feeds: dict[str, np.ndarray]
                     ) -> list[np.ndarray]:
        """The outputs of one op computed alone in FP32 on the CPU: the
        device's values fed in place of the activations it reads (TensorFlow
        feeds any tensor), the reference's own weights kept. Raises KeyError
        naming an input whose device value is missing."""
        tf = import_tf()
        g = self._import(feeds)
        op = g.get_operation_by_name(node)
        feed_dict = {}
        for k, t in enumerate(self.node_inputs.get(node, [])):
            if t in self.params:
                continue
            v = feeds.get(t) if t in feeds else device_inputs.get(k)
            if v is None:
                raise KeyError(f"the device value of input {k} ({t!r}) is not available")
            v = np.asarray(v)
            if v.dtype == np.float16:   # the reference computes in FP32
                v = v.astype(np.float32)
            feed_dict[op.inputs[k]] = v
        config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        with tf.compat.v1.Session(graph=g, config=config) as sess:
            values = sess.run(list(op.outputs), feed_dict=feed_dict)
        return [np.asarray(v) for v in values]


def _op_of(tensor: str) -> str:
    op, _, port = tensor.rpartition(":")
    return op if op and port.isdigit() else tensor


def _tensor_of(name: str) -> str:
    return name if _op_of(name) != name else f"{name}:0"


_ALIVE, _DEAD, _UNKNOWN = 0, 1, 2
_SWITCH = frozenset({"Switch", "RefSwitch"})


def _dead_tensors(g, sess, feed_dict, name: str, field_name: str) -> set[str]:
    """Tensors of a TF1 cond branch not taken in this run, found as the
    executor finds them: a Switch sends its input to the port of its
    predicate's value and a dead tensor to the other; an op with a dead input
    is dead; a Merge is dead only when all its inputs are. Predicates are
    fetched level by level (one run per nesting depth of the conds); switches
    of while loops (predicate from LoopCond) are left alone."""
    tf = import_tf()
    ops = g.get_operations()
    switches = [op for op in ops if op.type in _SWITCH and op.inputs[1].op.type != "LoopCond"]
    if not switches:
        return set()
    switch_names = {op.name for op in switches}
    preds: dict[str, bool] = {}
    while True:
        status: dict[str, int] = {}
        for op in ops:   # import order is a topological order outside loops
            ins = [status.get(t.name, _ALIVE) for t in op.inputs] + \
                  [_DEAD if any(status.get(o.name, _ALIVE) == _DEAD for o in c.outputs) and c.outputs else _ALIVE
                   for c in op.control_inputs]
            if op.type in _MERGE:
                st = _ALIVE if _ALIVE in ins else (_UNKNOWN if _UNKNOWN in ins else _DEAD)
            else:
                st = _DEAD if _DEAD in ins else (_UNKNOWN if _UNKNOWN in ins else _ALIVE)
            if op.name in switch_names and st == _ALIVE:
                if op.name not in preds:
                    for t in op.outputs:
                        status[t.name] = _UNKNOWN
                    continue
                taken = 1 if preds[op.name] else 0
                for k, t in enumerate(op.outputs):
                    status[t.name] = _ALIVE if k == taken else _DEAD
                continue
            for t in op.outputs:
                status[t.name] = st
        need = [op for op in switches if op.name not in preds and status.get(op.inputs[1].name, _ALIVE) == _ALIVE
                and status.get(op.inputs[0].name, _ALIVE) == _ALIVE]
        if not need:
            return {t for t, st in status.items() if st != _ALIVE}
        try:
            values = sess.run([op.inputs[1] for op in need], feed_dict=feed_dict)
        except tf.errors.OpError as e:
            raise LayerdiffError(f"run failed: {_tf_message(e)}", file=name, field=field_name) from e
        preds.update((op.name, bool(np.asarray(v))) for op, v in zip(need, values))


def _tf_message(e: BaseException) -> str:
    msg = getattr(e, "message", None) or str(e)
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip() and not ln.startswith("Graph execution")]
    return " ".join(lines)[:600] or type(e).__name__


def _fmt_shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"


# ------------------------------------------------------------------ loading

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
    return _analyse(gd, name, fmt, set(outputs), layers)


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
        raise LayerdiffError(f"cannot be frozen into a graph: {_tf_message(e)}", file=name, field="model") from e
    return frozen.graph.as_graph_def(), [t.op.name for t in frozen.outputs]


def _freeze_savedmodel(data: bytes, name: str, signature: str) -> tuple[Any, list[str]]:
    tf = import_tf()
    with tempfile.TemporaryDirectory(prefix="layerdiff-savedmodel-") as tmp:
        unpack_archive(data, Path(tmp), name)
        root = savedmodel_root(Path(tmp), name)
        try:
            obj = tf.saved_model.load(str(root))
        except Exception as e:
            raise LayerdiffError(f"is not a loadable SavedModel: {_tf_message(e)}", file=name, field="model") from e
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


def _analyse(gd, name: str, fmt: str, output_ops: set[str], layer_names: list[str]) -> TFGraph:
    """Inputs, sites in execution order and the consumer map of a frozen graph."""
    tf = import_tf()
    g = tf.Graph()
    try:
        with g.as_default():
            tf.graph_util.import_graph_def(gd, name="")
    except Exception as e:
        raise LayerdiffError(f"is not a valid TensorFlow graph: {_tf_message(e)}", file=name, field="model") from e
    ops = g.get_operations()
    index = {op.name: i for i, op in enumerate(ops)}
    inputs: list[GraphInput] = []
    for op in ops:
        if op.type in INPUT_OPS:
            t = op.outputs[0]
            shape = tuple(t.shape.as_list()) if t.shape.rank is not None else None
            inputs.append(GraphInput(op.name, _np_dtype(t.dtype), shape))
    if not inputs:
        raise LayerdiffError("has no inputs (no Placeholder op)", file=name, field="model")

    # Ops in a TF1 while-loop frame run once per iteration: no single value.
    in_loop: set[str] = set()
    for op in ops:
        if op.type in _LOOP_ENTER:
            stack = [op]
            while stack:
                cur = stack.pop()
                if cur.name in in_loop:
                    continue
                in_loop.add(cur.name)
                for out in cur.outputs:
                    stack.extend(c for c in out.consumers() if c.type not in _LOOP_EXIT)

    # Ops whose value depends on the inputs (data edges only).
    reach: set[str] = set()
    stack = [g.get_operation_by_name(i.name) for i in inputs]
    while stack:
        cur = stack.pop()
        for out in cur.outputs:
            for c in out.consumers():
                if c.name not in reach:
                    reach.add(c.name)
                    stack.append(c)

    # Execution order: topological over data and control edges, ties in
    # GraphDef order (Kahn's algorithm on a heap of GraphDef positions).
    import heapq

    preds = {op.name: {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs} for op in ops}
    succs: dict[str, list[str]] = {op.name: [] for op in ops}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    indeg = {n: len(ps) for n, ps in preds.items()}
    heap = [index[n] for n, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: list = []
    while heap:
        op = ops[heapq.heappop(heap)]
        order.append(op)
        for s in succs[op.name]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, index[s])
    if len(order) != len(ops):   # cycles (TF1 loops: NextIteration -> Merge): the rest in GraphDef order
        placed = {op.name for op in order}
        order.extend(op for op in ops if op.name not in placed)

    sites: list[TensorSite] = []
    site_ops: list[str] = []
    for op in order:
        if (op.name not in reach or op.name in in_loop or op.name in output_ops or op.type in INPUT_OPS
                or op.type in _NO_VALUE_OPS or not op.outputs
                or (op.type == "Identity" and _INLINE_BOUNDARY.match(op.name))):
            continue
        kept = [(k, t) for k, t in enumerate(op.outputs) if _np_dtype(t.dtype)]
        if not kept:
            continue
        n = len(site_ops)
        site_ops.append(op.name)
        for k, t in kept:
            sites.append(TensorSite(t.name, op.name, op.type, n, k))
    if not sites:
        raise LayerdiffError("has no op that computes from the inputs", file=name, field="model")

    # What each site op reads. An input coming through the Identity copies
    # that inlining or freezing adds is named by its source, a site or a
    # graph input; inputs computed from weights alone are parameters.
    site_set = set(site_ops)
    dropped_copies = {op.name for op in ops if op.type == "Identity" and op.inputs and op.name not in site_set
                      and (op.name in output_ops or _INLINE_BOUNDARY.match(op.name))}

    def source(t):
        while t.op.name in dropped_copies:
            t = t.op.inputs[0]
        return t

    node_inputs: dict[str, list[str]] = {}
    params: set[str] = set()
    for name in site_ops:
        names = []
        for t in g.get_operation_by_name(name).inputs:
            src = source(t)
            names.append(src.name)
            if src.op.name not in reach and src.op.type not in INPUT_OPS and _np_dtype(src.dtype):
                params.add(src.name)
        node_inputs[name] = names

    keep = site_set | {i.name for i in inputs}
    consumers: dict[str, list[str]] = {}
    for op in order:
        if op.name not in keep:
            continue
        outs: list[str] = []
        for t in op.outputs:
            for c in t.consumers():
                if c.name in keep and c.name not in outs:
                    outs.append(c.name)
        consumers[op.name] = outs
    layers = layer_map(site_ops, layer_names) if layer_names else {}
    optional = frozenset(op.name for op in ops if op.type == "PlaceholderWithDefault")
    return TFGraph(name=name, format=fmt, graph_def=gd, inputs=inputs, sites=sites, consumers=consumers,
                   layers=layers, optional_inputs=optional, node_inputs=node_inputs, params=frozenset(params))


_WIRE_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                          "float16", "float32", "float64", "bfloat16"})


def _np_dtype(dtype) -> str:
    """numpy dtype name of a TensorFlow dtype, "" for what has no numeric
    value (strings, resources, variants)."""
    try:
        n = np.dtype(dtype.as_numpy_dtype).name
    except TypeError:
        return ""
    return n if n in _WIRE_DTYPES else ""


_UNIQUIFIER = re.compile(r"_\d+$")


def layer_map(op_names: list[str], layer_names: list[str]) -> dict[str, str]:
    """op name -> the innermost Keras layer whose name scope holds it.
    TensorFlow makes a reused scope unique with a ``_N`` suffix, so
    ``model_1/conv1_1/convolution`` belongs to layer ``conv1``."""
    known = set(layer_names)
    out: dict[str, str] = {}
    for op in op_names:
        for seg in reversed(op.split("/")[:-1]):
            if seg in known:
                out[op] = seg
                break
            base = _UNIQUIFIER.sub("", seg)
            if base in known:
                out[op] = base
                break
    return out

