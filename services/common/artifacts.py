"""Chunked artifact upload: how a model or an inputs file crosses a gRPC
boundary (never by path, so no directory is shared between processes).

The store keeps each artifact under its content address (sha256) in the
service's own private directory. A file handed over in this process (the
embedded services) is taken as it lies on disk, a hard link to the user's
own file, where it is on the same file system and unchanged since it was
read: a 90 MB model copied into the store costs a tenth of a small model's
whole job. Such an entry is never touched (its times are the user's) and
is checked unchanged whenever it is read. A job holds the artifacts it uses
(``hold`` / ``release``) so that retention (``entries`` / ``discard``) never
deletes them under it; an upload that finds the disk full is refused with
RESOURCE_EXHAUSTED and leaves nothing behind.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from layerdiff.common.errors import LayerdiffError, LimitError, NotFoundError
from layerdiff.common.localfile import FileStamp, LocalFile
from layerdiff.common.sizes import DEFAULT_CHUNK_BYTES
from layerdiff.v1 import layerdiff_pb2 as pb

DEFAULT_MAX_ARTIFACT_BYTES = 8 * 1024**3
DEFAULT_QUOTA_BYTES = 64 * 1024**3


def quota_bytes() -> int:
    """LAYERDIFF_ARTIFACT_QUOTA_BYTES: what all of a store's uploads together may hold (64 GiB)."""
    from layerdiff.common.settings import env_limit

    return env_limit("LAYERDIFF_ARTIFACT_QUOTA_BYTES", DEFAULT_QUOTA_BYTES, size=True)


class Chunk(Protocol):
    """What an upload's chunk is read for: a pb.ArtifactChunk from the wire,
    or a _Piece of bytes handed over in this process."""

    @property
    def name(self) -> str: ...
    @property
    def total_size(self) -> int: ...
    @property
    def sha256(self) -> str: ...
    @property
    def data(self) -> bytes | memoryview: ...


