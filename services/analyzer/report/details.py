"""The failing tensors' worst elements, ``{op_name}.csv`` each (index,
std_value, npu_value, abs_diff, relative_diff; at most ``diff_cnt`` rows).

A job fails hundreds of tensors at a time, and creating that many files is
the slowest part of its reports (the file system, not the interpreter, on
a disk where the last run's files were just deleted). So the files are
written while the job still compares, on a thread of their own, each as
soon as its comparison is recorded, under a provisional name: a file's
final name is only known once every row is (names are made unique in
execution order, which the stream need not follow). ``place`` then renames
them, which creates nothing.

The files are made by a process of their own (``_WRITER``): the worst rows
are handed to it as numbers, a batch at a time, and it formats, creates,
renames and deletes them. Made by a thread of this process, each of the
three system calls a file takes gave the interpreter lock away and took it
back from the threads comparing, a forced switch each time: 257 files cost
a two-dump job a ninth of its time (0.11 s), most of it in those switches.
Where no process can be started, the thread writes them itself.
"""
from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import threading
from pathlib import Path

DETAIL_COLUMNS = ["index", "std_value", "npu_value", "abs_diff", "relative_diff"]
_HEAD = ",".join(DETAIL_COLUMNS) + "\r\n"
_ROW = "%d,%.6g,%.6g,%.6g,%.6g\r\n"     # g6's format, a row at once: 100k cells a job
# provisional names: hidden, so that no safe_filename (never a leading dot) is one
_PROVISIONAL = ".detail-{}.csv"
# rows handed to the writer at a time: one wake-up of its thread for each
BATCH = 16


# The writer: frames on its standard input, a byte saying what each is:
#   W name rows  a detail file (rows: count, then the indices, then each
#                row's four values), named ``name`` in the directory
#   R old new    a rename;  U name  a deletion (gone already is no error)
# Names are of the directory itself (dir_fd). The first failure (a full
# disk) stops the writing and is said on its standard error as
# "errno<TAB>strerror<TAB>filename", its exit status 1; it reads on to the
# end. Run with -I -S: nothing of this environment's site or variables.
_WRITER = r"""
import os, signal, struct, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is its parent's to answer: it ends with its input
HEAD = %r
ROW = %r
FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
src = sys.stdin.buffer
def take(n):
    b = src.read(n)
    if len(b) != n:
        raise EOFError
    return b
def name():
    return take(struct.unpack("<H", take(2))[0]).decode("utf-8", "surrogateescape")
failed = None
try:
    folder = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
except OSError as e:
    sys.stderr.write("%%d\t%%s\t%%s" %% (e.errno or 0, e.strerror or str(e), sys.argv[1]))
    sys.exit(1)
try:
    while op := src.read(1):
        target = old = name()
        try:
            if op == b"W":
                n = struct.unpack("<I", take(4))[0]
                idx = struct.unpack("<%%dq" %% n, take(8 * n))
                v = struct.unpack("<%%dd" %% (4 * n), take(32 * n))
                if failed is None:
                    data = memoryview((HEAD + "".join([ROW %% (idx[i], *v[4 * i:4 * i + 4])
                                                       for i in range(n)])).encode("ascii"))
                    fd = os.open(target, FLAGS, 0o666, dir_fd=folder)
                    try:
                        while data:
                            data = data[os.write(fd, data):]
                    finally:
                        os.close(fd)
            elif op == b"R":
                target = name()         # the file it fails to place is named by its final name
                try:
                    if failed is not None:
                        raise FileExistsError       # not placed after a failure: nothing provisional stays
                    os.replace(old, target, src_dir_fd=folder, dst_dir_fd=folder)
                except OSError:
                    try:
                        os.unlink(old, dir_fd=folder)
                    except OSError:
                        pass
                    raise
            elif op == b"U":
                try:
                    os.unlink(target, dir_fd=folder)
                except OSError:
                    pass
            else:
                raise EOFError
        except OSError as e:
            if failed is None:
                failed = (e.errno or 0, e.strerror or str(e), target)
except EOFError:
    failed = failed or (0, "the writer was handed a broken frame", "")
if failed is not None:
    sys.stderr.write("%%d\t%%s\t%%s" %% failed)
    sys.exit(1)
"""


def _frame_name(name: str) -> bytes:
    b = name.encode("utf-8", "surrogateescape")
    return struct.pack("<H", len(b)) + b


def _write_frame(name: str, worst: list) -> bytes:
    n = len(worst)
    return (b"W" + _frame_name(name) + struct.pack(f"<I{n}q{4 * n}d", n, *[w[0] for w in worst],
                                                   *[v for w in worst for v in w[1:5]]))


