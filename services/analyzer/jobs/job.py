"""A job as the analyzer holds it: its spec, state and events (what Watch
streams), what Cancel reaches, the record kept of it across restarts
(jobs/records.py), and the exit status a failure ends it with."""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.common.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, LayerdiffError, UnavailableError
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from layerdiff.analyzer.execute.fanout import CeleryPool
    from layerdiff.analyzer.execute.local import LocalPool
    from layerdiff.analyzer.jobs.receive import CollectorStream, InProcessStream

TERMINAL = {pb.DONE, pb.FAILED, pb.CANCELLED}
# A passing node's progress event waits until the last one is this old (s):
# an event a node cost a tenth of a two-dump job's time (made, kept, sent
# and read back by the client); a failing node, the last one and a change of
# state are always sent at once.
PROGRESS_EVERY_S = 0.1
# What a job's record keeps of its final event.
RECORDED_EVENT_FIELDS = ("nodes_done", "nodes_total", "message", "first_failing_node", "outcome", "exit_status")


@dataclass
class Job:
    id: str
    spec: pb.JobSpec
    report_dir: Path
    state: pb.JobState.ValueType = pb.QUEUED
    events: list = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    cond: threading.Condition = field(init=False, repr=False)       # notified of every event
    changed: threading.Condition = field(init=False, repr=False)    # of a change of state only
    cancelled: threading.Event = field(default_factory=threading.Event)
    call: CollectorStream | InProcessStream | None = None   # the collector stream being read, for Cancel
    executor: LocalPool | CeleryPool | None = None     # the comparisons' pool, for Cancel
    error: str = ""
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    dropped: int = 0    # events let go from the front of ``events`` (a finished job's history)
    owner: str = ""     # digest of the token that submitted it ("" on a service without tokens)
    thread: threading.Thread | None = None    # the job's own thread, while it runs here
    progress_at: float = -math.inf        # when the last progress event was made (time.monotonic)
    # what its summary.json says, kept for a client in this process (JobRunner.keep_summaries): read
    # back from the file, the last 10 ms of a two-dump command, after everything else was done
    summary: dict | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)
        self.changed = threading.Condition(self.lock)

    def emit(self, state: pb.JobState.ValueType | None = None, **kw) -> None:
        with self.cond:
            if state is not None and state != self.state:
                self.state = state
                self.changed.notify_all()
            self.events.append(pb.JobEvent(job_id=self.id, state=self.state, **kw))
            self.cond.notify_all()

    def progress(self, done: int, total: int, node: str, passed: bool) -> None:
        """A node is finished: its event, where it failed, is the last one
        or the last such event is PROGRESS_EVERY_S old; else only counted,
        in the next event's ``nodes_done``."""
        now = time.monotonic()
        if passed and not 0 < total <= done and now - self.progress_at < PROGRESS_EVERY_S:
            return
        self.progress_at = now
        self.emit(nodes_done=done, nodes_total=total, node=node, node_passed=passed)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def artifacts(self) -> list[str]:
        s = self.spec
        return [a for a in (s.model_artifact, s.inputs_artifact, s.device_model_artifact) if a]

    def record(self, event: pb.JobEvent | None = None) -> dict:
        """What the analyzer keeps of this job across restarts (jobrecords):
        enough for Watch and FetchReport, and a few words for an operator."""
        if event is None:
            event = self.events[-1] if self.events else pb.JobEvent(state=self.state)
        s = self.spec
        return {"id": self.id, "state": pb.JobState.Name(event.state), "created_at": self.created_at,
                "finished_at": self.finished_at, "error": self.error,
                "event": {f: getattr(event, f) for f in RECORDED_EVENT_FIELDS},
                "artifacts": self.artifacts, "model": s.model_name, "collector": s.collector,
                "precision": s.precision, "device": s.device, "dump_path": s.dump_path, "owner": self.owner}

    @classmethod
    def from_record(cls, rec: dict, report_dir: Path) -> Job:
        """A job read back from its record: finished, with its final event."""
        state = pb.JobState.Value(rec["state"])
        spec = pb.JobSpec(model_name=str(rec.get("model") or ""), collector=str(rec.get("collector") or ""),
                          precision=str(rec.get("precision") or ""), device=str(rec.get("device") or ""),
                          dump_path=str(rec.get("dump_path") or ""))
        job = cls(id=rec["id"], spec=spec, report_dir=report_dir, state=state, error=str(rec.get("error") or ""),
                  created_at=float(rec.get("created_at") or 0.0), finished_at=rec.get("finished_at"),
                  owner=str(rec.get("owner") or ""))
        event = rec.get("event") or {}
        job.events.append(pb.JobEvent(job_id=job.id, state=state,
                                      **{f: event[f] for f in RECORDED_EVENT_FIELDS if f in event}))
        return job


class EventCursor:
    """One watcher's place in a job's events (Watch): what it was sent, and
    with ``every_s`` > 0 the pace of node progress it wants. A paced
    watcher is sent, at most once in ``every_s``, the events since the last
    time with node progress thinned to the latest (which carries the
    count), and is not woken by node progress in between, only by a change
    of state (sent at once): hundreds of failing nodes a second would each
    wake the thread that sends and the client that reads."""

    def __init__(self, job: Job, every_s: float = 0.0) -> None:
        self.job = job
        self.every_s = every_s
        self.sent = 0       # counted over the job's whole history, of which a finished job keeps the end
        self.state: pb.JobState.ValueType | None = None     # of the last event sent
        self.quiet_until = -math.inf

    def next(self, active: Callable[[], bool], poll_s: float = 1.0) -> tuple[list, bool] | None:
        """(the events to send now, whether the job has ended); waits for
        them. None as soon as ``active()`` is false (looked at least every
        ``poll_s``: the caller went away)."""
        job = self.job
        with job.cond:
            while True:
                pending = self.sent < job.dropped + len(job.events)
                if job.done or pending and (job.state != self.state or time.monotonic() >= self.quiet_until):
                    break
                if pending:     # in the quiet time: a change of state ends it
                    job.changed.wait(timeout=min(poll_s, self.quiet_until - time.monotonic()))
                else:
                    job.cond.wait(timeout=poll_s)
                if not active():
                    return None
            batch = job.events[max(0, self.sent - job.dropped):]
            self.sent = job.dropped + len(job.events)
            finished = job.done
        if self.every_s > 0:
            last = max((i for i, e in enumerate(batch) if e.node), default=-1)
            batch = [e for i, e in enumerate(batch) if not e.node or i == last]
            self.quiet_until = time.monotonic() + self.every_s
        if batch:
            self.state = batch[-1].state
        return batch, finished


def failure_exit_status(e: BaseException) -> int:
    """2 for bad input or usage; 3 when a component failed and the job
    could not answer."""
    if isinstance(e, LayerdiffError) and not isinstance(e, UnavailableError):
        return EXIT_BAD_INPUT
    return EXIT_NO_ANSWER
