"""What a manifest entry says, checked: the manifest's file name, the node
it names (free text, never a path), the file it points at (always inside the
dump directory), and where its tensor goes on that node (role, slot, node).
Read by DumpDirectory, written by write_dump and ``layerdiff convert``."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import ROLE_INPUT, ROLE_OUTPUT, NodeRecord

MANIFEST = "manifest.json"


def check_node_name(name: object) -> str:
    """Node names are free text, but never a path: reject NUL and '..' segments."""
    if not isinstance(name, str) or not name:
        raise LayerdiffError("node name must be a non-empty string", field="name")
    if "\x00" in name:
        raise LayerdiffError("node name contains a NUL character", node=name.replace("\x00", "\\0"), field="name")
    if any(part == ".." for part in name.replace("\\", "/").split("/")):
        raise LayerdiffError("node name contains a '..' path segment", node=name, field="name")
    return name


def resolve_inside(root: Path, rel: object, node: str, *, opened_without_following: bool = False) -> Path:
    """The entry's file ``rel`` under ``root``: never absolute, never through
    '..', and still inside ``root`` once links are resolved.
    ``opened_without_following``: the caller opens the file itself with
    O_NOFOLLOW (a link there fails the open, and the caller asks again
    without this): a file directly in ``root`` is then not looked at here."""
    simple = simple_inside(root, rel, node) if opened_without_following else None
    if simple is not None:
        return Path(simple)
    rel = _check_relative(rel, node)
    if not _through_link(root, rel):
        # no '..', not absolute, no link on the way: inside, as written
        return Path(os.path.abspath(os.path.join(root, rel)))
    p = (root / rel).resolve()
    if root.resolve() not in p.parents:
        raise LayerdiffError(f"file {rel!r} is outside the dump directory", node=node, field="file")
    return p


def simple_inside(root: Path | str, rel: object, node: str) -> str | None:
    """``resolve_inside`` of a file named directly in ``root`` that the
    caller opens with O_NOFOLLOW, as a string (no Path made: a thousand a
    dump); None for any other name (it goes through ``resolve_inside``)."""
    rel = _check_relative(rel, node)
    return None if "/" in rel else os.path.abspath(os.path.join(root, rel))


def _check_relative(rel: object, node: str) -> str:
    """A manifest's file name: never absolute, never through '..'."""
    if not isinstance(rel, str) or not rel:
        raise LayerdiffError("manifest entry has no file", node=node, field="file")
    if "\x00" in rel or os.path.isabs(rel) or any(p == ".." for p in rel.replace("\\", "/").split("/")):
        raise LayerdiffError(f"file {rel!r} is outside the dump directory", node=node, field="file")
    return rel


def _through_link(root: Path, rel: str) -> bool:
    """Whether a component of ``rel`` under ``root`` is a symbolic link (one
    lstat a component: resolving the whole path costs one for every
    component of the root too, a thousand times a dump)."""
    at = str(root)
    for part in rel.split("/"):       # as the system reads the path (a backslash is a name's)
        if not part or part == ".":
            continue
        at = os.path.join(at, part)
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                return True
        except OSError:
            return False        # missing from here on: nothing to follow (the caller says it is missing)
    return False


def entry_placement(entry: dict, name: str) -> tuple[str, int, str]:
    """(role, slot, node) of a manifest entry: an output of the node it names
    unless it says ``"role": "input"`` (then ``slot`` is the input index and
    ``node`` the consuming node)."""
    role = entry.get("role", ROLE_OUTPUT)
    if role not in (ROLE_OUTPUT, ROLE_INPUT):
        raise LayerdiffError(f"role {role!r} is neither 'output' nor 'input'", node=name, field="role")
    slot = entry.get("slot", 0)
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 1 << 20:
        raise LayerdiffError(f"slot {slot!r} is not an input/output index", node=name, field="slot")
    node = entry.get("node", name)
    node = check_node_name(node) if node != name else name
    return role, slot, node


def place(rec: NodeRecord, entry: dict, role: str, slot: int, node: str) -> NodeRecord:
    """``rec`` put where entry_placement says, with the entry's overflow flag
    and the type the device wrote it in (``source_dtype``: bfloat16, FP8,
    where the file holds it widened)."""
    rec.role, rec.slot, rec.node = role, slot, node
    flag = entry.get("overflow")
    rec.overflow = flag if isinstance(flag, str) else ""
    source = entry.get("source_dtype")
    if isinstance(source, str) and source:
        rec.source_dtype = source
    about = entry.get("attributes")
    if isinstance(about, str) and about:
        rec.attributes = about
    op_type = entry.get("op_type")
    if isinstance(op_type, str) and op_type and not rec.op_type:
        rec.op_type = op_type
    return rec


def placement(r: NodeRecord) -> dict:
    """The manifest fields that place a record on its node (see entry_placement)."""
    d: dict = {}
    if r.role == ROLE_INPUT:
        d.update(role=ROLE_INPUT, slot=r.slot, node=r.node or r.name)
    elif r.node and r.node != r.name:
        d.update(node=r.node, slot=r.slot)
    if r.overflow:
        d["overflow"] = r.overflow
    if r.source_dtype:
        d["source_dtype"] = r.source_dtype
    if r.attributes:
        d["attributes"] = r.attributes
    return d
