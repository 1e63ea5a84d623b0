"""The reference read from a golden dump: a run on another host, device or
framework (PyTorch on a GPU against the same model on an NPU, two builds of
a runtime), compared with the device dump without a model.

The golden collector streams the dump first; every tensor is written as it
arrives into the job's spill directory (``.npy``, straight from the receive
buffer) and read back mapped when its comparison needs it, so the analyzer
holds none of the golden dump in its own memory whatever its size. A
collector serving in the analyzer's own process hands its records over
directly: a ``.npy`` file it maps whole is then mapped where it lies,
not copied.

What a model gives a model job comes from the dump here:

- **sites**: every output record, in execution order: the records' ``order``
  (a manifest's order, an HDF5 call's order attribute or seqid, an Ascend
  timestamp), ties in the order they arrived;
- **node inputs**: where the dump holds a node's inputs (``dump_mode`` all or
  input), each input whose bytes equal a dumped output is that tensor (an
  edge of the graph, found by content), else the dumped input itself;
- **no isolated re-run** unless a model is given: diagnosis then uses the
  vendor's rules and, with inputs dumped on both sides, the node's own error
  measured from its inputs.

An ONNX model (either side's) lends its graph: sites, op types, node order,
node inputs, weights and the isolated re-run of a node, the golden values
paired with its tensors by name.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps.readers import npy_file_of, read_npy
from layerdiff.common.onnxgraph import TensorSite, node_name, node_runtime, tensor_sites
from layerdiff.common.schema import ROLE_INPUT, STATUS_OK, NodeRecord, attribute, original_op

log = logging.getLogger(__name__)


@dataclass
class _Golden:
    """One golden output as received."""
    name: str
    node: str
    op_type: str
    order: int
    slot: int
    arrival: int
    key: str = ""          # its spill file's key; "" when the record was unreadable
    error: str = ""
    about: str = ""        # what the dump recorded of the call (JSON text: a module's attrs, an operator's args)


class DumpReference:
    """The golden dump of one job: fed record by record (``take``) while it
    streams, then ``seal``-ed; it then answers what the job asks of a
    reference (sites, node inputs, values by tensor name). Owns its spill
    directory, deleted by ``close``."""

    def __init__(self, name: str, model=None, provenance: dict | None = None) -> None:
        """``model``: an ONNX ModelProto lending graph structure, or None.
        Nothing is received before ``start`` names the spill directory."""
        self.name = name
        self.model = model
        self.provenance = dict(provenance or {})
        self.spill: Path | None = None
        self.sites: list[TensorSite] = []
        self.consumers: dict[str, list[str]] = {}
        self.node_inputs: dict[str, list[str]] = {}
        self.overflow: dict[str, str] = {}     # node -> why the golden runtime flagged it
        # node -> the tensor it is presumed to read ("": what neither dump holds) (_presume_chain)
        self.presumed: dict[str, str] = {}
        self.duplicates: list[str] = []
        self._outputs: list[_Golden] = []
        self._by_name: dict[str, _Golden] = {}
        self._inputs: dict[tuple[str, int], str] = {}   # (node, slot) -> spill key
        self._spilled: dict[str, Path] = {}     # spill key -> its file, as received
        self._files: dict[str, Path] = {}       # tensor (a site, a node's input) -> its spill file
        # a file read where it lies, as it was read while the golden stream
        # came (mapped, only its header touched; or read whole, a small one):
        # handed over at its first reading, read again for any later one
        self._as_read: dict[Path, np.ndarray] = {}
        self._layouts: dict[Path, tuple[tuple, str]] = {}     # file -> (shape, dtype.str), as received
        self._unavailable: dict[str, str] = {}  # site tensor -> why the golden dump has no value for it
        self._constants: dict = {}
        self._model_nodes: set[str] = set()     # the model's own nodes (re-run alone), with a model
        self._about: dict[str, str] = {}        # node -> what the dump recorded of its call (JSON text)
        self._marked: set[str] = set()          # outputs the dump marks as the model's own (model_output)
        self.bytes = 0
        self.records = 0
        self._sealed = False
        # what the sites' order was read from, and why there is none ("" where
        # there is one): the golden collector's word (DeviceGraph), or the model
        self.order_from = "the model's graph" if model is not None else ""
        self.order_unknown = ""

    def read_order(self, order_from: str, order_unknown: str) -> None:
        """Where the golden dump's collector read its execution order from
        (before ``seal``); a model's order stands over the dump's."""
        if self.model is None:
            self.order_from, self.order_unknown = order_from, order_unknown

    # ------------------------------------------------------------ receiving

    def start(self, spill_dir: Path) -> None:
        """Receive into ``spill_dir`` (created here, deleted by ``close``)."""
        self.spill = Path(spill_dir)
        self.spill.mkdir(parents=True, exist_ok=True)

    def take(self, rec: NodeRecord) -> None:
        """One record of the golden stream (its buffer is not kept: the
        array is written out here)."""
        self.records += 1
        if rec.overflow:
            self.overflow.setdefault(rec.node or rec.name, rec.overflow)
        if rec.role == ROLE_INPUT:
            node = rec.node or rec.name
            if rec.status == STATUS_OK and rec.array is not None and (node, rec.slot) not in self._inputs:
                key = f"in{len(self._spilled)}"
                self._save(key, rec.array)
                self._inputs[(node, rec.slot)] = key
            return
        if rec.name in self._by_name:
            self.duplicates.append(rec.name)
            return
        g = _Golden(rec.name, rec.node or rec.name, rec.op_type, rec.order, rec.slot, len(self._outputs),
                    about=rec.attributes)
        if rec.attributes:
            self._about.setdefault(g.node, rec.attributes)
            listed = attribute(rec.attributes, "model_output")
            if isinstance(listed, list) and rec.slot in [x for x in listed if type(x) is int]:
                self._marked.add(rec.name)
        if rec.status != STATUS_OK or rec.array is None:
            g.error = rec.message or "unreadable"
        else:
            g.key = f"out{len(self._spilled)}"
            self._save(g.key, rec.array)
        self._outputs.append(g)
        self._by_name[rec.name] = g

    def _save(self, key: str, arr: np.ndarray) -> None:
        if self.spill is None:
            raise RuntimeError("DumpReference.start was not called")
        # a golden .npy read in this process is kept where it lies, not
        # copied into the spill directory (half a large two-dump job's time
        # went into those copies)
        path = npy_file_of(arr)
        if path is None:
            path = self.spill / f"{key}.npy"
            np.save(path, np.ascontiguousarray(arr), allow_pickle=False)
        else:
            self._as_read[path] = arr
        self._spilled[key] = path
        self._layouts[path] = (tuple(arr.shape), arr.dtype.str)
        self.bytes += arr.nbytes

    @property
    def model_outputs(self) -> frozenset:
        """What the run's outcome is judged by: the model's graph outputs
        where a model lends its graph, else the outputs the dump marks as
        the model's own (a PyTorch capture's ``model_output``)."""
        if self.model is not None:
            return frozenset(o.name for o in self.model.graph.output)
        return frozenset(self._marked)

    @property
    def tensors(self) -> int:
        """Readable golden outputs."""
        return sum(1 for g in self._outputs if g.key)

    # -------------------------------------------------------------- sealing

    def seal(self) -> None:
        """The golden stream has ended: fix the sites, their order and the
        node inputs."""
        if self._sealed:
            return
        self._sealed = True
        if self.model is not None:
            self._seal_with_model()
        else:
            self._seal_from_dump()
        consumers: dict[str, list[str]] = {}
        producer = {s.tensor: s.node for s in self.sites}
        for s in self.sites:
            consumers.setdefault(s.node, [])
        for node, ins in self.node_inputs.items():
            for t in ins:
                p = producer.get(t)
                if p is not None and p != node and node not in consumers.setdefault(p, []):
                    consumers[p].append(node)
        self.consumers = consumers

    def _seal_from_dump(self) -> None:
        unknown = 1 << 40      # records without an order follow the ordered ones, in arrival order
        ordered = sorted(self._outputs, key=lambda g: (g.order if g.order >= 0 else unknown, g.arrival))
        node_index: dict[str, int] = {}
        for g in ordered:
            node_index.setdefault(g.node, len(node_index))
        # a node's outputs together, at its first one's place
        for g in sorted(ordered, key=lambda g: node_index[g.node]):
            self.sites.append(TensorSite(g.name, g.node, g.op_type, node_index[g.node], g.slot))
            self._place(g, g.name)
        self.node_inputs = self._inputs_by_content()
        self._presume_chain()

    def _presume_chain(self) -> None:
        """A node whose inputs neither dump records is presumed to read the
        first output of the node before it in execution order: what the
        vendor's rules (an error that jumps, a correlation that falls) need
        to tell a node's own error from an inherited one on a chain. Never
        used to pair device input records (``presumed``), and said in the
        evidence. Without an execution order nothing is presumed."""
        if self.order_unknown:
            return
        before = ""       # the first output of the node before
        node = None
        for s in self.sites:
            if s.node == node:
                continue
            if s.node not in self.node_inputs:
                if before:
                    self.node_inputs[s.node] = [before]
                # "": the first node reads the run's inputs, which neither dump holds
                self.presumed[s.node] = before
            node, before = s.node, s.tensor

    def _seal_with_model(self) -> None:
        """The model's tensors that the golden dump holds, paired by name,
        in the model's order; golden tensors the model lacks follow."""
        from layerdiff.analyzer.align.names import Aligner

        model_sites = tensor_sites(self.model)
        aligner = Aligner(model_sites)
        taken: dict[str, _Golden] = {}
        extra: list[_Golden] = []
        for g in sorted(self._outputs, key=lambda g: g.arrival):
            site = aligner.match(g.name, g.node, g.slot, original=original_op(g.about)).site
            if site is None or site.tensor in taken:
                extra.append(g)
            else:
                taken[site.tensor] = g
        for s in model_sites:
            if s.tensor in taken:
                self.sites.append(s)
                self._place(taken[s.tensor], s.tensor)
        last = len(self.model.graph.node)
        for i, g in enumerate(extra):
            # not in the model: compared by name, never re-run
            self.sites.append(TensorSite(g.name, g.node, g.op_type, last + i, g.slot))
            self._place(g, g.name)
        for i, node in enumerate(self.model.graph.node):
            self.node_inputs[node_name(node, i)] = list(node.input)
        self._constants = {i.name: i for i in self.model.graph.initializer}
        # a Constant node's output is a weight too (Paddle exports hold theirs so)
        self._constants.update({n.output[0]: n.attribute[0].t for n in self.model.graph.node
                                if n.op_type == "Constant" and n.output and n.attribute
                                and n.attribute[0].name == "value"})
        self._model_nodes = {s.node for s in model_sites}
        # the dump's own records of node inputs, where the model's tensors are not dumped
        for (node, slot), key in self._inputs.items():
            ins = self.node_inputs.get(node)
            if ins is not None and slot < len(ins) and ins[slot] and ins[slot] not in self._files \
                    and ins[slot] not in self._constants:
                self._files[ins[slot]] = self._spilled[key]

    def _place(self, g: _Golden, tensor: str) -> None:
        if g.key:
            self._files[tensor] = self._spilled[g.key]
        else:
            self._unavailable[tensor] = f"the reference dump's record of it is unreadable: {g.error}"

    def _inputs_by_content(self) -> dict[str, list[str]]:
        """node -> the tensors it read: a dumped input whose bytes are a
        dumped output is that output (an edge of the graph); otherwise the
        input is a tensor of its own, ``node (input k)``."""
        if not self._inputs:
            return {}
        wanted = {(self._dtype_shape(key)) for key in self._inputs.values()}
        by_digest: dict[tuple, str] = {}
        for g in sorted(self._outputs, key=lambda g: g.arrival):
            if g.key and self._dtype_shape(g.key) in wanted:
                by_digest.setdefault(self._digest(g.key), g.name)
        out: dict[str, list[str]] = {}
        for (node, slot), key in sorted(self._inputs.items()):
            ins = out.setdefault(node, [])
            ins.extend([""] * (slot + 1 - len(ins)))
            tensor = by_digest.get(self._digest(key))
            if tensor is None or tensor == node or self._by_name[tensor].node == node:
                tensor = f"{node} (input {slot})"
                self._files[tensor] = self._spilled[key]
            ins[slot] = tensor
        return out

    def _dtype_shape(self, key: str) -> tuple:
        shape, dtype = self._layouts[self._spilled[key]]     # as received: no file opened again
        return dtype, shape

    def _digest(self, key: str) -> tuple:
        arr = np.load(self._spilled[key], mmap_mode="r")
        h = hashlib.blake2b(digest_size=16)
        # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
        h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))  # type: ignore[arg-type]
        return arr.dtype.str, arr.shape, h.digest()

    # ------------------------------------------------------------ answering

    def value(self, tensor: str) -> np.ndarray | None:
        """A golden value, mapped from its spill file (None if not dumped)."""
        path = self._files.get(tensor)
        if path is None:
            return None
        # the golden stream's own reading, once (no file opened a second
        # time); after that, mapped again as a plain array (a memmap runs
        # Python on every view taken of it). Handed over, not kept: the
        # pages a comparison touches go with the reader that drops them.
        kept = self._as_read.pop(path, None)
        return kept if kept is not None else read_npy(path, sys.maxsize)

    def shape_of(self, tensor: str) -> tuple[tuple, str] | None:
        """(shape, dtype kind) of a golden value, as it was received, without
        reading it again (None if not dumped)."""
        path = self._files.get(tensor)
        known = None if path is None else self._layouts.get(path)
        return None if known is None else (known[0], np.dtype(known[1]).kind)

    def missing_reason(self, tensor: str) -> str:
        return self._unavailable.get(tensor, "")

    def constant(self, tensor: str) -> np.ndarray | None:
        init = self._constants.get(tensor)
        if init is None:
            return None
        from onnx import numpy_helper

        return numpy_helper.to_array(init)

    def constants_read(self, node: str) -> frozenset:
        return frozenset(t for t in self.node_inputs.get(node, []) if t in self._constants)

    def input_uses(self) -> dict[str, int]:
        """How many node inputs read each tensor; a presumed read is none
        (no device input record is ever compared against it)."""
        uses: dict[str, int] = {}
        for node, ins in self.node_inputs.items():
            if node in self.presumed:
                continue
            for t in ins:
                if t and t not in self._constants:
                    uses[t] = uses.get(t, 0) + 1
        return uses

    def check_inputs(self, feeds: dict, inputs_name: str) -> dict:
        return {}

    def node_runtime(self) -> list[dict]:
        return node_runtime(self.sites)

    def plan(self, feeds: dict, **limits) -> list[list[str]]:
        """One segment: every value is a mapped file, read when compared."""
        names = [s.tensor for s in self.sites]
        seen = set(names)
        for ins in self.node_inputs.values():
            for t in ins:
                if t and t in self._files and t not in seen:
                    seen.add(t)
                    names.append(t)
        return [names]

    def run(self, feeds: dict, only: list[str] | None = None) -> dict[str, np.ndarray]:
        names = only if only is not None else [s.tensor for s in self.sites]
        out = {}
        for t in names:
            v = self.value(t)
            if v is not None:
                out[t] = v
        return out

    def about(self, node: str) -> dict:
        """What the dump recorded of a node's call (a module's ``attrs``, an
        operator's ``args``), parsed; {} where nothing (or nothing valid)."""
        import json

        text = self._about.get(node, "")
        if not text:
            return {}
        try:
            v = json.loads(text)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}

    def run_isolated(self, site: TensorSite, inputs: dict[int, np.ndarray], feeds: dict) -> list[np.ndarray]:
        """The node re-run alone on the device's inputs: with a model, the
        model's node; without one, an ATen operator whose arguments the
        capture recorded (layerdiff.torch, level="operator"), replayed in
        FP32 on the CPU (layerdiff.analyzer.diagnose.replay)."""
        from layerdiff.analyzer.diagnose.isolation import IsolationUnavailable, run_isolated

        if self.model is None:
            about = self.about(site.node)
            if site.op_type.startswith("aten.") and "args" in about:
                from layerdiff.analyzer.diagnose.replay import replay

                return replay(site.op_type, about["args"], inputs)
            raise IsolationUnavailable("the reference is a dump: no model to re-run the node alone (give the "
                                       "model with --model, or capture PyTorch at level='operator')")
        if site.node not in self._model_nodes:
            raise IsolationUnavailable(f"{site.node!r} is not a node of the model")
        return run_isolated(self.model, site.order, inputs, feeds)

    def close(self) -> None:
        self._as_read.clear()
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)
