"""``layerdiff convert``: any supported dump to ``.npy`` files (and
flattened ``.txt``), each with a JSON sidecar keeping name, op type, order,
dtype and shape, plus a manifest so the result is itself a dump directory.
File names come from node names through layerdiff.common.names.safe_filename and
never leave the output directory; unreadable nodes, and files no reader
takes, go to convert_skip.log with their reasons."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.collector.dumps.manifest import MANIFEST, placement
from layerdiff.common.names import safe_filename
from layerdiff.common.schema import ROLE_INPUT, STATUS_OK


def convert(dump: str | Path, out: str | Path, *, txt: bool = False, fmt: str = "",
            default_concat_dim: int = 0) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    nodes, skipped = [], []
    reader = DumpDirectory(str(dump), fmt=fmt, default_concat_dim=default_concat_dim)
    skipped.extend(reader.unread())
    for rec in reader.records():
        if rec.status != STATUS_OK or rec.array is None:
            skipped.append((rec.name, rec.message))
            continue
        # the vendor's converter names a node's tensors {op}.input.N / {op}.output.N
        stem = safe_filename(f"{rec.node or rec.name}.input.{rec.slot}" if rec.role == ROLE_INPUT else rec.name,
                             taken)
        np.save(out / f"{stem}.npy", rec.array, allow_pickle=False)
        side = {"name": rec.name, "op_type": rec.op_type, "order": rec.order, "dtype": rec.array.dtype.name,
                "shape": list(rec.array.shape), "file": f"{stem}.npy", **placement(rec)}
        (out / f"{stem}.json").write_text(json.dumps(side), encoding="utf-8")
        if txt:
            np.savetxt(out / f"{stem}.txt", rec.array.reshape(-1), fmt="%.9g" if rec.array.dtype.kind == "f" else "%d")
        nodes.append(side)
    (out / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    with open(out / "convert_skip.log", "w", encoding="utf-8") as f:
        for name, reason in skipped:
            f.write(f"{name}: {reason}\n".replace("\r", "\\r"))
    return {"converted": len(nodes), "skipped": len(skipped), "out": str(out),
            "skips": [f"{name}: {reason}" for name, reason in skipped[:3]]}
