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


def status_bytes(pid: int, field: str = "VmRSS:") -> int:
    """A /proc/PID/status size (VmRSS, VmHWM) in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field)), 0)
    except OSError:
        return 0


def tree(pid: int) -> list[int]:
    """The process and its descendants, now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def bytecode_ready() -> None:
    """Every module of the package compiled ahead, as an installed package
    is: a timed command never compiles source (under PYTHONDONTWRITEBYTECODE
    an edited module would be compiled again on every run, and counted)."""
    import compileall

    import layerdiff

    compileall.compile_dir(os.path.dirname(layerdiff.__file__), quiet=1)


def timed(cmd: list[str], err_path: Path | None = None, **kw) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one whole command. The
    peak is the largest sum of the resident sets of the process and its
    children (a tool that works in worker processes counts them), polled
    every 20 ms, never less than the process's own high-water mark (wait4's
    figure would count this process's memory at fork time). The wall ends
    when the process is reaped, not at the next poll (a poll every 20 ms
    added 10 ms on average to a one-second command). Its stderr goes to
    ``err_path``, else is printed when it fails (an exit status past 1)."""
    with open(err_path, "wb") if err_path is not None else open(os.devnull, "wb") as sink:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                stderr=sink if err_path is not None else subprocess.PIPE, **kw)
        err: list[bytes] = []
        if err_path is None:
            threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True).start()
        ended = threading.Event()
        end: list[float] = []

        def reap() -> None:
            proc.wait()
            end.append(time.perf_counter())
            ended.set()

        threading.Thread(target=reap, daemon=True).start()
        peak = 0
        while not ended.is_set():
            peak = max(peak, sum(status_bytes(p) for p in tree(proc.pid)), status_bytes(proc.pid, "VmHWM:"))
            ended.wait(0.02)
        wall = end[0] - t
    if err_path is None and proc.returncode not in (0, 1):
        print((err[0] if err else b"").decode(errors="replace")[-2000:], file=sys.stderr)
    return wall, peak, proc.returncode


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
