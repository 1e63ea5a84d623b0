"""(c) the analyzer's peak RSS for jobs whose dumps are ~2 GB and ~8 GB of the
same network, against its memory budget (the reference's, and as much again
for diagnosis: the goal is at most twice the budget plus a few of the largest
tensor, whatever the dump) and against the dump; (d) the whole job on a
real CNN detector (PP-OCRv4 det) compared with its FP16 build, against
Polygraphy doing the same comparison in the same run.

Every measured program is its own process; peak RSS is the kernel's
high-water mark for that process (VmHWM).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from procs import bytecode_ready, serve, status_bytes, timed

from layerdiff.client.demo import det_input, packaged_model


def bench_vs_polygraphy(work: Path, height: int, width: int) -> dict:
    from polygraphy.json import save_json

    from layerdiff.collector.live.onnxrt import to_fp16

    ref = packaged_model()
    device = work / "det_fp16.onnx"
    onnx.save_model(to_fp16(onnx.load(str(ref))), str(device))
    x = det_input(height, width)
    np.savez(work / "page.npz", x=x)
    save_json([{"x": x}], str(work / "page.json"))
    bin_dir = Path(sys.executable).parent
    ours = timed([str(bin_dir / "layerdiff"), "run", str(ref), "--inputs", str(work / "page.npz"),
                   "--device-model", str(device), "--out", str(work / "ours"), "--no-progress"])
    summary = json.loads((work / "ours" / "summary.json").read_text())
    poly = bin_dir / "polygraphy"
    p1 = timed([str(poly), "run", str(ref), "--onnxrt", "--onnx-outputs", "mark", "all",
                 "--load-inputs", str(work / "page.json"), "--save-outputs", str(work / "ref_outputs.json")])
    p2 = timed([str(poly), "run", str(device), "--onnxrt", "--onnx-outputs", "mark", "all",
                 "--load-inputs", str(work / "page.json"), "--load-outputs", str(work / "ref_outputs.json")])
    poly_wall, poly_rss = p1[0] + p2[0], max(p1[1], p2[1])
    return {
        "model": ref.name, "input": [1, 3, height, width], "nodes_compared": summary["counts"]["compared"],
        "first_failing_node": (summary["first_failing_node"] or {}).get("node"),
        "layerdiff_wall_s": ours[0], "layerdiff_peak_rss_MiB": ours[1] / 2**20,
        "polygraphy_wall_s": poly_wall, "polygraphy_peak_rss_MiB": poly_rss / 2**20,
        "wall_ratio": ours[0] / poly_wall, "rss_ratio": ours[1] / poly_rss,
        "goal": "wall_ratio <= 0.33, rss_ratio <= 0.5",
    }


def bench_analyzer_rss(work: Path, side: int) -> dict:
    """A dump of the detector at side x side in float32 (~2 GB at 1088, ~8 GB
    at 2176), compared by an analyzer process: its peak RSS against its
    memory budget plus the largest tensor, and against the dump."""
    from layerdiff.analyzer.jobs.budget import MemoryBudget
    from layerdiff.client.api import run
    from layerdiff.collector.dumps.directory import write_dump
    from layerdiff.collector.live.onnxrt import LiveRunner

    ref = packaged_model()
    feeds = {"x": det_input(side, side)}
    dump = work / "dump"
    largest = 0

    def as_float32():        # a runtime that dumps its FP16 results as float32, written as they come
        nonlocal largest
        for rec in LiveRunner(ref.read_bytes(), feeds, precision="fp16").records():
            if rec.array is not None:
                rec.array = rec.array.astype(np.float32)
                largest = max(largest, rec.array.nbytes)
            yield rec

    write_dump(dump, as_float32())
    dump_bytes = sum(p.stat().st_size for p in dump.glob("*.npy"))
    np.savez(work / "in.npz", **feeds)
    collector, caddr = serve("collector", work / "collector")
    analyzer, aaddr = serve("analyzer", work / "analyzer")
    try:
        base = status_bytes(analyzer.pid, "VmHWM:")
        t = time.perf_counter()
        res = run(ref, work / "in.npz", dump=str(dump), analyzer=aaddr, collector=caddr, out=work / "rss-out",
                  progress=False)
        wall = time.perf_counter() - t
        peak = status_bytes(analyzer.pid, "VmHWM:")
    finally:
        analyzer.terminate()
        collector.terminate()
        analyzer.wait()
        collector.wait()
    budget = MemoryBudget.from_env().total
    memory = res.summary.get("memory", {})
    return {"input": [1, 3, side, side], "dump_MiB": dump_bytes / 2**20,
            "nodes": res.summary["counts"]["compared"], "largest_tensor_MiB": largest / 2**20,
            "budget_MiB": budget / 2**20, "reference_segments": memory.get("reference_segments"),
            "spilled_MiB": memory.get("spilled_bytes", 0) / 2**20,
            "analyzer_idle_rss_MiB": base / 2**20, "analyzer_peak_rss_MiB": peak / 2**20,
            # the bound: the reference's budget, as much again for diagnosis, and a few
            # tensors in flight (comparisons under way, a segment's inputs and outputs)
            "peak_above_idle_over_budget": (peak - base) / budget,
            "largest_tensors_beyond_twice_budget": (peak - base - 2 * budget) / largest,
            "peak_rss_over_dump": peak / dump_bytes, "job_wall_s": wall,
            "dump_GBps": dump_bytes / wall / 1e9, "analyzer_job_elapsed_s": res.summary["elapsed_s"]}


def bench_activation_scaling(work: Path, sizes: list[tuple[int, int]]) -> dict:
    """The detector's FP16 build run live at each input size (4x the pixels,
    4x the activations, from the first to the last), each job on an analyzer
    process of its own (its peak RSS is the job's): how the analyzer's peak
    grows with the activations, against the goal of 1.3x for 4x."""
    from layerdiff.client.api import run

    ref = packaged_model()
    rows = []
    for h, w in sizes:
        np.savez(work / f"in-{h}.npz", x=det_input(h, w))
        collector, caddr = serve("collector", work / f"collector-{h}")
        analyzer, aaddr = serve("analyzer", work / f"analyzer-{h}")
        try:
            idle = status_bytes(analyzer.pid, "VmHWM:")
            res = run(ref, work / f"in-{h}.npz", precision="fp16", analyzer=aaddr, collector=caddr,
                      out=work / f"scaling-{h}", progress=False)
            peak = status_bytes(analyzer.pid, "VmHWM:")
        finally:
            for proc in (analyzer, collector):
                proc.terminate()
                proc.wait()
        rows.append({"input": [1, 3, h, w], "analyzer_idle_rss_MiB": idle / 2**20,
                     "analyzer_peak_rss_MiB": peak / 2**20, "compared": res.summary["counts"]["compared"],
                     "job_elapsed_s": res.summary["elapsed_s"]})
    pixels = (sizes[-1][0] * sizes[-1][1]) / (sizes[0][0] * sizes[0][1])
    return {"sizes": rows, "pixels_ratio": pixels,
            "peak_ratio": rows[-1]["analyzer_peak_rss_MiB"] / rows[0]["analyzer_peak_rss_MiB"],
            "goal": "peak_ratio <= 1.3 for 4x the pixels"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--height", type=int, default=640)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--rss-sides", type=int, nargs="*", default=[1088, 2176],
                    help="input sides of the dumps (~2 GB at 1088, ~8 GB at 2176)")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-polygraphy", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    a = ap.parse_args(argv)
    bytecode_ready()
    out = {}
    if not a.skip_scaling:
        with tempfile.TemporaryDirectory(prefix="layerdiff-bench-scaling-") as tmp:
            sc = bench_activation_scaling(Path(tmp), [(480, 640), (960, 1280)])
        out["activation_scaling"] = sc
        first, last = sc["sizes"][0], sc["sizes"][-1]
        print(f"(c) analyzer peak RSS, FP16 build live: {first['analyzer_peak_rss_MiB']:.0f} MiB at "
              f"{first['input'][2]}x{first['input'][3]}, {last['analyzer_peak_rss_MiB']:.0f} MiB at "
              f"{last['input'][2]}x{last['input'][3]} ({sc['pixels_ratio']:.0f}x the pixels): "
              f"{sc['peak_ratio']:.2f}x (goal <= 1.3)")
    if not a.skip_polygraphy:
        with tempfile.TemporaryDirectory(prefix="layerdiff-bench-job-") as tmp:
            d = bench_vs_polygraphy(Path(tmp), a.height, a.width)
        out["vs_polygraphy"] = d
        print(f"(d) {d['model']} {d['input']} FP32 vs FP16 build, {d['nodes_compared']} nodes "
              f"(first failing: {d['first_failing_node']})")
        print(f"    layerdiff  {d['layerdiff_wall_s']:7.2f} s  {d['layerdiff_peak_rss_MiB']:8.0f} MiB")
        print(f"    polygraphy {d['polygraphy_wall_s']:7.2f} s  {d['polygraphy_peak_rss_MiB']:8.0f} MiB")
        print(f"    ratio wall {d['wall_ratio']:.2f} (goal <= 0.33), peak RSS {d['rss_ratio']:.2f} (goal <= 0.5)")
    if not a.skip_rss:
        out["analyzer_rss"] = []
        for side in a.rss_sides:
            with tempfile.TemporaryDirectory(prefix="layerdiff-bench-rss-") as tmp:
                c = bench_analyzer_rss(Path(tmp), side)
            out["analyzer_rss"].append(c)
            print(f"(c) dump {c['dump_MiB']:.0f} MiB at {side}x{side}, {c['nodes']} nodes, largest tensor "
                  f"{c['largest_tensor_MiB']:.0f} MiB: analyzer peak RSS {c['analyzer_peak_rss_MiB']:.0f} MiB "
                  f"(idle {c['analyzer_idle_rss_MiB']:.0f} MiB), {c['peak_rss_over_dump']:.2f}x the dump, "
                  f"{c['peak_above_idle_over_budget']:.2f}x the budget ({c['budget_MiB']:.0f} MiB) above idle, "
                  f"twice the budget {c['largest_tensors_beyond_twice_budget']:+.1f} largest tensors; "
                  f"{c['reference_segments']} segments, {c['spilled_MiB']:.0f} MiB spilled; "
                  f"job {c['job_wall_s']:.1f} s")
    print(json.dumps({"job": out}))
    return out


if __name__ == "__main__":
    main()
