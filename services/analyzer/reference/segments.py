"""The reference computed within a memory budget.

A network's node outputs can outweigh any budget (a detector at high
resolution produces tens of GB), so the reference is computed in segments of
consecutive nodes whose outputs fit about half the budget
(``LAYERDIFF_MEMORY_BUDGET``, 1 GiB by default), on demand. An ONNX model's
segment is a model of its own nodes only: what it reads from earlier
segments is handed to it (kept, or spilled to disk, only while a later
segment still reads it), so every node runs once whatever the number of
segments. A model that cannot be cut so (TensorFlow, a sub-model
onnxruntime refuses) runs a segment as the whole model exposing that
segment's outputs, in at most four segments (the prefix is recomputed
each time; a dump reference is one segment of mapped files).

Each value is handed out as many times as it has uses (``pop``) and then
forgotten; values computed before their device counterpart arrived wait on
disk once the resident ones pass the budget, so what the reference holds is
the budget (``layerdiff.analyzer.jobs.budget``), not the dump.
"""
from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.jobs.budget import MemoryBudget
from layerdiff.analyzer.reference.onnxrt import reference_session
from layerdiff.common.onnxgraph import cut_segments, estimate_output_bytes

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx

# The largest share of the budget one segment's outputs may take: the
# segment being compared and the one computed next are resident together.
SEGMENT_SHARE = 2


# ----------------------------------------------------------------- planning

def _graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    reads: set[str] = set()
    for n in graph.node:
        reads.update(t for t in _node_reads(n) if t not in defined)
        defined.update(t for t in n.output if t)
    return reads


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """Everything a node reads: its inputs and what its subgraphs (If,
    Loop, Scan bodies) read from outside themselves."""
    out = [t for t in node.input if t]
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.extend(sorted(_graph_reads(a.g)))
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                out.extend(sorted(_graph_reads(g)))
    return out


# ------------------------------------------------------------------ runners

