"""Watch mode: stream a dump directory while the runtime is still writing it.

A node file is sent once it is complete and stable: its size has not changed
between two polls, it is older than one poll interval, and (for ``.npy``) its
header's declared size matches the bytes on disk. The watch ends when the
runtime writes ``manifest.json`` (its last act) and every node it lists has
been sent, or after ``idle_s`` seconds without a new file. Files are named
after their nodes (``{node}.npy``), as the runtime writes them one by one.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.collector.dumps.manifest import MANIFEST
from layerdiff.common.errors import LayerdiffError, NotFoundError
from layerdiff.common.schema import NodeRecord

_WATCHED = (".npy", ".pb", ".tensor")


def watch_records(path: str, *, poll_s: float = 0.2, idle_s: float = 10.0, fmt: str = "",
                  default_concat_dim: int = 0) -> Iterator[NodeRecord]:
    root = Path(path)
    if root.is_file():
        # a runtime writes a watched dump file by file into a directory; one file is read once, whole
        raise LayerdiffError(f"--watch follows a dump directory while it is written; {path!r} is a file (compare "
                             "it without --watch)", field="dump_path")
    if not root.is_dir():
        raise NotFoundError(f"dump directory {path!r} does not exist on the collector host", field="dump_path")
    sizes: dict[str, int] = {}
    sent: set[str] = set()
    last_new = time.monotonic()
    reader = DumpDirectory(path, fmt=fmt, default_concat_dim=default_concat_dim, entries=[])
    while True:
        now = time.time()
        ready = []
        for p in sorted(root.iterdir()):
            if p.name in sent or not p.is_file() or p.suffix.lower() not in _WATCHED:
                continue
            st = p.stat()
            stable = sizes.get(p.name) == st.st_size and st.st_size > 0 and now - st.st_mtime >= poll_s
            sizes[p.name] = st.st_size
            if stable:
                ready.append(p)
        for p in ready:
            rec = reader.read_entry(len(sent), {"name": p.stem, "file": p.name, "order": len(sent), "op_type": ""})
            if rec.status != "ok":
                continue    # most likely still being written: look again next poll, judge at the end
            sent.add(p.name)
            last_new = time.monotonic()
            yield rec
        manifest = root / MANIFEST
        if manifest.exists():
            try:
                listed = {n.get("file") for n in json.loads(manifest.read_text(encoding="utf-8")).get("nodes", [])
                          if isinstance(n, dict)}
            except (ValueError, AttributeError, UnicodeDecodeError) as e:
                raise LayerdiffError(f"is not valid JSON: {e}", file=str(manifest)) from e
            if listed <= sent:
                break
        if time.monotonic() - last_new > idle_s:
            break
        time.sleep(poll_s)
    for name in sorted(set(sizes) - sent):
        rec = reader.read_entry(len(sent), {"name": Path(name).stem, "file": name, "order": len(sent), "op_type": ""})
        if rec.status != "ok":
            rec.message = f"{rec.message} (file still incomplete or broken when the watch ended)"
        yield rec
