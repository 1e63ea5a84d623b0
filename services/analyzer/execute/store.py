"""Out-of-band tensor store for distributed comparisons.

Celery messages carry references, never tensor bytes: the analyzer writes
each small tensor to Redis under a key of its job, and keeps each large one
in its own memory behind an Arrow Flight endpoint; the task names the key
(and endpoint) with the dtype and shape it expects, and the worker reads the
bytes back and checks their size before using them. A job's keys live under one prefix and carry a
time-to-live (the job's deadline), so a job that ends or dies leaves nothing
behind for long; ``drop_job`` deletes them at once.
"""
from __future__ import annotations

import hmac
import json
import os
import re
import ssl
import threading
from typing import cast
from urllib.parse import parse_qsl, urlencode

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import redis

from layerdiff.common.errors import LayerdiffError, UnavailableError
from layerdiff.common.schema import ALLOWED_DTYPES
from layerdiff.common.security import ClientSecurity, ServerSecurity, flight_middleware

PREFIX = "layerdiff:job:"
# Redis values are limited to 512 MiB; large tensors are cut into parts.
PART_BYTES = 64 * 1024 * 1024


def _job_key(job_id: str) -> str:
    return f"{PREFIX}{job_id}"


class PayloadError(LayerdiffError):
    """A referenced payload could not be read. Unlike a bad reference, this
    is the system's fault, not the data's: ``source`` is "store" (Redis) or
    "endpoint" (an analyzer's tensor endpoint), ``at`` its address as the
    reference gave it, ``cause`` the reason in a few words. The analyzer
    sends such a node again, then fails the job naming the component."""

    def __init__(self, message: str, *, source: str, at: str, key: str, cause: str) -> None:
        super().__init__(message, field=key)
        self.source = source
        self.at = at
        self.key = key
        self.cause = cause


# What a transport error comes down to, as the user would look it up.
_CAUSES = (("connection refused", "connection refused"), ("network is unreachable", "network is unreachable"),
           ("no route to host", "no route to host"), ("connection reset", "connection reset"),
           ("deadline exceeded", "timed out"), ("timed out", "timed out"), ("timeout", "timed out"),
           ("name or service not known", "unknown host"), ("dns resolution failed", "unknown host"),
           ("not held by this analyzer", "payload no longer held"), ("status: 404", "not a tensor endpoint"),
           ("token", "the endpoint refuses this worker's token (LAYERDIFF_TOKEN)"),
           ("unauthenticated", "the endpoint refuses this worker's token (LAYERDIFF_TOKEN)"),
           ("handshake", "TLS handshake failed (LAYERDIFF_TLS_CA, LAYERDIFF_TLS_CERT)"),
           ("certificate", "TLS certificate not trusted (LAYERDIFF_TLS_CA)"))


def short_cause(text: str) -> str:
    low = text.lower()
    for needle, cause in _CAUSES:
        if needle in low:
            return cause
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line[:200]


# ------------------------------------------------------------ Redis connections
# One URL names the broker, the result backend and the tensor store:
# redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], or rediss://... (TLS) with the
# TLS options in its query: ssl_cert_reqs (required, the default; optional;
# none), ssl_ca_certs, ssl_ca_path, ssl_certfile, ssl_keyfile,
# ssl_check_hostname (true, the default unless ssl_cert_reqs=none).
TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "cert_required": ssl.CERT_REQUIRED,
              "optional": ssl.CERT_OPTIONAL, "cert_optional": ssl.CERT_OPTIONAL,
              "none": ssl.CERT_NONE, "cert_none": ssl.CERT_NONE}
_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|passwd|pass|pwd)=)[^&]*")


def mask_url(url: str | None) -> str:
    """``url`` fit for a log line or an error message: the password (and a
    user given alone, which may be one) replaced by ``***``. A URL without
    credentials comes back unchanged."""
    if not url or "://" not in url:
        return url or ""
    scheme, rest = url.split("://", 1)
    head, q, query = rest.partition("?")
    at = head.rfind("@")      # the last one: a password may hold an unescaped '@'
    if at >= 0:
        user, colon, _ = head[:at].partition(":")
        head = (f"{user}:***" if colon else "***") + head[at:]
    if q:
        query = _SECRET_QUERY.sub(r"\1***", query)
    return f"{scheme}://{head}{q}{query}"


