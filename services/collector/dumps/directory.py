"""Dump directories on the collector's host, read where they lie.

A dump is one file per node output in one of the formats of
layerdiff.collector.dumps.readers (npy, npz, onnx, bin, h5), tiled slices
(layerdiff.collector.dumps.tiled), or an Ascend runtime dump
(layerdiff.collector.dumps.ascend); DumpDirectory lists the dump and hands
each entry to its format's reader, and write_dump writes any of them.

An optional ``manifest.json`` lists the nodes with their execution order::

    {"nodes": [{"name": "conv1", "op_type": "Conv", "order": 0, "file": "conv1.npy"},
               {"name": "fc", "file": "all.bin", "format": "bin", "dtype": "float16",
                "shape": [1, 10], "offset": 4096}]}

Tiled nodes list their ``slices`` instead of a ``file`` (see
layerdiff.collector.dumps.tiled). What an entry's ``name``, ``file``,
``role``, ``slot`` and ``node`` may hold is checked by
layerdiff.collector.dumps.manifest.

An entry's format is its ``format`` field, else the dump's format, else the
file extension. Without a manifest every file of a known extension (or of the
chosen format) is read, in file-name order. Every entry is validated on its own (name, path, header,
size) before anything is mapped, and a bad entry becomes an error record for
that node only: the rest of the dump streams on.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps.manifest import (
    MANIFEST,
    check_node_name,
    entry_placement,
    place,
    placement,
    resolve_inside,
    simple_inside,
)
from layerdiff.collector.dumps.readers import (
    FinalLink,
    h5_ordered,
    read_h5,
    read_npy,
    read_npz,
    read_raw,
    read_tensor_proto,
)
from layerdiff.collector.dumps.tiled import splice
from layerdiff.common.errors import LayerdiffError, NotFoundError
from layerdiff.common.npz import write_npz
from layerdiff.common.schema import (
    DEFAULT_MAX_TENSOR_BYTES,
    ROLE_INPUT,
    ROLE_OUTPUT,
    NodeRecord,
    original_op,
)

FORMATS = ("npy", "npz", "onnx", "bin", "h5", "ascend")
_EXTENSIONS = {".npy": "npy", ".npz": "npz", ".pb": "onnx", ".tensor": "onnx", ".bin": "bin", ".h5": "h5",
               ".hdf5": "h5"}


# the formats a file's extension alone says how to read (bin needs a manifest's dtype and shape)
_SELF_DESCRIBING = ("npy", "npz", "onnx", "h5")
_SEQ = re.compile(r"^(\d+)[_.-]|[_.-](\d+)$")


# What a dump's execution order was read from (DumpDirectory.order_from,
# DeviceGraph.order_from): every source but the last is trusted; by the names
# alone no order is known, and no node is called first.
ORDER_MANIFEST = "the manifest's order"
ORDER_RUNTIME = "the runtime's timestamps"
ORDER_ARCHIVE = "the archive's order"
ORDER_CALLS = "the HDF5 calls' order"
ORDER_ONE = "its one tensor"
ORDER_TIMES = "the files' modification times"
ORDER_SEQUENCE = "the sequence numbers in the file names"
ORDER_UNKNOWN = "the file names"
ORDER_KEYS = "the HDF5 file's group names"
# the sources that give no order, and why
UNORDERED = {ORDER_UNKNOWN: "its files carry equal modification times and no sequence numbers in their names",
             ORDER_KEYS: "its HDF5 calls carry no order attributes or distinct seqids, and the file does not keep "
                         "the order they were written in"}


def _files(root: Path) -> list[os.DirEntry[str]]:
    """The files (or links to files) directly in ``root``, as its listing
    gives them: what each is, and its times once asked, come with the entry
    (one look a file, not three)."""
    out = []
    with os.scandir(root) as it:
        for e in it:
            try:
                if e.is_file():
                    out.append(e)
            except OSError:
                continue
    return out


def _format_of(name: str) -> str | None:
    """The dump format a file's extension names (None: none)."""
    return _EXTENSIONS.get(os.path.splitext(name)[1].lower())


