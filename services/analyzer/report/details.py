"""The failing tensors' worst elements, ``{op_name}.csv`` each (index,
std_value, npu_value, abs_diff, relative_diff; at most ``diff_cnt`` rows).

A job fails hundreds of tensors at a time, and creating that many files is
the slowest part of its reports (the file system, not the interpreter, on
a disk where the last run's files were just deleted). So the files are
written while the job still compares, each as soon as its comparison is
recorded, under a provisional name: a file's final name is only known once
every row is (names are made unique in execution order, which the stream
need not follow). ``place`` then renames them, which creates nothing.

They are made by the report's process (report.writer), which later makes
the summary's documents too: the worst rows are handed to it as numbers, a
batch at a time, by a thread of this process, so that the job's thread
never waits on its pipe. Where no process can be started, that thread
writes them itself.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from pathlib import Path

from layerdiff.analyzer.report.table_parts import pack
from layerdiff.analyzer.report.writer import (
    ReportProcess,
    detail_frame,
    detail_text,
    name_frame,
    summary_frame,
    tables_frame,
)

# provisional names: hidden, so that no safe_filename (never a leading dot) is one
_PROVISIONAL = ".detail-{}.csv"
# rows handed to the writer at a time: one wake-up of its thread for each
BATCH = 16


def tables_there() -> bool:
    """Whether the report's process is to make the Parquet tables: where
    this process has not loaded pyarrow (ReportProcess says why)."""
    return "pyarrow" not in sys.modules


def write_detail(path: Path, worst: list) -> None:
    """One tensor's worst rows, written here. Three system calls, each of
    which lets the interpreter go: a file object makes twice as many."""
    data = memoryview(detail_text(worst))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


class DetailFiles:
    """A job's detail files, from its first failing row to its reports, and
    the report's process that makes them. ``add`` hands a failing row's
    worst elements to the thread that feeds the process; ``place`` names
    every failing row's file; ``hand_over`` gives the process the summary
    to make its documents; ``finish`` waits for all it was given; ``close``
    (whatever happened) stops it and deletes what was never placed."""

    def __init__(self, out: Path, tables: bool | None = None) -> None:
        """``tables``: whether the process makes the Parquet tables (None:
        where this process has not loaded pyarrow, tables_there)."""
        self.out = Path(out)
        self.tables = tables
        # what the thread hands the process: batches of (name, worst rows, stale name), frames, or the tables' parts
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list[tuple[str, list, str | None]] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()       # the thread has started the process, or found it cannot
        self._written: dict[str, str] = {}    # row label -> provisional file name
        self._named = 0                       # provisional names given (a label added twice gets a new one)
        self._failure: OSError | None = None  # the thread's own (a full disk): raised by place
        self._closed = False
        self._writer: ReportProcess | None = None   # the process making the files (None: this one makes them)

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

    def start(self) -> None:
        """Start the report's process now rather than at the first failing
        rows: at a job's start it boots (30 ms of a core) while the
        reference is read on the other, not while both compare."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._feed, name="report-details", daemon=True)
            self._thread.start()

    def _hand_over(self) -> None:
        if not self._batch:
            return
        self.start()
        self._todo.put(self._batch)
        self._batch = []

    def _feed(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._failure = e
        if self._failure is None:
            try:
                self._writer = ReportProcess(self.out, tables=self.tables if self.tables is not None
                                             else tables_there())
            except (OSError, ValueError):
                self._writer = None     # no process to be had: written here
        self._ready.set()
        while (item := self._todo.get()) is not None:
            if self._writer is not None:
                if isinstance(item, dict):      # the tables' parts (hand_tables)
                    self._writer.send(tables_frame(pack(item)))
                    continue
                self._writer.send(item if isinstance(item, bytes) else
                                  b"".join((b"U" + name_frame(stale) if stale is not None else b"")
                                           + detail_frame(name, worst) for name, worst, stale in item))
                continue
            for name, worst, stale in item:
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

    @property
    def _process(self) -> ReportProcess | None:
        """The process, once the thread has tried to start it (None: none)."""
        if self._thread is not None:
            self._ready.wait()
        return self._writer

    def place(self, rows: list, detail_files: dict[str, str]) -> None:
        """Every failing row's file under its name in ``detail_files`` (row
        label -> file name): renamed where it was written, written where it
        was not (rows recorded without ``add``). The process's failures
        are ``finish``'s; this one's are raised here."""
        self._hand_over()
        self._closed = True
        if self._process is not None:
            frames = []
            for r in rows:
                if not r.failed:
                    continue
                provisional = self._written.pop(r.label, None)
                frames.append(b"R" + name_frame(provisional) + name_frame(detail_files[r.label])
                              if provisional is not None else detail_frame(detail_files[r.label], r.outcome.worst))
            frames += [b"U" + name_frame(name) for name in self._written.values()]
            self._written.clear()
            self._todo.put(b"".join(frames))
            return
        self._stop()
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

    def hand_over(self, summary: dict) -> bool:
        """The summary to the process, after the files placed, to make its
        documents (report.documents). False where there is no process, or
        marshal cannot carry the summary: the caller makes them itself."""
        process = self._process
        if process is None or process.broken:
            return False
        try:
            frame = summary_frame(summary)
        except ValueError:
            return False
        self._todo.put(frame)
        return True

    def hand_tables(self, parts: dict) -> bool:
        """The Parquet tables' parts (report.table_parts) to the process, to
        make the tables beside the rest. False where there is no process, or
        one that makes no tables: the caller makes them itself."""
        process = self._process
        if process is None or process.broken or not process.tables:
            return False
        self._todo.put(parts)       # packed by the thread feeding the process
        return True

    def finish(self) -> frozenset[str]:
        """Everything the process was handed written (OSError: its failure,
        naming the file); what it was handed but could not make, for the
        caller to make: "documents" (of the summary), "tables" (of their
        parts), where a value of a type of its own is among them."""
        self._closed = True
        self._stop()
        writer, self._writer = self._writer, None
        if writer is None:
            return frozenset()
        failure = writer.finish()
        if failure is not None:
            raise failure
        return writer.refused

    def close(self) -> None:
        """The job ends (placed or not): nothing provisional is left."""
        self._batch = []        # not written only to be deleted
        self._stop()
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        names, self._written = list(self._written.values()), {}
        if self._writer is not None:
            self._writer.send(b"".join(b"U" + name_frame(name) for name in names))
            self._writer.finish()       # what it failed at no longer matters: the job has ended
            self._writer = None
            return
        for name in names:
            _unlink(self.out / name)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass        # gone already; or its directory went or cannot be written: it goes with the job