def broker_host(url: str) -> str | None:
    """The host a worker's connections to ``url`` reach, read as its Redis
    clients read it (kombu's for the broker, redis-py's for the tensor
    store: a fragment, userinfo and IPv6 brackets included); None for a
    Unix socket. Where the two would reach different hosts, or none, a
    LayerdiffError (the URL masked)."""
    from kombu.utils.url import parse_url as kombu_url
    from redis.connection import parse_url as redis_url

    if url.partition("://")[0].lower() in ("unix", "socket", "redis+socket"):
        return None
    try:
        by_kombu, by_redis = kombu_url(url).get("hostname") or "", redis_url(url).get("host") or ""
    except (ValueError, TypeError) as e:
        raise LayerdiffError(f"broker URL {mask_url(url)} cannot be read ({e})", field="broker") from None
    if not by_kombu or by_kombu != by_redis:
        raise LayerdiffError(f"broker URL {mask_url(url)} names no single host (the broker's client reads "
                             f"{by_kombu or 'none'}, the store's {by_redis or 'none'})", field="broker")
    return by_kombu


def redis_connection(url: str) -> tuple[str, dict | None]:
    """How to connect to the Redis ``url`` names: (the URL without its TLS
    query options, the TLS options as redis-py, kombu and Celery take them,
    or None for a plain connection). Raises LayerdiffError for TLS options
    on a redis:// URL or an unknown or unreadable one (the URL masked)."""
    scheme = url.partition("://")[0].lower()
    base, q, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True) if q else []
    given = {k.lower(): v for k, v in pairs if k.lower().startswith("ssl")}
    rest = [(k, v) for k, v in pairs if not k.lower().startswith("ssl")]
    clean = base + ("?" + urlencode(rest) if rest else "")
    if scheme != "rediss":
        if given:
            raise LayerdiffError(f"broker URL {mask_url(url)}: TLS options ({', '.join(sorted(given))}) need a "
                                 "rediss:// URL", field="broker")
        return clean, None
    unknown = sorted(set(given) - set(TLS_OPTIONS))
    if unknown:
        raise LayerdiffError(f"broker URL {mask_url(url)}: unknown TLS option {unknown[0]} (known: "
                             f"{', '.join(TLS_OPTIONS)})", field="broker")
    reqs = given.get("ssl_cert_reqs", "required").strip().lower()
    if reqs not in _CERT_REQS:
        raise LayerdiffError(f"broker URL {mask_url(url)}: ssl_cert_reqs={reqs} is not one of required, optional, "
                             "none", field="broker")
    opts: dict = {"ssl_cert_reqs": _CERT_REQS[reqs]}
    for key in ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile"):
        if given.get(key):
            path = os.path.expanduser(given[key])
            if not os.access(path, os.R_OK):
                raise LayerdiffError(f"broker URL {mask_url(url)}: {key} {path} cannot be read", field="broker")
            opts[key] = path
    check = given.get("ssl_check_hostname", "false" if opts["ssl_cert_reqs"] == ssl.CERT_NONE else "true")
    opts["ssl_check_hostname"] = check.strip().lower() not in ("false", "0", "no", "off")
    return clean, opts


def redis_error_text(url: str, e: BaseException) -> str:
    """What a Redis client error means, in one line naming the masked URL."""
    text = " ".join(str(e).split()) or type(e).__name__
    low = text.lower()
    scheme = url.partition("://")[0].lower()
    if isinstance(e, redis.AuthenticationError) or any(
            w in low for w in ("noauth", "wrongpass", "invalid password", "invalid username-password",
                               "authentication required")):
        hint = "the credentials in the URL are missing or wrong (redis://:PASSWORD@host or redis://USER:PASSWORD@host)"
    elif "ssl" in low or "certificate" in low or "handshake" in low:
        hint = ("the TLS handshake failed: the server speaks no TLS there (use redis://), or its certificate is not "
                "trusted (ssl_ca_certs=PATH in the URL's query)" if scheme == "rediss" else
                "TLS trouble on a plain redis:// URL")
    elif scheme == "redis" and any(w in low for w in ("closed by server", "connection reset", "timeout reading",
                                                      "timed out", "protocol error")):
        hint = "the connection was dropped: if that port speaks TLS, use a rediss:// URL"
    else:
        return f"{type(e).__name__}: {text}"
    return f"{type(e).__name__}: {text} ({hint})"


