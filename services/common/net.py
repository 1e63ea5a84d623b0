"""gRPC channel and server settings shared by every process.

Liveness: every channel made by :func:`channel` pings its server over an
idle connection (HTTP/2 keepalive), so a call on a link that was cut (a
watch that may last hours has no deadline) fails within
``keepalive + keepalive_timeout`` seconds instead of hanging; servers made by
:func:`make_server` accept those pings (never answering a well-behaved
client with GOAWAY too_many_pings), and ping their clients the same way. The settings come from the
environment, read when a channel or server is made:

=============================== ==================================================== =======
variable                        meaning                                              default
=============================== ==================================================== =======
LAYERDIFF_KEEPALIVE_S           a client pings an idle connection this often         10
LAYERDIFF_KEEPALIVE_TIMEOUT_S   a ping unanswered this long closes the connection    10
LAYERDIFF_MIN_PING_INTERVAL_S   a server accepts pings this often at most            min(5, LAYERDIFF_KEEPALIVE_S)
LAYERDIFF_MAX_PING_STRIKES      pings faster than that a server tolerates before     0 (never)
                                it closes the connection (GOAWAY too_many_pings)
LAYERDIFF_CONNECT_TIMEOUT_S     a client gives up on a server it cannot reach        15
                                after this long
=============================== ==================================================== =======
"""
from __future__ import annotations

import math
import os
import socket
from concurrent import futures

import grpc

from layerdiff.common.sizes import MAX_MESSAGE_BYTES

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


KEEPALIVE_S_DEFAULT = 10.0
KEEPALIVE_TIMEOUT_S_DEFAULT = 10.0
MIN_PING_INTERVAL_S_DEFAULT = 5.0
MAX_PING_STRIKES_DEFAULT = 0
CONNECT_TIMEOUT_S_DEFAULT = 15.0


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; an unset, empty or
    unusable value is the default (a liveness setting must never stop a
    process from starting)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        return default
    return v if math.isfinite(v) and v > 0 else default


def keepalive_settings() -> dict:
    """The keepalive settings in effect (seconds; strikes a count)."""
    keepalive = _env_seconds("LAYERDIFF_KEEPALIVE_S", KEEPALIVE_S_DEFAULT)
    timeout = _env_seconds("LAYERDIFF_KEEPALIVE_TIMEOUT_S", KEEPALIVE_TIMEOUT_S_DEFAULT)
    min_ping = _env_seconds("LAYERDIFF_MIN_PING_INTERVAL_S", min(MIN_PING_INTERVAL_S_DEFAULT, keepalive))
    raw = os.environ.get("LAYERDIFF_MAX_PING_STRIKES", "").strip()
    try:
        strikes = max(0, int(raw)) if raw else MAX_PING_STRIKES_DEFAULT
    except ValueError:
        strikes = MAX_PING_STRIKES_DEFAULT
    return {"keepalive_s": keepalive, "keepalive_timeout_s": timeout, "min_ping_interval_s": min_ping,
            "max_ping_strikes": strikes}


def connect_timeout() -> float:
    """Seconds a client waits for a server it cannot reach."""
    return _env_seconds("LAYERDIFF_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S_DEFAULT)


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def client_options() -> list[tuple[str, int]]:
    k = keepalive_settings()
    return GRPC_OPTIONS + [
        ("grpc.keepalive_time_ms", _ms(k["keepalive_s"])),
        ("grpc.keepalive_timeout_ms", _ms(k["keepalive_timeout_s"])),
        # a ping sent while a call is open waits for its answer this long
        # (gRPC's own default is a minute, whatever keepalive_timeout says)
        ("grpc.http2.ping_timeout_ms", _ms(k["keepalive_timeout_s"])),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),     # keep pinging through an hours-long silent watch
    ]


def server_options() -> list[tuple[str, int]]:
    k = keepalive_settings()
    return GRPC_OPTIONS + [
        # gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: the
        # shortest interval between pings received on a connection without data
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(k["min_ping_interval_s"])),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", k["max_ping_strikes"]),
        # the server pings its clients too: a watch whose client vanished
        # behind a cut link gives its worker thread back
        ("grpc.keepalive_time_ms", _ms(k["keepalive_s"])),
        ("grpc.keepalive_timeout_ms", _ms(k["keepalive_timeout_s"])),
        ("grpc.http2.ping_timeout_ms", _ms(k["keepalive_timeout_s"])),
    ]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_server(max_workers: int = 16, interceptors: list | None = None) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=server_options(),
                       interceptors=interceptors or None)


def bind(server: grpc.Server, host: str, port: int, security=None) -> int:
    """Bind a port, over TLS when ``security`` (security.ServerSecurity) has a
    certificate; port 0 picks a free one. Returns the bound port."""
    if security is not None and security.tls:
        bound = server.add_secure_port(f"{host}:{port}", security.grpc_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound


def channel(address: str, security=None) -> grpc.Channel:
    """A channel with the message limits and keepalive above: over TLS and
    with the bearer token where ``security`` (security.ClientSecurity) says."""
    if security is None:
        return grpc.insecure_channel(address, options=client_options())
    return security.channel(address, client_options())


def serve_health(server: grpc.Server):
    """grpc.health.v1 on ``server``: SERVING for the whole server ("") once
    started; the caller sets NOT_SERVING while it shuts down."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return servicer


def wait_ready(ch: grpc.Channel, timeout: float = 10.0) -> None:
    grpc.channel_ready_future(ch).result(timeout=timeout)
