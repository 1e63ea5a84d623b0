"""Ports and subnets for what a test starts itself (a redis-server, a
listener nobody answers), safe when pytest-xdist runs tests side by side.

A port chosen by binding port 0 lies in the kernel's ephemeral range, from
which every later port-0 bind and every outgoing connection also draws: the
port can be taken between choosing and binding it. These ports come from
below that range instead, a block of its own for each xdist worker, in
turn, and each is checked free by binding it."""
from __future__ import annotations

import itertools
import os
import random
import socket

_LOW, _BLOCK = 20000, 1500      # worker k takes ports [20000 + 1500 k, 20000 + 1500 (k + 1))


def worker_index() -> int:
    """0 for the first (or only) test process, k for xdist's gw<k>."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def _ceiling() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_start = _LOW + (worker_index() * _BLOCK) % max(_ceiling() - _LOW - _BLOCK, _BLOCK)
# a random start within the block: a rerun does not meet the previous run's ports in TIME_WAIT
_turn = itertools.cycle(range(_start, _start + _BLOCK))
for _ in range(random.randrange(_BLOCK)):
    next(_turn)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at ``host`` now, from this worker's block."""
    for port in itertools.islice(_turn, _BLOCK):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_start}..{_start + _BLOCK - 1}")
