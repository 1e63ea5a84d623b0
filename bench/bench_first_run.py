"""(j) A new user's first command against their tenth, as installed from a
wheel: ``layerdiff compare`` of a PyTorch model's device capture against
its CPU FP32 capture, run from an installed copy of the package (``--site``,
the folder ``pip install --target`` filled), timed

- with no build of the metric kernels and an empty numba cache (what an
  install from the wheel gives until ``layerdiff kernels`` runs), then
  again with numba's cache warm;
- ``layerdiff kernels``, the step after installing, on its own;
- after it: the first command, then ``--runs`` more, the first against
  their median.

Goal: the first run after installing within 1.2x a warm run. The site's
build is removed before the first step and left as ``layerdiff kernels``
made it at the end.

    python3 bench/bench_first_run.py --out DIR [--site DIR] [--model resnet18] [--precision fp16]
        [--device cuda] [--runs 3]

Without torchvision ``--model tiny`` captures a small CNN (on the CPU, the
device run is BF16 autocast).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda import Device, build_model  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


class Site:
    """The installed package the commands run from, with a numba cache of
    the bench's own."""

    def __init__(self, site: Path, work: Path):
        self.site, self.work = site, work
        self.compare_dir = site / "layerdiff" / "analyzer" / "compare"
        if not (self.compare_dir / "kernel.py").is_file():
            raise SystemExit(f"{site}: no installed layerdiff there (pip install --target {site} layerdiff-*.whl)")

    def remove_build(self) -> None:
        for f in self.compare_dir.glob("_kernels*"):
            f.unlink()

    def env(self, cache: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(self.site), os.environ.get("PYTHONPATH")])),
                   NUMBA_CACHE_DIR=str(cache))
        for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
            env.pop(k, None)
        return env

    def layerdiff(self, args: list[str], cache: Path) -> dict:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *args], env=self.env(cache),
                           capture_output=True, text=True, cwd=self.work)
        return {"seconds": round(time.perf_counter() - t0, 2), "exit": p.returncode,
                "stderr": [ln for ln in p.stderr.splitlines() if not ln.startswith("layerdiff: job ")][-3:],
                "stdout_head": p.stdout.splitlines()[:1]}


def install_checkout(work: Path) -> Path:
    """This checkout as a user installs it: its wheel, installed into a
    folder of its own (no dependencies: this environment has them)."""
    root = Path(__file__).resolve().parents[1]
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "wheel"), str(root)],
                   check=True, capture_output=True)
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(work / "site"),
                    *map(str, (work / "wheel").glob("layerdiff-*.whl"))], check=True, capture_output=True)
    return work / "site"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", type=Path, help="where the wheel is installed (pip install --target; default: this "
                                             "checkout's wheel built and installed into a temporary folder)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    import torch

    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="layerdiff-first-run-"))
    try:
        site = Site((a.site or install_checkout(work)).resolve(), work)
        model, shape = build_model(torch, a.model)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        golden, device = work / "golden", work / "device"
        golden.mkdir()
        device.mkdir()
        Device(torch, "cpu", "fp32").run(model, x, golden / "run.h5", "module")
        Device(torch, a.device, a.precision).run(model, x, device / "run.h5", "module")
        compare = ["compare", str(golden), str(device), "--out", str(work / "out"), "--no-progress"]

        def fresh_cache() -> Path:
            return Path(tempfile.mkdtemp(prefix="numba-", dir=work))

        site.remove_build()
        cache = fresh_cache()
        before = {"first": site.layerdiff(compare, cache), "again": site.layerdiff(compare, cache)}
        cache = fresh_cache()       # where no build can be made, numba's cache is what it fills
        kernels = site.layerdiff(["kernels"], cache)
        after = [site.layerdiff(compare, cache) for _ in range(a.runs + 1)]
        warm = sorted(r["seconds"] for r in after[1:])[a.runs // 2]
        report = {
            "python": platform.python_version(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__, "model": a.model, "device": a.device, "precision": a.precision,
            "capture_mb": round((device / "run.h5").stat().st_size / 2**20, 1),
            "before layerdiff kernels": before,
            "before: first / again": round(before["first"]["seconds"] / before["again"]["seconds"], 2),
            "layerdiff kernels": kernels,
            "after": after,
            "after: first / median of the next": round(after[0]["seconds"] / warm, 2),
            "goal": "first run after installing within 1.2x a warm run",
        }
        (a.out / "first_run.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
