"""(e) `layerdiff compare` of two dumps (a golden FP32 dump of the packaged
PP-OCRv4 detector and the dump of its FP16 build, ~770 MB together, the
FP32 one about 2/3 of it) against reading the two dumps' files once, both
measured in the same run, warm (files in the page cache) and cold.

- read: a plain script (its own process) reading every file of both dumps
  once with os.readv into one reused buffer; its figure is the time of the
  reading loop alone (the process's start-up is reported beside it);
- job: the whole command, `python -m layerdiff.client.cli compare GOLDEN
  DEVICE --out DIR --no-progress` with the embedded services, from its
  start to its exit (start-up, both streams, comparisons, reports);
- the two in turn (read, job, read, job, ...), each ratio job / read taken
  pair by pair, the median quoted; one warm-up pair is not counted;
- cold: the page cache dropped before every read and every job
  (``echo 3 > /proc/sys/vm/drop_caches`` as root, which also evicts the
  interpreter's libraries: the job starts cold too), else each dump file
  evicted with posix_fadvise(DONTNEED) (the dumps only); the method used is
  recorded;
- phases: one more warm job in its own process, through the Python API,
  timing its states from the job's events (start-up, golden dump streamed
  into the spill directory, device dump streamed and compared, reports,
  fetch).

- user (``--formats npy,user``): the same two runs dumped as a user's own
  script writes them (a plain onnxruntime session with every node output
  made a graph output, ``{i:04d}_{name}.npy`` in its output order, no
  manifest; the FP16 build from onnxruntime's convert_float_to_float16,
  whose casts add device tensors of its own and shift the numbers): the
  order, the names and the extra tensors are found by the reader, not
  told by a manifest;
- msprobe (``--msprobe``): the peer tool's ``msprobe compare`` on the same
  tensors, measured in the same run, in turn with the job (msprobe, job,
  msprobe, job, ...; one warm-up pair not counted), wall time and peak RSS
  of each whole process. mindstudio-probe is installed on first use into a
  virtual environment of its own (``--msprobe-venv``, default
  ~/.cache/layerdiff-bench/msprobe): its requirements are not the
  project's. The dumps are converted to its PyTorch layout first (dump.json
  and one .pt per tensor, not timed), with this environment's torch, which
  msprobe also imports from here. The goal: the job at least 10x faster
  than msprobe, at no more than its peak memory.

Usage: python bench/bench_compare.py [--side N] [--target-mb 770]
       [--runs 3] [--formats npy[,h5][,user]] [--no-cold] [--cold-method auto|drop_caches|fadvise]
       [--keep DIR] [--msprobe] [--msprobe-venv DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from procs import bytecode_ready, timed

MSPROBE_VERSION = "26.2.0"
MSPROBE_GOAL = "job at least 10x faster than msprobe compare, at no more than its peak RSS"
GOAL = "job within a large fraction of reading the two dumps once (ratio job/read near 1)"

_READ_SCRIPT = r"""
import json, os, sys, time
buf = memoryview(bytearray(16 << 20))
files = []
for d in sys.argv[1:]:
    for root, _, names in os.walk(d):
        files += [os.path.join(root, n) for n in sorted(names)]
t = time.perf_counter()
n = 0
for p in files:
    fd = os.open(p, os.O_RDONLY)
    try:
        while True:
            k = os.readv(fd, [buf])
            if not k:
                break
            n += k
    finally:
        os.close(fd)
print(json.dumps({"bytes": n, "files": len(files), "read_s": time.perf_counter() - t}))
"""

_PHASES_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from layerdiff.client.api import compare
from layerdiff.v1 import layerdiff_pb2 as pb
marks, seen = [], set()
def on_event(e):
    state = pb.JobState.Name(e.state)
    if state == "REFERENCE" and "reference tensors read from" in e.message:
        state = "GOLDEN_READ"
    if state not in seen:
        seen.add(state)
        marks.append((state, time.perf_counter() - t0))
res = compare(sys.argv[1], sys.argv[2], out=sys.argv[3], progress=on_event)
marks.append(("FETCHED", time.perf_counter() - t0))
print(json.dumps({"marks": marks, "analyzer_elapsed_s": res.summary.get("elapsed_s")}))
"""


# ------------------------------------------------------------------ dumps

def _records(x: np.ndarray, precision: str) -> list:
    from layerdiff.client.demo import packaged_model
    from layerdiff.collector.live.onnxrt import LiveRunner

    return [r for r in LiveRunner(packaged_model().read_bytes(), {"x": x}, precision=precision).records()
            if r.array is not None]


