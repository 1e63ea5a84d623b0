"""(i) The verdicts on real accelerator runs: PyTorch models captured with
``layerdiff.torch.capture`` on a device (CUDA: BF16 and FP16 autocast, FP32
with TF32 matmuls and convolutions, strict FP32) against a CPU FP32 capture
of the same model, judged by ``layerdiff compare`` (dump against dump, no
model).

For each model: the clean device, then bugs planted at random sites (a leaf
``Conv2d``/``Linear`` the forward calls, drawn with a fixed seed): a block
of 1/16 of the output channels scaled (1.05 to 2; 1.01 to 1.05 on strict
FP32), or a tile of 1/16 of the output zeroed (a quarter of the rows by a
quarter of the columns). The bug is a forward hook registered before the
capture's own, so the capture records the wrong output as a broken kernel
would write it. Counted: false "Computation error" headlines on clean runs,
and the share of bugs named at the module that has them.

Random weights (torchvision builds them without downloading anything;
``--calibrate-bn`` gives their BatchNorms the statistics of a few random
batches, so that activations keep a trained network's scale), one image of
224x224, module level; ``--operator`` adds ATen operator captures
of the first model in BF16, the bugs planted in a convolution's or a matrix
product's output (the analyzer replays a failing operator in FP32 on the
CPU from the device's inputs).

    python3 bench/bench_cuda.py --out DIR [--models resnet18,mobilenet_v3_small,vit_b_16]
        [--precisions bf16,fp16,tf32,fp32] [--bugs 2] [--jobs 4] [--deadline 480] [--device cuda]

On a machine without torchvision ``--models tiny`` runs a small CNN and an
MLP (the CPU check of this script: CPU autocast is BF16 only).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

SIZES = {"fp32": (1.01, 1.02, 1.05), "tf32": (1.05, 1.2, 2.0), "fp16": (1.05, 1.2, 2.0), "bf16": (1.05, 1.2, 2.0)}


def build_model(torch, name: str):
    torch.manual_seed(0)
    if name == "tiny":
        n = torch.nn
        return n.Sequential(n.Conv2d(3, 32, 3, padding=1), n.BatchNorm2d(32), n.ReLU(), n.Conv2d(32, 64, 3, padding=1),
                            n.ReLU(), n.Conv2d(64, 64, 3, padding=1), n.ReLU(), n.AdaptiveAvgPool2d(1), n.Flatten(),
                            n.Linear(64, 10)).eval(), (1, 3, 32, 32)
    if name == "mlp":
        n = torch.nn
        return n.Sequential(n.Linear(256, 512), n.GELU(), n.LayerNorm(512), n.Linear(512, 512), n.GELU(),
                            n.Linear(512, 64)).eval(), (8, 16, 256)
    import torchvision

    return getattr(torchvision.models, name)(weights=None).eval(), (1, 3, 224, 224)


def calibrate_batchnorm(torch, model, shape: tuple, batches: int = 4) -> None:
    """Running statistics of every BatchNorm from a few batches of random
    inputs, as training leaves them: with the freshly built ones (mean 0,
    variance 1) a randomly initialised network's activations shrink layer
    after layer (to 1e-7 and below in MobileNetV3's later blocks, FP16's
    subnormals), which no trained network does."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    gen = torch.Generator().manual_seed(2)
    for m in norms:
        m.reset_running_stats()
        m.momentum = None           # a plain average over the batches
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(max(8, shape[0]), *shape[1:], generator=gen))
    model.eval()


PRODUCTS = ("aten.convolution.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default")


