"""SavedModel archives: a SavedModel directory packed as one tar archive
(client side), and tar or zip archives unpacked with every member checked
(no absolute paths, no ``..``, no links, only regular files and directories,
bounded member count and unpacked size, whatever the headers declare).
Keras files (zip archives) have their members checked the same way."""
from __future__ import annotations

import io
import os
import re
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path

from layerdiff.common.errors import LayerdiffError, LimitError

MAX_ARCHIVE_MEMBERS = 100_000
MAX_UNPACKED_BYTES = 16 * 1024**3


def pack_directory(path: str | os.PathLike) -> bytes:
    """A SavedModel directory as one tar archive (client side): regular files
    and directories only, names relative to the directory."""
    root = Path(path)
    if not (root / "saved_model.pb").is_file() and not (root / "saved_model.pbtxt").is_file():
        raise LayerdiffError("is a directory without saved_model.pb, not a SavedModel", file=str(root),
                             field="model")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise LayerdiffError(f"holds a link ({rel}); copy the files instead", file=str(root), field="model")
            if p.is_dir() or p.is_file():
                tar.add(p, arcname=rel, recursive=False)
    return buf.getvalue()


def _member_path(raw: str, archive: str) -> str:
    name = raw.replace("\\", "/")
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if not name or name == ".":
        return ""
    if "\x00" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise LayerdiffError(f"archive member {raw!r} has an absolute path", file=archive, field="model")
    if any(part == ".." for part in name.split("/")):
        raise LayerdiffError(f"archive member {raw!r} has a '..' path segment", file=archive, field="model")
    return name


def check_zip_members(data: bytes, archive: str, max_bytes: int = MAX_UNPACKED_BYTES) -> list[zipfile.ZipInfo]:
    """Validate every member of a zip (names, links, declared sizes) without
    unpacking it."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except Exception as e:    # BadZipFile, a damaged directory ("zip file version 6.4"...)
        raise LayerdiffError(f"is not a readable zip archive ({type(e).__name__}: {e})", file=archive,
                             field="model") from e
    infos = z.infolist()
    if len(infos) > MAX_ARCHIVE_MEMBERS:
        raise LimitError(f"archive has {len(infos)} members (limit {MAX_ARCHIVE_MEMBERS})", file=archive,
                         field="model")
    total = 0
    for info in infos:
        _member_path(info.filename, archive)
        if stat.S_ISLNK(info.external_attr >> 16):
            raise LayerdiffError(f"archive member {info.filename!r} is a link", file=archive, field="model")
        total += info.file_size
        if total > max_bytes:
            raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive, field="model")
    return infos


def unpack_archive(data: bytes, dest: Path, archive: str, max_bytes: int = MAX_UNPACKED_BYTES) -> None:
    """Unpack a tar (optionally gzip) or zip archive into ``dest``: regular
    files and directories only, every path inside ``dest``, at most
    ``max_bytes`` written whatever the headers declare."""
    dest = Path(dest)
    root = dest.resolve()
    written = 0

    def target(rel: str) -> Path:
        p = (dest / rel).resolve()
        if root != p and root not in p.parents:
            raise LayerdiffError(f"archive member {rel!r} lands outside the unpack directory", file=archive,
                                 field="model")
        return p

    def copy(src, rel: str) -> None:
        nonlocal written
        p = target(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "xb") as out:
            while True:
                piece = src.read(1 << 20)
                if not piece:
                    break
                written += len(piece)
                if written > max_bytes:
                    raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive,
                                     field="model")
                out.write(piece)

    if data[:4] == b"PK\x03\x04":
        infos = check_zip_members(data, archive, max_bytes)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in infos:
                rel = _member_path(info.filename, archive)
                if not rel:
                    continue
                if info.is_dir():
                    target(rel).mkdir(parents=True, exist_ok=True)
                    continue
                with z.open(info) as src:
                    copy(src, rel)
        return
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LayerdiffError(f"is not a readable tar archive ({e})", file=archive, field="model") from e
    with tar:
        count = 0
        try:
            for m in tar:
                count += 1
                if count > MAX_ARCHIVE_MEMBERS:
                    raise LimitError(f"archive has more than {MAX_ARCHIVE_MEMBERS} members", file=archive,
                                     field="model")
                rel = _member_path(m.name, archive)
                if m.issym() or m.islnk():
                    raise LayerdiffError(f"archive member {m.name!r} is a link", file=archive, field="model")
                if m.isdir():
                    if rel:
                        target(rel).mkdir(parents=True, exist_ok=True)
                    continue
                if not m.isfile():
                    raise LayerdiffError(f"archive member {m.name!r} is not a regular file", file=archive,
                                         field="model")
                if not rel:
                    continue
                if m.size > max_bytes - written:
                    raise LimitError(f"archive unpacks to more than {max_bytes} bytes", file=archive,
                                     field="model")
                member = tar.extractfile(m)
                if member is not None:
                    copy(member, rel)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise LayerdiffError(f"is not a readable tar archive ({e})", file=archive, field="model") from e


def savedmodel_root(directory: Path, archive: str) -> Path:
    """The one directory of an unpacked archive that holds saved_model.pb."""
    found = sorted({p.parent for pat in ("saved_model.pb", "saved_model.pbtxt") for p in directory.rglob(pat)})
    if not found:
        raise LayerdiffError("is not a SavedModel (no saved_model.pb in the archive)", file=archive, field="model")
    if len(found) > 1:
        rels = [p.relative_to(directory).as_posix() or "." for p in found]
        raise LayerdiffError(f"holds several SavedModels ({rels}); upload one", file=archive, field="model")
    return found[0]

