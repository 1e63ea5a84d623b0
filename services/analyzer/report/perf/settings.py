"""The performance settings of a job (``perf_mode``: DUMP_OP_PERF 0 / 1 /
2, runs, clock), checked at submit time: what every job prepares, apart
from the performance tables (``table``) that only a performance job needs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

from layerdiff.collector.live.profile import (
    DEFAULT_GRAPH_OPTIMIZATION,
    DEFAULT_RUNS,
    MAX_RUNS,
    check_graph_optimization,
)
from layerdiff.common.errors import LayerdiffError
from layerdiff.v1 import layerdiff_pb2 as pb

DEFAULT_CLOCK_MHZ = 1000.0
MODES: dict[str, pb.PerfMode.ValueType] = {
    "accuracy": pb.PERF_MODE_ACCURACY, "perf": pb.PERF_MODE_PERF, "both": pb.PERF_MODE_BOTH,
    "0": pb.PERF_MODE_ACCURACY, "1": pb.PERF_MODE_PERF, "2": pb.PERF_MODE_BOTH}
MODE_NAMES: dict[pb.PerfMode.ValueType, str] = {
    pb.PERF_MODE_ACCURACY: "accuracy", pb.PERF_MODE_PERF: "perf", pb.PERF_MODE_BOTH: "both"}


def parse_mode(value) -> pb.PerfMode.ValueType:
    """``accuracy`` / ``perf`` / ``both``, or the seed's DUMP_OP_PERF 0 / 1 / 2."""
    if isinstance(value, int) and value in MODE_NAMES:
        return cast(pb.PerfMode.ValueType, value)      # one of the enum's values (checked just above)
    mode = MODES.get(str(value or "accuracy").strip().lower())
    if mode is None:
        raise LayerdiffError(f"unknown perf mode {value!r} (accuracy, perf, both, or 0, 1, 2)", field="perf_mode")
    return mode


@dataclass(frozen=True)
class PerfSettings:
    mode: pb.PerfMode.ValueType = pb.PERF_MODE_ACCURACY
    hide_span_nodes: bool = False
    runs: int = DEFAULT_RUNS
    clock_mhz: float = DEFAULT_CLOCK_MHZ
    graph_optimization: str = DEFAULT_GRAPH_OPTIMIZATION

    @property
    def enabled(self) -> bool:
        return self.mode != pb.PERF_MODE_ACCURACY

    @property
    def only(self) -> bool:
        return self.mode == pb.PERF_MODE_PERF

    def as_dict(self) -> dict:
        return {"perf_mode": MODE_NAMES[self.mode], "perf_all_nodes": not self.hide_span_nodes,
                "perf_runs": self.runs, "clock_mhz": self.clock_mhz,
                "graph_optimization": self.graph_optimization}


def check_perf_options(o: pb.PerfOptions) -> PerfSettings:
    """Checked at submit time, so bad options fail the Submit call."""
    if o.mode not in MODE_NAMES:
        raise LayerdiffError(f"unknown perf mode {o.mode}", field="perf_mode")
    runs = o.runs or DEFAULT_RUNS
    if runs < 1 or runs > MAX_RUNS:
        raise LayerdiffError(f"must be between 1 and {MAX_RUNS}", field="perf_runs")
    clock = o.clock_mhz or DEFAULT_CLOCK_MHZ
    if not math.isfinite(clock) or clock <= 0:
        raise LayerdiffError("must be a positive frequency in MHz", field="clock_mhz")
    return PerfSettings(o.mode, o.hide_span_nodes, runs, clock, check_graph_optimization(o.graph_optimization))
