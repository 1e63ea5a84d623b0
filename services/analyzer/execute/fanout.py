"""The distributed executor: per-node comparisons fanned out to Celery
workers on any host, with the same interface as the local pool.

- Tensor bytes go to the tensor store (Redis), never into a Celery message:
  a task carries references, dtypes, shapes and tolerances (a few hundred
  bytes per node).
- Small nodes are batched into one task of about ``batch_bytes`` of
  comparison work (an empty Celery round trip costs milliseconds); a batch
  also leaves after ``linger_s`` so progress never stalls. Nodes larger than
  CHUNK_ELEMENTS are cut at the same bounds as in the local pool and their
  chunk results merged exactly.
- Reliability: tasks are acknowledged late; results are idempotent per
  (job, item). A task without a result after ``task_timeout_s`` (its worker
  died, or the broker lost it) is sent again, with a doubled timeout each
  time, and whichever copy answers first counts. A job has a deadline.
- Every wait is bounded. A broker that stops answering (sending, polling
  results, writing tensors) fails the job after ``store_grace_s``; one that
  comes back without the job's data (restarted) fails it as soon as it
  answers again; tasks that could not be sent meanwhile wait in ``_unsent``
  and go out when the broker is back with the job's data. ``cancel()`` ends
  every future at once.
- A node is skipped only for its own data (shapes that do not reconcile).
  One the system kept from being compared (a payload the worker could not
  read, an exception on the worker, a task that failed, an item left
  unanswered) is sent again, ``max_attempts`` times in all, and then fails
  the job with a message naming the component and the cause; the other
  nodes fail with it at once rather than each wait out its own attempts.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis
from kombu.exceptions import OperationalError

from layerdiff.analyzer.compare import metrics as M
from layerdiff.analyzer.compare.node import NodeOutcome, SkipNode, chunk_bounds, merge_chunks, reconcile
from layerdiff.analyzer.execute.celery_app import make_app, send_compare
from layerdiff.analyzer.execute.store import (
    FLIGHT_MIN_BYTES,
    TensorStore,
    drop_from_endpoint,
    mask_url,
    tensor_endpoint,
)
from layerdiff.common.errors import LayerdiffError, UnavailableError

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = int(os.environ.get("LAYERDIFF_JOB_DEADLINE_S", "3600"))
# A batch holds well under a second of work; a task silent for this long is
# presumed lost with its worker.
DEFAULT_TASK_TIMEOUT_S = float(os.environ.get("LAYERDIFF_TASK_TIMEOUT_S", "30"))
# No result for this long: are there workers at all? Asked by a ping, so that
# workers busy with other jobs' tasks keep the job waiting and hung or absent
# ones fail it.
DEFAULT_WORKER_SILENCE_S = float(os.environ.get("LAYERDIFF_WORKER_SILENCE_S", "60"))
STORE_GRACE_S = float(os.environ.get("LAYERDIFF_STORE_GRACE_S", "20"))
MAX_ATTEMPTS = 3
RETRY_DELAY_S = 0.5       # before the n-th resend of an item: n times this


class StoreLost(UnavailableError):
    """The broker answers again but without the job's data (it restarted)."""


class PoolCancelled(LayerdiffError):
    """The job was cancelled: what it still waited for is not needed."""


@dataclass
class _Node:
    future: Future
    shape: tuple
    diff_cnt: int
    note: str = ""
    parts: list = field(default_factory=list)   # chunk results, in offset order


@dataclass
class _Item:
    node: _Node
    k: int               # chunk index
    nbytes: int
    msg: dict = field(default_factory=dict)     # what a task carries for it, kept to send it again
    attempts: int = 1