class TensorStore:
    def __init__(self, url: str, ttl_s: int = 3600) -> None:
        self.url = mask_url(url)       # in messages: never the password
        self.ttl_s = ttl_s
        clean, tls = redis_connection(url)
        self.r = redis.Redis.from_url(clean, socket_timeout=30, socket_connect_timeout=5, health_check_interval=10,
                                      **(tls or {}))

    def close(self) -> None:
        """Close this store's connections to Redis now (idempotent; a call
        made afterwards opens a new one). A store made for one job or one
        check is closed by whoever made it, never left to the garbage
        collector."""
        self.r.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise UnavailableError(f"broker {self.url} refuses connections: {redis_error_text(self.url, e)}",
                                   field="broker") from e

    # ------------------------------------------------------------ job marker
    def open_job(self, job_id: str) -> None:
        self.r.set(_job_key(job_id), b"1", ex=self.ttl_s)

    def job_alive(self, job_id: str) -> bool:
        return bool(self.r.exists(_job_key(job_id)))

    def drop_job(self, job_id: str) -> None:
        keys = list(self.r.scan_iter(match=f"{_job_key(job_id)}*", count=1000))
        for i in range(0, len(keys), 500):
            self.r.delete(*keys[i:i + 500])

    # --------------------------------------------------------------- tensors
    def put(self, job_id: str, name: str, arr: np.ndarray) -> dict:
        """Store an array; returns the reference a task carries."""
        if not arr.flags.c_contiguous:   # (ascontiguousarray would also turn a scalar into shape (1,))
            arr = np.ascontiguousarray(arr)
        key = f"{_job_key(job_id)}:{name}"
        raw = arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")   # .data: the array's memoryview
        parts = max(1, -(-arr.nbytes // PART_BYTES))
        pipe = self.r.pipeline(transaction=False)
        for i in range(parts):
            pipe.set(f"{key}:{i}", raw[i * PART_BYTES:(i + 1) * PART_BYTES], ex=self.ttl_s)
        pipe.execute()
        return {"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape), "nbytes": arr.nbytes, "parts": parts}

    def get(self, ref: dict) -> np.ndarray:
        """Read a referenced array back, refusing anything whose size or type
        does not match the reference."""
        key = ref.get("key", "?")
        dtype = ref.get("dtype")
        if dtype not in ALLOWED_DTYPES:
            raise LayerdiffError(f"dtype {dtype!r} is not allowed", field=key)
        shape = tuple(int(s) for s in ref.get("shape", ()))
        nbytes = int(ref.get("nbytes", -1))
        if nbytes != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise LayerdiffError(f"shape {shape} of {dtype} does not make {nbytes} bytes", field=key)
        if "flight" in ref:
            return fetch_flight(ref, nbytes).view(dtype).reshape(shape)
        parts = int(ref.get("parts", 1))
        values = self.r.mget([f"{key}:{i}" for i in range(parts)])
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise PayloadError(f"payload missing from the store (part {missing[0]} of {parts}; expired, deleted "
                               "or the store restarted)", source="store", at=self.url, key=key,
                               cause="payload missing (expired, deleted or the store restarted)")
        # every part is there (checked above), as bytes: the client does not decode responses
        chunks = cast("list[bytes]", values)
        got = sum(len(v) for v in chunks)
        if got != nbytes:
            raise PayloadError(f"payload truncated: {got} of {nbytes} bytes", source="store", at=self.url, key=key,
                               cause=f"payload truncated ({got} of {nbytes} bytes)")
        buf = chunks[0] if parts == 1 else b"".join(chunks)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


# ----------------------------------------------------------------- large tensors
# Redis moves about 0.4 GB/s here, an Arrow Flight stream about 2 GB/s: large
# tensors stay in the analyzer's memory and workers pull them from its Flight
# endpoint instead.
FLIGHT_MIN_BYTES = int(os.environ.get("LAYERDIFF_FLIGHT_MIN_BYTES", str(1024 * 1024)))
_FLIGHT_CHUNK = 4 * 1024 * 1024
_BLOB_SCHEMA = pa.schema([("data", pa.binary())])


class TensorEndpoint(flight.FlightServerBase):
    """Serves the analyzer's in-flight tensors to workers: DoGet(key)."""

    def __init__(self, host: str, advertise: str, port: int = 0, security: ServerSecurity | None = None) -> None:
        """``security``: TLS (workers verify it with LAYERDIFF_TLS_CA; its
        certificate must name the advertised host) and the tokens workers
        must send; a non-loopback host without them is refused unless
        LAYERDIFF_INSECURE=1."""
        security = security if security is not None else ServerSecurity()
        security.check_exposure(host, "tensor endpoint")
        super().__init__(f"{security.flight_scheme()}://{host}:{port}", middleware=flight_middleware(security),
                         **security.flight_kwargs())
        self.address = f"{advertise}:{self.port}"
        self._arrays: dict[str, np.ndarray] = {}
        # the jobs this analyzer runs, with the nonce each one's tasks carry:
        # the record a worker checks a task against (JOB_ACTION), not a key
        # anyone who can write to Redis can make
        self._jobs: dict[str, str] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self.serve, name="tensor-endpoint", daemon=True).start()

    def put(self, key: str, arr: np.ndarray) -> dict:
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        with self._lock:
            self._arrays[key] = arr
        return {"key": key, "flight": self.address, "dtype": arr.dtype.name, "shape": list(arr.shape),
                "nbytes": arr.nbytes, "parts": 1}

    def open_job(self, job_id: str, nonce: str) -> None:
        with self._lock:
            self._jobs[job_id] = nonce

    def close_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def do_action(self, context, action):
        if action.type != JOB_ACTION:
            raise KeyError(f"no action {action.type!r} here")
        try:
            asked = json.loads(action.body.to_pybytes()[:4096])
            job, nonce = str(asked["job"]), str(asked["nonce"])
        except (ValueError, KeyError, TypeError):
            raise KeyError("a job check names a job and its nonce") from None
        with self._lock:
            live = self._jobs.get(job)
        if live is None or not hmac.compare_digest(live.encode(), nonce.encode()):
            raise KeyError(f"job {job} is not running on this analyzer")
        return [b"live"]

    def drop(self, prefix: str) -> None:
        with self._lock:
            for k in [k for k in self._arrays if k.startswith(prefix)]:
                del self._arrays[k]

    def do_get(self, context, ticket):
        key = ticket.ticket.decode("utf-8", "replace")
        with self._lock:
            arr = self._arrays.get(key)
        if arr is None:
            raise KeyError(f"tensor {key!r} is not held by this analyzer (job ended?)")
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)

        def batches():
            for off in range(0, max(raw.size, 1), _FLIGHT_CHUNK):
                piece = pa.py_buffer(raw[off:off + _FLIGHT_CHUNK])
                offsets = pa.py_buffer(np.array([0, piece.size], np.int32))
                yield pa.RecordBatch.from_arrays(
                    [pa.Array.from_buffers(pa.binary(), 1, [None, offsets, piece])], schema=_BLOB_SCHEMA)

        return flight.GeneratorStream(_BLOB_SCHEMA, batches())


_endpoint: TensorEndpoint | None = None
_endpoint_lock = threading.Lock()


_hosts: tuple[str, str] | None = None     # (listen, advertise), decided at the analyzer's start


def _route_to(host: str) -> str:
    """This host's address on the route to ``host``."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))       # no packet is sent: this only picks the route
        return s.getsockname()[0]


def configure_tensor_endpoint(broker_url: str) -> tuple[str, str]:
    """Where the endpoint listens and what address workers are given:
    LAYERDIFF_TENSOR_HOST / LAYERDIFF_ADVERTISE_HOST, else, when the broker
    is on another host, this host's address on the route to it (workers
    reach the broker, so they share its network), else loopback. An
    advertised loopback address with a broker elsewhere is refused here, at
    the analyzer's start: workers on other hosts could not reach it."""
    global _hosts
    from layerdiff.common.security import is_loopback

    broker = broker_host(broker_url) or ""
    remote = bool(broker) and not is_loopback(broker)
    host = os.environ.get("LAYERDIFF_TENSOR_HOST", "").strip()
    advertise = os.environ.get("LAYERDIFF_ADVERTISE_HOST", "").strip()
    try:
        derived = _route_to(broker) if remote else "127.0.0.1"
    except OSError as e:
        raise UnavailableError(f"no route to the broker's host {broker} ({e.strerror or e})",
                               field="broker") from None
    host = host or derived
    advertise = advertise or (host if host not in ("0.0.0.0", "::") else derived)
    if remote and is_loopback(advertise):
        raise LayerdiffError(f"workers reach the broker at {broker}, but would be sent to the tensor endpoint "
                             f"at {advertise}, their own loopback: set LAYERDIFF_TENSOR_HOST (and "
                             "LAYERDIFF_ADVERTISE_HOST) to an address they reach, or leave both unset",
                             field="LAYERDIFF_TENSOR_HOST")
    if not is_loopback(host):      # TLS and tokens, as for every endpoint on the network
        ServerSecurity.from_env().check_exposure(host, "tensor endpoint")
    _hosts = (host, advertise)
    return _hosts


