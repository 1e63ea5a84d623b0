"""The report's process: a job's report files made beside the job, by a
process of its own (``ReportProcess`` starts it at the job's first failing
rows; report.details hands it the detail files, report.files the summary).

A two-dump job is bound by the interpreter lock of its process. Made by a
thread of the job's process, each of the three system calls a detail file
takes gave the lock away and took it back from the threads comparing (257
files: a ninth of the job, 0.11 s); summary.json's JSON, report.html and
the explorer's files held it for a third of the reports' time (50 ms).
Here they cost the job what it takes to hand them over: the detail rows as
numbers, the summary marshalled (3 ms). marshal carries the job's own
values, through a pipe only the job holds; nothing received from elsewhere
is ever unmarshalled.

What it is handed, frames on its standard input, a byte saying what each is:

  W name rows   a detail file (rows: count, then the indices, then each
                row's four values), named ``name`` in the directory
  R old new     a rename;  U name  a deletion (gone already is no error)
  D name        the directory (the first frame of a process started ahead
                of its job, with no directory given: ReportProcess.prestart)
  T size data   the Parquet tables' parts (report.table_parts): the tables
                (report.tables), made by a child forked for them
  S size data   the summary: its documents (report.documents), summary.json
                here and the pages by a child forked for them

The tables, summary.json and the pages each take 15-25 ms of a core: made
at once, the job's last of them waits for them no longer than for what it
writes itself (the CSV files). A child is forked only once the modules it
needs are loaded (``_preload``, while the job compares): never in the middle
of an import.

Names are of the directory itself (dir_fd). The first failure (a full disk)
stops the writing and is said on its standard error as
"errno<TAB>strerror<TAB>filename", its exit status 1; it reads on to the
end. A summary or tables' parts it cannot make files of (a numpy number in
them, which marshal carries as its bytes: JSON and Arrow refuse them) is no
failure: its exit status 3 says so, its standard error what it left
("documents", "tables"), and the job makes them itself.
"""
from __future__ import annotations

import fcntl
import marshal
import os
import signal
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

DETAIL_COLUMNS = ["index", "std_value", "npu_value", "abs_diff", "relative_diff"]
DETAIL_HEAD = ",".join(DETAIL_COLUMNS) + "\r\n"
DETAIL_ROW = "%d,%.6g,%.6g,%.6g,%.6g\r\n"     # g6's format, a row at once: 100k cells a job

# The process runs this layerdiff (the first path: the job's own package,
# whatever the environment's), isolated from this environment's variables
# and its site (-I -S); one that makes the tables is given the directories
# numpy and pyarrow are loaded from here, after the standard library's. It
# ends without the interpreter's clean-up, every file closed already.
_BOOT = ("import os, sys; sys.path.insert(0, sys.argv[1]); sys.path.extend(sys.argv[3:]); "
         "from layerdiff.analyzer.report.writer import main; code = main(sys.argv[2], len(sys.argv) > 3); "
         "sys.stderr.flush(); os._exit(code)")
_PACKAGE_ROOT = str(Path(__file__).parents[3])      # the directory layerdiff is imported from
# (where an import hook of an installer places it elsewhere, no process: the job writes its files itself)
_BOOTABLE = Path(_PACKAGE_ROOT, "layerdiff", "analyzer", "report", "writer.py").is_file()
# a pipe as large as the summary of a few thousand nodes: handed over in one write, not 64k at a time
_PIPE_BYTES = 1 << 20
# its exit status where all went well but what it names on its standard error (the job makes them)
_REFUSED = 3
_LEFT = frozenset({"documents", "tables"})
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW


def detail_text(rows) -> bytes:
    """A detail file's bytes: numbers only, no cell to quote (one format a
    row, as csv.writer's dialect ends it). ``rows``: (index, four values)."""
    return (DETAIL_HEAD + "".join(map(DETAIL_ROW.__mod__, rows))).encode("ascii")


# ------------------------------------------------------------ the job's side

def name_frame(name: str) -> bytes:
    b = name.encode("utf-8", "surrogateescape")
    return struct.pack("<H", len(b)) + b


def detail_frame(name: str, worst) -> bytes:
    """The W frame of a detail file: ``worst`` rows, tuples or WorstRows
    (whose columns give their bytes whole; no numpy loaded here)."""
    n = len(worst)
    if hasattr(worst, "flat"):      # compare.worst.WorstRows
        indices, values = worst.flat.astype("<i8").tobytes(), worst.values().astype("<f8").tobytes()
    else:
        indices = struct.pack(f"<{n}q", *[w[0] for w in worst])
        values = struct.pack(f"<{4 * n}d", *[v for w in worst for v in w[1:5]])
    return b"W" + name_frame(name) + struct.pack("<I", n) + indices + values