def bytes_per_pixel(probe: int = 256) -> tuple[float, float]:
    """Tensor bytes of the FP32 and the FP16 run per input pixel, measured on
    a probe-sized input (the detector is fully convolutional: its tensors
    scale with the input's area)."""
    from layerdiff.client.demo import det_input

    x = det_input(probe, probe)
    return tuple(sum(r.array.nbytes for r in _records(x, p)) / probe ** 2 for p in ("fp32", "fp16"))


def pick_side(target_bytes: float, per_px: tuple[float, float]) -> int:
    """The square input side (a multiple of 32, as the detector wants) whose
    two dumps come nearest ``target_bytes`` together."""
    return max(32, int(round((target_bytes / sum(per_px)) ** 0.5 / 32)) * 32)


def make_dumps(root: Path, side: int, fmt: str) -> dict:
    """Golden FP32 and device FP16 dumps of the detector at side x side."""
    from layerdiff.client.demo import det_input
    from layerdiff.collector.dumps.directory import write_dump

    x = det_input(side, side)
    out = {}
    for name, precision in (("golden", "fp32"), ("device", "fp16")):
        recs = _records(x, precision)
        d = write_dump(root / f"{name}-{fmt}", recs, fmt)
        out[name] = {"path": str(d), "tensors": len(recs), "tensor_bytes": sum(r.array.nbytes for r in recs),
                     "file_bytes": _dir_bytes(d), "dtypes": sorted({r.array.dtype.name for r in recs})}
        del recs
    return out