class PrefixRunner:
    """Segments of any reference, each run as the whole model exposing its
    own outputs (``reference.run(feeds, only=...)``): none smaller than half
    the budget, at most four (``layerdiff.common.onnxgraph.plan_segments``)."""

    def __init__(self, reference, feeds: dict[str, np.ndarray], budget: int) -> None:
        self.reference = reference
        self.feeds = feeds
        self.segments = reference.plan(feeds, min_bytes=budget // SEGMENT_SHARE)
        self.reads: list[list[str]] = [[] for _ in self.segments]    # nothing handed between segments

    def run(self, i: int, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.reference.run(self.feeds, only=self.segments[i])


class ChainedRunner:
    """An ONNX reference's segments, each a model of its own nodes fed with
    what earlier segments computed (``reads[i]``: the tensors segment i
    takes from them). A segment whose model onnxruntime does not take runs
    as the whole model instead."""

    def __init__(self, reference, feeds: dict[str, np.ndarray], budget: int) -> None:
        self.reference = reference
        self.feeds = feeds
        model = reference.model
        sizes = estimate_output_bytes(model, feeds)
        by_node: dict[int, list[str]] = {}
        for s in reference.sites:
            by_node.setdefault(s.order, []).append(s.tensor)
        order = sorted(by_node)
        self.segments = cut_segments([by_node[k] for k in order], sizes, budget // SEGMENT_SHARE)
        # node ranges [start, end) of each segment, in graph order
        self.ranges: list[tuple[int, int]] = []
        owner = {t: k for k, ts in by_node.items() for t in ts}
        start = 0
        for seg in self.segments:
            end = max(owner[t] for t in seg) + 1 if seg else start
            self.ranges.append((start, end))
            start = end
        if self.ranges:
            self.ranges[-1] = (self.ranges[-1][0], len(model.graph.node))
        inits = {i.name for i in model.graph.initializer}
        # onnxruntime loads a Constant node's output as an initializer (a
        # MatMul then packs it, and sums in another order than with an input):
        # a segment holds its own copy of each Constant it reads
        self._constants = {t: n for n in model.graph.node if n.op_type == "Constant" for t in n.output if t}
        produced_in: dict[str, int] = {}
        for i, (a, b) in enumerate(self.ranges):
            for n in model.graph.node[a:b]:
                for t in n.output:
                    if t:
                        produced_in[t] = i
        self.reads = []
        for i, (a, b) in enumerate(self.ranges):
            names = dict.fromkeys(t for n in model.graph.node[a:b] for t in _node_reads(n))
            self.reads.append([t for t in names if t not in inits and t not in self._constants
                               and produced_in.get(t, i) < i])
        self._inits = inits

    def run(self, i: int, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(self.segments) == 1:
            return self.reference.run(self.feeds)
        try:
            sub = self._segment_model(i, given)
            sess = reference_session(sub, quiet=True)
            # a spilled value is fed as its mapping (np.asarray: a plain view of the file's pages)
            feeds = {v.name: np.asarray(given[v.name] if v.name in given else self.feeds[v.name])
                     for v in sub.graph.input}
            names = [o.name for o in sess.get_outputs()]
            values = sess.run(None, feeds)
        except Exception:
            # a value no tensor input carries (a sequence), a sub-model
            # onnxruntime refuses: the whole model computes the segment, or
            # says what is wrong
            return self.reference.run(self.feeds, only=self.segments[i])
        return {n: np.asarray(v) for n, v in zip(names, values)}

    def _segment_model(self, i: int, given: dict[str, np.ndarray]) -> onnx.ModelProto:
        model = self.reference.model
        a, b = self.ranges[i]
        nodes = model.graph.node[a:b]
        reads = dict.fromkeys(t for n in nodes for t in _node_reads(n))
        produced = {t for n in nodes for t in n.output if t}
        constants = [self._constants[t] for t in reads if t in self._constants and t not in produced]
        inputs = []
        for t in reads:
            if t in produced or t in self._inits or t in self._constants:
                continue
            v = given[t] if t in given else self.feeds[t]
            v = np.asarray(v)
            if v.dtype == object:
                raise TypeError(f"{t!r} is not a tensor")
            inputs.append(onnx.helper.make_tensor_value_info(t, onnx.helper.np_dtype_to_tensor_dtype(v.dtype),
                                                             list(v.shape)))
        graph = onnx.GraphProto(name=f"{model.graph.name}-segment{i}")
        graph.node.extend(constants)
        graph.node.extend(nodes)
        graph.input.extend(inputs)
        graph.initializer.extend(x for x in model.graph.initializer if x.name in reads)
        graph.output.extend(onnx.ValueInfoProto(name=t) for t in self.segments[i])
        sub = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
        sub.opset_import.extend(model.opset_import)
        sub.functions.extend(model.functions)
        return sub


# ------------------------------------------------------------- the values

class SegmentedReference:
    """Reference values computed one segment at a time, on demand, within
    ``budget`` bytes; each value is handed out as many times as it has uses
    (``pop``; once by default, more where node inputs read it too) and then
    forgotten. Values waiting for their device counterpart, and those later
    segments read, go to ``spill_dir`` (deleted by ``close``) when what is
    resident passes the budget."""

    def __init__(self, reference, feeds: dict[str, np.ndarray], uses: dict[str, int] | None = None,
                 budget: int | None = None, spill_dir: Path | None = None,
                 make_room: Callable[[], None] | None = None) -> None:
        """``make_room``: called before each segment is computed, to let go
        of what the job only caches (its free receive buffers): a segment
        is the largest allocation a job makes."""
        self.reference = reference
        self.make_room = make_room
        self.feeds = feeds
        self.budget = MemoryBudget.from_env().reference if budget is None else budget
        chained = getattr(reference, "chainable", False)
        self.runner = (ChainedRunner if chained else PrefixRunner)(reference, feeds, self.budget)
        self.segments = self.runner.segments
        self.segment_of = {t: i for i, seg in enumerate(self.segments) for t in seg}
        self.computed = 0
        self.values: dict[str, np.ndarray] = {}
        self.uses = dict(uses or {})
        # tensor -> the last segment that reads it from an earlier one
        self._last_reader: dict[str, int] = {}
        for i, names in enumerate(self.runner.reads):
            for t in names:
                self._last_reader[t] = i
        self._carried: dict[str, np.ndarray] = {}
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._spilled = 0
        self.spilled_bytes = 0
        self._closed = False
        self._lock = threading.Lock()
        # the model's own outputs, kept for the impact re-runs' baseline when small
        model = getattr(reference, "model", None) if getattr(reference, "chainable", False) else None
        self._outputs = {o.name for o in model.graph.output} if model is not None else set()
        self._kept_outputs: dict[str, np.ndarray] = {}

    def ensure(self, upto: int) -> SegmentedReference:
        with self._lock:
            while self.computed <= min(upto, len(self.segments) - 1) and not self._closed:
                i = self.computed
                if self.make_room is not None:
                    self.make_room()
                got = self._step(i, self._carried)
                if self._closed:     # closed while the segment ran: its values go with the rest
                    break
                self.values.update(got)
                for t in self._outputs.intersection(got):
                    if sum(v.nbytes for v in self._kept_outputs.values()) + got[t].nbytes <= self.budget // 8:
                        self._kept_outputs[t] = got[t]
                self.computed += 1
                self._bound()
            if self._closed:
                self._drop()
        return self

    def _step(self, i: int, carried: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Segment i's values, from what earlier segments left in
        ``carried``, which then keeps only what a later segment still reads."""
        got = self.runner.run(i, {t: carried[t] for t in self.runner.reads[i] if t in carried})
        for t in [t for t in carried if self._last_reader.get(t, -1) <= i]:
            del carried[t]
        carried.update((t, v) for t, v in got.items() if self._last_reader.get(t, -1) > i)
        return got

    def _resident(self) -> int:
        seen: set[int] = set()
        total = 0
        for v in list(self.values.values()) + list(self._carried.values()):
            if isinstance(v, np.memmap) or id(v) in seen:
                continue
            seen.add(id(v))
            total += v.nbytes
        return total

    def _bound(self) -> None:
        """Past the budget, the values computed longest ago go to disk."""
        if self._spill_dir is None or len(self.segments) == 1:
            return
        over = self._resident() - self.budget // SEGMENT_SHARE
        if over <= 0:
            return
        for t in sorted(set(self.values) | set(self._carried), key=lambda t: self.segment_of.get(t, 0)):
            if over <= 0:
                break
            v = self.values.get(t, self._carried.get(t))
            if not isinstance(v, np.ndarray) or isinstance(v, np.memmap) or v.dtype == object or v.nbytes < 4096:
                continue
            mapped = self._spill(v)
            if t in self.values:
                self.values[t] = mapped
            if t in self._carried:
                self._carried[t] = mapped
            over -= v.nbytes

    def _spill(self, v: np.ndarray) -> np.ndarray:
        assert self._spill_dir is not None     # _bound spills only where there is a spill directory
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        path = self._spill_dir / f"{self._spilled}.npy"
        self._spilled += 1
        np.save(path, v, allow_pickle=False)
        self.spilled_bytes += v.nbytes
        return np.load(path, mmap_mode="r", allow_pickle=False)

    def pop(self, tensor: str) -> np.ndarray | None:
        i = self.segment_of.get(tensor)
        if i is None:
            return None
        self.ensure(i)
        with self._lock:
            left = self.uses.pop(tensor, 1) - 1
            if left > 0:
                self.uses[tensor] = left
                return self.values.get(tensor)
            return self.values.pop(tensor, None)

    def value_of(self, tensor: str) -> np.ndarray | None:
        """Any tensor a node reads: a model input, a weight or a node output
        (one use of it)."""
        if tensor in self.feeds:
            return np.asarray(self.feeds[tensor])
        const = self.reference.constant(tensor)
        return const if const is not None else self.pop(tensor)

    def replay(self) -> Iterator[dict[str, np.ndarray]]:
        """Every segment's values once more, one segment at a time, from a
        computation of its own (value pairing fingerprints them so)."""
        carried: dict[str, np.ndarray] = {}
        for i in range(len(self.segments)):
            yield self._step(i, carried)

    def graph_outputs(self) -> dict[str, np.ndarray] | None:
        """The model's outputs as computed here (what an impact re-run is
        judged against), or None where some were not computed or together
        they pass an eighth of the budget."""
        kept = dict(self._kept_outputs)
        return kept if self._outputs and set(kept) == self._outputs else None

    def memory(self) -> dict:
        """How the reference kept within its budget (summary.json ``memory``)."""
        return {"budget_bytes": self.budget, "reference_segments": len(self.segments),
                "chained": isinstance(self.runner, ChainedRunner), "spilled_bytes": self.spilled_bytes}

    def close(self) -> None:
        """Forget every value and delete the spilled ones; a segment under
        way (a cancelled job's) is not waited for: it does so when it ends."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _drop(self) -> None:
        self.values.clear()
        self._kept_outputs.clear()
        self._carried.clear()
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)