def execution_order(files: list[os.DirEntry[str]]) -> tuple[list[str], str]:
    """The names of a manifest-less dump's files in execution order, and
    what the order came from: the files' modification times (nanoseconds)
    where no two are equal (a script writes its tensors one after the
    other); else a sequence number every name carries (``00012_conv.npy``,
    ``conv.12.npy``: msprobe's and most scripts' convention), by its value;
    else the names, which say nothing of the order (ORDER_UNKNOWN)."""
    if len(files) > 1:
        times = [p.stat().st_mtime_ns for p in files]
        if len(set(times)) == len(times):
            return [p.name for _, p in sorted(zip(times, files))], ORDER_TIMES
    seqs = []
    for p in files:
        m = _SEQ.search(os.path.splitext(p.name)[0])
        seqs.append(int(m.group(1) or m.group(2)) if m else None)
    if files and all(q is not None for q in seqs) and len(set(seqs)) == len(seqs):
        return [p.name for _, p in sorted(zip(seqs, files))], ORDER_SEQUENCE
    return sorted(p.name for p in files), ORDER_UNKNOWN


def _without_leading_numbers(stems: list[str]) -> list[str]:
    """``00012_conv`` is the tensor ``conv``, the 12th written: the number
    leaves the name where every name leads with one and the rest stay
    distinct (a trailing number may be the tensor's own: ``layer_2``)."""
    rest = [m.string[m.end():] if (m := _SEQ.match(s)) and m.group(1) else "" for s in stems]
    return rest if all(rest) and len(set(rest)) == len(rest) else stems