class _Writer:
    """The process that makes a job's detail files in ``out`` (it exists).
    ``send`` hands it frames (blocking while its pipe is full); ``finish``
    ends its input, waits for it and gives its failure (OSError) or None."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WRITER % (_HEAD, _ROW), str(out)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     close_fds=True)
        self.broken = False

    def send(self, frames: bytes) -> None:
        if self.broken or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(frames)
        except OSError:
            self.broken = True      # it ended early: finish says why

    def finish(self) -> OSError | None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            self.broken = True
        err = self.proc.stderr.read() if self.proc.stderr is not None else b""
        code = self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if code == 0 and not self.broken:
            return None
        errno_, _, rest = err.decode("utf-8", "replace").partition("\t")
        strerror, _, filename = rest.partition("\t")
        if not strerror:
            return OSError(0, f"the detail files' writer ended with status {code}")
        return OSError(int(errno_) if errno_.isdigit() else 0, strerror,
                       str(self.out / filename) if filename and "/" not in filename else filename or None)


def write_detail(path: Path, worst: list) -> None:
    """One tensor's worst rows (numbers only, no cell to quote: one format a
    row, as csv.writer's dialect ends it). Three system calls, each of which
    lets the interpreter go: a file object makes twice as many."""
    data = memoryview((_HEAD + "".join(map(_ROW.__mod__, worst))).encode("ascii"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


class DetailFiles:
    """A job's detail files, from its first failing row to its reports.
    ``add`` hands a failing row's worst elements to the writer thread;
    ``place`` names every failing row's file; ``close`` (whatever happened)
    stops the writer and deletes what was never placed."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()    # batches of (name, worst rows, stale name)
        self._batch: list[tuple[str, list, str | None]] = []
        self._thread: threading.Thread | None = None
        self._written: dict[str, str] = {}    # row label -> provisional file name
        self._named = 0                       # provisional names given (a label added twice gets a new one)
        self._failure: OSError | None = None  # the writer's (a full disk): raised by place
        self._closed = False
        self._writer: _Writer | None = None   # the process making the files (None: this one makes them)

    def add(self, row) -> None:
        """A recorded row: written now, under a provisional name, if it failed."""
        if not row.failed or self._closed:
            return
        name = _PROVISIONAL.format(self._named)
        self._named += 1
        stale = self._written.get(row.label)
        self._written[row.label] = name
        self._batch.append((name, row.outcome.worst, stale))
        if len(self._batch) >= BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._batch:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_all, name="report-details", daemon=True)
            self._thread.start()
        self._todo.put(self._batch)
        self._batch = []

    def _write_all(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._failure = e
        if self._failure is None:
            try:
                self._writer = _Writer(self.out)
            except (OSError, ValueError):
                self._writer = None     # no process to be had: written here
        while (batch := self._todo.get()) is not None:
            if self._writer is not None:
                self._writer.send(b"".join((b"U" + _frame_name(stale) if stale is not None else b"")
                                           + _write_frame(name, worst) for name, worst, stale in batch))
                continue
            for name, worst, stale in batch:
                if self._failure is not None:
                    break       # drained, not written: place says why
                try:
                    if stale is not None:
                        _unlink(self.out / stale)
                    write_detail(self.out / name, worst)
                except OSError as e:
                    self._failure = e

    def _stop(self) -> None:
        self._hand_over()
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None

    def place(self, rows: list, detail_files: dict[str, str]) -> None:
        """Every failing row's file under its name in ``detail_files`` (row
        label -> file name): renamed where the writer wrote it, written
        here where it did not (rows recorded without ``add``)."""
        self._stop()
        self._closed = True
        if self._failure is not None:
            raise self._failure
        if self._writer is not None:
            frames = []
            for r in rows:
                if not r.failed:
                    continue
                provisional = self._written.pop(r.label, None)
                frames.append(b"R" + _frame_name(provisional) + _frame_name(detail_files[r.label])
                              if provisional is not None else _write_frame(detail_files[r.label], r.outcome.worst))
            failure = self._finish(frames)
            if failure is not None:
                raise failure
            return
        for r in rows:
            if not r.failed:
                continue
            final = self.out / detail_files[r.label]
            provisional = self._written.pop(r.label, None)
            if provisional is not None:
                os.replace(self.out / provisional, final)
            else:
                write_detail(final, r.outcome.worst)
        self._discard()

    def _finish(self, frames: list[bytes]) -> OSError | None:
        """The writer's last frames (and the deletion of whatever provisional
        file is left), its end, and its failure."""
        writer, self._writer = self._writer, None
        assert writer is not None
        frames += [b"U" + _frame_name(name) for name in self._written.values()]
        self._written.clear()
        writer.send(b"".join(frames))
        return writer.finish()

    def close(self) -> None:
        """The job ends (placed or not): nothing provisional is left."""
        self._batch = []        # not written only to be deleted
        self._stop()
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        if self._writer is not None:
            self._finish([])        # what it failed at no longer matters: the job has ended
            return
        for name in self._written.values():
            _unlink(self.out / name)
        self._written.clear()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass        # gone already; or its directory went or cannot be written: it goes with the job
