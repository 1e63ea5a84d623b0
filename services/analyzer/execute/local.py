"""The embedded executor: per-node comparisons on the cores of this machine.

The metric kernel is compiled and releases the GIL, so a pool of threads runs
comparisons truly in parallel while reading the received buffers in place
(no copy of any tensor into another process).
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from layerdiff.analyzer.compare.node import NodeOutcome, compare_node


def default_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LocalPool:
    def __init__(self, max_cores: int | None = None) -> None:
        self.max_cores = max(1, max_cores or default_cores())
        self.max_in_flight = 2 * self.max_cores   # each in-flight node holds its tensors
        self._ex = ThreadPoolExecutor(max_workers=self.max_cores, thread_name_prefix="layerdiff-compare")

    def submit(self, ref, dev, tol, diff_cnt, force_compare) -> Future[NodeOutcome]:
        return self._ex.submit(compare_node, ref, dev, tol, diff_cnt, force_compare)

    def cancel(self) -> None:
        """The job is cancelled: comparisons not yet started never start
        (their futures end cancelled); running ones finish their chunk."""
        self._ex.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