class DumpDirectory:
    """A directory of node dumps, or one file that is a dump (an HDF5 or
    .npz archive, a single .npy or .pb tensor), read where it lies."""

    def __init__(self, path: str, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, fmt: str = "",
                 default_concat_dim: int = 0, entries: list[dict] | None = None) -> None:
        """``entries``: read these manifest entries instead of listing the directory."""
        if not path:
            raise LayerdiffError("no dump path given", field="dump_path")
        if fmt and fmt not in FORMATS:
            raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
        self.root = Path(path)
        single: str | None = None
        single_kind = ""
        if self.root.is_file():
            kind = fmt or _EXTENSIONS.get(self.root.suffix.lower(), "")
            if kind not in _SELF_DESCRIBING:
                raise LayerdiffError(f"dump file {path!r} is not one layerdiff reads as a dump (.h5, .npz, .npy, .pb; "
                                     "or give the directory)", field="dump_path")
            single, single_kind, self.root = self.root.name, kind, self.root.parent
        elif not self.root.is_dir():
            raise NotFoundError(f"dump file or directory {path!r} does not exist on the collector host",
                                field="dump_path")
        # made absolute once: a relative root would ask the system for the
        # working directory again for every file it names (a call a file)
        self._absolute_root = os.path.abspath(self.root)
        self.max_tensor_bytes = max_tensor_bytes
        self.fmt = fmt
        self.default_concat_dim = default_concat_dim
        self.ascend_files: list[Path] | None = None
        self.graph_inputs: list[str] = []     # the manifest's top-level "inputs" (see collector.dumpgraph)
        # what the execution order was read from (ORDER_*)
        self.order_from = ORDER_MANIFEST
        if entries is None and single is not None:
            entries = [{"name": Path(single).stem, "file": single, "order": 0, "op_type": ""}]
            self.order_from = {"h5": ORDER_CALLS, "npz": ORDER_ARCHIVE}.get(single_kind, ORDER_ONE)
            if single_kind == "h5" and not h5_ordered(self.root / single):
                self.order_from = ORDER_KEYS
        self.single = single
        self.entries = entries if entries is not None else self._entries()

    @property
    def order_known(self) -> bool:
        """Can the dump's first failing node be called first?"""
        return self.order_from not in UNORDERED

    @property
    def order_unknown(self) -> str:
        """Why the dump has no execution order ('' where it has one)."""
        return UNORDERED.get(self.order_from, "")

    def _entries(self) -> list[dict]:
        mpath = self.root / MANIFEST
        listed = None if mpath.exists() else _files(self.root)
        if listed is not None and self.fmt in ("", "ascend"):
            # Vendor runtime dumps: {op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}
            # files, possibly under {time}/{device_id}/{model_id}/{data_index}.
            from layerdiff.collector.dumps import ascend

            found = ascend.dump_files(self.root)
            # files named as the runtime names its dumps, and nothing else
            # layerdiff reads: read as such, so that an unreadable one is said
            others = any(_format_of(e.name) in _SELF_DESCRIBING for e in listed)
            if self.fmt == "ascend" or any(ascend.looks_like_dump(p) for p in found[:8]) or (found and not others):
                self.ascend_files = found
                self.order_from = ORDER_RUNTIME
                return []
        if listed is not None:
            files = [e for e in listed if e.name != MANIFEST and
                     (_format_of(e.name) == self.fmt if self.fmt else _format_of(e.name) in _SELF_DESCRIBING)]
            names, self.order_from = execution_order(files)
            # a number leading every name is the script's count, not the
            # tensor's name, whatever gave the order (two builds number
            # their tensors differently: an FP16 build's casts shift them)
            # (a dump file's stem: its name without its extension, no Path made a file)
            stems = _without_leading_numbers([os.path.splitext(f)[0] for f in names])
            return [{"name": stem, "file": f, "order": i, "op_type": ""}
                    for i, (stem, f) in enumerate(zip(stems, names))]
        try:
            doc = json.loads(mpath.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise LayerdiffError(f"is not valid JSON: {e}", file=str(mpath)) from e
        nodes = doc.get("nodes") if isinstance(doc, dict) else None
        inputs = doc.get("inputs") if isinstance(doc, dict) else None
        if isinstance(inputs, list):
            self.graph_inputs = [v for v in inputs if isinstance(v, str)]
        if not isinstance(nodes, list):
            raise LayerdiffError("must hold {\"nodes\": [...]}", file=str(mpath), field="nodes")
        return nodes

    def unread(self) -> list[tuple[str, str]]:
        """The files of the directory no reader takes, each with why (what
        ``convert`` reports): (path relative to the directory, reason)."""
        if self.single is not None:
            return []
        taken = {MANIFEST}
        if self.ascend_files is not None:
            taken |= {str(p.relative_to(self.root)) for p in self.ascend_files}
        else:
            taken |= {e["file"] for e in self.entries if isinstance(e, dict) and isinstance(e.get("file"), str)}
        stems = {Path(t).stem for t in taken}
        out = []
        for p in sorted(self.root.iterdir()):
            # a tensor's sidecars (its .json, .txt) and the logs layerdiff writes beside them are no tensors
            if p.is_file() and p.name not in taken and p.suffix.lower() != ".log" \
                    and not (p.suffix.lower() in (".json", ".txt") and p.stem in stems):
                kind = _EXTENSIONS.get(p.suffix.lower())
                why = (f"a {kind} file, while the dump is read as {self.fmt or 'another format'}" if kind else
                       "not a dump file (no dump format has this name or extension)")
                out.append((p.name, why))
        return out

    def records(self) -> Iterator[NodeRecord]:
        if self.ascend_files is not None:
            from layerdiff.collector.dumps import ascend

            yield from ascend.records(self.root, self.ascend_files, self.max_tensor_bytes, check_node_name)
            return
        for i, entry in enumerate(self.entries):
            fmt = self._format(entry) if isinstance(entry, dict) else None     # read once an entry
            if fmt in ("npz", "h5"):
                yield from self._archive_records(i, entry)
            else:
                yield self.read_entry(i, entry, fmt)

    def _format(self, entry: dict) -> str:
        fmt = entry.get("format") or self.fmt
        if not fmt and isinstance(entry.get("file"), str):     # no Path made: a thousand entries a dump
            fmt = _format_of(entry["file"]) or "npy"
        return fmt or "npy"

    def _archive_records(self, i: int, entry: dict) -> Iterator[NodeRecord]:
        """Files holding many nodes (npz, HDF5)."""
        order = entry.get("order", i) if isinstance(entry.get("order", i), int) else i
        try:
            path = resolve_inside(self.root, entry.get("file"), str(entry.get("name")))
            read = read_h5 if self._format(entry) == "h5" else read_npz
            members = list(read(path, self.max_tensor_bytes))
        except LayerdiffError as e:
            yield NodeRecord.error(str(entry.get("name") or f"<entry {i}>"), str(e), order=order)
            return
        # npz members carry no role of their own: the entry's "members" map says
        # which are inputs; HDF5 datasets say it by their group.
        members_field = entry.get("members")
        placements = members_field if isinstance(members_field, dict) else {}
        for key, value, *where in members:
            placed = placements.get(key) if not where else None
            rec_order = order
            try:
                name = check_node_name(key)
                if isinstance(placed, dict):
                    role, slot, node = entry_placement(placed, name)
                elif where:
                    role, slot = where[0], where[1]
                    node = name
                    placed = {"overflow": where[2] if len(where) > 2 else "",
                              "source_dtype": where[4] if len(where) > 4 else "",
                              "op_type": where[5] if len(where) > 5 else "",
                              "attributes": where[6] if len(where) > 6 else ""}
                    if len(where) > 3 and where[3] >= 0:
                        rec_order = where[3]
                else:
                    role, slot, node = ROLE_OUTPUT, 0, name
            except LayerdiffError as e:
                yield NodeRecord.error(key.replace("\x00", "\\0") or f"<member of {path.name}>", str(e),
                                       order=order)
                continue
            if isinstance(value, LayerdiffError):
                yield NodeRecord.error(name, str(value), order=rec_order, node=node, role=role, slot=slot)
            else:
                yield place(NodeRecord(name=name, op_type=entry.get("op_type") or "", order=rec_order,
                                       array=value),
                            placed if isinstance(placed, dict) else {}, role, slot, node)

    def _npy(self, path: Path | str, entry: dict, name: str, shown: str, no_link: bool) -> np.ndarray:
        try:
            return read_npy(path, self.max_tensor_bytes, name=shown, no_link=no_link)
        except FinalLink:
            raise
        except LayerdiffError:
            # asked only then: a stat a file less for the thousands that are there
            if not os.path.exists(path):
                raise _missing(entry, name) from None
            raise

    def read_entry(self, i: int, entry: object, fmt: str | None = None) -> NodeRecord:
        """One manifest entry as a record (an error record if it cannot be
        read); ``fmt``: its format, where the caller has read it already."""
        if not isinstance(entry, dict):
            return NodeRecord.error(f"<entry {i}>", f"manifest entry {i} is not an object")
        raw_name = entry.get("name")
        op_type = entry.get("op_type") or ""
        order = entry.get("order", i)
        if not isinstance(op_type, str):
            op_type = str(op_type)
        if not isinstance(order, int) or isinstance(order, bool):
            order = i
        role, slot = ROLE_OUTPUT, 0
        try:
            name = check_node_name(raw_name)
            role, slot, node = entry_placement(entry, name)
            if "slices" in entry:
                arr = splice(self.root, entry, name, self.default_concat_dim, self.max_tensor_bytes)
                return place(NodeRecord(name=name, op_type=op_type, order=order, array=arr), entry, role, slot,
                             node)
            fmt = fmt or self._format(entry)
            shown = str(entry.get("file"))
            if fmt == "npy":
                # opened without following a link: a file of the dump's own
                # directory needs no look of its own first (one system call,
                # and no Path made, less a file: a thousand a dump); a link
                # there is checked
                simple = simple_inside(self._absolute_root, entry.get("file"), name)
                try:
                    arr = self._npy(simple if simple is not None else resolve_inside(
                        self.root, entry.get("file"), name, opened_without_following=True),
                        entry, name, shown, no_link=True)
                except FinalLink:      # a link: where it leads must lie inside the dump too
                    arr = self._npy(resolve_inside(self.root, entry.get("file"), name), entry, name, shown,
                                    no_link=False)
            else:
                path = resolve_inside(self.root, entry.get("file"), name)
                if not path.exists():
                    raise _missing(entry, name)
                if fmt == "onnx":
                    _, arr = read_tensor_proto(path, self.max_tensor_bytes, name=shown)
                elif fmt == "bin":
                    arr = read_raw(path, entry.get("dtype"), entry.get("shape"), entry.get("offset", 0),
                                   self.max_tensor_bytes, name=shown)
                else:
                    raise LayerdiffError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})", node=name,
                                         field="format")
        except LayerdiffError as e:
            shown = raw_name if isinstance(raw_name, str) and raw_name else f"<entry {i}>"
            return NodeRecord.error(shown.replace("\x00", "\\0"), str(e), op_type, order,
                                    status=getattr(e, "status", "error"), role=role, slot=slot)
        return place(NodeRecord(name=name, op_type=op_type, order=order, array=arr), entry, role, slot, node)


