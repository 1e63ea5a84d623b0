"""The analyzer run inside a command's own process, without a server.

Two dumps compared by a command started with no service addresses are read
by a collector in the same process, whose records are handed over, not sent
(``collector.core.in_process``): nothing of the job needs a socket, and
nothing loads gRPC or Flight (a twentieth of such a command's time). The
jobs are the served analyzer's own (``JobRunner``); the client's calls
(``client.local_client``) go straight to them.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from layerdiff.analyzer.jobs.runner import JobRunner
from layerdiff.common.artifacts import ArtifactStore
from layerdiff.common.memory import leave_loaded_out_of_collection, release_freed_tensors_to_system


class LocalAnalyzer:
    """A JobRunner and its artifact store in a work directory of their own,
    deleted by ``stop``; use as a context manager."""

    def __init__(self) -> None:
        release_freed_tensors_to_system()
        # what a job cancelled at the very end still writes must not fail the stop
        self._tmp = tempfile.TemporaryDirectory(prefix="layerdiff-analyzer-", ignore_cleanup_errors=True)
        workdir = Path(self._tmp.name)
        self.store = ArtifactStore(workdir / "artifacts")
        self.runner = JobRunner(self.store, workdir / "jobs", None, keep_summaries=True)
        leave_loaded_out_of_collection()

    def stop(self) -> None:
        self.runner.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalAnalyzer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
