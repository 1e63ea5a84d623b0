"""Overflow records of the Ascend runtime (``dump_debug`` on): the payload of
an ``Opdebug.Node_OpDebug.{task_id}.{stream_id}.{timestamp}`` dump file, and
the AI Core status register bits that say what overflowed.

Two payload layouts exist:

- the classic one (2048 bytes): three info blocks of six uint64
  (model_id, stream_id, task_id, task_type, pc_start, para_base) for
  *DHA Atomic Add* at 0, *L2 Atomic Add* at 128 and *AI Core* at 256; then the
  status words: DHA at 512, L2 at 768, and at 1024 the AI Core's
  kernel_code, block_idx and status;
- the newer one: a uint32 magic 0x5A5A5A5A and a uint32 version, then one
  accelerator record (valid, acc_type, reserved, data_len as uint32, then
  data_len bytes of uint64 fields whose names depend on acc_type).

Both decode to the JSON the vendor's tools print, so users find the fields
they know (model_id, stream_id, task_id, task_type, pc_start, para_base,
kernel_code, block_idx, status).
"""
from __future__ import annotations

import struct

from layerdiff.common.errors import LayerdiffError

# AI Core status register bits, as the runtime documents them.
STATUS_BITS = {
    0x008: "the sign of the most negative signed integer was negated (NEG overflow)",
    0x010: "integer add, subtract, multiply or multiply-add overflowed",
    0x020: "floating-point computation overflowed",
    0x080: "a negative number was converted to an unsigned type",
    0x100: "FP32 or INT32 to FP16 conversion overflowed",
    0x400: "CUBE accumulation overflowed",
}

CLASSIC_SIZE = 2048
_INFO_FIELDS = ("model_id", "stream_id", "task_id", "task_type", "pc_start", "para_base")
_HEX_FIELDS = frozenset({"pc_start", "para_base", "kernel_code", "src_addr", "dst_addr"})
_BLOCKS = (("DHA Atomic Add", 0, 512), ("L2 Atomic Add", 128, 768), ("AI Core", 256, 1024))

MAGIC = 0x5A5A5A5A
_ACC_TYPES = {0: "AIC", 1: "AIV", 2: "AICPU", 3: "SDMA"}
_ACC_FIELDS = {
    "AIC": ("model_id", "stream_id", "task_id", "task_type", "context_id", "thread_id", "pc_start", "para_base",
            "core_id", "block_id", "status"),
    "SDMA": ("model_id", "stream_id", "task_id", "task_type", "context_id", "thread_id", "src_addr", "dst_addr",
             "channel_id", "status"),
    "AICPU": ("model_id", "stream_id", "task_id", "task_type", "context_id", "cpu_id", "thread_id", "status"),
}
_ACC_FIELDS["AIV"] = _ACC_FIELDS["AIC"]
# Version 1 of AIC/AIV records widens the status to four words.
_V1_STATUS_WORDS = 4


def causes(status: int) -> list[str]:
    """The documented causes behind a status register value, one per set bit
    (an undocumented bit is named as such)."""
    out = []
    bit = 1
    while bit <= status:
        if status & bit:
            out.append(f"0x{bit:08x}: {STATUS_BITS.get(bit, 'undocumented status bit')}")
        bit <<= 1
    return out


def _u64(data: bytes, at: int) -> int:
    return struct.unpack_from("<Q", data, at)[0]


def _fmt(key: str, value: int):
    return hex(value) if key in _HEX_FIELDS else value


def decode(payload: bytes, shown: str = "overflow record") -> dict:
    """The vendor JSON of one overflow payload; a clear error for anything
    that is neither layout."""
    if len(payload) >= 8 and struct.unpack_from("<I", payload, 0)[0] == MAGIC:
        return _decode_new(payload, shown)
    if len(payload) != CLASSIC_SIZE:
        raise LayerdiffError(f"overflow payload of {len(payload)} bytes is neither the classic {CLASSIC_SIZE}-byte "
                             f"layout nor starts with the magic 0x{MAGIC:08X}", file=shown)
    out: dict = {}
    for title, info_at, status_at in _BLOCKS:
        block = {k: _fmt(k, _u64(payload, info_at + 8 * i)) for i, k in enumerate(_INFO_FIELDS)}
        if title == "AI Core":
            block["kernel_code"] = hex(_u64(payload, status_at))
            block["block_idx"] = _u64(payload, status_at + 8)
            block["status"] = _u64(payload, status_at + 16)
        else:
            block["status"] = _u64(payload, status_at)
        out[title] = block
    return out


