"""The ``layerdiff`` subcommands that run or probe the services:
``collector serve``, ``analyzer serve``, ``worker`` and ``health``. What they
start is imported only when the subcommand runs, so a collector host never
loads the analyzer's stack.
"""
from __future__ import annotations

import signal


def _serve(server_cls, a, **kw) -> int:
    server = server_cls(host=a.host, port=a.port, workdir=a.workdir, **kw)
    print(f"{a.service} listening on {server.address}", flush=True)
    stop = lambda *_: server.stop(grace=2.0)  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.wait()
    return 0


def add_service(sub, name: str) -> None:
    p = sub.add_parser(name, help=f"the {name} service")
    s = p.add_subparsers(dest="action", required=True)
    serve = s.add_parser("serve", help=f"run the {name} gRPC service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    serve.add_argument("--workdir", help="private working directory (default: a temporary one)")
    serve.add_argument("--token-file", help="accepted tokens, one a line (default: LAYERDIFF_TOKEN_FILE)")
    serve.add_argument("--tls-cert", help="server certificate, PEM (default: LAYERDIFF_TLS_CERT)")
    serve.add_argument("--tls-key", help="its private key, PEM (default: LAYERDIFF_TLS_KEY)")
    serve.add_argument("--tls-ca", help="CA client certificates must chain to: mutual TLS (default: LAYERDIFF_TLS_CA)")
    if name == "collector":
        serve.add_argument("--dump-roots", help="':'-separated directories dumps may be read from "
                                                "(default: LAYERDIFF_DUMP_ROOTS)")
        serve.add_argument("--health-port", type=int, default=None,
                           help="also serve grpc.health.v1 on this port (default: LAYERDIFF_HEALTH_PORT; none)")
    if name == "analyzer":
        serve.add_argument("--broker", help="Redis URL: fan comparisons out to Celery workers "
                                            "(default: LAYERDIFF_BROKER_URL; none = local pool)")
    serve.set_defaults(func=_cmd_serve, service=name)


def _cmd_serve(a) -> int:
    from layerdiff.common.security import ServerSecurity

    security = ServerSecurity.from_env(token_file=a.token_file, cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca)
    if a.service == "collector":
        from layerdiff.collector.service import CollectorServer

        return _serve(CollectorServer, a, security=security, dump_roots=a.dump_roots, health_port=a.health_port)
    from layerdiff.analyzer.service import AnalyzerServer

    return _serve(AnalyzerServer, a, broker_url=a.broker, security=security)



def add_worker(sub) -> None:
    p = sub.add_parser("worker", help="a Celery worker for the analyzer's per-node comparisons",
                       description="Start a Celery worker that compares nodes for any analyzer using the same "
                                   "broker. It needs nothing but the broker address.")
    p.add_argument("--broker", help="Redis URL (default: LAYERDIFF_BROKER_URL)")
    p.add_argument("--max-cores", "--max_cores", type=int, help="worker processes (default: CPU count)")
    p.add_argument("--loglevel", default="WARNING")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(a) -> int:
    import os

    from layerdiff.analyzer.execute.local import default_cores
    from layerdiff.common.errors import LayerdiffError

    broker = a.broker or os.environ.get("LAYERDIFF_BROKER_URL")
    if not broker:
        raise LayerdiffError("no broker: give --broker or set LAYERDIFF_BROKER_URL", field="broker")
    os.environ["LAYERDIFF_BROKER_URL"] = broker
    from layerdiff.analyzer.execute.celery_app import QUEUE, make_app

    app = make_app(broker)
    app.worker_main(["worker", f"--loglevel={a.loglevel}", f"--concurrency={a.max_cores or default_cores()}",
                     "-Q", QUEUE, "--pool=prefork", "-n", f"layerdiff-{os.getpid()}@%h", "--without-gossip",
                     "--without-mingle"])
    return 0



def add_health(sub) -> None:
    p = sub.add_parser("health", help="probe a service's health (grpc.health.v1): exit 0 when SERVING, "
                                      "1 when not ready, 3 when it does not answer")
    p.add_argument("address", help="HOST:PORT of an analyzer, or of a collector (its Flight or health port)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.set_defaults(func=_cmd_health)


def _cmd_health(a) -> int:
    from layerdiff.client.health import probe

    status, line = probe(a.address, a.timeout)
    print(line, flush=True)
    return status