def _write_about(call, text: str) -> None:
    """A record's attributes (JSON text of {"attrs": ..., "args": ...}) back
    on its HDF5 call group, as layerdiff.torch writes them."""
    import json

    try:
        about = json.loads(text)
    except ValueError:
        return
    for key in ("attrs", "args"):
        if isinstance(about, dict) and key in about:
            call.attrs[key] = json.dumps(about[key])


def write_dump(directory: str | Path, records: Iterable[NodeRecord], fmt: str = "npy") -> Path:
    """Write records (outputs, and inputs where a record's role says so) as a
    dump directory in any of FORMATS, with a manifest where the format needs
    one (used to save what a live run produced, and by tests and demos).
    Every format but npz and ascend writes each record as it comes, so a
    generator's dump never has to fit in memory. Returns the directory a
    reader should be given."""
    if fmt not in FORMATS:
        raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kept: Iterable[tuple[int, NodeRecord]] = ((i, r) for i, r in enumerate(records) if r.array is not None)
    if fmt in ("npz", "ascend"):
        kept = list(kept)
    if fmt == "ascend":
        return _write_ascend(root, kept)
    nodes: list[dict] = []
    if fmt == "h5":
        import h5py

        with h5py.File(root / "dump.h5", "w", track_order=True) as f:
            for _, r in kept:
                # grouped by operator, as the layout is: /op/seqid/{input,output}/N
                node = (r.node or r.name).replace("/", "_")
                ds = f.create_dataset(f"{node}/0/{r.role}/{r.slot}", data=r.array)
                if r.overflow:
                    ds.attrs["overflow"] = r.overflow
                if r.source_dtype:
                    ds.attrs["dtype"] = r.source_dtype
                call = f[f"{node}/0"]
                if r.op_type and "class" not in call.attrs and "op" not in call.attrs:
                    call.attrs["op" if r.op_type.startswith("aten.") else "class"] = r.op_type
                if r.attributes and "attrs" not in call.attrs and "args" not in call.attrs:
                    _write_about(call, r.attributes)
        nodes.append({"name": "dump", "file": "dump.h5", "format": "h5", "order": 0})
    elif fmt == "npz":
        keys = [r.name if r.role != ROLE_INPUT else f"{r.node or r.name}.input.{r.slot}" for _, r in kept]
        write_npz(root / "dump.npz", {k: _held(r) for k, (_, r) in zip(keys, kept)})
        members = {k: placement(r) for k, (_, r) in zip(keys, kept) if placement(r)}
        nodes.append({"name": "dump", "file": "dump.npz", "format": "npz", "order": 0, "members": members})
    elif fmt == "bin":
        offset = 0
        with open(root / "dump.bin", "wb") as f:
            for i, r in kept:
                pad = -offset % 64
                f.write(b"\0" * pad)
                offset += pad
                arr = np.require(r.array, requirements="C")  # keeps 0-d tensors 0-d
                f.write(arr.tobytes())
                nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                              "file": "dump.bin", "format": "bin", "dtype": arr.dtype.name,
                              "shape": list(arr.shape), "offset": offset, **placement(r)})
                offset += arr.nbytes
    else:
        from onnx import numpy_helper

        for i, r in kept:
            if fmt == "onnx":
                fname = f"{i:05d}.pb"
                (root / fname).write_bytes(numpy_helper.from_array(np.asarray(r.array), r.name).SerializeToString())
            else:
                fname = f"{i:05d}.npy"
                np.save(root / fname, _held(r), allow_pickle=False)
            nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                          "file": fname, **placement(r)})
    (root / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    return root


def _held(r: NodeRecord) -> np.ndarray:
    """The array of a record write_dump keeps (it keeps only records with one)."""
    assert r.array is not None
    return r.array


def _write_ascend(root: Path, kept: Iterable[tuple[int, NodeRecord]]) -> Path:
    """One vendor dump file per node ({time}/{device_id}/{model_id}/{data_index}
    layout), and an overflow record for every node flagged as overflowing."""
    from layerdiff.collector.dumps import ascend, overflow

    leaf = ascend.leaf_dir(root)
    leaf.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[NodeRecord]] = {}
    for _, r in kept:
        groups.setdefault(r.node or r.name, []).append(r)
    base = int(time.time() * 1e6)
    for task_id, (node, recs) in enumerate(groups.items(), start=1):
        ins = sorted((r for r in recs if r.role == ROLE_INPUT), key=lambda r: r.slot)
        outs = sorted((r for r in recs if r.role != ROLE_INPUT), key=lambda r: r.slot)
        stamp = base + 2 * task_id
        fname = ascend.file_name(recs[0].op_type, node, task_id, 0, stamp)
        ascend.write_dump_file(leaf / fname, node, [_held(r) for r in ins], [_held(r) for r in outs], stamp,
                               original_ops=[original_op(r.attributes) for r in outs])
        if any(r.overflow for r in recs):
            payload = overflow.encode_classic({"model_id": 1, "stream_id": 0, "task_id": task_id,
                                               "status": 0x20})
            ascend.write_op_debug_file(leaf / ascend.file_name("Opdebug", "Node_OpDebug", 10**6 + task_id, 0,
                                                               stamp + 1), payload, stamp + 1)
    return root


def _missing(entry: dict, name: str) -> LayerdiffError:
    return LayerdiffError(f"manifest names a missing file {entry.get('file')!r}", node=name, field="file")
