"""The analyzer's gRPC calls as the client makes them (``AnalyzerClient``):
uploads (handed over in memory to an analyzer in this process), Submit,
Watch, FetchReport, Cancel (what a failed call or a Ctrl-C becomes is
``calls``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from layerdiff.client.calls import (
    Interrupted,
    after_cancel,
    by_ctrl_c,
    call_details,
    call_failure,
    hand_over,
    report_dir,
    report_target,
    sigint_held,
    state_of,
    take_report,
)
from layerdiff.common.artifacts import chunks_of
from layerdiff.common.errors import EXIT_NO_ANSWER, JobFailed, LayerdiffError
from layerdiff.common.localfile import LocalFile
from layerdiff.common.net import channel, connect_timeout, wait_ready
from layerdiff.common.security import ClientSecurity, with_token
from layerdiff.v1 import layerdiff_pb2 as pb
from layerdiff.v1 import layerdiff_pb2_grpc as pbg

if TYPE_CHECKING:
    from layerdiff.common.artifacts import ArtifactStore

CALL_TIMEOUT = 600.0
# Ctrl-C: the Cancel call (and the wait for a Submit under way) may take this long.
CANCEL_TIMEOUT = 5.0
# Closing a channel waits for its calls to drain; a call that Ctrl-C broke off
# inside grpc may never drain, so the client waits this long and goes on.
CLOSE_TIMEOUT = 2.0
# fetch of a job that is not DONE: how long its events are read to learn its state.
STATE_TIMEOUT = 5.0


@dataclass(frozen=True)
class Embedded:
    """The analyzer (and the collector) running in this process: uploads
    are handed to their stores, not sent; a report is taken from the
    analyzer's directory (hard links where it can), not streamed."""
    store: ArtifactStore
    beside: ArtifactStore | None            # the embedded collector's store
    reports: Callable[[str], list[tuple[str, Path]]]    # job id -> (path in the report, file)
    summary: Callable[[str], dict | None]               # job id -> what its summary.json says (None: not kept)


class AnalyzerClient:
    """The analyzer's calls. ``submit``, ``watch``, ``fetch`` and ``cancel``
    raise grpc.RpcError as the service answers; ``run``, ``watch`` and
    ``fetch`` below turn every failure into a LayerdiffError."""

    def __init__(self, address: str, connect_timeout_s: float | None = None, local: Embedded | None = None) -> None:
        """``local``: where the analyzer (and the collector) run in this process."""
        self.address = address
        self.local = local
        wait = connect_timeout() if connect_timeout_s is None else connect_timeout_s
        security = ClientSecurity.from_env()
        self.channel = channel(address, security)
        try:
            wait_ready(self.channel, timeout=wait)
        except grpc.FutureTimeoutError:
            self.channel.close()
            hint = ("; over TLS: check that LAYERDIFF_TLS_CA signed its certificate and that it accepts this "
                    "client's (LAYERDIFF_TLS_CERT)") if security.tls else \
                "; if it serves TLS, give its CA in LAYERDIFF_TLS_CA"
            raise JobFailed(f"analyzer {address} is not reachable (no answer within {wait:g} s{hint})",
                            EXIT_NO_ANSWER) from None
        except BaseException:
            self.channel.close()
            raise
        self.stub = pbg.AnalyzerStub(with_token(self.channel, security))

    def upload(self, data: bytes, name: str, origin: LocalFile | None = None) -> str:
        """The artifact id of ``data``; ``origin``: the file it was read from
        (the embedded analyzer takes it as it lies on disk)."""
        if self.local is not None:      # the embedded analyzer: handed over, not sent
            return hand_over(self.local.store, self.local.beside, data, name, origin)
        call = self.stub.PutArtifact.future(chunks_of(data, name), timeout=CALL_TIMEOUT)
        try:
            return call.result().id
        except grpc.RpcError as e:
            raise call_failure(f"analyzer {self.address}, upload of {name}", e) from None
        except BaseException:
            call.cancel()
            raise

    def submit(self, spec: pb.JobSpec) -> str:
        """The job id. Ctrl-C while the analyzer takes the job waits a moment
        for its id and cancels it (raising Interrupted)."""
        call = self.stub.Submit.future(spec, timeout=CALL_TIMEOUT)
        try:
            return call.result().job_id
        except BaseException as e:
            if not by_ctrl_c(e):
                raise
            with sigint_held():
                try:
                    job_id = call.result(timeout=CANCEL_TIMEOUT).job_id
                except Exception:
                    call.cancel()
                    raise Interrupted("interrupted while submitting; no job was started") from None
            raise self.interrupted(job_id) from None

    def watch(self, job_id: str, timeout: float | None = None, progress_every_s: float = 0.0):
        """The job's events from its first, to its end: every one, or with
        ``progress_every_s`` node progress at most that often (the latest;
        changes of state at once). No deadline by default: a job may run
        for hours, and the channel's keepalive finds a dead link."""
        every_ms = max(0, min(round(progress_every_s * 1000), 2**32 - 1))
        return self.stub.Watch(pb.WatchRequest(job_id=job_id, progress_every_ms=every_ms), timeout=timeout)

    def state(self, job_id: str, timeout: float = STATE_TIMEOUT) -> tuple[pb.JobEvent | None, bool]:
        """The job's latest event, and whether the job has ended."""
        return state_of(self.watch(job_id, timeout=timeout))

    def summary(self, job_id: str) -> dict | None:
        """The finished job's summary, as its summary.json reads, where the
        analyzer runs in this process; None: read from the file fetched."""
        return self.local.summary(job_id) if self.local is not None else None

    def fetch(self, job_id: str, out: Path) -> list[Path]:
        out = Path(out)
        root = report_dir(out)
        if self.local is not None:
            return take_report(self.local.reports(job_id), out, root)
        written: list[Path] = []
        handle = None
        stream = self.stub.FetchReport(pb.ReportRequest(job_id=job_id), timeout=CALL_TIMEOUT)
        try:
            for chunk in stream:
                target = report_target(out, root, chunk.path)
                try:
                    if chunk.offset == 0:
                        if handle:
                            handle.close()
                        target.parent.mkdir(parents=True, exist_ok=True)
                        handle = open(target, "wb")
                        written.append(target)
                    assert handle is not None       # the analyzer sends each file from offset 0
                    handle.write(chunk.data)
                    if chunk.last:
                        handle.close()
                        handle = None
                except OSError as e:
                    raise LayerdiffError(f"cannot write a report: {e.strerror}", file=str(target),
                                         field="out") from None
        finally:
            stream.cancel()
            if handle:
                handle.close()
        return written

    def cancel(self, job_id: str, timeout: float = 30) -> pb.JobEvent:
        return self.stub.Cancel(pb.JobRef(job_id=job_id), timeout=timeout)

    def interrupted(self, job_id: str) -> Interrupted:
        """Ctrl-C during job ``job_id``: cancel it (bounded, a second Ctrl-C
        held off) and say what became of it."""
        with sigint_held():
            try:
                ev = self.cancel(job_id, timeout=CANCEL_TIMEOUT)
            except grpc.RpcError as e:
                return Interrupted(f"interrupted; job {job_id} could not be cancelled on analyzer {self.address} "
                                   f"({call_details(e)}), it may still be running", job_id)
        return after_cancel(job_id, ev)

    def close(self) -> None:
        closing = threading.Thread(target=self.channel.close, name="channel-close", daemon=True)
        closing.start()
        closing.join(CLOSE_TIMEOUT)
