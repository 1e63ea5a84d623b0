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
result backend and the tensor store are the same server; redis://, with a
password or an ACL user, or rediss:// for TLS, see store.redis_connection),
LAYERDIFF_VISIBILITY_TIMEOUT_S (how long an unacknowledged task waits before
it is redelivered to another worker; default 60) and the task secret,
LAYERDIFF_TASK_SECRET or LAYERDIFF_TASK_SECRET_FILE (its first line).

Signed messages: with a task secret, every task message, result and remote
control message is JSON signed with HMAC-SHA256 (content type
application/x-layerdiff-signed), and that is the only content a worker or the
result backend accepts. A worker logs a message that is unsigned, altered or
signed with another secret as one line, acknowledges it (it is never
redelivered) and never runs it. Without a secret messages are plain JSON, as
before, and a worker refuses to start on a broker that is not on a loopback
address: anyone who can write to that Redis could otherwise make it work.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
import uuid

from celery import Celery
from celery.backends.redis import RedisBackend
from celery.worker.consumer.consumer import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import register
from kombu.utils import json as kjson
from vine import promise

from layerdiff.analyzer.execute.store import broker_host, mask_url, redis_connection
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.security import is_loopback as security_is_loopback

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------ signing
SIGNED = "layerdiff-signed"                          # the serializer's name, as Celery's settings give it
SIGNED_CONTENT_TYPE = "application/x-layerdiff-signed"
SECRET_ENV, SECRET_FILE_ENV = "LAYERDIFF_TASK_SECRET", "LAYERDIFF_TASK_SECRET_FILE"
MIN_SECRET_CHARS = 16
# A signed body is itself JSON: {"hmac-sha256":"<64 hex digits>","data":<the JSON signed>}.
# The MAC covers the exact bytes of <the JSON signed>, which is decoded only once it matches.
_SIG_HEAD, _SIG_MID = '{"hmac-sha256":"', '","data":'


class SignatureError(Exception):
    """A message that is not signed with this process's task secret."""


def task_secret() -> bytes | None:
    """The shared task secret: LAYERDIFF_TASK_SECRET, or the first line of the
    file LAYERDIFF_TASK_SECRET_FILE names (surrounding whitespace ignored);
    None when neither is set. Raises LayerdiffError for both set, a file that
    cannot be read, or a secret shorter than MIN_SECRET_CHARS."""
    value = os.environ.get(SECRET_ENV, "").strip()
    path = os.environ.get(SECRET_FILE_ENV, "").strip()
    if value and path:
        raise LayerdiffError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one", field="task secret")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.readline(65536).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise LayerdiffError(f"cannot read the task secret file {path} ({SECRET_FILE_ENV}): "
                                 f"{getattr(e, 'strerror', None) or e}", field="task secret") from None
        if not value:
            raise LayerdiffError(f"the task secret file {path} ({SECRET_FILE_ENV}) has an empty first line",
                                 field="task secret")
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise LayerdiffError(f"the task secret has {len(value)} characters, fewer than {MIN_SECRET_CHARS} "
                             f"(e.g. openssl rand -hex 32 > FILE, then {SECRET_FILE_ENV}=FILE)", field="task secret")
    return value.encode("utf-8")