class CeleryPool:
    def __init__(self, broker_url: str, job_id: str, max_cores: int | None = None, *,
                 deadline_s: float = DEFAULT_DEADLINE_S, task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
                 batch_bytes: int = 32 * 1024**2, linger_s: float = 0.05,
                 max_inflight_bytes: int = 512 * 1024**2, max_attempts: int = MAX_ATTEMPTS,
                 retry_delay_s: float = RETRY_DELAY_S, store_grace_s: float = STORE_GRACE_S,
                 worker_silence_s: float = DEFAULT_WORKER_SILENCE_S) -> None:
        self.broker_url = mask_url(broker_url)     # in messages and logs: never the password
        self.job_id = job_id
        self.max_cores = max_cores or 1
        self.max_in_flight = 4096          # nodes; memory is bounded by bytes below
        self.app = make_app(broker_url)
        self.store = TensorStore(broker_url, ttl_s=int(deadline_s) + 600)
        self.store.ping()
        self.store.open_job(job_id)
        # the record workers check this job's tasks against: this analyzer's
        # endpoint, with a nonce only its signed tasks carry
        self.nonce = secrets.token_hex(16)
        self.ticket_ttl_s = float(deadline_s) + 600
        self.endpoint = tensor_endpoint()
        self.endpoint.open_job(job_id, self.nonce)
        self.deadline = time.monotonic() + deadline_s
        self.task_timeout_s = task_timeout_s
        self.batch_bytes = batch_bytes
        self.linger_s = linger_s
        self.max_inflight_bytes = max_inflight_bytes
        self.max_attempts = max(1, max_attempts)
        self.retry_delay_s = retry_delay_s
        self.store_grace_s = store_grace_s
        self.worker_silence_s = worker_silence_s
        self._heard = time.monotonic()      # the last result, or the last time a worker answered a ping
        self._ids = itertools.count()
        self._items: dict[int, _Item] = {}
        self._retries: list[tuple[float, dict]] = []    # (not before, item message)
        self._batch: list[dict] = []
        self._batch_nbytes = 0
        self._batch_since = 0.0
        self._tasks: dict = {}            # AsyncResult -> (item ids, items, sent at, timeout)
        self._unsent: list[dict] = []     # item messages the broker refused; sent again when it is back
        self._down_since: float | None = None    # the broker stopped answering then (None: it answers)
        self._inflight_bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self._failure: LayerdiffError | None = None
        self.stats = {"tasks": 0, "items": 0, "message_bytes": 0, "retried": 0}
        self._poller = threading.Thread(target=self._poll, name=f"fanout-{job_id}", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ submit
    def submit(self, ref, dev, tol, diff_cnt: int, force_compare: bool) -> Future:
        fut: Future = Future()
        if self._failure is not None:
            fut.set_exception(self._failure)
            return fut
        try:
            dev, note = reconcile(ref, dev, force_compare)
        except SkipNode as e:
            fut.set_exception(e)
            return fut
        bounds = chunk_bounds(ref.size)
        node = _Node(fut, tuple(ref.shape), diff_cnt, note, [None] * len(bounds))
        common = {"atol": tol.atol, "rtol": tol.rtol, "diff_cnt": diff_cnt}
        for attempt in range(2):
            try:
                if len(bounds) == 1:
                    self._add(node, 0, ref, dev, dict(common, force_compare=False))
                else:
                    r, d = ref.reshape(-1), dev.reshape(-1)
                    for k, (a, b) in enumerate(bounds):
                        self._add(node, k, r[a:b], d[a:b], dict(common, offset=a))
                break
            except LayerdiffError as e:
                if e is not self._failure:
                    raise
                if not fut.done():     # the pool failed meanwhile: this node fails with the rest
                    fut.set_exception(e)
                break
            except (redis.RedisError, OperationalError) as e:
                if self._await_broker(e) and attempt == 0:
                    continue      # a blip: the store is back with the job's data
                self._fail_all(UnavailableError(f"broker {self.broker_url} failed: {e}", field="broker"))
                if not fut.done():
                    fut.set_exception(self._failure)
                break
        return fut

    def _await_broker(self, e: Exception) -> bool:
        """A store error seen while sending: the broker is down until the
        poller sees it answer again (see _check_broker, which bounds the
        wait by the grace period). True when it is back with this job's data."""
        with self._cv:
            self._mark_down_locked(e)
            while self._down_since is not None and self._failure is None:
                self._cv.wait(0.2)
            return self._failure is None

    def _lost(self) -> StoreLost:
        return StoreLost(f"broker {self.broker_url} came back without this job's data (restarted?); the remaining "
                         "nodes cannot be compared: run the job again", field="broker")

    def _unreachable(self, e: Exception) -> UnavailableError:
        return UnavailableError(f"broker {self.broker_url} unreachable for {self.store_grace_s:.0f} s: "
                                f"{_one_line(str(e))}; check that Redis runs and this host reaches it "
                                "(the interval is LAYERDIFF_STORE_GRACE_S)", field="broker")

    def _add(self, node: _Node, k: int, ref, dev, item: dict) -> None:
        nbytes = ref.nbytes + dev.nbytes
        with self._cv:
            while self._inflight_bytes > self.max_inflight_bytes and self._failure is None:
                self._cv.wait(0.1)
            if self._failure is not None:
                raise self._failure
            item_id = next(self._ids)
            self._items[item_id] = _Item(node, k, nbytes, item)
            self._inflight_bytes += nbytes
        try:
            item.update(id=item_id, ref=self._put(f"{item_id}:r", ref), dev=self._put(f"{item_id}:d", dev))
        except BaseException:
            with self._cv:      # never left registered and unsent: close() would wait for it
                self._items.pop(item_id, None)
                self._inflight_bytes -= nbytes
                self._cv.notify_all()
            raise
        with self._cv:
            if self._failure is not None:
                raise self._failure
            if not self._batch:
                self._batch_since = time.monotonic()
            self._batch.append(item)
            self._batch_nbytes += nbytes
            if self._batch_nbytes >= self.batch_bytes:
                self._flush_locked()

    def _put(self, name: str, arr) -> dict:
        if arr.nbytes >= FLIGHT_MIN_BYTES:
            return tensor_endpoint().put(f"layerdiff:job:{self.job_id}:{name}", arr)
        return self.store.put(self.job_id, name, arr)

    def _flush_locked(self) -> None:
        if not self._batch:
            return
        items, self._batch, self._batch_nbytes = self._batch, [], 0
        self._send_locked(items, self.task_timeout_s)
        self.stats["tasks"] += 1
        self.stats["items"] += len(items)
        self.stats["message_bytes"] += len(json.dumps([self.job_id, items]))

    def _send_locked(self, items: list[dict], timeout: float) -> None:
        """Send a task; a broker that refuses it keeps the items in
        ``_unsent`` for the poller (never raises: the items are registered
        and must either go out or fail with the job)."""
        if self._down_since is not None:
            self._unsent.extend(items)
            return
        try:
            res = send_compare(self.app, self.job_id, items, nonce=self.nonce, at=self.endpoint.address,
                               ttl_s=self.ticket_ttl_s)
        except (OperationalError, redis.RedisError, ConnectionError, OSError) as e:
            log.warning("job %s: broker %s refuses a task (%s); its %d items wait for it", self.job_id,
                        self.broker_url, _one_line(str(e)), len(items))
            self._unsent.extend(items)
            self._mark_down_locked(e)
            return
        self._tasks[res] = ([it["id"] for it in items], items, time.monotonic(), timeout)

    def _mark_down_locked(self, e: Exception) -> None:
        if self._down_since is None:
            log.warning("job %s: broker %s stopped answering: %s", self.job_id, self.broker_url, _one_line(str(e)))
            self._down_since = time.monotonic()

    def _check_broker(self) -> None:
        """While the broker is down: has it come back (with this job's data:
        send what waits; without: the job's data is lost), or has it been
        down too long? Raises the job's failure."""
        with self._cv:
            since = self._down_since
        if since is None:
            return
        try:
            alive = self.store.job_alive(self.job_id)
        except (redis.RedisError, OperationalError, ConnectionError, OSError) as e:
            if time.monotonic() - since > self.store_grace_s:
                raise self._unreachable(e) from None
            return
        if not alive:
            raise self._lost()
        with self._cv:
            log.warning("job %s: broker %s answers again after %.1f s", self.job_id, self.broker_url,
                        time.monotonic() - since)
            self._down_since = None
            self._cv.notify_all()
            unsent, self._unsent = self._unsent, []
            live = [m for m in unsent if m["id"] in self._items]
            if live:
                self._send_locked(live, self.task_timeout_s)

    def _resend_overdue(self) -> None:
        now = time.monotonic()
        with self._cv:
            overdue = [(res, t) for res, t in self._tasks.items() if now - t[2] > t[3]]
        if not overdue:
            return
        if not self.store.job_alive(self.job_id):
            raise self._lost()
        with self._cv:
            for res, (_ids, items, _, timeout) in overdue:
                if self._tasks.pop(res, None) is None:
                    continue
                live = [it for it in items if it["id"] in self._items]
                if live:
                    log.warning("job %s: task %s silent for %.0f s, sending its %d nodes again", self.job_id, res.id,
                                timeout, len(live))
                    self.stats["resent"] = self.stats.get("resent", 0) + 1
                    self._send_locked(live, timeout * 2)

    # ----------------------------------------------------------------- results
    def _poll(self) -> None:
        try:
            self._poll_loop()
        except Exception as e:  # a bug here would leave every future unresolved: fail them instead
            log.exception("job %s: the fan-out poller failed", self.job_id)
            self._fail_all(LayerdiffError(f"internal error in the fan-out: {type(e).__name__}: {e}"))

    def _poll_loop(self) -> None:
        while True:
            with self._cv:
                if self._closed and not self._items:
                    return
                if self._batch and time.monotonic() - self._batch_since >= self.linger_s:
                    self._flush_locked()
                self._send_retries_locked()
                tasks = [(res, t[0]) for res, t in self._tasks.items()] if self._down_since is None else []
            try:
                self._check_broker()
                for res, ids in tasks:
                    if res.ready():
                        value = res.get(propagate=False, disable_sync_subtasks=False)
                        res.forget()
                        with self._cv:
                            self._tasks.pop(res, None)
                            self._resolve_locked(ids, value)
                        self._heard = time.monotonic()
                if tasks:
                    self._resend_overdue()
                    self._check_workers()
            except LayerdiffError as e:
                self._fail_all(e)
            except (redis.RedisError, OperationalError, ConnectionError, OSError) as e:
                with self._cv:
                    self._mark_down_locked(e)
            if time.monotonic() > self.deadline and self._items:
                self._fail_all(LayerdiffError(f"deadline exceeded with {len(self._items)} comparisons outstanding",
                                              field="deadline"))
            time.sleep(0.02 if self._down_since is None else 0.2)

    def _check_workers(self) -> None:
        """Tasks outstanding and no result for ``worker_silence_s``: fail the
        job unless some worker answers a ping (it is busy, not gone)."""
        if time.monotonic() - self._heard <= self.worker_silence_s:
            return
        try:
            answered = self.app.control.ping(timeout=2.0)
        except (OperationalError, redis.RedisError, ConnectionError, OSError):
            return    # the broker itself: its own bound applies
        if answered:
            self._heard = time.monotonic()
            return
        raise UnavailableError(
            f"no worker has answered for {self.worker_silence_s:.0f} s on broker {self.broker_url}: start workers "
            f"(layerdiff worker --broker {self.broker_url}) or check that they run (the interval is "
            "LAYERDIFF_WORKER_SILENCE_S)", field="workers")

    def _resolve_locked(self, ids: list[int], value) -> None:
        resent: dict[tuple, list[int]] = {}     # (what went wrong, delay, attempt) -> items sent again
        if not isinstance(value, list):
            # the task itself failed on the worker: no node in it was compared
            cause = _one_line(f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else repr(value))
            for i in ids:
                self._not_compared_locked(i, {"kind": "task failed", "cause": cause}, resent)
        else:
            by_id = {r.get("id"): r for r in value if isinstance(r, dict)}
            for i in ids:
                r = by_id.get(i)
                if r is None:
                    self._not_compared_locked(i, {"kind": "no result"}, resent)
                elif "error" in r:
                    self._not_compared_locked(i, r, resent)
                else:
                    try:
                        self._finish_item(i, r)
                    except (KeyError, TypeError, ValueError, AttributeError) as e:
                        self._not_compared_locked(i, {"kind": "unreadable", "cause": f"{type(e).__name__}: {e}"},
                                                  resent)
        if self._failure is None:
            for (what, delay, attempt), items in resent.items():
                log.warning("job %s: %d item%s not compared (%s); sending %s again in %.1f s, attempt %d of %d "
                            "(items %s)", self.job_id, len(items), "s" if len(items) > 1 else "", what,
                            "them" if len(items) > 1 else "it", delay, attempt, self.max_attempts,
                            _id_list(items))

    def _finish_item(self, item_id: int, result: dict) -> None:
        """A worker's answer for one item: the comparison, or a skip for the
        node's own data. Raises (and changes nothing) on a malformed answer."""
        entry = self._items.get(item_id)
        if entry is None:
            return
        node, k = entry.node, entry.k
        outcome = skip = None
        parts = node.parts
        if "skip" in result:
            skip = SkipNode(str(result["skip"]))
        elif "metrics" in result:
            outcome = NodeOutcome(M.NodeMetrics.from_dict(result["metrics"]), [tuple(w) for w in result["worst"]],
                                  result.get("note", ""))
        else:
            parts = list(node.parts)
            parts[k] = (M.Accumulator.from_dict(result["acc"]), [tuple(w) for w in result["worst"]])
            if all(p is not None for p in parts):
                m, worst = merge_chunks(parts, node.shape, node.diff_cnt)
                outcome = NodeOutcome(m, worst, node.note)
        self._drop_item_locked(item_id)
        node.parts = parts
        if node.future.done():
            return
        if skip is not None:
            node.future.set_exception(skip)
        elif outcome is not None:
            node.future.set_result(outcome)

    def _drop_item_locked(self, item_id: int) -> None:
        entry = self._items.pop(item_id)
        self._inflight_bytes -= entry.nbytes
        if entry.nbytes >= FLIGHT_MIN_BYTES:
            drop_from_endpoint(f"layerdiff:job:{self.job_id}:{item_id}:")
        self._cv.notify_all()

    def _not_compared_locked(self, item_id: int, err: dict, resent: dict) -> None:
        """The system kept a worker from comparing an item: send it again
        (later, and to whichever worker takes it), or, after max_attempts,
        fail the job."""
        entry = self._items.get(item_id)
        if entry is None or self._failure is not None:
            return
        if err.get("kind") == "job":
            # the store answers but has no marker for this job: its data is gone, no attempt can bring it back
            self._fail_all_locked(self._lost())
            return
        if entry.attempts >= self.max_attempts:
            log.error("job %s: item %d not compared after %d attempts: %s", self.job_id, item_id, entry.attempts,
                      _describe(err))
            self._fail_all_locked(self._system_failure(err, entry.attempts))
            return
        delay = self.retry_delay_s * entry.attempts
        entry.attempts += 1
        self.stats["retried"] += 1
        resent.setdefault((_describe(err), delay, entry.attempts), []).append(item_id)
        self._retries.append((time.monotonic() + delay, entry.msg))

    def _send_retries_locked(self) -> None:
        if not self._retries:
            return
        now = time.monotonic()
        due: list[tuple[float, dict]] = []
        later: list[tuple[float, dict]] = []
        for t, m in self._retries:
            if m["id"] in self._items:
                (due if t <= now else later).append((t, m))
        self._retries = later
        if due:
            self._send_locked([m for _, m in due], self.task_timeout_s)

    def _system_failure(self, err: dict, attempts: int) -> UnavailableError:
        """One line for the user: which component failed, why, and what to do."""
        err = {k: _one_line(str(v)) for k, v in err.items() if v not in (None, "")}
        kind = err.get("kind")
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        worker = f" (worker {err['worker']})" if err.get("worker") else ""
        if kind == "payload" and err.get("source") == "endpoint":
            return UnavailableError(
                f"workers cannot fetch tensors from the analyzer's tensor endpoint at {err.get('at') or '?'} "
                f"({err.get('cause') or 'unknown error'}) after {tries}{worker}: set LAYERDIFF_TENSOR_HOST / "
                "LAYERDIFF_ADVERTISE_HOST to an address the workers reach")
        if kind == "payload":
            return UnavailableError(
                f"workers cannot read payload {err.get('key') or '?'} from the tensor store at {self.broker_url} "
                f"({err.get('cause') or 'unknown error'}) after {tries}{worker}", field="broker")
        if kind == "task failed":
            return UnavailableError(f"a worker task failed {tries} in a row: {err.get('cause')}", field="workers")
        if kind == "no result":
            return UnavailableError(f"workers returned no result for a node in {tries} (are the workers and the "
                                    "analyzer the same version?)", field="workers")
        if kind == "unreadable":
            return UnavailableError(f"workers returned an unreadable result for a node in {tries}: "
                                    f"{err.get('cause')} (are the workers and the analyzer the same version?)",
                                    field="workers")
        if kind == "task":
            return UnavailableError(f"workers refuse a node's task in {tries}{worker}: {err.get('error')}",
                                    field="workers")
        return UnavailableError(f"a worker failed comparing a node in {tries}{worker}: {err.get('error')}",
                                field="workers")

    def _fail_all(self, exc: LayerdiffError) -> None:
        with self._cv:
            self._fail_all_locked(exc)

    def _fail_all_locked(self, exc: LayerdiffError) -> None:
        if self._failure is None:     # the first reason stands (a cancel is not turned into an outage)
            self._failure = exc
        for entry in list(self._items.values()):
            if not entry.node.future.done():
                entry.node.future.set_exception(self._failure)
        self._items.clear()
        self._tasks.clear()
        self._unsent = []
        self._retries = []
        self._batch = []
        self._inflight_bytes = 0
        self._cv.notify_all()

    # ------------------------------------------------------------------- close
    def cancel(self) -> None:
        """The job is cancelled: every pending comparison ends now."""
        with self._cv:
            if self._failure is None:
                self._fail_all_locked(PoolCancelled("cancelled"))

    def close(self) -> None:
        with self._cv:
            self._flush_locked()
            self._closed = True
        # every outstanding item ends within the bounds above (a result, the
        # broker's grace, the task timeout, the deadline): this wait is bounded too
        self._poller.join(timeout=max(0.0, self.deadline - time.monotonic()) + 5)
        self.endpoint.close_job(self.job_id)
        drop_from_endpoint(f"layerdiff:job:{self.job_id}:")
        try:
            self.store.drop_job(self.job_id)
        except redis.RedisError as e:  # the keys expire by themselves
            log.warning("could not delete job %s from the store: %s", self.job_id, e)
        finally:   # this job's connections end with it, not when the collector finds the cycles
            self.store.close()
            self.app.backend.client.connection_pool.disconnect()
            self.app.close()


def _describe(err: dict) -> str:
    """An item's error as the log shows it."""
    parts = [str(err.get("kind") or "error")]
    for k in ("source", "at", "cause", "worker"):
        if err.get(k):
            parts.append(f"{k}={_one_line(str(err[k]))}")
    if err.get("error") and not err.get("cause"):
        parts.append(_one_line(str(err["error"])))
    return ", ".join(parts)


def _one_line(text: str, most: int = 300) -> str:
    """A worker's text (a traceback's message may span lines) fit for a job's one-line failure reason."""
    text = " ".join(text.split())
    return text if len(text) <= most else text[:most - 3] + "..."


def _id_list(ids: list[int], most: int = 10) -> str:
    shown = ", ".join(str(i) for i in ids[:most])
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")