@cache
def _table_roots() -> tuple[str, ...]:
    """Where numpy and pyarrow are imported from here: the process has no
    site of its own (-S), and makes the tables with them."""
    import importlib.util

    roots = []
    for name in ("numpy", "pyarrow"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:
            roots.append(str(Path(spec.origin).parents[1]))
    return tuple(dict.fromkeys(roots))


def tables_frame(packed: bytes) -> bytes:
    """The T frame of the tables' parts (report.table_parts.pack made ``packed``)."""
    return b"T" + struct.pack("<Q", len(packed)) + packed


def summary_frame(summary: dict) -> bytes:
    """The S frame of a summary (ValueError: marshal cannot carry it, an
    object of a class of its own in it)."""
    data = marshal.dumps(summary)
    return b"S" + struct.pack("<Q", len(data)) + data


def _launch(path: str, tables: bool) -> tuple[subprocess.Popen, bool]:
    """The report's process, writing into ``path`` ("": into the directory
    its first frame, D, names), and whether it makes the tables (asked by
    ``tables``, where numpy and pyarrow are to be found)."""
    roots = _table_roots() if tables else ()
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, _PACKAGE_ROOT, path, *roots],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
    try:
        assert proc.stdin is not None     # stdin=PIPE
        fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (OSError, AttributeError):
        pass        # a smaller pipe: the same frames, written in more pieces
    return proc, bool(roots)


def _let_go(proc: subprocess.Popen) -> None:
    """A process started ahead and not taken: its input closed, it ends."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
    except OSError:
        pass


class ReportProcess:
    """The process that writes into the report directory ``out`` (it
    exists). ``send`` hands it frames (blocking while its pipe is full);
    ``finish`` ends its input, waits for it and gives its failure (OSError)
    or None; ``refused`` then names what it was handed and made no files
    of ("documents", "tables": a value marshal carried as another type).

    ``tables``: it makes the Parquet tables too (it loads numpy and pyarrow
    for them, 60 ms of a core and 50 MiB). Worth it where the job's process
    has not loaded pyarrow: a command comparing two dumps in its own process
    never needs it otherwise; a served analyzer, or a ``run``, has it loaded
    for the Arrow batches it receives, and makes the tables itself."""

    # one started ahead of its job (prestart), taken by the next job of this process
    _spare: tuple[subprocess.Popen, bool] | None = None
    _spare_lock = threading.Lock()

    def __init__(self, out: Path, tables: bool = False) -> None:
        if not _BOOTABLE:
            raise OSError(0, "layerdiff is not importable from a directory of its own here")
        self.out = out
        self.broken = False
        self.refused: frozenset[str] = frozenset()
        with ReportProcess._spare_lock:
            spare, ReportProcess._spare = ReportProcess._spare, None
        if spare is not None and spare[0].poll() is None and spare[1] == tables:
            self.proc, self.tables = spare
            self.send(b"D" + name_frame(os.path.abspath(out)))
        else:
            if spare is not None:
                _let_go(spare[0])
            self.proc, self.tables = _launch(str(out), tables)

    @classmethod
    def prestart(cls, tables: bool = False) -> None:
        """A process started now, before the job that will take it exists:
        a command that will run a job in its own process starts it before
        its own imports, on the core they leave idle (with the tables'
        modules, the process loads for 90 ms of a core). Left untaken, it
        ends with this process (its input closes)."""
        if not _BOOTABLE:
            return
        with cls._spare_lock:
            if cls._spare is None:
                try:
                    cls._spare = _launch("", tables)
                except OSError:
                    pass        # the job starts one of its own

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
        if code in (0, _REFUSED) and not self.broken:
            if code == _REFUSED:
                self.refused = frozenset(err.decode("ascii", "replace").split()) & _LEFT
            return None
        number, strerror, filename = _heard(err.decode("utf-8", "replace"))
        if not strerror:
            return OSError(0, f"the report's process ended with status {code}")
        return OSError(number or 0, strerror,
                       str(self.out / filename) if filename and "/" not in filename else filename or None)


# ------------------------------------------------------------ the process

def _preload(tables: bool) -> None:
    """The page's (and the tables') modules, loaded while the job compares."""
    try:
        from layerdiff.analyzer.report import documents  # noqa: F401

        if tables:
            from layerdiff.analyzer.report import tables as _  # noqa: F401
    except Exception:       # the frame that needs them says what failed
        pass


class _Input:
    """Frames' fields read from standard input (EOFError: a frame cut short)."""

    def __init__(self) -> None:
        self.src = sys.stdin.buffer

    def op(self) -> bytes:
        """The next frame's letter (b"": the input has ended)."""
        return self.src.read(1)

    def take(self, n: int) -> bytes:
        b = self.src.read(n)
        if len(b) != n:
            raise EOFError
        return b

    def name(self) -> str:
        return self.take(struct.unpack("<H", self.take(2))[0]).decode("utf-8", "surrogateescape")

    def value(self) -> object:
        return marshal.loads(self.take(struct.unpack("<Q", self.take(8))[0]))