def _decode_new(payload: bytes, shown: str) -> dict:
    if len(payload) < 24:
        raise LayerdiffError(f"overflow payload of {len(payload)} bytes is cut short", file=shown)
    magic, version, valid, acc_code, _rsv, data_len = struct.unpack_from("<6I", payload, 0)
    acc = _ACC_TYPES.get(acc_code)
    if acc is None:
        raise LayerdiffError(f"unknown accelerator type {acc_code} in overflow record", file=shown, field="acc_type")
    names = _ACC_FIELDS[acc]
    wide = acc in ("AIC", "AIV") and version == 1
    words = len(names) + (_V1_STATUS_WORDS - 1 if wide else 0)
    if data_len != 8 * words or len(payload) < 24 + data_len:
        raise LayerdiffError(f"overflow record declares {data_len} bytes of {acc} data, expected {8 * words} "
                             f"within {len(payload) - 24} bytes", file=shown, field="data_len")
    data: dict = {}
    for i, k in enumerate(names):
        at = 24 + 8 * i
        if k == "status" and wide:
            data[k] = [_u64(payload, at + 8 * j) for j in range(_V1_STATUS_WORDS)]
        else:
            data[k] = _fmt(k, _u64(payload, at))
    return {"magic": hex(magic), "version": version,
            "acc_list": {"valid": valid, "acc_type": acc, "rsv": _rsv, "data_len": data_len, "data": data}}


def flagged_tasks(record: dict) -> list[dict]:
    """(stream_id, task_id, status, unit) of every unit whose status is set,
    from a decoded record of either layout."""
    out = []
    if "acc_list" in record:
        d = record["acc_list"]["data"]
        st = d.get("status", 0)
        status = 0
        for w in (st if isinstance(st, list) else [st]):
            status |= int(w)
        if status:
            out.append({"unit": record["acc_list"]["acc_type"], "stream_id": int(d.get("stream_id", 0)),
                        "task_id": int(d.get("task_id", 0)), "status": status})
        return out
    for title, block in record.items():
        if isinstance(block, dict) and int(block.get("status", 0)):
            out.append({"unit": title, "stream_id": int(block["stream_id"]), "task_id": int(block["task_id"]),
                        "status": int(block["status"])})
    return out


def describe(flag: dict) -> str:
    """One line for a report: unit, status in hex and its causes."""
    return f"{flag['unit']} status 0x{flag['status']:x} (" + "; ".join(
        c.split(": ", 1)[1] for c in causes(flag["status"])) + ")"


def encode_classic(ai_core: dict, dha: dict | None = None, l2: dict | None = None) -> bytes:
    """A classic 2048-byte payload (the collector's own overflow records and
    tests use it); dict keys as in the decoded JSON, hex strings allowed."""
    buf = bytearray(CLASSIC_SIZE)

    def num(v) -> int:
        return int(v, 16) if isinstance(v, str) else int(v)

    for (title, info_at, status_at), block in zip(_BLOCKS, (dha or {}, l2 or {}, ai_core)):
        for i, k in enumerate(_INFO_FIELDS):
            struct.pack_into("<Q", buf, info_at + 8 * i, num(block.get(k, 0)))
        if title == "AI Core":
            struct.pack_into("<3Q", buf, status_at, num(block.get("kernel_code", block.get("pc_start", 0))),
                             num(block.get("block_idx", 0)), num(block.get("status", 0)))
        else:
            struct.pack_into("<Q", buf, status_at, num(block.get("status", 0)))
    return bytes(buf)


def scan(path: str) -> dict:
    """Every overflow record in a file or under a dump directory, decoded,
    with the operator dump files of the tasks each one flags."""
    from pathlib import Path

    import numpy as np

    from layerdiff.collector.dumps import ascend

    p = Path(path)
    if not p.exists():
        raise LayerdiffError("does not exist", file=str(path))
    root = p if p.is_dir() else p.parent
    files = ascend.dump_files(p) if p.is_dir() else [p]
    by_task: dict[tuple[int, int], list[str]] = {}
    if p.is_dir():
        for f in files:
            n = ascend.parse_name(f.name)
            if n is not None and not n.is_op_debug:
                by_task.setdefault((n.stream_id, n.task_id), []).append(str(f.relative_to(root)))
    out: dict = {"records": [], "unreadable": []}
    for f in files:
        n = ascend.parse_name(f.name)
        if p.is_dir() and (n is None or not n.is_op_debug):
            continue
        shown = str(f.relative_to(root))
        try:
            _, tensors = ascend.read_dump_file(f, shown=shown)
            payloads = [arr for role, _, arr in tensors if role == "output"]
            if not payloads:
                raise LayerdiffError("holds no overflow payload (no output)", file=shown)
            for arr in payloads:
                if isinstance(arr, LayerdiffError):
                    raise arr
                record = decode(np.asarray(arr).tobytes(), shown)
                flagged = [dict(flag, causes=causes(flag["status"]),
                                operators=by_task.get((flag["stream_id"], flag["task_id"]), []))
                           for flag in flagged_tasks(record)]
                out["records"].append({"file": shown, "record": record, "flagged": flagged})
        except LayerdiffError as e:
            out["unreadable"].append((shown, str(e)))
    return out
