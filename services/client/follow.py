"""Following a job on the analyzer once it exists: its events to its end
(a progress bar, or a callback per event), whether it answered, its reports
fetched into a directory and its summary read (``RunResult``). What ``run``,
``compare``, ``watch`` and ``fetch`` share; every failure is a JobFailed
with its exit status, naming the analyzer and the job.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.client.calls import call_details, call_errors, code_name
from layerdiff.common.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, JobFailed
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from typing import TypeAlias

    from layerdiff.client.analyzer_client import AnalyzerClient
    from layerdiff.client.local_client import LocalClient

    Client: TypeAlias = AnalyzerClient | LocalClient

TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)
# how often the progress bar (or a job followed without one) is sent node progress (s)
BAR_EVERY_S = 0.1


@dataclass(frozen=True)
class Answer:
    """What a job answers, as its headline words it (summary.json's
    ``answer``): ``verdict`` is ``computation error`` (``node`` computes
    wrongly on its own, ``cause`` and ``evidence`` say why), ``computation
    error the outputs absorb``, ``nan in the reference``, ``no verdict`` (a
    node that could not be judged), ``accumulated precision error`` (the
    outputs leave their tolerance by rounding; ``node`` adds the most),
    ``pass`` or ``no answer`` (too little compared: ``reason``)."""
    headline: str
    verdict: str
    status: str                 # pass, fail, no_answer
    exit_status: int
    node: str | None = None
    tensor: str | None = None
    op_type: str | None = None
    order: int | None = None
    cause: str | None = None
    evidence: tuple[str, ...] = ()
    reason: str | None = None
    compared: int | None = None         # coverage: reference tensors compared
    expected: int | None = None         # of those expected
    coverage: float | None = None       # their ratio
    adequate: bool | None = None        # enough to answer

    @classmethod
    def of(cls, summary: dict) -> Answer:
        a = summary.get("answer") or {}
        outcome = summary.get("outcome") or {}
        cov = a.get("coverage") or summary.get("coverage") or {}
        if not a:       # a report written before summaries held the answer: its headline alone
            return cls(headline=(summary.get("diagnosis") or {}).get("headline", ""), verdict="",
                       status=outcome.get("status", ""), exit_status=int(outcome.get("exit_status", EXIT_NO_ANSWER)),
                       reason=outcome.get("reason"), compared=cov.get("compared"), expected=cov.get("expected"),
                       coverage=cov.get("ratio"), adequate=cov.get("adequate"))
        return cls(headline=a.get("headline", ""), verdict=a.get("verdict", ""), status=a.get("status") or "",
                   exit_status=int(a.get("exit_status", EXIT_NO_ANSWER)), node=a.get("node"), tensor=a.get("tensor"),
                   op_type=a.get("op_type"), order=a.get("order"), cause=a.get("cause"),
                   evidence=tuple(a.get("evidence") or ()), reason=a.get("reason"), compared=cov.get("compared"),
                   expected=cov.get("expected"), coverage=cov.get("ratio"), adequate=cov.get("adequate"))


@dataclass
class RunResult:
    job_id: str
    out: Path
    summary: dict

    @property
    def answer(self) -> Answer:
        """The job's answer: the node its headline names, why, and the
        coverage it stands on (the same in the terminal, report.html and
        summary.json)."""
        return Answer.of(self.summary)

    @property
    def first_failing_node(self) -> str | None:
        """The first node past the seed's atol/rtol: a detail (rounding its
        precision explains trips it as often as a bug), not the answer
        (``answer.node``)."""
        f = self.summary.get("first_failing_node")
        return f["node"] if f else None

    @property
    def outcome(self) -> str:
        """``pass``, ``fail`` (failing nodes), ``no_answer`` (too little
        compared to answer) or ``perf_only``."""
        return (self.summary.get("outcome") or {}).get("status", "")

    @property
    def exit_status(self) -> int:
        """What ``layerdiff run`` exits with: 0 pass, 1 failing nodes, 3 too
        little compared to answer (2, bad input, is raised as JobFailed or
        LayerdiffError instead)."""
        return int((self.summary.get("outcome") or {}).get("exit_status", EXIT_NO_ANSWER))


def reattach_command(job_id: str, analyzer: str) -> str:
    return f"layerdiff watch {job_id} --analyzer {analyzer}"


def _progress_bar(enabled):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="node", desc="comparing", file=sys.stderr, disable=None, dynamic_ncols=True)


def follow(client: Client, job_id: str, out, *, progress: bool | Callable[[pb.JobEvent], None] = True,
           timeout: float | None = None, reattachable: bool = True) -> RunResult:
    """What ``run``, ``watch`` and ``fetch`` share once a job exists: follow
    its events to its end (a progress bar, or ``progress`` called with each
    event), check it answered, fetch its reports into ``out`` and read its
    summary. Every failure is a LayerdiffError (JobFailed with the exit
    status); Ctrl-C propagates as KeyboardInterrupt for the caller to cancel."""
    out = Path(out)
    last = _follow_events(client, job_id, progress, timeout, reattachable)
    _check_ended(job_id, last, client.address, reattachable)
    return fetch_result(client, job_id, out, reattachable=reattachable)


def fetch_result(client: Client, job_id: str, out, *, reattachable: bool = True) -> RunResult:
    """The reports of a finished job into ``out``, and its summary."""
    out = Path(out)
    not_done = False
    try:
        client.fetch(job_id, out)
    except call_errors() as e:
        # the analyzer has the job, not (yet) its reports: below, say in what state it is
        not_done = code_name(e) in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
        if not not_done:
            raise _job_failure(client.address, job_id, e, "while sending the reports of", reattachable,
                               retry=f"layerdiff fetch {job_id} --analyzer {client.address}") from None
    if not_done:
        _raise_not_done(client, job_id, reattachable)
    # a job of this process hands its summary over as summary.json holds it (tested), not to be parsed again
    summary = client.summary(job_id)
    if summary is not None:
        return RunResult(job_id, out, summary)
    summary_path = out / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JobFailed(f"job {job_id}: the reports fetched into {out} hold no readable summary.json ({e})",
                        EXIT_NO_ANSWER) from None
    return RunResult(job_id, out, summary)


def _follow_events(client: Client, job_id: str, progress, timeout, reattachable) -> pb.JobEvent | None:
    bar = _progress_bar(progress is True)
    last = None
    # a callable is given every event (each failing node's); a bar, or
    # nothing, needs only the count now and then and the end
    stream = client.watch(job_id, timeout=timeout, progress_every_s=0.0 if callable(progress) else BAR_EVERY_S)
    try:
        for ev in stream:
            last = ev
            if callable(progress):
                progress(ev)
            if bar is not None:
                if ev.nodes_total and bar.total != ev.nodes_total:
                    bar.total = ev.nodes_total
                bar.set_description(pb.JobState.Name(ev.state).lower())
                bar.n = ev.nodes_done
                bar.refresh()
    except call_errors() as e:
        if code_name(e) == "DEADLINE_EXCEEDED" and timeout is not None:
            hint = f" (follow it: {reattach_command(job_id, client.address)})" if reattachable else ""
            raise JobFailed(f"job {job_id} did not end within {timeout:g} s; it goes on on analyzer "
                            f"{client.address}{hint}", EXIT_NO_ANSWER) from None
        raise _job_failure(client.address, job_id, e, "during", reattachable) from None
    finally:
        stream.cancel()
        if bar is not None:
            bar.close()
    return last


def _job_failure(analyzer: str, job_id: str, e: BaseException, when: str, reattachable: bool,
                 retry: str | None = None) -> JobFailed:
    """A call about a job that failed: the analyzer does not know the job
    (exit status 2), or it stopped answering (3)."""
    code = code_name(e)
    details = e.details() if hasattr(e, "details") else ""
    if code == "NOT_FOUND":
        return JobFailed(f"analyzer {analyzer}: {details or 'no job ' + repr(job_id)}", EXIT_BAD_INPUT)
    if code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        return JobFailed(f"analyzer {analyzer}: {details}", EXIT_BAD_INPUT)
    hint = f" (reattach: {retry or reattach_command(job_id, analyzer)})" if reattachable else ""
    return JobFailed(f"analyzer {analyzer} stopped answering {when} job {job_id}: {call_details(e)}{hint}",
                     EXIT_NO_ANSWER)


def _check_ended(job_id: str, last: pb.JobEvent | None, analyzer: str, reattachable: bool) -> None:
    """A job whose events ended without DONE: JobFailed with its exit status."""
    if last is not None and last.state == pb.DONE:
        return
    if last is None:
        raise JobFailed(f"job {job_id} lost: analyzer {analyzer} sent no progress", EXIT_NO_ANSWER)
    status = last.exit_status if last.state == pb.FAILED and last.exit_status else EXIT_NO_ANSWER
    if last.state not in TERMINAL:
        # the stream ended while the job runs: the analyzer is going away
        hint = f" (reattach: {reattach_command(job_id, analyzer)})" if reattachable else ""
        raise JobFailed(f"analyzer {analyzer} stopped answering during job {job_id}: its events ended while "
                        f"it was {pb.JobState.Name(last.state)}{hint}", EXIT_NO_ANSWER)
    raise JobFailed(f"job {job_id} {pb.JobState.Name(last.state)}: {last.message or 'no reason given'}", status)


def _raise_not_done(client: Client, job_id: str, reattachable: bool) -> None:
    """A job without reports: one line with its state and reason."""
    try:
        last, ended = client.state(job_id)
    except call_errors() as e:
        raise _job_failure(client.address, job_id, e, "about", reattachable) from None
    if ended:
        _check_ended(job_id, last, client.address, reattachable)
    state = pb.JobState.Name(last.state) if last is not None else "QUEUED"
    done = f", {last.nodes_done}/{last.nodes_total} nodes" if last is not None and last.nodes_total else ""
    hint = f"; follow it: {reattach_command(job_id, client.address)}" if reattachable else ""
    raise JobFailed(f"job {job_id} is {state}{done}: reports exist once it is DONE{hint}", EXIT_NO_ANSWER)
