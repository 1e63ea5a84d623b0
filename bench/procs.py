"""Processes the benches start: services on free ports, waiting, and the
task messages the broker actually carries."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis


def serve(service: str, workdir, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`layerdiff <service> serve --port 0`; returns (process, address)."""
    proc = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", service, "serve", "--port", "0",
                             "--workdir", str(workdir)], stdout=subprocess.PIPE, text=True, env=env)
    return proc, re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)


def wait(pred, timeout: float = 60) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError("timed out")


class TaskPushes:
    """Sizes of the task messages pushed to a Redis broker while in the block
    (Redis MONITOR: it slows the server, so never time a run inside it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sizes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with redis.Redis(port=self.port).monitor() as m:
            for cmd in m.listen():
                if cmd["command"].upper().startswith("LPUSH"):
                    self.sizes.append(len(cmd["command"]))
                if self._stop.is_set():
                    return

    def __enter__(self) -> TaskPushes:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        redis.Redis(port=self.port).ping()   # one more command so the monitor sees the stop
        self._thread.join(timeout=5)


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the process's open sockets."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def connections_to(pid: int, port: int) -> int:
    """Established TCP connections of ``pid`` to remote ``port``."""
    inodes = socket_inodes(pid)
    n = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                n += 1
    return n
