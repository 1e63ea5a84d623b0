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
"""
from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

DETAIL_COLUMNS = ["index", "std_value", "npu_value", "abs_diff", "relative_diff"]
_HEAD = ",".join(DETAIL_COLUMNS) + "\r\n"
_ROW = "%d,%.6g,%.6g,%.6g,%.6g\r\n"     # g6's format, a row at once: 100k cells a job
# provisional names: hidden, so that no safe_filename (never a leading dot) is one
_PROVISIONAL = ".detail-{}.csv"
# rows handed to the writer at a time: one wake-up of its thread for each
BATCH = 16


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
        while (batch := self._todo.get()) is not None:
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

    def close(self) -> None:
        """The job ends (placed or not): nothing provisional is left."""
        self._batch = []        # not written only to be deleted
        self._stop()
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        for name in self._written.values():
            _unlink(self.out / name)
        self._written.clear()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass        # gone already; or its directory went or cannot be written: it goes with the job
