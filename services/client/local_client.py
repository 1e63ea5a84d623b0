"""The client's calls to an analyzer running in this process without a
server (``analyzer.local.LocalAnalyzer``): the same calls as
``AnalyzerClient`` makes over gRPC, made on the analyzer's jobs directly. A
failed call raises ``calls.CallError`` with the status the served analyzer
would have answered, so that following a job reads either alike.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.analyzer.jobs.job import EventCursor
from layerdiff.client.calls import (
    CallError,
    Interrupted,
    after_cancel,
    call_details,
    hand_over,
    report_dir,
    state_of,
    take_report,
)
from layerdiff.common.localfile import LocalFile
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from layerdiff.analyzer.local import LocalAnalyzer
    from layerdiff.collector.core import Collector

# where the job's messages say it runs
ADDRESS = "this process"
# a watch looks this often whether it was cancelled or ran out of time (s)
POLL_S = 0.2


class _Events:
    """One watch of a job's events, as a gRPC stream reads: iterate the
    events to the job's end, ``cancel()`` from any thread; past its
    ``timeout`` it raises DEADLINE_EXCEEDED."""

    def __init__(self, cursor: EventCursor, timeout: float | None) -> None:
        self.cursor = cursor
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.cancelled = False

    def _active(self) -> bool:
        return not self.cancelled and (self.deadline is None or time.monotonic() < self.deadline)

    def __iter__(self) -> Iterator[pb.JobEvent]:
        while True:
            got = self.cursor.next(self._active, POLL_S)
            if got is None:
                if self.cancelled:
                    return
                raise CallError("DEADLINE_EXCEEDED", "Deadline Exceeded")
            batch, finished = got
            yield from batch
            if finished:
                return

    def cancel(self) -> None:
        self.cancelled = True


class LocalClient:
    """``AnalyzerClient``'s calls on an analyzer in this process.
    ``beside``: the collector in this process, which is handed what is
    uploaded too."""

    def __init__(self, analyzer: LocalAnalyzer, beside: Collector | None = None) -> None:
        self.analyzer = analyzer
        self.beside = beside
        self.address = ADDRESS

    def upload(self, data: bytes, name: str, origin: LocalFile | None = None) -> str:
        """The artifact id of ``data`` (taken as it lies, where ``origin``
        is the file it was read from)."""
        return hand_over(self.analyzer.store, self.beside.store if self.beside is not None else None, data, name,
                         origin)

    def submit(self, spec: pb.JobSpec) -> str:
        try:
            return self.analyzer.runner.submit(spec).id
        except Exception as e:
            raise CallError.of(e) from None

    def watch(self, job_id: str, timeout: float | None = None, progress_every_s: float = 0.0) -> _Events:
        """The job's events from its first, to its end (``progress_every_s``:
        node progress at most that often, changes of state at once)."""
        try:
            job = self.analyzer.runner.get(job_id)
        except Exception as e:
            raise CallError.of(e) from None
        return _Events(EventCursor(job, max(0.0, progress_every_s)), timeout)

    def state(self, job_id: str, timeout: float = 5.0) -> tuple[pb.JobEvent | None, bool]:
        """The job's latest event, and whether the job has ended."""
        return state_of(self.watch(job_id, timeout=timeout))

    def fetch(self, job_id: str, out: Path) -> list[Path]:
        root = report_dir(out)
        try:
            files = self.analyzer.runner.report_files(job_id)
        except Exception as e:
            raise CallError.of(e) from None
        return take_report(files, Path(out), root)

    def summary(self, job_id: str) -> dict | None:
        """The finished job's summary, as its summary.json reads (None: not kept)."""
        return self.analyzer.runner.summary(job_id)

    def cancel(self, job_id: str, timeout: float = 30) -> pb.JobEvent:
        try:
            job = self.analyzer.runner.cancel(job_id)
        except Exception as e:
            raise CallError.of(e) from None
        return pb.JobEvent(job_id=job.id, state=job.state)

    def interrupted(self, job_id: str) -> Interrupted:
        """Ctrl-C during job ``job_id``: cancel it and say what became of it."""
        try:
            ev = self.cancel(job_id)
        except CallError as e:
            return Interrupted(f"interrupted; job {job_id} could not be cancelled ({call_details(e)})", job_id)
        return after_cancel(job_id, ev)

    def close(self) -> None:
        pass