def tensor_endpoint() -> TensorEndpoint:
    """This process's endpoint, started on first use, where
    configure_tensor_endpoint decided (else LAYERDIFF_TENSOR_HOST, loopback);
    LAYERDIFF_TENSOR_PORT chooses its port (default: a free one)."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            host = os.environ.get("LAYERDIFF_TENSOR_HOST", "127.0.0.1")
            host, advertise = _hosts or (host, os.environ.get("LAYERDIFF_ADVERTISE_HOST", host))
            _endpoint = TensorEndpoint(host, advertise, int(os.environ.get("LAYERDIFF_TENSOR_PORT", "0")),
                                       ServerSecurity.from_env())
        return _endpoint


def drop_from_endpoint(prefix: str) -> None:
    """Forget held tensors under ``prefix``; nothing to do if no endpoint runs."""
    if _endpoint is not None:
        _endpoint.drop(prefix)


# A worker keeps one client per analyzer endpoint it reads from, reused from
# task to task (a connection per fetch would cost a handshake every time). An
# analyzer listens on a new port each time it starts, so a long-lived worker
# would otherwise hold one client per analyzer it ever served: beyond
# MAX_ENDPOINT_CLIENTS the least recently used is let go (its connection ends
# as soon as no fetch in progress uses it).
MAX_ENDPOINT_CLIENTS = 8


def _worker_security() -> ClientSecurity:
    """A worker's token and TLS settings towards the analyzers' endpoints
    (LAYERDIFF_TOKEN, LAYERDIFF_TLS_CA...), read once."""
    global _security
    if _security is None:
        _security = ClientSecurity.from_env()
    return _security


_security: ClientSecurity | None = None
_clients: dict[str, flight.FlightClient] = {}    # in order of use, the most recent last
_clients_lock = threading.Lock()


def _endpoint_client(location: str) -> flight.FlightClient:
    with _clients_lock:
        client = _clients.pop(location, None)
        if client is None:
            security = _worker_security()
            client = flight.connect(security.flight_location(location), **security.flight_connect_kwargs())
        _clients[location] = client
        while len(_clients) > MAX_ENDPOINT_CLIENTS:
            del _clients[next(iter(_clients))]
    return client


JOB_ACTION = "layerdiff.job"


def job_running(location: str, job_id: str, nonce: str) -> str:
    """'' where the analyzer whose endpoint is at ``location`` runs job
    ``job_id`` with this nonce; else why not (it ended, it never ran there).
    An endpoint that cannot be reached is a PayloadError (source
    "endpoint"), as a tensor that cannot be fetched from it: the analyzer
    then names the endpoint and what to set."""
    from layerdiff.collector.service import flight_message

    try:
        client = _endpoint_client(location)
        list(client.do_action(flight.Action(JOB_ACTION, json.dumps({"job": job_id, "nonce": nonce}).encode()),
                              flight.FlightCallOptions(timeout=15, headers=_worker_security().flight_headers())))
        return ""
    except (flight.FlightUnavailableError, flight.FlightTimedOutError, OSError) as e:
        text = flight_message(e)
        raise PayloadError(f"the analyzer's endpoint at {location} cannot be reached to check job {job_id}: {text}",
                           source="endpoint", at=location, key="", cause=short_cause(text)) from None
    except (pa.ArrowException, KeyError) as e:
        return f"job {job_id} is not running on the analyzer at {location} ({short_cause(flight_message(e))})"


def fetch_flight(ref: dict, nbytes: int) -> np.ndarray:
    location = ref["flight"]
    client = _endpoint_client(location)
    reader = None
    try:
        reader = client.do_get(flight.Ticket(ref["key"].encode()),
                               flight.FlightCallOptions(timeout=300, headers=_worker_security().flight_headers()))
        out = np.empty(nbytes, dtype=np.uint8)
        got = 0
        for chunk in reader:
            col = chunk.data.column(0)
            bufs = col.buffers()
            offs = np.frombuffer(bufs[1], np.int32)[col.offset:col.offset + len(col) + 1]
            data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
            for i in range(len(col)):
                piece = data[offs[i]:offs[i + 1]]
                if got + piece.size > nbytes:
                    raise PayloadError(f"payload larger than the declared {nbytes} bytes", source="endpoint",
                                       at=location, key=ref["key"], cause=f"payload larger than {nbytes} bytes")
                out[got:got + piece.size] = piece
                got += piece.size
    except (pa.ArrowException, KeyError) as e:
        from layerdiff.collector.service import flight_message

        text = flight_message(e)
        raise PayloadError(f"payload missing from the analyzer at {location}: {text}", source="endpoint",
                           at=location, key=ref["key"], cause=short_cause(text)) from None
    except BaseException:
        if reader is not None:
            reader.cancel()   # read no further than the failure
        raise
    finally:
        # The reader holds its call and the call the connection: let go of it
        # here, not when an exception's traceback (this frame) is freed.
        reader = None
    if got != nbytes:
        raise PayloadError(f"payload truncated: {got} of {nbytes} bytes", source="endpoint", at=location,
                           key=ref["key"], cause=f"payload truncated ({got} of {nbytes} bytes)")
    return out
