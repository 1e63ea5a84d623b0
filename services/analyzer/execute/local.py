"""The embedded executor: per-node comparisons on the cores of this machine.

The metric kernel is compiled and releases the GIL, so a pool of threads runs
comparisons truly in parallel while reading the received buffers in place
(no copy of any tensor into another process). A small tensor is compared
on the thread that submits it: handing it over (a queue, a wake-up, the
interpreter lock taken back on each side) costs more than comparing it.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from layerdiff.analyzer.compare.node import NodeOutcome, compare_node
from layerdiff.common.settings import env_limit


def default_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Tensors of at most this many elements are compared where they are
# submitted (a tenth of a millisecond of work or less: three fifths of a
# detector's tensors, under 1 % of its elements); LAYERDIFF_INLINE_ELEMENTS
# sets it.
INLINE_ELEMENTS = 1 << 16


def _fill(fut: Future, call: Callable, *args) -> Future:
    """``fut``, given what ``call(*args)`` returns or raises (made now)."""
    try:
        fut.set_result(call(*args))
    except BaseException as e:     # handed to whoever reads the result
        fut.set_exception(e)
    return fut


def _metrics_of(compared: Future):
    return None if compared.exception() is not None else compared.result().metrics


class LocalPool:
    def __init__(self, max_cores: int | None = None, inline_elements: int | None = None) -> None:
        self.max_cores = max(1, max_cores or default_cores())
        self.inline_elements = env_limit("LAYERDIFF_INLINE_ELEMENTS", INLINE_ELEMENTS) \
            if inline_elements is None else inline_elements
        # each in-flight node holds its tensors; comparisons are recorded in
        # the order they came, so a large one at the head holds up the stream:
        # four a core let the stream read on (and compare its small tensors)
        # while both cores compare large ones (two a core: 4 % slower on a
        # two-dump job, the analyzer's peak the same)
        self.max_in_flight = 4 * self.max_cores
        self._ex = ThreadPoolExecutor(max_workers=self.max_cores, thread_name_prefix="layerdiff-compare")

    def submit(self, ref, dev, tol, diff_cnt, force_compare) -> Future[NodeOutcome]:
        if ref.size <= self.inline_elements:
            return _fill(Future(), compare_node, ref, dev, tol, diff_cnt, force_compare)
        return self._ex.submit(compare_node, ref, dev, tol, diff_cnt, force_compare)

    def submit_with(self, ref, dev, tol, diff_cnt, force_compare,
                    after: Callable) -> tuple[Future[NodeOutcome], Future]:
        """The comparison, and ``after(ref, dev, force_compare, metrics)``
        (the error model's figures of the pair, told the comparison's
        metrics, None where it failed) run next on the same core, while the
        pair is still in its caches: one hand-off a tensor, not two. The
        second future holds what ``after`` gave or raised; it is never
        set where the comparison is cancelled before it starts. A small
        tensor: both made here, before this returns."""
        if ref.size <= self.inline_elements:
            compared = _fill(Future(), compare_node, ref, dev, tol, diff_cnt, force_compare)
            return compared, _fill(Future(), after, ref, dev, force_compare, _metrics_of(compared))
        then: Future = Future()

        def both() -> NodeOutcome:
            outcome = None
            try:
                outcome = compare_node(ref, dev, tol, diff_cnt, force_compare)
                return outcome
            finally:
                _fill(then, after, ref, dev, force_compare, outcome.metrics if outcome is not None else None)

        return self._ex.submit(both), then

    def cancel(self) -> None:
        """The job is cancelled: comparisons not yet started never start
        (their futures end cancelled); running ones finish their chunk."""
        self._ex.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