def _write(folder: int, name: str, data: bytes) -> None:
    view = memoryview(data)
    fd = os.open(name, _FLAGS, 0o666, dir_fd=folder)
    try:
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _rename(folder: int, old: str, new: str, failed: bool) -> None:
    try:
        if failed:
            raise FileExistsError       # not placed after a failure: nothing provisional stays
        os.replace(old, new, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError:
        try:
            os.unlink(old, dir_fd=folder)
        except OSError:
            pass
        raise


class _Frames:
    """The process's work: every frame to the end of the input, and the
    first failure (errno, strerror, file name), after which nothing more
    is written."""

    def __init__(self, path: str, inp: _Input, preload: threading.Thread | None = None) -> None:
        self.path = path
        self.inp = inp
        self.preload = preload      # loading the page's modules: joined before the page's process forks
        self.failed: tuple[int, str, str] | None = None
        self.refused: set[str] = set()      # what it was handed and could not make files of
        self.children: list[tuple[_Child, str]] = []        # (a child making files, what it makes)

    def run(self) -> tuple[int, str, str] | None:
        if not self.path:       # started ahead of its job: the directory comes first
            try:
                op = self.inp.op()
                if not op:
                    return None     # never taken: nothing to write
                if op != b"D":
                    raise EOFError
                self.path = self.inp.name()
            except EOFError:
                return (0, "the report's process was handed a broken frame", "")
        try:
            folder = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return (e.errno or 0, e.strerror or str(e), self.path)
        try:
            while op := self.inp.op():
                self._frame(folder, op)
        except EOFError:
            self.failed = self.failed or (0, "the report's process was handed a broken frame", "")
        finally:
            os.close(folder)
            self._wait_children()
        return self.failed

    def _wait_children(self) -> None:
        children, self.children = self.children, []
        for child, what in children:
            try:
                if not child.wait():
                    self.refused.add(what)
            except Exception as e:
                self.failed = self.failed or _failure(e, "nodes.parquet" if what == "tables" else "report.html",
                                                      b"T")

    def _frame(self, folder: int, op: bytes) -> None:
        inp, target = self.inp, ""
        try:
            if op == b"W":
                target = inp.name()
                n = struct.unpack("<I", inp.take(4))[0]
                idx = struct.unpack(f"<{n}q", inp.take(8 * n))
                v = struct.unpack(f"<{4 * n}d", inp.take(32 * n))
                if self.failed is None:
                    _write(folder, target, detail_text([(idx[i], *v[4 * i:4 * i + 4]) for i in range(n)]))
            elif op == b"R":
                old = inp.name()
                target = inp.name()         # the file it fails to place is named by its final name
                _rename(folder, old, target, self.failed is not None)
            elif op == b"U":
                try:
                    os.unlink(inp.name(), dir_fd=folder)
                except OSError:
                    pass
            elif op == b"T":
                data = inp.take(struct.unpack("<Q", inp.take(8))[0])
                if self.failed is None:
                    self.children.append((_Child(partial(_tables_made, Path(self.path), data), self.preload),
                                          "tables"))
            elif op == b"S":
                target = "summary.json"
                value = inp.value()
                if self.failed is None:
                    self._documents(value)
            else:
                raise EOFError
        except EOFError:
            raise
        except Exception as e:      # a file that cannot be made, or a value the page cannot take
            self.failed = self.failed or _failure(e, target, op)


    def _documents(self, summary: object) -> None:
        from layerdiff.analyzer.report.documents import PAGES, write_summary

        if not isinstance(summary, dict):
            self.refused.add("documents")
            return
        out = Path(self.path)
        pages = _Child(partial(_pages_made, out, summary), self.preload)
        try:
            write_summary(out, summary)
            refused = False
        except (TypeError, ValueError):
            # marshal carries a numpy number as its bytes (a buffer): JSON
            # refuses it; the job makes the documents itself
            refused = True
        except BaseException:
            try:
                pages.wait()    # ended, whatever it made: the failure said is this one
            except Exception:
                pass
            raise
        if pages.wait() is False or refused:
            self.refused.add("documents")
            for name in ("summary.json", *PAGES):      # none of them, as before a summary it cannot take
                try:
                    os.unlink(out / name)
                except OSError:
                    pass


class _Child:
    """Files made by a child of the report's process (``made``: a function
    saying how it went, as ``_pages_made`` does) while the process goes on:
    the pages beside summary.json, the tables beside both. Made by ``wait``
    where no child can be had."""

    def __init__(self, made: Callable[[], tuple[int, str]], preload: threading.Thread | None) -> None:
        self.made = made
        self.pid, self.said = 0, -1
        if preload is not None:
            preload.join()      # forked alone, never in the middle of an import
        try:
            self.said, told = os.pipe()
        except OSError:
            return
        try:
            self.pid = os.fork()
        except OSError:
            os.close(self.said)
            os.close(told)
            self.said = -1
            return
        if self.pid == 0:       # the child: the files, then its word on them, then gone, whatever happens
            code = 1
            try:
                os.close(self.said)
                code, word = made()
                os.write(told, word.encode("utf-8", "replace"))
            finally:
                os._exit(code)
        os.close(told)

    def wait(self) -> bool:
        """True when made, False where what it was given holds a value of a
        type the files cannot take (the job then makes them); OSError or any
        other failure raised as the job is told it."""
        if not self.pid:
            code, word = self.made()
        else:
            chunks = []
            try:
                while chunk := os.read(self.said, 4096):
                    chunks.append(chunk)
            finally:
                os.close(self.said)
            code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            word = b"".join(chunks).decode("utf-8", "replace")
        if code == 0:
            return True
        if code == _REFUSED:
            return False
        number, strerror, filename = _heard(word)
        if number is None:
            raise OSError(0, f"a child of the report's process ended with status {code}")
        if number:
            raise OSError(number, strerror, filename or None)
        raise _ChildFailure(strerror, filename)


class _ChildFailure(Exception):
    """What a child failed at, other than a file (said as its type and
    message), and the file it was making."""

    def __init__(self, message: str, filename: str) -> None:
        super().__init__(message)
        self.filename = filename


def _pages_made(out: Path, summary: dict) -> tuple[int, str]:
    """The pages made: (0, ""), (_REFUSED, "") for a value they cannot
    take, (1, "errno<TAB>strerror<TAB>file") for a failure."""
    def make() -> None:
        from layerdiff.analyzer.report.documents import write_pages

        write_pages(out, summary)

    return _made(make, "report.html")


def _tables_made(out: Path, packed: bytes) -> tuple[int, str]:
    """The tables made of their packed parts, as ``_pages_made`` says it."""
    def make() -> None:
        from layerdiff.analyzer.report.table_parts import unpack
        from layerdiff.analyzer.report.tables import write_table_parts

        write_table_parts(out, unpack(packed))

    return _made(make, "nodes.parquet")


def _made(make: Callable[[], None], default_file: str) -> tuple[int, str]:
    try:
        make()
    except OSError as e:
        return 1, _said((e.errno or 0, e.strerror or str(e), str(e.filename or default_file)))
    except (TypeError, ValueError):     # pyarrow's ArrowInvalid and ArrowTypeError among them
        return _REFUSED, ""
    except Exception as e:      # said as a failure, never as a traceback
        return 1, _said((0, f"{type(e).__name__}: {e}", default_file))
    return 0, ""


def _said(failure: tuple[int, str, str]) -> str:
    """A failure as the report's process and its children say it: "errno<TAB>strerror<TAB>filename"."""
    return "{}\t{}\t{}".format(*failure)


def _heard(word: str) -> tuple[int | None, str, str]:
    """What _said said: (errno, None where there was no failure's word; strerror; filename)."""
    number, _, rest = word.partition("\t")
    strerror, _, filename = rest.partition("\t")
    return (int(number) if number.isdigit() else None), strerror, filename


def _failure(e: Exception, target: str, op: bytes) -> tuple[int, str, str]:
    """A failure as the job is told it: a detail file by its final name; in
    the documents, the file the error names."""
    if isinstance(e, _ChildFailure):
        return (0, str(e), e.filename or target)
    if not isinstance(e, OSError):
        return (0, f"{type(e).__name__}: {e}", target)
    return (e.errno or 0, e.strerror or str(e), str(e.filename) if op in (b"S", b"T") and e.filename else target)


def main(path: str, tables: bool = False) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the job's to answer: it ends with its input
    # its standard error says its failure to the job, nothing else (a newer
    # interpreter warns of a fork where a library has started a thread)
    warnings.simplefilter("ignore")
    preload = threading.Thread(target=_preload, args=(tables,), name="preload", daemon=True)
    preload.start()
    frames = _Frames(path, _Input(), preload)
    try:
        failed = frames.run()
    except Exception as e:      # said as a failure, never as a traceback
        failed = (0, f"{type(e).__name__}: {e}", "")
    if failed is not None:
        sys.stderr.write(_said(failed))
        return 1
    if frames.refused:
        sys.stderr.write(" ".join(sorted(frames.refused)))
        return _REFUSED
    return 0