def sign(obj, secret: bytes) -> str:
    """``obj`` as JSON (kombu's, as the json serializer writes it) signed with ``secret``."""
    data = kjson.dumps(obj)
    mac = hmac.new(secret, data.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"{_SIG_HEAD}{mac}{_SIG_MID}{data}}}"


def verify(body, secret: bytes | None):
    """The object a signed body carries; SignatureError unless ``secret`` signed it."""
    if secret is None:
        raise SignatureError("this process has no task secret to verify the signature with")
    if isinstance(body, (bytes, bytearray, memoryview)):
        body = bytes(body).decode("utf-8", "replace")
    if not isinstance(body, str):
        raise SignatureError("not a signed layerdiff message")
    n = len(_SIG_HEAD)
    mac, mid = body[n:n + 64], body[n + 64:n + 64 + len(_SIG_MID)]
    if not (body.startswith(_SIG_HEAD) and mid == _SIG_MID and body.endswith("}")):
        raise SignatureError("not a signed layerdiff message (no signature)")
    data = body[n + 64 + len(_SIG_MID):-1]
    want = hmac.new(secret, data.encode("utf-8"), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want.encode("ascii"), mac.encode("utf-8", "replace")):
        raise SignatureError("bad signature (signed with another secret, or altered)")
    return kjson.loads(data)


# The secret of this process, set by make_app. kombu's serializers are
# registered per process, not per app: one process, one secret.
_secret: bytes | None = None


def _encode(obj) -> str:
    if _secret is None:
        raise SignatureError(f"no task secret in this process ({SECRET_ENV} / {SECRET_FILE_ENV})")
    return sign(obj, _secret)


def _decode(body):
    return verify(body, _secret)


register(SIGNED, _encode, _decode, content_type=SIGNED_CONTENT_TYPE, content_encoding="utf-8")


def _one_line(value, most: int = 120) -> str:
    """A message's own text (an attacker's, perhaps) fit for one log line."""
    text = " ".join(str(value).split())
    return repr(text if len(text) <= most else text[:most - 3] + "...")


def _reason(exc: BaseException) -> str:
    """Why a message that raised ``exc`` on its way in is not run."""
    cause = exc.args[0] if isinstance(exc, DecodeError) and exc.args else exc
    if isinstance(cause, SignatureError):
        return str(cause)
    if isinstance(cause, ContentDisallowed) and _secret is not None:
        return "unsigned (this worker accepts only messages signed with its task secret)"
    if isinstance(cause, ContentDisallowed):
        return (f"content type not accepted (this worker has no task secret; a signed message needs "
                f"{SECRET_FILE_ENV} or {SECRET_ENV})")
    return f"undecodable ({type(cause).__name__}: {_one_line(cause)})"


def _rejected(message, exc: BaseException | str) -> None:
    """One log line for a message this worker will not run, saying why."""
    reason = exc if isinstance(exc, str) else _reason(exc)
    headers = getattr(message, "headers", None)
    headers = headers if isinstance(headers, dict) else {}
    kind = "task message" if "task" in headers else "message"
    log.error("rejected a %s, not run: %s (task %s, id %s, content type %s)", kind, reason,
              _one_line(headers.get("task", "-")), _one_line(headers.get("id", "-")),
              _one_line(getattr(message, "content_type", "-")))


# a task body at most (a batch of tensor keys and tolerances: a few kB)
MAX_BODY_BYTES = 1 << 20
# a ticket valid for longer than this from now is dated ahead, and refused
MAX_TICKET_S = 2 * 24 * 3600


def new_ticket(task_id: str, job_id: str, nonce: str, at: str, ttl_s: float, now: float | None = None) -> dict:
    """What a task carries in its signed body that decides what runs: the
    task and its id (a header swapped, a message resent under another id:
    refused), the job, the analyzer's nonce for the job and the endpoint
    to check it against (``at``), and when it expires."""
    now = time.time() if now is None else now
    return {"task": TASK, "id": task_id, "job": job_id, "nonce": nonce, "at": at, "expires": now + ttl_s}


def send_compare(app, job_id: str, items: list, *, nonce: str, at: str, ttl_s: float, queue: str = QUEUE):
    """A comparison task of job ``job_id`` sent with its ticket; the AsyncResult."""
    task_id = str(uuid.uuid4())
    return app.send_task(TASK, args=[job_id, items], kwargs={"ticket": new_ticket(task_id, job_id, nonce, at, ttl_s)},
                         queue=queue, task_id=task_id)


class SeenTasks:
    """The task ids a worker has taken, each kept until its ticket expires:
    a message taken again (a replay, the same id under a new message) is
    refused. Owned by the worker's consumer."""

    def __init__(self, most: int = 1 << 20) -> None:
        self._until: dict[str, float] = {}
        self.most = most

    def add(self, task_id: str, expires: float, now: float) -> bool:
        """Take ``task_id``; False where it was taken already."""
        if task_id in self._until and self._until[task_id] > now:
            return False
        if len(self._until) >= self.most or len(self._until) % 4096 == 4095:
            self._until = {k: t for k, t in self._until.items() if t > now}
            if len(self._until) >= self.most:       # full of live ids: the half soonest to expire goes
                kept = sorted(self._until.items(), key=lambda kv: kv[1])[len(self._until) // 2:]
                self._until = dict(kept)
        self._until[task_id] = expires
        return True


def inadmissible(headers, content_type, body, signed: bool, seen: SeenTasks | None = None,
                 now: float | None = None) -> str:
    """Why a message may not run here ('' where it may): it must name the
    one layerdiff task, come in the one content type this worker accepts
    (the signed one where it has a secret, else JSON), decode by this
    module's own code (the signature checked first) and hold Celery's
    [args, kwargs, embed]. Whatever kombu would hand over raw
    (application/data, application/text), a body Celery cannot unpack,
    another task's name (celery.accumulate on signed arguments): refused
    here, before Celery unpacks anything."""
    if not isinstance(headers, dict):
        return "no headers"
    task = headers.get("task")
    if task != TASK:
        return f"not a layerdiff task ({_one_line(task)})"
    want = SIGNED_CONTENT_TYPE if signed else "application/json"
    if content_type != want:
        return (f"content type {_one_line(content_type)} not accepted (this worker takes {want} only"
                + (")" if signed else "; a signed message needs a task secret)"))
    raw = body if isinstance(body, (bytes, bytearray, memoryview, str)) else None
    if raw is None:
        return "no body"
    if len(raw) > MAX_BODY_BYTES:
        return f"a body of {len(raw)} bytes, over the {MAX_BODY_BYTES} a task holds"
    try:
        payload = verify(raw, _secret) if signed else kjson.loads(bytes(raw).decode("utf-8")
                                                                     if not isinstance(raw, str) else raw)
    except SignatureError as e:
        return str(e)
    except (ValueError, UnicodeDecodeError) as e:
        return f"undecodable ({type(e).__name__}: {_one_line(e)})"
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3 and isinstance(payload[0], (list, tuple))
            and isinstance(payload[1], dict) and isinstance(payload[2], dict)):
        return "malformed body (not Celery's [args, kwargs, embed])"
    ticket = payload[1].get("ticket")
    now = time.time() if now is None else now
    if not isinstance(ticket, dict):
        return "no ticket (an analyzer's task carries one)"
    if ticket.get("task") != task or ticket.get("id") != headers.get("id"):
        return f"its ticket is another task's (task {_one_line(ticket.get('task'))}, id {_one_line(ticket.get('id'))})"
    if not payload[0] or ticket.get("job") != payload[0][0]:
        return "its ticket is another job's"
    expires = ticket.get("expires")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or not isinstance(ticket.get("nonce"), str) \
            or not isinstance(ticket.get("at"), str):
        return "its ticket lacks an expiry, a nonce or the analyzer to check it with"
    if expires <= now:
        return f"expired {now - expires:.0f} s ago"
    if expires > now + MAX_TICKET_S:
        return f"dated ahead (valid {expires - now:.0f} s more, over {MAX_TICKET_S})"
    if seen is not None and not seen.add(str(headers.get("id")), float(expires), now):
        return "a replay (this worker took this task id already)"
    return ""


class RejectingConsumer(Consumer):
    """The worker's consumer: a task or remote-control message it may not
    decode (unsigned, altered, signed with another secret, or of a content
    type it does not accept) is logged as one line, without a traceback or
    the body, and acknowledged, so that it is neither run nor delivered
    again; the consumer goes on with the next message."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the task ids this worker took: kept across its broker connections
        self.seen = SeenTasks()

    def create_task_handler(self, promise=promise):
        """Celery's handler of task messages, behind this worker's own
        check (``inadmissible``): a message that fails it is logged as one
        line and acknowledged, and anything raised on the way in is too, so
        that no message ever stops the worker (a body Celery could not
        unpack used to end it, and every restarted worker after it)."""
        handle = super().create_task_handler(promise)
        signed = self.app.conf.task_serializer == SIGNED
        seen = self.seen

        def on_task_received(message):
            why = inadmissible(getattr(message, "headers", None), getattr(message, "content_type", None),
                               getattr(message, "body", None), signed, seen)
            if why:
                _rejected(message, why)
                message.ack_log_error(log, self.connection_errors)
                return None
            try:
                return handle(message)
            except Exception as exc:  # whatever a message makes Celery raise: logged, never the worker's end
                _rejected(message, exc)
                message.ack_log_error(log, self.connection_errors)
                return None

        return on_task_received

    def on_decode_error(self, message, exc):
        _rejected(message, exc)
        message.ack_log_error(log, self.connection_errors)

    def on_invalid_task(self, body, message, exc):
        if not isinstance(exc, ContentDisallowed):
            return super().on_invalid_task(body, message, exc)
        _rejected(message, exc)
        message.reject_log_error(log, self.connection_errors)


def is_loopback(url: str) -> bool:
    """True for a Redis URL on this host only: a Unix socket, or a host that
    is a loopback address or a name resolving to loopback addresses alone
    (read as the clients read the URL: broker_host)."""
    try:
        host = broker_host(url)
    except LayerdiffError:
        return False
    return host is None or security_is_loopback(host)


def check_worker_broker(url: str, signed: bool) -> None:
    """A worker without a task secret runs whatever anyone who can write to
    its Redis sends it: refused unless that Redis is on this host."""
    if not signed and not is_loopback(url):
        raise LayerdiffError(
            f"refusing to start a worker on broker {mask_url(url)} without a task secret: the broker is not on "
            f"a loopback address, and anyone who can write to it could make this worker run tasks; give the "
            f"workers and the analyzer the same secret in a file named by {SECRET_FILE_ENV} (or in "
            f"{SECRET_ENV})", field="broker")


class LayerdiffCelery(Celery):
    def worker_main(self, argv=None):
        """A worker starts only when its messages cannot be forged (signed, or a loopback broker)."""
        check_worker_broker(self.conf.broker_url or "", self.conf.task_serializer == SIGNED)
        return super().worker_main(argv)


def _backend_url(url: str) -> str:
    """The result backend: PolledRedisBackend on the broker's server."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return url
    return f"{__name__}:PolledRedisBackend+{url}"


def make_app(broker_url: str | None = None, visibility_timeout_s: int | None = None,
             secret: bytes | str | None = None) -> Celery:
    """The Celery app on ``broker_url`` (default: LAYERDIFF_BROKER_URL). Its
    messages are signed with ``secret`` (default: task_secret(), read
    from the environment); without one they are plain JSON. A worker started
    with app.worker_main refuses a non-loopback broker without a secret."""
    global _secret
    url = broker_url or os.environ.get("LAYERDIFF_BROKER_URL", "")
    vt = visibility_timeout_s or int(os.environ.get("LAYERDIFF_VISIBILITY_TIMEOUT_S",
                                                    DEFAULT_VISIBILITY_TIMEOUT_S))
    if secret is None:
        secret = task_secret()
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if secret:
        _secret = secret
    codec = SIGNED if secret else "json"
    # TLS options travel as settings, not in the URL: Celery and kombu read
    # them (and their defaults) differently from a query string.
    clean, tls = redis_connection(url) if url else (url, None)
    app = LayerdiffCelery("layerdiff", broker=clean, backend=_backend_url(clean), set_as_current=False)
    app.conf.update(
        task_serializer=codec, result_serializer=codec, accept_content=[codec], result_accept_content=[codec],
        broker_use_ssl=tls, redis_backend_use_ssl=tls,
        layerdiff_store_url=url,      # the tensor store's URL, TLS options included
        worker_consumer=f"{__name__}:RejectingConsumer",
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
    from layerdiff.analyzer.execute.store import TensorStore

    if url not in _stores:
        _stores[url] = TensorStore(url)
    return _stores[url]


def compare_batch(self, job_id: str, items: list[dict], ticket: dict | None = None) -> list[dict]:
    """Compare a batch of nodes (or chunks of large nodes) of one job, once
    the analyzer that sent it says the job runs there (``ticket``: its
    nonce and endpoint, checked and signed with the message)."""
    import redis

    from layerdiff.analyzer.compare.node import SkipNode, compare_chunk, compare_node
    from layerdiff.analyzer.compare.tolerances import Tolerance
    from layerdiff.analyzer.execute.store import PayloadError, job_running
    from layerdiff.common.errors import LayerdiffError

    worker = getattr(self.request, "hostname", None) or f"pid {os.getpid()}"
    store = _store(self.app.conf.get("layerdiff_store_url") or self.app.conf.broker_url)
    try:
        why = "no ticket" if not isinstance(ticket, dict) else \
            job_running(str(ticket.get("at")), job_id, str(ticket.get("nonce")))
    except PayloadError as e:       # the analyzer cannot be reached: said as for a tensor it holds
        return [{"id": it.get("id"), "error": str(e), "kind": "payload", "source": e.source, "at": e.at,
                 "key": "", "cause": e.cause, "worker": worker} for it in items]
    if why:
        return [{"id": it.get("id"), "kind": "job", "worker": worker,
                 "error": f"job {job_id} no longer exists (finished, expired or cancelled): {why}"} for it in items]
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
                out.append({"id": it["id"], "metrics": res.metrics.as_dict(), "worst": list(res.worst),
                            "note": res.note})
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
