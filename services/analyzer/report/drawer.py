"""Failing nodes' plots drawn beside the comparisons (``--show-graph``).

Drawing a node's three PNGs takes longer than comparing it: done on the
thread that receives the stream, it held the whole job up (a detector's
INT8 build: 1.44x the job without plots). A ``PlotDrawer`` draws on a
thread of its own while the comparisons go on; at most ``ahead`` nodes wait
to be drawn (their tensors held, their receive buffers retained), so a slow
disk or a large tensor makes the stream wait rather than memory grow.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class PlotDrawer:
    """One job's plot drawing: ``submit`` a node's drawing, ``results`` once
    the stream has ended, or ``abandon`` when the job stops early."""

    def __init__(self, ahead: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
        self._slots = threading.BoundedSemaphore(ahead)
        self._drawings: list[tuple[str, Future, Callable[[], None] | None]] = []

    def submit(self, label: str, draw: Callable[[], dict], release: Callable[[], None] | None = None) -> None:
        """Draw ``label``'s plots (``draw()`` returns their paths) on the
        drawing thread; ``release`` lets go of what the drawing reads (a
        receive buffer) once it is drawn. Waits while ``ahead`` nodes wait."""
        self._slots.acquire()

        def run() -> dict:
            try:
                return draw()
            finally:
                if release is not None:
                    release()
                self._slots.release()

        try:
            self._drawings.append((label, self._pool.submit(run), release))
        except BaseException:
            self._slots.release()
            if release is not None:
                release()
            raise

    def results(self) -> list[tuple[str, dict | Exception]]:
        """Every node's plots (or why they were not drawn), in the order
        submitted, once all are drawn."""
        self._pool.shutdown(wait=True)
        out: list[tuple[str, dict | Exception]] = []
        for label, fut, _ in self._drawings:
            e = fut.exception()
            out.append((label, e if isinstance(e, Exception) else fut.result()))
        self._drawings.clear()
        return out

    def abandon(self) -> None:
        """The job stops early: drawings not started are dropped (what they
        held let go), the one under way finishes on its own."""
        for _, fut, release in self._drawings:
            if fut.cancel():
                if release is not None:
                    release()
                self._slots.release()
        self._drawings.clear()
        self._pool.shutdown(wait=False)
