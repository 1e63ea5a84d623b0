"""Model files read (and hashed) on a thread of their own from the moment
the command knows their names, while the interpreter imports what the job
needs: on a small model the two take about as long, one on each core,
instead of one after the other.

``start`` is called by the command line with the files it was given;
``take`` hands a file's bytes, its stamp and its sha256 to the reader that
asks for that path (``api.read_upload``), once: what nobody asks for is
let go with the process. Light on imports by design: it runs before the
rest of the client is imported.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from layerdiff.common.localfile import FileStamp


class _Read:
    """One file's read under way: its bytes, the stamp it had before and
    after (unchanged, or no result) and their sha256."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = threading.Event()
        self.result: tuple[bytes, FileStamp, str] | None = None

    def run(self) -> None:
        try:
            before = FileStamp.of(self.path)
            data = self.path.read_bytes()
            if FileStamp.of(self.path) == before and len(data) == before.size and data:
                self.result = (data, before, hashlib.sha256(data).hexdigest())
        except OSError:
            pass        # the reader that asks reads it again and says what is wrong
        finally:
            self.done.set()


_lock = threading.Lock()
_reads: dict[Path, _Read] = {}


def start(paths: list) -> None:
    """Begin reading these files (regular files only; anything else is read
    by its reader as before)."""
    todo = []
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        try:
            if not path.is_file():
                continue
            key = path.resolve()
        except OSError:
            continue
        with _lock:
            if key not in _reads:
                _reads[key] = r = _Read(path)
                todo.append(r)
    if todo:
        threading.Thread(target=_run_all, args=(todo,), name="prefetch", daemon=True).start()


def _run_all(reads: list[_Read]) -> None:
    for r in reads:
        r.run()


def take(path: Path) -> tuple[bytes, FileStamp, str] | None:
    """The prefetched (bytes, stamp, sha256) of ``path``, once; None where
    it was not prefetched or could not be read whole and unchanged."""
    try:
        key = Path(path).resolve()
    except OSError:
        return None
    with _lock:
        r = _reads.pop(key, None)
    if r is None:
        return None
    r.done.wait()
    return r.result
