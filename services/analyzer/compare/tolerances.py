"""Tolerances: the global atol/rtol and per-op overrides from op_config.csv
(columns ``op_name,atol,rtol``, and optionally ``precision``; ``NA`` or an
empty cell keeps the global value). The precision column (fp32, tf32,
fp16, bf16, fp8_e4m3fn, fp8_e5m2, int8) says what that node computes in,
for the error model, over the job's precision and the data's types."""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass

from layerdiff.analyzer.align.names import normalize
from layerdiff.analyzer.compare.metrics import ATOL_DEFAULT, RTOL_DEFAULT
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.precision import Precision
from layerdiff.common.precision import parse as parse_precision


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


class Tolerances:
    def __init__(self, atol: float | None = None, rtol: float | None = None, op_config_csv: str = "",
                 node_precision: dict[str, str] | None = None) -> None:
        """``node_precision``: node -> precision name (the job's
        --node-precision), over op_config.csv's column."""
        self.default = Tolerance(ATOL_DEFAULT if atol is None else float(atol),
                                 RTOL_DEFAULT if rtol is None else float(rtol))
        for field, v in (("atol", self.default.atol), ("rtol", self.default.rtol)):
            if not math.isfinite(v) or v < 0:
                raise LayerdiffError(f"must be a finite number >= 0, got {v}", field=field)
        self.per_op: dict[str, tuple[float | None, float | None]] = {}
        self.precisions: dict[str, Precision] = {}      # normalized node name -> its precision
        if op_config_csv.strip():
            self._parse(op_config_csv)
        for name, value in (node_precision or {}).items():
            p = parse_precision(value, field=f"node_precision[{name}]")
            if p is not None:
                self.precisions[normalize(name)] = p

    def _parse(self, text: str) -> None:
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or "op_name" not in reader.fieldnames:
            raise LayerdiffError("needs a header with op_name,atol,rtol", file="op_config.csv", field="op_name")
        for line, row in enumerate(reader, start=2):
            name = (row.get("op_name") or "").strip()
            if not name:
                continue
            vals: list[float | None] = []
            for field in ("atol", "rtol"):
                raw = (row.get(field) or "NA").strip()
                if raw.upper() in ("NA", ""):
                    vals.append(None)
                    continue
                try:
                    v = float(raw)
                except ValueError:
                    raise LayerdiffError(f"line {line}: {raw!r} is not a number or NA", file="op_config.csv",
                                         node=name, field=field) from None
                if not math.isfinite(v) or v < 0:
                    raise LayerdiffError(f"line {line}: must be >= 0", file="op_config.csv", node=name, field=field)
                vals.append(v)
            self.per_op[normalize(name)] = (vals[0], vals[1])
            raw = (row.get("precision") or "").strip()
            if raw and raw.upper() != "NA":
                try:
                    p = parse_precision(raw, field="")
                except LayerdiffError as e:
                    raise LayerdiffError(f"line {line}: {e}", file="op_config.csv", node=name,
                                         field="precision") from None
                if p is not None:
                    self.precisions[normalize(name)] = p

    def for_node(self, *names: str) -> Tolerance:
        for n in names:
            o = self.per_op.get(normalize(n))
            if o is not None:
                return Tolerance(self.default.atol if o[0] is None else o[0],
                                 self.default.rtol if o[1] is None else o[1])
        return self.default
