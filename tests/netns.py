"""Hosts of their own for the tests, made with network namespaces: a bridge
in the root namespace (the analyzer's host) and one namespace joined to it
by a veth pair. Every name carries the test process's id and a role letter,
so runs and modules never collide, and leftovers of killed runs are found
and removed. Root and iproute2 are needed (CI has both)."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ports import worker_index

ROOT = Path(__file__).resolve().parents[1]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def netns_usable() -> str | None:
    """Why the namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        ip("netns", "list")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is unavailable: {getattr(e, 'stderr', '') or e}"
    return None


def require_netns() -> None:
    """Skip the test where namespaces cannot be made; in CI that is a failure."""
    why = netns_usable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs as root with iproute2, yet: {why}")
        pytest.skip(why)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.231.0.0/16 that no address or route here uses."""
    used = []
    for link in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        if route.get("dst") not in (None, "default"):
            used.append(ipaddress.ip_network(route["dst"], strict=False))
    # each xdist worker starts in a band of its own: two workers never
    # choose the same free /24 before either has made it
    start = 40 + (worker_index() * 50 + os.getpid() % 50) % 200
    for i in range(256):
        net = ipaddress.ip_network(f"10.231.{(start + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 under 10.231.0.0/16")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_leftovers() -> None:
    """Namespaces and links of runs that were killed before their teardown
    (each name carries its run's process id, which no longer exists)."""
    for line in ip("netns", "list").stdout.splitlines():
        m = re.fullmatch(r"ld-[a-z](\d+)", line.split()[0]) if line.split() else None
        if m and not _pid_alive(int(m.group(1))):
            ip("netns", "delete", m.group(0), check=False)
    for link in json.loads(ip("-j", "link", "show").stdout or "[]"):
        m = re.fullmatch(r"ld(?:br|b[a-z]|v[a-z]?)(\d+)[hn]?", link.get("ifname", ""))
        if m and not _pid_alive(int(m.group(1))):
            ip("link", "delete", link["ifname"], check=False)


def _delete_all(steps: list[tuple[str, ...]]) -> list[str]:
    """Run each ``ip`` deletion; the problems met, beyond what was already gone."""
    problems = []
    for args in steps:
        res = ip(*args, check=False)
        if res.returncode != 0 and "No such file" not in res.stderr and "Cannot find device" not in res.stderr \
                and "does not exist" not in res.stderr:
            problems.append(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return problems


class Hosts:
    """A bridge in the root namespace with ``bridge_ip`` and one namespace,
    another host at ``peer_ip``, joined by a veth pair. ``delete`` removes
    whatever of it exists; ``cut``/``mend`` take the link down and up."""

    def __init__(self, role: str = "w") -> None:
        tag = str(os.getpid())
        self.bridge = f"ldb{role}{tag}"
        self.ns = f"ld-{role}{tag}"
        self.veth_host, self.veth_ns = f"ldv{role}{tag}h", f"ldv{role}{tag}n"
        net = _free_subnet()
        self.prefix = net.prefixlen
        self.bridge_ip, self.peer_ip = str(net.network_address + 1), str(net.network_address + 2)

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_ip}/{self.prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        ip("netns", "add", self.ns)
        ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
        ip("link", "set", self.veth_host, "master", self.bridge)
        ip("link", "set", self.veth_host, "up")
        ip("link", "set", self.veth_ns, "netns", self.ns)
        ip("-n", self.ns, "addr", "add", f"{self.peer_ip}/{self.prefix}", "dev", self.veth_ns)
        ip("-n", self.ns, "link", "set", self.veth_ns, "up")
        ip("-n", self.ns, "link", "set", "lo", "up")   # a host of its own: 127.0.0.1 answers, and refuses
        ping = subprocess.run(["ip", "netns", "exec", self.ns, "ping", "-c", "1", "-W", "2", self.bridge_ip],
                              capture_output=True, text=True, timeout=20) if shutil.which("ping") else None
        assert ping is None or ping.returncode == 0, f"the namespace {self.ns} cannot reach the bridge: {ping.stdout}"

    def in_ns(self, *argv: str) -> list[str]:
        """A command line that runs ``argv`` on the other host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def cut(self) -> None:
        """Cut the cable: packets to and from the other host are dropped,
        no connection is reset (what a pulled cable or a dead switch does)."""
        ip("link", "set", self.veth_host, "down")

    def mend(self) -> None:
        ip("link", "set", self.veth_host, "up")

    def delete(self) -> list[str]:
        """Remove the namespace (and with it the veth pair) and the bridge;
        the problems met, if any."""
        return _delete_all([("netns", "delete", self.ns), ("link", "delete", self.veth_host),
                            ("link", "delete", self.bridge)])

    def exists(self) -> bool:
        return (self.ns in ip("netns", "list").stdout
                or ip("link", "show", self.bridge, check=False).returncode == 0
                or ip("link", "show", self.veth_host, check=False).returncode == 0)


class Network:
    """Several hosts of their own on one bridge: the root namespace (the
    client's host) at ``bridge_ip``, and a namespace per named host, at
    ``ip[name]``. ``run(name, *argv)`` is a command line that runs ``argv``
    on that host with a private, empty ``/tmp`` (``unshare --mount``), as a
    container would. Each host needs a letter of its own (the names carry
    it and the test process's id, which ``remove_leftovers`` relies on)."""

    def __init__(self, role: str, letters: dict[str, str]) -> None:
        tag = str(os.getpid())
        self.bridge = f"ldb{role}{tag}"
        net = _free_subnet()
        self.prefix = net.prefixlen
        self.bridge_ip = str(net.network_address + 1)
        self.ns = {name: f"ld-{k}{tag}" for name, k in letters.items()}
        self.veth = {name: (f"ldv{k}{tag}h", f"ldv{k}{tag}n") for name, k in letters.items()}
        self.ip = {name: str(net.network_address + 2 + i) for i, name in enumerate(letters)}

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_ip}/{self.prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for name, ns in self.ns.items():
            host, peer = self.veth[name]
            ip("netns", "add", ns)
            ip("link", "add", host, "type", "veth", "peer", "name", peer)
            ip("link", "set", host, "master", self.bridge)
            ip("link", "set", host, "up")
            ip("link", "set", peer, "netns", ns)
            ip("-n", ns, "addr", "add", f"{self.ip[name]}/{self.prefix}", "dev", peer)
            ip("-n", ns, "link", "set", peer, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def run(self, name: str, *argv: str) -> list[str]:
        # What lies under /tmp and must stay visible (a checkout and its
        # virtualenv there, as in CI) is bound back from the original /tmp,
        # reached through a descriptor opened before the tmpfs hides it.
        kept = (Path(p).resolve() for p in (ROOT, sys.prefix))
        keep = sorted({str(p.relative_to("/tmp")) for p in kept if Path("/tmp") in p.parents})
        binds = "".join(f' && mkdir -p "/tmp/{k}" && mount --no-canonicalize --bind "/proc/self/fd/3/{k}" '
                        f'"/tmp/{k}"' for k in keep)
        script = f'exec 3</tmp && mount -t tmpfs tmpfs /tmp{binds} && exec 3<&- && exec "$0" "$@"'
        return ["ip", "netns", "exec", self.ns[name], "unshare", "--mount", "sh", "-c", script, *argv]

    def delete(self) -> list[str]:
        steps = [("netns", "delete", ns) for ns in self.ns.values()]
        steps += [("link", "delete", h) for h, _ in self.veth.values()] + [("link", "delete", self.bridge)]
        return _delete_all(steps)

    def exists(self) -> bool:
        listed = ip("netns", "list").stdout
        return any(ns in listed for ns in self.ns.values()) or \
            ip("link", "show", self.bridge, check=False).returncode == 0
