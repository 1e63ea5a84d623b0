"""``layerdiff health ADDRESS``: a container probe.

Asks the service's standard health (grpc.health.v1, as Kubernetes and load
balancers do) and, where the address is a collector's Flight endpoint, its
health action instead. Prints one line; exit status 0 when SERVING, 1 when
the service answers but is not ready, 3 when it does not answer. TLS and the
token come from LAYERDIFF_TLS_CA / LAYERDIFF_TLS_CERT / LAYERDIFF_TLS_KEY and
LAYERDIFF_TOKEN, as for every client.
"""
from __future__ import annotations

import grpc

from layerdiff.common.net import channel
from layerdiff.common.security import ClientSecurity, with_token

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 3


def probe(address: str, timeout: float = 5.0, service: str = "") -> tuple[int, str]:
    """(exit status, one line) for the service at ``address``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    security = ClientSecurity.from_env()
    ch = channel(address, security)
    try:
        stub = health_pb2_grpc.HealthStub(with_token(ch, security))
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:     # a collector's Flight endpoint
            return _flight(address, timeout, security)
        return UNREACHABLE, f"{address}: {e.code().name}: {' '.join((e.details() or '').split())}"
    finally:
        ch.close()
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING), \
        f"{address}: {name}"


def _flight(address: str, timeout: float, security: ClientSecurity) -> tuple[int, str]:
    from layerdiff.collector.service import CollectorClient
    from layerdiff.common.errors import LayerdiffError

    client = CollectorClient(address, security=security)
    try:
        reply = client.health(timeout=timeout)
    except LayerdiffError as e:
        return UNREACHABLE, f"{address}: {e}"
    except Exception as e:   # the transport's own failure, in one line
        return UNREACHABLE, f"{address}: {' '.join(str(e).split()[:30])}"
    finally:
        client.close()
    return (SERVING if reply.status == "SERVING" else NOT_SERVING), f"{address}: {reply.status} ({reply.service})"