class ArtifactStore:
    """Content-addressed files in a private directory."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.quota = quota_bytes()
        self._names: dict[str, str] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()
        # entries that are the user's own files (hard links): id -> (their stamp, when taken or last used)
        self._linked: dict[str, tuple[FileStamp, float]] = {}
        for partial in self.root.glob(".upload-*"):   # left by a service that died mid-upload
            _unlink(partial)

    def used_bytes(self) -> int:
        """Bytes the stored artifacts take (uploads under way included)."""
        total = 0
        with os.scandir(self.root) as it:
            for e in it:
                try:
                    total += e.stat(follow_symlinks=False).st_size if e.is_file(follow_symlinks=False) else 0
                except OSError:
                    pass
        return total

    def receive(self, chunks: Iterable[Chunk]) -> pb.ArtifactRef:
        try:
            return self._receive(chunks)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LimitError(f"disk full: no space left in {self.root} for this upload; free space there "
                                 "and upload again") from None
            raise

    def _receive(self, chunks: Iterable[Chunk]) -> pb.ArtifactRef:
        h = hashlib.sha256()
        name, expected, declared_sha = "", -1, ""
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                for i, chunk in enumerate(chunks):
                    if i == 0:
                        name = chunk.name or "artifact"
                        expected = chunk.total_size
                        declared_sha = chunk.sha256
                        if expected > self.max_bytes:
                            raise LimitError(f"declared size {expected} exceeds the limit of {self.max_bytes} bytes",
                                             file=name, field="total_size")
                        used = self.used_bytes()
                        if used + max(expected, 0) > self.quota:
                            raise LimitError(f"the store holds {used} bytes; {expected} more would pass its quota "
                                             f"of {self.quota} (LAYERDIFF_ARTIFACT_QUOTA_BYTES)", file=name,
                                             field="total_size")
                    size += len(chunk.data)
                    if expected < 0 and used + size > self.quota:
                        raise LimitError(f"the upload passes the store's quota of {self.quota} bytes "
                                         "(LAYERDIFF_ARTIFACT_QUOTA_BYTES)", file=name, field="data")
                    if size > self.max_bytes or (expected >= 0 and size > expected):
                        raise LimitError(f"upload is larger than declared ({size} > {expected})",
                                         file=name, field="data")
                    h.update(chunk.data)
                    f.write(chunk.data)
            if expected >= 0 and size != expected:
                raise LayerdiffError(f"upload truncated: {size} of {expected} bytes arrived",
                                     file=name, field="total_size")
            digest = h.hexdigest()
            if declared_sha and declared_sha != digest:
                raise LayerdiffError("sha256 of the received bytes does not match", file=name, field="sha256")
            with self._lock:
                os.replace(tmp, self.root / digest)
                tmp = ""
                self._names[digest] = name
            return pb.ArtifactRef(id=digest, name=name, size=size)
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)

    def put(self, data: bytes, name: str, origin: LocalFile | None = None) -> pb.ArtifactRef:
        """Store bytes handed over in this process (the embedded services),
        under the checks an upload passes; read in place, not copied into
        messages. ``origin``: the file they were read from, taken as it is
        where it can be (see the module's docstring)."""
        if origin is not None:
            taken = self._take(data, name, origin)
            if taken is not None:
                return taken
        # one piece: hashed and written in one call each, which let other
        # threads run, instead of a hundred hand-overs of the interpreter
        return self.receive(iter([_Piece(name, len(data), memoryview(data))]))

    def _take(self, data: bytes, name: str, origin: LocalFile) -> pb.ArtifactRef | None:
        """A hard link to ``origin`` as the entry of ``data``, or None (another
        file system, a link refused, the file changed since it was read)."""
        if len(data) > self.max_bytes or self.used_bytes() + len(data) > self.quota:
            return None         # the upload's own checks say so
        digest = origin.sha256 or hashlib.sha256(data).hexdigest()
        dst = self.root / digest
        tmp = self.root / f".upload-link-{digest[:16]}-{threading.get_ident()}"
        try:
            os.link(origin.path, tmp)
            if FileStamp.of(tmp) != origin.stamp:
                return None
            with self._lock:
                if not dst.exists():
                    os.replace(tmp, dst)
                    self._linked[digest] = (origin.stamp, time.time())
                self._names[digest] = name
        except OSError:
            return None
        finally:
            _unlink(tmp)
        return pb.ArtifactRef(id=digest, name=name, size=len(data))

    def has(self, artifact_id: str) -> bool:
        try:
            self.path(artifact_id)
        except NotFoundError:
            return False
        return True

    def link_from(self, other: ArtifactStore, artifact_id: str) -> None:
        """Hold what another store of this process holds (the embedded
        collector takes the analyzer's artifacts so): a hard link where both
        lie on one file system, a copy elsewhere; nothing if already held."""
        src = other.path(artifact_id)
        with other._lock:
            linked = other._linked.get(artifact_id)
        with self._lock:
            dst = self.root / artifact_id
            if not dst.exists():
                try:
                    os.link(src, dst)
                    if linked is not None:      # the user's own file still: left untouched here too
                        self._linked[artifact_id] = (linked[0], time.time())
                except OSError:
                    fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
                    os.close(fd)
                    try:
                        shutil.copyfile(src, tmp)
                        os.replace(tmp, dst)
                    finally:
                        _unlink(tmp)
            self._names[artifact_id] = other.name(artifact_id)

    def path(self, artifact_id: str, field: str = "artifact") -> Path:
        if not artifact_id or len(artifact_id) != 64 or any(c not in "0123456789abcdef" for c in artifact_id):
            raise NotFoundError(f"not an artifact id: {artifact_id!r}", field=field)
        p = self.root / artifact_id
        if not p.exists():
            raise NotFoundError(f"artifact {artifact_id} was never uploaded", field=field)
        return p

    def name(self, artifact_id: str) -> str:
        return self._names.get(artifact_id, artifact_id[:12])

    def read(self, artifact_id: str, field: str = "artifact") -> bytes:
        p = self.path(artifact_id, field)
        with self._lock:
            linked = self._linked.get(artifact_id)
        data = p.read_bytes()
        if linked is not None and FileStamp.of(p) != linked[0]:
            raise LayerdiffError("changed on disk while the job ran; run again on the file as it is now",
                                 file=self.name(artifact_id), field=field)
        return data

    # ------------------------------------------------------------ retention

    def hold(self, artifact_ids: Iterable[str]) -> None:
        """A job uses these artifacts: ``discard`` leaves them alone until
        they are released, and their age counts from now."""
        with self._lock:
            for a in artifact_ids:
                if a:
                    self._held[a] += 1
                    if a in self._linked:      # the user's file: its times are not ours to change
                        self._linked[a] = (self._linked[a][0], time.time())
                        continue
                    try:
                        os.utime(self.root / a)
                    except (OSError, ValueError):
                        pass

    def release(self, artifact_ids: Iterable[str]) -> None:
        with self._lock:
            for a in artifact_ids:
                if a and self._held[a] > 0:
                    self._held[a] -= 1
                    if not self._held[a]:
                        del self._held[a]

    def entries(self) -> list[tuple[str, float, int]]:
        """(id, time of its last upload or use, size) of every stored
        artifact that no job holds."""
        out = []
        with self._lock:
            held = set(self._held)
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.startswith(".") or e.name in held:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                with self._lock:
                    linked = self._linked.get(e.name)
                out.append((e.name, linked[1] if linked else st.st_mtime, st.st_size))
        return out

    def discard(self, artifact_id: str, mtime: float | None = None) -> bool:
        """Delete an artifact unless a job holds it or (given ``mtime``) it
        was uploaded or used again since. True when it was deleted."""
        with self._lock:
            if self._held.get(artifact_id):
                return False
            p = self.root / artifact_id
            linked = self._linked.get(artifact_id)
            try:
                if mtime is not None and (linked[1] if linked else p.stat().st_mtime) != mtime:
                    return False
                p.unlink()
            except OSError:
                return False
            self._names.pop(artifact_id, None)
            self._linked.pop(artifact_id, None)
            return True


class _Piece:
    """A piece of bytes handed over in this process, read as an upload's
    chunk is (``name``, ``total_size`` and ``sha256`` on the first only)."""

    __slots__ = ("name", "total_size", "data", "sha256")

    def __init__(self, name: str, total_size: int, data: memoryview) -> None:
        self.name, self.total_size, self.data, self.sha256 = name, total_size, data, ""


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def chunks_of(data: bytes, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.ArtifactChunk]:
    digest = hashlib.sha256(data).hexdigest()
    view = memoryview(data)
    if not data:
        yield pb.ArtifactChunk(name=name, total_size=0, sha256=digest, data=b"")
        return
    for off in range(0, len(data), chunk_bytes):
        piece = bytes(view[off:off + chunk_bytes])
        if off == 0:
            yield pb.ArtifactChunk(name=name, total_size=len(data), sha256=digest, data=piece)
        else:
            yield pb.ArtifactChunk(data=piece)


def upload(stub, data: bytes, name: str, timeout: float = 600.0) -> str:
    """Upload bytes through a stub with a PutArtifact method; returns the id."""
    ref = stub.PutArtifact(chunks_of(data, name), timeout=timeout)
    return ref.id
