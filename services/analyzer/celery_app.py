"""The Celery application of the distributed executor and its one task.

The task is thin: it reads the referenced tensors from the store, runs the
same plain comparison functions as the local pool and returns JSON (never a
pickle). It is idempotent: the same (job, item) gives the same answer, so a
redelivered task (its worker died before acknowledging) is harmless.

Each item's result is one of: the comparison ("metrics", or "acc" for a
chunk); {"skip": why} when the node's own data cannot be compared (shapes
that do not reconcile), which the report lists as skipped; or {"error": text,
"kind": ...} when the system kept the worker from comparing it, which the
analyzer retries and then fails the job on, because a debugger that passes
over nodes it could not read gives a verdict it has not earned. Kinds:
"payload" (a referenced tensor could not be read; "source" is "store" or
"endpoint", "at" the endpoint's address, "cause" why), "job" (the store holds
no such job), "task" (a reference the worker refuses) and "worker" (any other
exception). Every error names the worker that saw it.

Configuration comes from the environment: LAYERDIFF_BROKER_URL (Redis; the
result backend and the tensor store are the same server) and
LAYERDIFF_VISIBILITY_TIMEOUT_S (how long an unacknowledged task waits before
it is redelivered to another worker; default 60).
"""
from __future__ import annotations

import os

from celery import Celery
from celery.backends.redis import RedisBackend

QUEUE = "layerdiff"
TASK = "layerdiff.compare_batch"
DEFAULT_VISIBILITY_TIMEOUT_S = 60


class PolledRedisBackend(RedisBackend):
    """Celery's Redis result backend without its pub/sub consumer: the
    analyzer polls each task's result key. The consumer subscribes on every
    send; while Redis is down it retries inside the send for seconds, and
    once its retries are spent it refuses every later send until the process
    restarts. A broker restart must cost a job a clear failure, never the
    analyzer its ability to send."""

    def on_task_call(self, producer, task_id):
        pass


def _backend_url(url: str) -> str:
    """The result backend: PolledRedisBackend on the broker's server."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return url
    return f"{__name__}:PolledRedisBackend+{url}"


def make_app(broker_url: str | None = None, visibility_timeout_s: int | None = None) -> Celery:
    url = broker_url or os.environ.get("LAYERDIFF_BROKER_URL", "")
    vt = visibility_timeout_s or int(os.environ.get("LAYERDIFF_VISIBILITY_TIMEOUT_S",
                                                    DEFAULT_VISIBILITY_TIMEOUT_S))
    app = Celery("layerdiff", broker=url, backend=_backend_url(url), set_as_current=False)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"], result_accept_content=["json"],
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_default_queue=QUEUE, result_expires=3600, broker_connection_retry_on_startup=True,
        # Every Redis call is bounded: a broker gone or cut off is noticed in
        # seconds, and the analyzer's grace period decides what it means.
        broker_transport_options={"visibility_timeout": vt, "socket_timeout": 10, "socket_connect_timeout": 5},
        broker_connection_timeout=5, task_publish_retry_policy={
            "max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0},
        redis_socket_timeout=10, redis_socket_connect_timeout=5,
        result_backend_thread_safe=True,   # one backend (one connection pool) for all of a job's threads
        result_backend_transport_options={"retry_policy": {"timeout": 5.0}},
        worker_hijack_root_logger=False, worker_send_task_events=False,
    )
    app.task(name=TASK, bind=True)(compare_batch)
    return app


_stores: dict[str, object] = {}


def _store(url: str):
    from layerdiff.analyzer.store import TensorStore

    if url not in _stores:
        _stores[url] = TensorStore(url)
    return _stores[url]


def compare_batch(self, job_id: str, items: list[dict]) -> list[dict]:
    """Compare a batch of nodes (or chunks of large nodes) of one job."""
    import redis

    from layerdiff.analyzer.compare import SkipNode, compare_chunk, compare_node
    from layerdiff.analyzer.store import PayloadError
    from layerdiff.analyzer.tolerances import Tolerance
    from layerdiff.errors import LayerdiffError

    worker = getattr(self.request, "hostname", None) or f"pid {os.getpid()}"
    store = _store(self.app.conf.broker_url)
    if not store.job_alive(job_id):
        return [{"id": it.get("id"), "kind": "job", "worker": worker,
                 "error": f"job {job_id} no longer exists (finished, expired or cancelled)"} for it in items]
    out = []
    for it in items:
        try:
            ref = store.get(it["ref"])
            dev = store.get(it["dev"])
            tol = Tolerance(float(it["atol"]), float(it["rtol"]))
            diff_cnt = int(it["diff_cnt"])
            if "offset" in it:
                acc, worst = compare_chunk(ref, dev, int(it["offset"]), tol, diff_cnt)
                out.append({"id": it["id"], "acc": acc.to_dict(), "worst": worst})
            else:
                # "perm": the layout permutation the analyzer decided (its LayoutVote stays there)
                res = compare_node(ref, dev, tol, diff_cnt, bool(it.get("force_compare")), it.get("perm"))
                out.append({"id": it["id"], "metrics": res.metrics.as_dict(), "worst": res.worst, "note": res.note})
        except SkipNode as e:
            out.append({"id": it.get("id"), "skip": str(e)})
        except PayloadError as e:
            # the store's own URL stays out of results: it may carry a password
            out.append({"id": it.get("id"), "error": str(e), "kind": "payload", "source": e.source,
                        "at": e.at if e.source == "endpoint" else "", "key": e.key, "cause": e.cause,
                        "worker": worker})
        except redis.RedisError as e:
            out.append({"id": it.get("id"), "error": f"{type(e).__name__}: {e}", "kind": "payload",
                        "source": "store", "at": "", "key": "", "cause": f"{type(e).__name__}: {e}",
                        "worker": worker})
        except LayerdiffError as e:   # a reference the worker refuses (a dtype, a size)
            out.append({"id": it.get("id"), "error": str(e), "kind": "task", "worker": worker})
        except Exception as e:  # reported per item: the rest of the batch goes on
            out.append({"id": it.get("id"), "error": f"{type(e).__name__}: {e}", "kind": "worker",
                        "worker": worker})
    return out
