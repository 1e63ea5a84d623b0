"""A file as it was when read: what tells it unchanged since without
reading it again. Light on imports: the command line's read ahead
(client/prefetch.py) uses it before the rest of the client is imported."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileStamp:
    """What tells a file's content unchanged without reading it: the same
    file (device, inode), size and modification time (to the nanosecond)."""
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @staticmethod
    def of(path) -> FileStamp:
        st = os.stat(path)
        return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class LocalFile:
    """The file an upload's bytes were read from, as it was when read
    (``sha256``: of those bytes, where the reader made it already)."""
    path: Path
    stamp: FileStamp
    sha256: str = ""