def called_sites(torch, model, x, level: str) -> list[str]:
    """Where a bug can be planted: at module level the leaf Conv2d/Linear
    modules the forward actually calls (an ``nn.MultiheadAttention``'s
    ``out_proj`` is read, never called) and whose output is not all zeros;
    at operator level each call of a
    convolution or matrix product, named as the capture names it (``op``,
    then ``op@k``)."""
    seen: list[str] = []
    if level == "module":
        # a module whose output is all zeros (ViT's head starts so) has no bug to plant
        hooks = [m.register_forward_hook(lambda mod, i, o, name=name: seen.append(name) if o.any() else None)
                 for name, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
        with torch.no_grad():
            model(x)
        for h in hooks:
            h.remove()
        return list(dict.fromkeys(seen))
    with torch.no_grad(), OperatorBug(torch, None, None)() as counter:
        model(x)
    return counter.calls


def _damage(out, kind: str, factor: float, draw: dict):
    """The bug written into an output: ``block`` scales 1/16 of the
    channels (dim 1 of a convolution, the last of anything else), ``tile``
    zeroes a quarter of the rows by a quarter of the columns."""
    out = out.clone()
    conv = out.dim() == 4
    if kind == "block":
        dim = 1 if conv else out.dim() - 1
        c = out.shape[dim]
        width = max(1, c // 16)
        out.narrow(dim, int(draw["start"] * (c - width + 1)), width).mul_(factor)
    else:
        rows_dim, cols_dim = (2, 3) if conv else (out.dim() - 2, out.dim() - 1)
        r, c = out.shape[rows_dim], out.shape[cols_dim]
        h, w = max(1, r // 4), max(1, c // 4)
        out.narrow(rows_dim, int(draw["row"] * (r - h + 1)), h).narrow(
            cols_dim, int(draw["col"] * (c - w + 1)), w).zero_()
    return out


class ModuleBug:
    """A forward hook on the module ``site``, registered before the
    capture's own, so that the capture records the damaged output."""

    def __init__(self, site: str, kind: str, factor: float, rng: np.random.Generator):
        self.site, self.kind, self.factor = site, kind, factor
        self.draw = {"start": float(rng.random()), "row": float(rng.random()), "col": float(rng.random())}

    @contextmanager
    def armed(self, model):
        h = dict(model.named_modules())[self.site].register_forward_hook(
            lambda mod, i, out: _damage(out, self.kind, self.factor, self.draw))
        try:
            yield
        finally:
            h.remove()


def OperatorBug(torch, site: str | None, damage):
    """A dispatch mode entered outside the capture's: the capture records
    what it returns. It counts the calls of each product (``calls``) and
    damages the one named ``site``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []
            self.count: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = str(func)
            if op in PRODUCTS:
                k = self.count.get(op, 0)
                self.count[op] = k + 1
                name = op if k == 0 else f"{op}@{k}"
                self.calls.append(name)
                if name == site:
                    out = damage(out)
            return out
    return Mode


class OpBug(ModuleBug):
    def __init__(self, torch, site: str, kind: str, factor: float, rng: np.random.Generator):
        super().__init__(site, kind, factor, rng)
        self.torch = torch

    @contextmanager
    def armed(self, model):
        with OperatorBug(self.torch, self.site, lambda out: _damage(out, self.kind, self.factor, self.draw))():
            yield


class Device:
    """How a capture runs: where, and in which precision."""

    def __init__(self, torch, device: str, precision: str):
        self.torch, self.device, self.precision = torch, device, precision

    def run(self, model, x, path: Path, level: str, bug: ModuleBug | None = None) -> None:
        from layerdiff.torch import capture

        torch = self.torch
        on = self.device
        tf32 = self.precision == "tf32"
        if on == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        model = model.to(on)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        try:
            with torch.autocast(on, dtype=dtype or torch.float32, enabled=dtype is not None):
                with bug.armed(model) if bug else nullcontext(), capture(model, path, level=level):
                    model(x.to(on))
            if on == "cuda":
                torch.cuda.synchronize()
        finally:
            model.to("cpu")


def judge(golden: Path, device: Path, out: Path, timeout: float, python: str = sys.executable) -> dict:
    """``layerdiff compare`` as a user runs it; what it concluded."""
    cmd = [python, "-m", "layerdiff.client.cli", "compare", str(golden), str(device), "--out", str(out),
           "--dump-mode", "all", "--no-progress"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"exit": None, "headline": "timed out", "seconds": timeout}
    res = {"exit": p.returncode, "seconds": round(time.monotonic() - t0, 1)}
    try:
        s = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {**res, "headline": "no summary", "stderr": p.stderr[-600:] + p.stdout[-600:]}
    first = s.get("first_computation_error") or next(iter(s.get("benign_computation_errors") or []), None)
    res.update(headline=s["diagnosis"]["headline"], named=first["node"] if first else None,
               evidence=(first or {}).get("evidence", [])[:3])
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/layerdiff-cuda"))
    p.add_argument("--models", default="resnet18,mobilenet_v3_small,vit_b_16")
    p.add_argument("--precisions", default="bf16,fp16,tf32,fp32")
    p.add_argument("--bugs", type=int, default=2, help="bugs per model and precision")
    p.add_argument("--operator", action="store_true", help="also ATen operator captures of the first model (bf16)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=4, help="compares at a time")
    p.add_argument("--deadline", type=float, default=480, help="seconds after which nothing new starts")
    p.add_argument("--seed", type=int, default=26)
    p.add_argument("--factors", help="block bug sizes to draw from (default: 1.05,1.2,2; 1.01,1.02,1.05 on fp32)")
    p.add_argument("--calibrate-bn", action="store_true",
                   help="BatchNorm statistics from a few random batches first (activations of a trained network's "
                        "scale instead of vanishing ones)")
    p.add_argument("--compare-python", default=sys.executable,
                   help="the Python that runs layerdiff compare (default: this one)")
    a = p.parse_args(argv)
    import torch

    t0 = time.monotonic()
    rng = np.random.default_rng(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    pool = ThreadPoolExecutor(a.jobs)
    cases: list[dict] = []

    def left() -> float:
        return a.deadline - (time.monotonic() - t0)

    def submit(case: dict, golden: Path, device: Path) -> None:
        def task():
            if left() < 0:
                case.update(headline="not run (deadline)")
                return case
            case.update(judge(golden, device, device.with_suffix(".out"), timeout=max(30.0, left() + 120),
                               python=a.compare_python))
            case["ok"] = _ok(case)
            shutil.rmtree(device, ignore_errors=True)
            print(_line(case), flush=True)
            return case
        cases.append(case)
        case["future"] = pool.submit(task)

    plan = [(m, "module") for m in a.models.split(",")]
    if a.operator:
        plan.append((plan[0][0], "operator"))
    for name, level in plan:
        if left() < 60:
            break
        print(f"{time.monotonic() - t0:.0f}s: {name} ({level})", flush=True)
        model, shape = build_model(torch, name)
        if a.calibrate_bn:
            calibrate_batchnorm(torch, model, shape)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        sites = called_sites(torch, model, x, level)
        golden = a.work / f"{name}-{level}-cpu"
        golden.mkdir()
        Device(torch, "cpu", "fp32").run(model, x, golden / "run.h5", level)
        precisions = a.precisions.split(",") if level == "module" else ["bf16"]
        for prec in precisions:
            dev = Device(torch, a.device, prec)
            for b in range(a.bugs + 1):
                if left() < 30:
                    break
                case = {"model": name, "level": level, "precision": prec, "device": a.device}
                bug = None
                if b:
                    kind = "block" if b % 2 else "tile"
                    sizes = [float(f) for f in a.factors.split(",")] if a.factors else SIZES[prec]
                    factor = float(rng.choice(sizes)) if kind == "block" else 0.0
                    site = str(rng.choice(sites))
                    bug = ModuleBug(site, kind, factor, rng) if level == "module" else \
                        OpBug(torch, site, kind, factor, rng)
                    case.update(bug=kind, factor=factor, site=site)
                path = a.work / f"{name}-{level}-{prec}-{b}"
                path.mkdir()
                dev.run(model, x, path / "run.h5", level, bug)
                case["mb"] = round((path / "run.h5").stat().st_size / 2**20)
                submit(case, golden, path)
    pool.shutdown(wait=True)
    for c in cases:
        c.pop("future", None)
        c.setdefault("ok", None)
    report = {"seconds": round(time.monotonic() - t0), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
              "summary": summarize(cases), "cases": cases}
    (a.out / "cuda_verdicts.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return report


def _line(c: dict) -> str:
    what = f"{c.get('bug', 'clean')}{'' if not c.get('factor') else ' x' + str(c['factor'])}"
    at = f" at {c['site']}" if c.get("site") else ""
    return (f"{'OK  ' if c['ok'] else 'MISS' if c['ok'] is False else '--  '} {c['model']:>18} {c['level']:<8} "
            f"{c['precision']:<5} {what}{at}: exit {c.get('exit')} {c.get('seconds', '')}s {c['headline'][:160]}")


def _ok(c: dict) -> bool | None:
    if c.get("exit") is None:
        return None
    if "bug" not in c:      # rounding is never a computation error (the outputs may still leave atol/rtol)
        return not c["headline"].startswith("Computation error")
    return c.get("named") == c["site"]


def summarize(cases: list[dict]) -> dict:
    ran = [c for c in cases if c["ok"] is not None]
    clean = [c for c in ran if "bug" not in c]
    bugs = [c for c in ran if "bug" in c]
    by = {}
    for c in bugs:
        key = f"{c['precision']} {c['bug']}"
        n, k = by.get(key, (0, 0))
        by[key] = (n + 1, k + bool(c["ok"]))
    return {"clean runs": len(clean), "false computation errors":
            sum(c["headline"].startswith("Computation error") for c in clean),
            "clean exit 0": sum(c["exit"] == 0 for c in clean),
            "bugs": len(bugs), "named at the right node": sum(bool(c["ok"]) for c in bugs),
            "by precision and kind (named/planted)": {k: f"{v[1]}/{v[0]}" for k, v in sorted(by.items())},
            "not run": len(cases) - len(ran)}


if __name__ == "__main__":
    main()
