"""The consumer of one job's device stream.

Each record from the collector is matched to its reference tensor, its
comparison goes to the executor (local pool or Celery workers), and
comparisons are finished in the order they were submitted, at most
``max_in_flight`` at a time (flow control: the stream waits while the
executor is busy). A finished comparison becomes a report row; a failing
node is examined (``NodeExaminer``) once what it reads is settled.

Every record arrives holding its receive buffer (``record.lease``); the
consumer releases that hold when it has handled the record, and each reader
that goes on reading the array afterwards (a pending comparison, a device
value kept for an isolated re-run, a node waiting for its examination)
holds its own. The report does not depend on the order the stream arrives
in, nor on the executor or its core count.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from layerdiff.analyzer.compare import SkipNode
from layerdiff.analyzer.diagnose import NodeExaminer
from layerdiff.analyzer.report import JobReport, Row
from layerdiff.onnxgraph import TensorSite
from layerdiff.schema import ROLE_INPUT, STATUS_OK, NodeRecord

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    site: TensorSite
    rec: NodeRecord
    ref: np.ndarray
    tol: object
    lease: object    # this comparison's own hold on the device buffer

    @property
    def key(self):
        return (self.site.node, self.rec.slot) if self.rec.role == ROLE_INPUT else self.site.tensor


class StreamConsumer:
    """Takes the records of one job's stream (``take``) and, at the end
    (``finish``), leaves every comparison, skip and examination in ``report``.

    ``references``: called once, when the first reference value is needed
    (the first segment is computed while the collector starts producing).
    ``progress(done, node, passed)``: after each node output is finished.
    """

    def __init__(self, prepared, executor, references: Callable[[], object], report: JobReport,
                 report_dir: Path, progress: Callable[[int, str, bool], None] | None = None,
                 dump_mode: str = "output") -> None:
        self.p = prepared
        self.executor = executor
        self._references = references
        self.refs = None
        self.rep = report
        self.report_dir = report_dir
        self.progress = progress or (lambda done, node, passed: None)
        self.examiner = NodeExaminer(prepared.reference, prepared.feeds, prepared.quantized,
                                     given_ranges=prepared.given_ranges, dump_mode=dump_mode,
                                     groups=getattr(prepared.aligner, "groups", {}))
        self.limit = getattr(executor, "max_in_flight", 2 * max(1, executor.max_cores))
        self.pending: dict[Future, _Pending] = {}
        self.seen: set[str] = set()
        self.seen_inputs: set[tuple] = set()
        self.read_as_input: set[str] = set()
        self.done = 0
        self._plot_names: set[str] = set()

    # ------------------------------------------------------------------ intake

    def take(self, rec: NodeRecord) -> None:
        """Handle one record; its own hold on the buffer ends here."""
        try:
            self._take(rec)
        finally:
            if rec.lease is not None:
                rec.lease.release()

    def _reference(self):
        if self.refs is None:
            self.refs = self._references()
        return self.refs

    def _take(self, rec: NodeRecord) -> None:
        rep = self.rep
        rep.device_names.append(rec.name if rec.role != ROLE_INPUT else f"{rec.name} (input {rec.slot})")
        if rec.status != STATUS_OK:
            rep.device_errors.append((rec.name, rec.message))
        if rec.overflow:
            rep.note_overflow(rec.node or rec.name, rec.overflow)
        if rec.role == ROLE_INPUT:
            self._take_input(rec)
            return
        decision = self.p.aligner.match(rec.name, rec.node, rec.slot)
        site = decision.site
        if site is None:
            rep.invalid_out.append((rec.name, rec.message if rec.status != STATUS_OK
                                    else "not found in the reference model"))
            rep.log_splice_failure(rec)
            return
        if site.tensor in self.seen:
            rep.skipped.append((rec.name, f"duplicate device tensor for {site.tensor!r}"))
            return
        self.seen.add(site.tensor)
        if rec.status != STATUS_OK:
            self._refuse(site.tensor, site.tensor, f"device tensor unusable: {rec.message}", rec)
            return
        if decision.skip_reason:
            rep.user_skipped.add(site.tensor)
            self._refuse(site.tensor, site.tensor, decision.skip_reason)
            return
        ref = self._reference().pop(site.tensor)
        if ref is None:
            self._refuse(site.tensor, site.tensor, "the reference run produced no value")
            return
        self.examiner.note_range(site.tensor, ref)
        self.examiner.keep_output(site.tensor, rec.array, rec.lease)
        self._submit(site, rec, ref)

    def _take_input(self, rec: NodeRecord) -> None:
        """Input k of a node against the reference tensor that node reads."""
        rep = self.rep
        node = rec.node or rec.name
        decision = self.p.aligner.match(node)
        if decision.site is None:
            rep.invalid_out.append((f"{node} (input {rec.slot})", rec.message if rec.status != STATUS_OK
                                    else "not a node of the reference model"))
            return
        owner = decision.site
        ins = self.p.reference.node_inputs.get(owner.node, [])
        shown = f"{owner.node} (input {rec.slot})"
        if rec.slot >= len(ins) or not ins[rec.slot]:
            rep.invalid_out.append((shown, f"the reference node has {len(ins)} inputs"))
            return
        key = (owner.node, rec.slot)
        site = TensorSite(ins[rec.slot], owner.node, owner.op_type, owner.order, rec.slot)
        if key in self.seen_inputs:
            rep.skipped.append((shown, "duplicate device input"))
            return
        self.seen_inputs.add(key)
        if rec.status != STATUS_OK:
            self._refuse(key, shown, f"device tensor unusable: {rec.message}", rec, counts=False)
            return
        if decision.skip_reason:
            self._refuse(key, shown, decision.skip_reason, counts=False)
            return
        ref = self._reference().value_of(site.tensor)
        if ref is None:
            self._refuse(key, shown, f"the reference value of {site.tensor!r} was already released: give the "
                                     "job dump_mode input or all", counts=False)
            return
        self.read_as_input.add(site.tensor)
        self.examiner.keep_input(owner.node, rec.slot, rec.array, rec.lease)
        self._submit(site, rec, ref)

    def _refuse(self, key, shown: str, reason: str, rec: NodeRecord | None = None, counts: bool = True) -> None:
        """Not compared, for a reason of the data: a skip, and settled for
        the nodes that read it."""
        self.rep.skipped.append((shown, reason))
        if rec is not None:
            self.rep.log_splice_failure(rec)
        self.examiner.settle(key)
        if counts:
            self.done += 1

    # ------------------------------------------------------------ comparisons

    def _submit(self, site: TensorSite, rec: NodeRecord, ref: np.ndarray) -> None:
        self._drain(self.limit - 1)
        tol = self.p.tolerances.for_node(site.node, site.tensor)
        lease = rec.lease.retain() if rec.lease is not None else None
        try:
            fut = self.executor.submit(ref, rec.array, tol, self.p.diff_cnt, self.p.force_compare)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self.pending[fut] = _Pending(site, rec, ref, tol, lease)

    def finish_done(self) -> None:
        """Record the comparisons already finished at the head (the stream
        is quiet: their rows and progress need not wait for more records)."""
        self._drain(len(self.pending))

    def _drain(self, keep: int) -> None:
        """Finish comparisons in the order they were submitted until at most
        ``keep`` are pending, and any already done at the head."""
        while self.pending:
            head = next(iter(self.pending))
            if len(self.pending) <= keep and not head.done():
                return
            while not head.done():
                # not wait([head]) alone: a future cancelled in its executor's
                # queue (Cancel) is done but never wakes a waiter
                wait([head], timeout=0.5)
            self._finished(head)

    def _finished(self, fut: Future) -> None:
        item = self.pending.pop(fut)
        try:
            self._record(item, fut)
        finally:
            if item.lease is not None:
                item.lease.release()

    def _record(self, item: _Pending, fut: Future) -> None:
        site, rec, p = item.site, item.rec, self.p
        try:
            outcome = fut.result()
        except SkipNode as e:
            shown = f"{site.node} (input {rec.slot})" if rec.role == ROLE_INPUT else site.tensor
            self.rep.skipped.append((shown, str(e)))
            self.examiner.settle(item.key)
            passed = True
        else:
            row = Row(site, rec.name, outcome, role=rec.role, overflow=rec.overflow,
                      constants_read=p.reference.constants_read(site.node),
                      reads=tuple(t for t in p.reference.node_inputs.get(site.node, [])
                                  if t and t not in p.feeds))   # model inputs are exact on both sides
            if row.failed and p.show_graph:
                self._draw(row, item.ref, rec.array, item.tol)
            self.examiner.row_done(row, item.ref, rec.array, item.lease, item.tol, p.force_compare)
            self.rep.rows.append(row)
            passed = not row.failed
        if rec.role == ROLE_INPUT:
            return   # progress counts node outputs
        self.done += 1
        self.progress(self.done, site.tensor, passed)

    def _draw(self, row: Row, ref, dev, tol) -> None:
        from layerdiff.analyzer.compare import reconcile
        from layerdiff.analyzer.plots import node_plots
        from layerdiff.names import safe_filename

        p = self.p
        try:
            dev, _ = reconcile(ref, dev, True)
            stem = safe_filename(row.label if row.is_input or row.site.output_index else row.site.node,
                                 self._plot_names)
            self.rep.plots[row.label] = node_plots(self.report_dir, stem, ref, dev, max_bins=p.max_bins,
                                                   min_bins=p.min_bins, atol=tol.atol, rtol=tol.rtol,
                                                   title=row.label)
        except Exception as e:  # a plot is an extra: the comparison stands without it
            log.warning("no plots for %s: %s", row.label, e)
            self.rep.skipped.append((row.label, f"plots not drawn: {e}"))

    # ------------------------------------------------------------------- end

    def finish(self) -> None:
        """The stream has ended: finish every comparison and examination,
        and account for the reference tensors the device never sent."""
        self._reference()   # surfaces reference errors even for an empty stream
        self._drain(0)
        self.examiner.finish()
        rep = self.rep
        rep.input_ranges = self.examiner.input_ranges
        rep.quantized = self.examiner.quantized
        rep.range_skips = list(self.p.range_skips)
        fused = getattr(self.p.aligner, "fused", {})   # reference tensor -> the device node computing it inside
        for s in self.p.reference.sites:
            if s.tensor in self.seen or s.tensor in self.read_as_input:
                continue
            reason = self.p.aligner.skip_reason_for(s)
            if reason:
                rep.user_skipped.add(s.tensor)
                rep.skipped.append((s.tensor, reason))
            elif s.tensor in fused:
                rep.fused.append((s, fused[s.tensor]))
            else:
                rep.not_dumped.append(s)

    def abandon(self) -> None:
        """The job stops early (cancelled, failed): let go of every buffer."""
        for item in self.pending.values():
            if item.lease is not None:
                item.lease.release()
        self.pending.clear()
        self.examiner.abandon()