def make_user_dumps(root: Path, side: int) -> dict:
    """The same two runs as a user's script dumps them: every node output of
    a plain onnxruntime session (graph optimizations off, each output made a
    graph output, the model's own output first), one ``{i:04d}_{name}.npy``
    a tensor in the session's output order, no manifest; the device run is
    the FP16 build ``convert_float_to_float16(keep_io_types=True)`` makes
    (its casts are device tensors of its own, and shift the numbers)."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from layerdiff.client.demo import det_input, packaged_model

    x = det_input(side, side)
    out = {}
    for name, fp16 in (("golden", False), ("device", True)):
        model = onnx.load(str(packaged_model()))
        if fp16:
            model = convert_float_to_float16(model, keep_io_types=True)
        have = {o.name for o in model.graph.output}
        for t in [o for n in model.graph.node for o in n.output if o and o not in have]:
            model.graph.output.append(onnx.ValueInfoProto(name=t))
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        d = root / f"{name}-user"
        subprocess.run(["rm", "-rf", str(d)], check=True)
        d.mkdir(parents=True)
        arrays = sess.run(names, {sess.get_inputs()[0].name: x})
        for i, (t, a) in enumerate(zip(names, arrays)):
            np.save(d / f"{i:04d}_{t.replace('/', '_')}.npy", a)
        out[name] = {"path": str(d), "tensors": len(arrays), "tensor_bytes": sum(a.nbytes for a in arrays),
                     "file_bytes": _dir_bytes(d), "dtypes": sorted({a.dtype.name for a in arrays})}
        del arrays, sess
    return out


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


# --------------------------------------------------------------- caches

def drop_caches_allowed() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(dirs: list[str], method: str) -> None:
    """Make the next read of the dumps cold."""
    os.sync()
    if method == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    for d in dirs:
        for p in Path(d).rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# ----------------------------------------------------------------- runs

def _child(cmd: list[str], err_path: Path) -> tuple[float, float, float, int, str]:
    """(wall s, user s, sys s, exit code, stdout) of one command, timed from
    just before its start to just after it is reaped."""
    with open(err_path, "wb") as err, tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    return wall, ru.ru_utime, ru.ru_stime, proc.returncode, text


def read_once(dirs: list[str], work: Path) -> dict:
    wall, user, sys_s, rc, text = _child([sys.executable, "-c", _READ_SCRIPT, *dirs], work / "read.err")
    if rc != 0:
        raise RuntimeError(f"read script failed ({rc}): {(work / 'read.err').read_text()[-2000:]}")
    d = json.loads(text.strip().splitlines()[-1])
    d.update(wall_s=wall, user_s=user, sys_s=sys_s)
    return d


def job_once(golden: str, device: str, work: Path, i: int) -> dict:
    out = work / f"out-{i}"
    cmd = [sys.executable, "-m", "layerdiff.client.cli", "compare", golden, device, "--out", str(out),
           "--no-progress"]
    wall, user, sys_s, rc, _ = _child(cmd, work / "job.err")
    if rc not in (0, 1):
        raise RuntimeError(f"compare exited {rc}: {(work / 'job.err').read_text()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"wall_s": wall, "user_s": user, "sys_s": sys_s, "exit": rc, "compared": summary["counts"]["compared"],
            "failed": summary["counts"]["failed"], "analyzer_elapsed_s": summary.get("elapsed_s")}


def paired(dumps: dict, work: Path, runs: int, cold_method: str | None) -> dict:
    """Read and job in turn, ``runs`` pairs (after one uncounted warm-up pair
    when warm); ratios pair by pair."""
    dirs = [dumps["golden"]["path"], dumps["device"]["path"]]
    total = dumps["golden"]["file_bytes"] + dumps["device"]["file_bytes"]
    reads, jobs = [], []
    if cold_method is None:
        read_once(dirs, work)
        job_once(*dirs, work, -1)
    for i in range(runs):
        if cold_method:
            evict(dirs, cold_method)
        reads.append(read_once(dirs, work))
        if cold_method:
            evict(dirs, cold_method)
        jobs.append(job_once(*dirs, work, i))
    med = statistics.median
    read_s = [r["read_s"] for r in reads]
    job_s = [j["wall_s"] for j in jobs]
    ratios = [j / r for j, r in zip(job_s, read_s)]
    return {
        "cache": f"cold ({cold_method})" if cold_method else "warm",
        "read_s": {"min": min(read_s), "median": med(read_s), "max": max(read_s)},
        "read_GBps": total / med(read_s) / 1e9,
        "read_process_wall_s": med(r["wall_s"] for r in reads),
        "job_s": {"min": min(job_s), "median": med(job_s), "max": max(job_s)},
        "job_user_s": med(j["user_s"] for j in jobs), "job_sys_s": med(j["sys_s"] for j in jobs),
        "job_analyzer_elapsed_s": med(j["analyzer_elapsed_s"] or 0.0 for j in jobs),
        "job_GBps": total / med(job_s) / 1e9,
        "ratio_job_over_read": {"min": min(ratios), "median": med(ratios), "max": max(ratios)},
        "compared": jobs[0]["compared"], "failed": jobs[0]["failed"], "exit": jobs[0]["exit"],
    }


def phases(dumps: dict, work: Path) -> dict:
    """One warm job through the API in its own process, its states timed."""
    out = work / "out-phases"
    _, _, _, rc, text = _child([sys.executable, "-c", _PHASES_SCRIPT, dumps["golden"]["path"],
                                dumps["device"]["path"], str(out)], work / "phases.err")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    if rc != 0:
        return {"error": (work / "phases.err").read_text()[-2000:]}
    d = json.loads(text.strip().splitlines()[-1])
    spans, prev = {}, 0.0
    names = {"QUEUED": "start-up (imports, embedded services, submit)",
             "REFERENCE": "job prepared",
             "GOLDEN_READ": "golden dump streamed into the spill directory",
             "COMPARING": "sealing, first device batch",
             "REPORTING": "device dump streamed and compared (diagnosis included)",
             "DONE": "reports written", "FETCHED": "reports fetched"}
    for state, t in d["marks"]:
        spans[names.get(state, state)] = spans.get(names.get(state, state), 0.0) + (t - prev)
        prev = t
    return {"spans_s": spans, "total_s": prev, "analyzer_elapsed_s": d["analyzer_elapsed_s"]}


# --------------------------------------------------------------- msprobe

# One dump directory of .npy files as msprobe's PyTorch layout: dump.json
# (task "tensor", one Functional API per tensor, its statistics) and
# dump_tensor_data/<api>.output.0.pt.
_TO_MSPROBE = r"""
import json, re, sys
from pathlib import Path
import numpy as np, torch
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
(dst / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
data = {}
for p in sorted(src.glob("*.npy")):
    t = torch.from_numpy(np.ascontiguousarray(np.load(p)))
    stem = re.sub(r"^\d+_", "", p.stem)     # a user's script's count: the two builds number apart
    api = "Functional." + re.sub(r"[^A-Za-z0-9_]", "_", stem) + ".0.forward"
    name = api + ".output.0.pt"
    torch.save(t, dst / "dump_tensor_data" / name)
    f = t.double()
    stat = (lambda g: float(g()) if f.numel() else 0.0)
    data[api] = {"input_args": [], "input_kwargs": {}, "output": [{
        "type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": stat(f.max),
        "Min": stat(f.min), "Mean": stat(f.mean), "Norm": stat(f.norm), "requires_grad": False,
        "data_name": name}]}
json.dump({"task": "tensor", "level": "L1", "framework": "pytorch",
           "dump_data_dir": str(dst / "dump_tensor_data"), "data": data}, open(dst / "dump.json", "w"))
"""


def msprobe_venv(where: Path) -> Path:
    """msprobe's command in a virtual environment of its own, made (and
    mindstudio-probe installed from the package index) on first use."""
    exe = where / "bin" / "msprobe"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        subprocess.run([str(where / "bin" / "pip"), "install", "-q", f"mindstudio-probe=={MSPROBE_VERSION}"],
                       check=True)
    return exe


def vs_msprobe(dumps: dict, work: Path, runs: int, venv: Path) -> dict:
    """``msprobe compare`` and ``layerdiff compare`` of the same tensors in
    turn, after one warm-up pair: medians, and the ratios pair by pair."""
    exe = msprobe_venv(venv)
    layout = {}
    for side in ("golden", "device"):
        layout[side] = work / f"msprobe-{side}"
        subprocess.run(["rm", "-rf", str(layout[side])], check=True)
        subprocess.run([sys.executable, "-c", _TO_MSPROBE, dumps[side]["path"], str(layout[side])], check=True)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {**os.environ, "PYTHONPATH": site}        # this environment's torch for its .pt files
    ms_cmd = [str(exe), "compare", "-tp", str(layout["device"] / "dump.json"), "-gp",
              str(layout["golden"] / "dump.json"), "-o", str(work / "msprobe-out")]
    ours_cmd = [sys.executable, "-m", "layerdiff.client.cli", "compare", dumps["golden"]["path"],
                dumps["device"]["path"], "--out", str(work / "ours-out"), "--no-progress"]
    theirs, ours = [], []
    for i in range(runs + 1):
        subprocess.run(["rm", "-rf", str(work / "msprobe-out"), str(work / "ours-out")], check=True)
        m = timed(ms_cmd, work / "msprobe.err", env=env)
        o = timed(ours_cmd, work / "ours.err")
        if m[2] != 0:
            raise RuntimeError(f"msprobe compare exited {m[2]}: {(work / 'msprobe.err').read_text()[-2000:]}")
        if o[2] not in (0, 1):
            raise RuntimeError(f"layerdiff compare exited {o[2]}: {(work / 'ours.err').read_text()[-2000:]}")
        if i:
            theirs.append(m)
            ours.append(o)
    rows = sum(1 for _ in next((work / "msprobe-out").glob("compare_result_*.csv")).open()) - 1
    med = statistics.median
    files = {tool: sum(len(f) for _, _, f in os.walk(work / f"{tool}-out")) for tool in ("msprobe", "ours")}
    return {"msprobe_version": MSPROBE_VERSION, "msprobe_rows": rows,
            "files_written": {"msprobe": files["msprobe"], "layerdiff": files["ours"]},
            "file_create_us": file_create_us(work),
            "msprobe_wall_s": med(m[0] for m in theirs), "msprobe_peak_rss_MiB": med(m[1] for m in theirs) / 2**20,
            "layerdiff_wall_s": med(o[0] for o in ours), "layerdiff_peak_rss_MiB": med(o[1] for o in ours) / 2**20,
            "speedup_median": med(m[0] / o[0] for m, o in zip(theirs, ours)),
            "rss_ratio_median": med(o[1] / m[1] for m, o in zip(theirs, ours)), "goal": MSPROBE_GOAL}


def file_create_us(where: Path, n: int = 256) -> float:
    """Microseconds to create (and write 4 KiB to) a file in a new directory
    under ``where``, now: what each of a report's files costs there. On a
    file system without a journal (ext4 here) a file created where many were
    just deleted costs ten to thirty times what it costs elsewhere (each
    recently freed inode is looked at, and passed over): the two tools'
    outputs are deleted between runs, and layerdiff writes a file for every
    failing tensor, msprobe one a run."""
    d = Path(tempfile.mkdtemp(prefix="create-", dir=where))
    try:
        data = b"0" * 4096
        t = time.perf_counter()
        for i in range(n):
            fd = os.open(d / f"{i}.csv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, data)
            os.close(fd)
        return (time.perf_counter() - t) / n * 1e6
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------- main

def _row(label: str, p: dict) -> str:
    return (f"    {label:5s} read {p['read_s']['median']:6.3f} s ({p['read_GBps']:5.2f} GB/s)   job "
            f"{p['job_s']['median']:6.2f} s [{p['job_s']['min']:.2f}-{p['job_s']['max']:.2f}] "
            f"({p['job_GBps']:.3f} GB/s, user {p['job_user_s']:.1f} s sys {p['job_sys_s']:.1f} s)   "
            f"job/read {p['ratio_job_over_read']['median']:5.1f}x")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", type=int, default=0, help="input side (default: picked for --target-mb)")
    ap.add_argument("--target-mb", type=float, default=770, help="both dumps together, MB (1e6 bytes)")
    ap.add_argument("--runs", type=int, default=3, help="counted pairs (read, job) per cache state")
    ap.add_argument("--formats", default="npy", help="dump formats, comma-separated: npy, h5, and user (the "
                    "npy files a user's script writes: numbered, no manifest, the FP16 build's casts)")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--cold-method", choices=("auto", "drop_caches", "fadvise"), default="auto")
    ap.add_argument("--keep", help="write the dumps here and keep them (default: a temporary directory)")
    ap.add_argument("--msprobe", action="store_true", help="also time msprobe compare on the same tensors")
    ap.add_argument("--msprobe-venv", default=str(Path.home() / ".cache" / "layerdiff-bench" / "msprobe"),
                    help="msprobe's own virtual environment (made on first use)")
    a = ap.parse_args(argv)
    bytecode_ready()
    out: dict = {"goal": GOAL}
    per_px = bytes_per_pixel()
    side = a.side or pick_side(a.target_mb * 1e6, per_px)
    out["input"] = [1, 3, side, side]
    out["bytes_per_pixel"] = {"fp32": per_px[0], "fp16": per_px[1]}
    cold = None
    if not a.no_cold:
        cold = "drop_caches" if a.cold_method == "drop_caches" or (
            a.cold_method == "auto" and drop_caches_allowed()) else "fadvise"
    out["cold_method"] = cold
    tmp = None if a.keep else tempfile.TemporaryDirectory(prefix="layerdiff-bench-compare-")
    root = Path(a.keep or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    try:
        for fmt in [f.strip() for f in a.formats.split(",") if f.strip()]:
            t = time.perf_counter()
            dumps = make_user_dumps(root, side) if fmt == "user" else make_dumps(root, side, fmt)
            g, d = dumps["golden"], dumps["device"]
            total = g["file_bytes"] + d["file_bytes"]
            res = {"dumps": dumps, "total_bytes": total, "fp32_share": g["file_bytes"] / total,
                   "make_s": time.perf_counter() - t}
            print(f"(e) layerdiff compare, PP-OCRv4 det {out['input']}, {fmt}: golden FP32 "
                  f"{g['file_bytes'] / 1e6:.0f} MB + device FP16 {d['file_bytes'] / 1e6:.0f} MB = {total / 1e6:.0f} MB "
                  f"({g['tensors']} + {d['tensors']} tensors, FP32 {res['fp32_share']:.0%})", flush=True)
            work = root / f"work-{fmt}"
            work.mkdir(exist_ok=True)
            res["warm"] = paired(dumps, work, a.runs, None)
            print(_row("warm", res["warm"]), flush=True)
            if cold:
                res["cold"] = paired(dumps, work, a.runs, cold)
                print(_row("cold", res["cold"]) + f"   [{cold}]", flush=True)
            res["phases"] = ph = phases(dumps, work)
            if "spans_s" in ph:
                print(f"    one warm job through the API, {ph['total_s']:.2f} s: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in ph["spans_s"].items()))
            w = res["warm"]
            print(f"    {w['compared']} tensors compared, {w['failed']} failing (exit {w['exit']})")
            if a.msprobe and fmt in ("npy", "user"):
                res["msprobe"] = v = vs_msprobe(dumps, work, a.runs, Path(a.msprobe_venv))
                print(f"    msprobe {v['msprobe_version']} compare {v['msprobe_wall_s']:.2f} s "
                      f"{v['msprobe_peak_rss_MiB']:.0f} MiB ({v['msprobe_rows']} rows), layerdiff compare "
                      f"{v['layerdiff_wall_s']:.2f} s {v['layerdiff_peak_rss_MiB']:.0f} MiB: "
                      f"{v['speedup_median']:.1f}x faster, {v['rss_ratio_median']:.2f}x its memory "
                      f"(goal >= 10x, <= 1x); files a run: {v['files_written']['layerdiff']} and "
                      f"{v['files_written']['msprobe']}, {v['file_create_us']:.0f} us to create one in "
                      f"{work} after the runs", flush=True)
            out[fmt] = res
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(json.dumps({"compare": out}, default=str))
    return out


if __name__ == "__main__":
    main()
