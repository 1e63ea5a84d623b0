"""A frozen TensorFlow graph (TFGraph) and how it runs: feeds checked
against its inputs, every site's value fetched in one session (the branches
of a TF1 cond not taken left out), parameters evaluated once, one op run
alone on device values.

TensorFlow model handling is a small set of modules, shared by the analyzer
(reference runs) and the collector (device runs):

- layerdiff.common.tf.format: which kind of model file a model is (no TensorFlow);
- layerdiff.common.tf.archive: SavedModel archives packed and unpacked safely;
- layerdiff.common.tf.runtime: TensorFlow imported lazily, on its one thread;
- layerdiff.common.tf.load: the three file kinds loaded, checked and frozen
  into one GraphDef (load_tf_model);
- layerdiff.common.tf.sites: a frozen GraphDef analysed into a TFGraph (its
  inputs, its sites in execution order, consumers, parameters, Keras layers);
- this module: the TFGraph itself.

TensorFlow is imported only inside the functions that need it, so that the
collector and the ONNX paths start without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import GraphInput, TensorSite
from layerdiff.common.tf.runtime import import_tf, on_tf_thread, tf_message

INPUT_OPS = frozenset({"Placeholder", "PlaceholderWithDefault"})
_MERGE = frozenset({"Merge", "RefMerge"})


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
            raise LayerdiffError(f"TensorFlow cannot import the graph: {tf_message(e)}", file=self.name) from e
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
                raise LayerdiffError(f"run failed: {tf_message(e)}", file=self.name, field=field_name) from e
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
                    raise LayerdiffError(f"the weights cannot be evaluated: {tf_message(e)}", file=self.name) from e
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
            raise LayerdiffError(f"run failed: {tf_message(e)}", file=name, field=field_name) from e
        preds.update((op.name, bool(np.asarray(v))) for op, v in zip(need, values))



def _fmt_shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"
