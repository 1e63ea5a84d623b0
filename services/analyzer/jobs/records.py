"""What the analyzer remembers of its jobs across restarts, and how long it
keeps finished jobs and uploads.

Every job has a small JSON record beside its report directory,
``<workdir>/jobs/<id>.json`` next to ``<workdir>/jobs/<id>/``, written
atomically (a temporary file, then ``os.replace``) when the job is submitted
and when it ends. On start-up every record is read back: finished jobs stay
watchable and, when DONE, fetchable; a job that had not finished when the
analyzer died is recorded as FAILED and its partial reports are deleted.

Retention bounds what finished jobs and unused uploads keep on disk, by age
and by total size (``Retention``, from ``LAYERDIFF_RETAIN_*``): the oldest go
first. A job finished (or an upload made or used) in the last
``grace_s`` seconds, and the most recently finished job, are never deleted
for size, so a client can always fetch what it has just run; an upload that
a queued or running job holds is never deleted at all.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from layerdiff.common.errors import EXIT_NO_ANSWER, LayerdiffError, os_error_in
from layerdiff.common.settings import parse_bytes

log = logging.getLogger(__name__)

RECORD_VERSION = 1
TERMINAL_STATES = frozenset({"DONE", "FAILED", "CANCELLED"})
RESTARTED_MESSAGE = "analyzer restarted while the job was running; run it again"
GiB = 1024 ** 3
_ID = re.compile(r"^[0-9a-f]{8,64}$")
_REMEMBER_FORGOTTEN = 10000   # ids deleted by retention, kept to say why a job is gone


def _number(env: Mapping[str, str], name: str, default: float, parse=float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = -1
    if value < 0:
        raise LayerdiffError(f"must be a number >= 0, got {text!r}", field=name)
    return value


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1024 ** 4), ("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class Retention:
    """Limits on finished jobs (reports and records) and on uploads that no
    queued or running job uses. 0 turns a limit off."""
    days: float = 7.0                 # LAYERDIFF_RETAIN_DAYS
    max_bytes: int = 10 * GiB         # LAYERDIFF_RETAIN_BYTES
    max_jobs: int = 10000             # LAYERDIFF_RETAIN_JOBS
    grace_s: float = 300.0            # LAYERDIFF_RETAIN_GRACE_S: never deleted for size when younger

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Retention:
        env = os.environ if env is None else env
        d = cls()
        return cls(days=_number(env, "LAYERDIFF_RETAIN_DAYS", d.days),
                   max_bytes=int(_number(env, "LAYERDIFF_RETAIN_BYTES", d.max_bytes, parse_bytes)),
                   max_jobs=int(_number(env, "LAYERDIFF_RETAIN_JOBS", d.max_jobs, int)),
                   grace_s=_number(env, "LAYERDIFF_RETAIN_GRACE_S", d.grace_s))

    def describe(self) -> str:
        """e.g. "finished jobs are kept for 7 days, 10 GiB in all and 10000 jobs at most (LAYERDIFF_RETAIN_*)"."""
        limits = []
        if self.days:
            limits.append(f"for {self.days:g} days")
        if self.max_bytes:
            limits.append(f"{format_bytes(self.max_bytes)} in all")
        if self.max_jobs:
            limits.append(f"{self.max_jobs} jobs")
        if not limits:
            return "finished jobs are kept without limit"
        text = limits[0] if len(limits) == 1 else ", ".join(limits[:-1]) + " and " + limits[-1]
        return f"finished jobs are kept {text} at most (LAYERDIFF_RETAIN_*)"


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def is_disk_full(e: BaseException | None) -> bool:
    """An OSError saying the disk (or the user's quota) is full, raised
    directly or as the cause of what was raised."""
    import errno

    return os_error_in(e, (errno.ENOSPC, errno.EDQUOT), ("No space left on device", "Disk quota exceeded"))


class JobRecords:
    """The records of one analyzer's jobs under ``jobs_dir``, and the
    retention of finished jobs and uploads. Thread-safe."""

    def __init__(self, jobs_dir: Path, retention: Retention | None = None) -> None:
        self.dir = Path(jobs_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.retention = retention if retention is not None else Retention()
        self._index: dict[str, dict] = {}
        self._forgotten: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.RLock()

    def record_path(self, job_id: str) -> Path:
        return self.dir / f"{job_id}.json"

    def report_dir(self, job_id: str) -> Path:
        return self.dir / job_id

    # ---------------------------------------------------------------- files

    def load(self, now: float | None = None) -> tuple[list[dict], list[str]]:
        """Read every record back: (records, oldest first; ids of the jobs
        that were not finished, now recorded as FAILED with their partial
        reports deleted). Report directories without a record, and records
        that cannot be read, are deleted."""
        now = time.time() if now is None else now
        records, interrupted, recorded = [], [], set()
        for path in sorted(self.dir.glob("*.json")):
            job_id = path.stem
            if not _ID.match(job_id):
                continue
            try:
                rec = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(rec, dict) or rec.get("id") != job_id or not isinstance(rec.get("state"), str):
                    raise ValueError("not a job record")
            except (OSError, ValueError) as e:
                log.warning("job record %s cannot be read (%s): the job and its reports are deleted", path, e)
                self._remove(job_id)
                continue
            recorded.add(job_id)
            if rec["state"] not in TERMINAL_STATES:
                event = dict(rec.get("event") or {})
                event.update(message=RESTARTED_MESSAGE, exit_status=EXIT_NO_ANSWER, outcome="",
                             first_failing_node="", nodes_done=0)
                rec.update(state="FAILED", finished_at=now, error=RESTARTED_MESSAGE, event=event, report_bytes=0)
                shutil.rmtree(self.report_dir(job_id), ignore_errors=True)
                interrupted.append(job_id)
                self.save(rec)
            elif "report_bytes" not in rec:
                rec["report_bytes"] = dir_bytes(self.report_dir(job_id))
            with self._lock:
                self._index[job_id] = rec
            records.append(rec)
        for entry in self.dir.iterdir():
            name = entry.name
            if name.startswith(".") and name.endswith(".json.tmp"):
                _unlink(entry)
            elif _ID.match(name) and entry.is_dir() and name not in recorded:
                log.info("report directory %s has no job record: deleted", entry)
                shutil.rmtree(entry, ignore_errors=True)
        records.sort(key=lambda r: (r.get("finished_at") or 0, r.get("created_at") or 0))
        return records, interrupted

    def save(self, record: dict) -> bool:
        """Write ``record`` atomically and index it. False, with one line
        logged, when it could not be written (the job goes on either way)."""
        job_id = record["id"]
        record = dict(record, version=RECORD_VERSION)
        with self._lock:
            self._index[job_id] = record
        path = self.record_path(job_id)
        tmp = path.with_name(f".{job_id}.json.tmp")
        try:
            data = json.dumps(record, indent=1, sort_keys=True).encode("utf-8")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as e:
            full = " (disk full)" if is_disk_full(e) else ""
            log.warning("job %s: its record could not be written to %s%s: %s", job_id, path, full, e)
            _unlink(tmp)
            return False

    def finish(self, record: dict) -> bool:
        """Save the record of a job that has ended, with the size of its reports."""
        record = dict(record, report_bytes=dir_bytes(self.report_dir(record["id"])))
        return self.save(record)

    def why_forgotten(self, job_id: str) -> str | None:
        """Why retention deleted this job (while this analyzer has run)."""
        with self._lock:
            return self._forgotten.get(job_id)

    def _remove(self, job_id: str) -> None:
        # The record first: a crash in between leaves an orphan directory,
        # which the next start deletes, never a record without its reports.
        _unlink(self.record_path(job_id))
        shutil.rmtree(self.report_dir(job_id), ignore_errors=True)

    # ------------------------------------------------------------ retention

    def enforce(self, artifacts=None, now: float | None = None) -> list[str]:
        """Delete finished jobs, and uploads that ``artifacts`` (an
        ArtifactStore) does not hold for a job, beyond the limits: older
        than ``days``, the oldest jobs beyond ``max_jobs``, then the oldest
        of both beyond ``max_bytes`` in all. Returns the ids of the jobs
        deleted."""
        r = self.retention
        now = time.time() if now is None else now
        with self._lock:
            finished = sorted((rec for rec in self._index.values() if rec.get("state") in TERMINAL_STATES),
                              key=lambda rec: (rec.get("finished_at") or 0, rec.get("created_at") or 0))
            items = [("job", rec["id"], rec.get("finished_at") or 0.0,
                      int(rec.get("report_bytes") or 0) + 1024) for rec in finished]
            newest = finished[-1]["id"] if finished else None
            uploads = artifacts.entries() if artifacts is not None else []
            items += [("artifact", aid, mtime, size) for aid, mtime, size in uploads]
            items.sort(key=lambda it: it[2])
            doomed: dict[tuple, str] = {}
            if r.days:
                cutoff = now - r.days * 86400
                for it in items:
                    if it[2] < cutoff:
                        doomed[it] = f"older than {r.days:g} days (LAYERDIFF_RETAIN_DAYS)"
            if r.max_jobs:
                kept = [it for it in items if it[0] == "job" and it not in doomed]
                for it in kept[:max(0, len(kept) - r.max_jobs)]:
                    if it[1] != newest:
                        doomed[it] = f"beyond the newest {r.max_jobs} jobs (LAYERDIFF_RETAIN_JOBS)"
            if r.max_bytes:
                kept = [it for it in items if it not in doomed]
                total = sum(it[3] for it in kept)
                for it in kept:
                    if total <= r.max_bytes:
                        break
                    if it[1] == newest or now - it[2] < r.grace_s:
                        continue
                    doomed[it] = (f"the oldest beyond {format_bytes(r.max_bytes)} of finished jobs and uploads "
                                  "(LAYERDIFF_RETAIN_BYTES)")
                    total -= it[3]
            deleted = [key for (kind, key, _t, _s) in doomed if kind == "job"]
            for (kind, key, _t, _s), why in doomed.items():
                if kind == "job":
                    self._index.pop(key, None)
                    self._forgotten[key] = why
            while len(self._forgotten) > _REMEMBER_FORGOTTEN:
                self._forgotten.popitem(last=False)
        for (kind, key, mtime, _size), why in doomed.items():
            if kind == "job":
                self._remove(key)
            elif artifacts.discard(key, mtime):
                log.info("upload %s deleted: %s", key, why)
        if deleted:
            log.info("deleted %d finished job(s) under the retention limits: %s", len(deleted), ", ".join(deleted))
        return deleted


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def drop_broker_keys(broker_url: str, job_ids: Iterable[str], timeout_s: float = 2.0) -> None:
    """Best effort: delete what interrupted jobs left on the broker, with
    short socket timeouts; one line logged when the broker does not answer."""
    job_ids = list(job_ids)
    if not broker_url or not job_ids:
        return
    try:
        import redis

        from layerdiff.analyzer.execute.store import TensorStore

        store = TensorStore(broker_url)
        store.r = redis.Redis.from_url(broker_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        for job_id in job_ids:
            store.drop_job(job_id)
    except Exception as e:
        log.warning("the broker keys of %d interrupted job(s) were not deleted (they expire with the job "
                    "deadline): %s", len(job_ids), str(e).splitlines()[0] if str(e) else type(e).__name__)
