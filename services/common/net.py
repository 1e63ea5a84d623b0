"""gRPC channel and server settings shared by every process."""
from __future__ import annotations

import socket
from concurrent import futures

import grpc

# Payload per message of a stream. 1-4 MiB messages stream faster than larger
# ones (fewer fresh allocations); the hard limit below leaves headroom.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_server(max_workers: int = 16) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Bind an insecure port; port 0 picks a free one. Returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def wait_ready(ch: grpc.Channel, timeout: float = 10.0) -> None:
    grpc.channel_ready_future(ch).result(timeout=timeout)
