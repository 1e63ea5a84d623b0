"""How many files a layerdiff process may hold open, set as it starts.

A dump's tensors are read by mapping their files, and each mapping holds a
file descriptor of its own for as long as its tensor is kept (Python's
mmap keeps a duplicate of the one it was given): a golden dump of a few
thousand tensors, kept for a whole job, holds that many. Two things follow.

- The soft limit many systems start a shell with (1024) is below that: the
  job would fail half-way with "Too many open files" although the hard
  limit allows far more. ``allow_open_files`` raises the soft limit to the
  hard one, as the Go runtime and other servers do at start.
- The kernel's table of a process's descriptors grows by doubling, and a
  table grown while the process has threads waits for an RCU grace period
  first (a two-dump job stalled 12 ms, both cores idle, at its 256th
  descriptor). Grown once while the process is still alone it costs
  nothing, so ``allow_open_files`` sizes it for ``TABLE_SLOTS``
  descriptors up front: call it before anything starts a thread (numpy's
  BLAS starts its own on import).

What cannot be raised is said plainly where a job runs out
(``too_many_open_files``, jobs.runner).
"""
from __future__ import annotations

import errno
import fcntl
import os

from layerdiff.common.errors import os_error_in

try:
    import resource
except ImportError:     # not a POSIX system: nothing to raise
    resource = None  # type: ignore[assignment]

# descriptors the table is sized for at start: 32 KiB of the kernel's memory
TABLE_SLOTS = 4096
_NR_OPEN = 1 << 20


def allow_open_files(slots: int = TABLE_SLOTS) -> int:
    """The soft limit on open files raised to the hard one, and the
    descriptor table sized for ``slots`` (or the limit, if lower) while
    the caller is alone. Returns the soft limit now in force (-1: not
    known). Never raises: a process that cannot raise it runs as before."""
    if resource is None:
        return -1
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # an unlimited hard limit: as many as Linux lets a process have by default (nr_open)
        want = _NR_OPEN if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (OSError, ValueError):
        soft = open_files_limit()
    _grow_table((slots if soft < 0 or soft == resource.RLIM_INFINITY else min(slots, soft)) - 1)
    return soft


def _grow_table(fd: int) -> None:
    """The table made to hold descriptor ``fd``: a duplicate of one this
    process holds, placed at ``fd`` or above (never over one in use), and
    closed again; the table keeps its size."""
    if fd < 3:
        return
    for held in (0, 1, 2):
        try:
            dup = fcntl.fcntl(held, fcntl.F_DUPFD_CLOEXEC, fd)
        except OSError as e:
            if e.errno == errno.EBADF:
                continue        # a daemon's closed standard stream: try the next
            return              # EINVAL, EMFILE: the limit is lower than asked
        os.close(dup)
        return


def open_files_limit() -> int:
    """The soft limit on open files (-1: none, or not known)."""
    if resource is None:
        return -1
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return -1
    return -1 if soft == resource.RLIM_INFINITY else soft


def too_many_open_files(e: BaseException | None) -> bool:
    """An OSError saying this process (EMFILE) or the system (ENFILE) has
    no descriptor left, raised directly or as the cause of what was."""
    return os_error_in(e, (errno.EMFILE, errno.ENFILE), ("Too many open files",))
