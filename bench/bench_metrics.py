"""Throughput of metrics.compare against a memory-bound baseline.

    python bench/bench_metrics.py [--mib 256] [--repeat 5]

``--mib`` is the size of the float32/float32 pair (reference + device).  For
each case the baseline is ``np.sum`` over a float32 array holding the same
number of bytes as the pair being compared (best of ``--repeat``); the ratio
is baseline time / compare time, i.e. 1.0 means the full metric set costs as
much as summing the bytes once.  Everything runs on one thread.  The last
line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial

import numpy as np


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _make_data(n, seed=0):
    """Reference ~ N(0,1) with a per-row scale spanning 1e-2..1e2 (rows of
    1024, like channels of an activation); device = reference plus relative
    noise of ~1e-3 and a small absolute term."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(n, dtype=np.float32)
    rows = -(-n // 1024)
    scale = (10.0 ** rng.uniform(-2, 2, rows)).astype(np.float32)
    ref *= np.repeat(scale, 1024)[:n]
    noise = rng.standard_normal(n, dtype=np.float32)
    dev = ref + noise * (np.float32(1e-3) * np.abs(ref) + np.float32(1e-4))
    return ref, dev.astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0,
                    help="MiB of the float32/float32 pair (default 256)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    from layerdiff.analyzer.compare import metrics

    n = int(args.mib * 2**20) // 8
    t0 = time.perf_counter()
    metrics.warmup()
    warm_s = time.perf_counter() - t0
    ref, dev32 = _make_data(n)
    dev16 = dev32.astype(np.float16)

    cases = [("fp32/fp32", ref, dev32), ("fp32/fp16", ref, dev16)]
    results = []
    print(f"elements per tensor: {n:,}   warmup: {warm_s:.2f} s   "
          f"cpu: {platform.processor() or platform.machine()}  cores: {os.cpu_count()}")
    print(f"{'case':<10} {'bytes':>10} {'np.sum GB/s':>12} {'compare GB/s':>13} {'ratio':>7}")
    for name, r, d in cases:
        nbytes = r.nbytes + d.nbytes
        base = np.ones(nbytes // 4, dtype=np.float32)
        t_base = _best(partial(np.sum, base), args.repeat)
        del base
        metrics.compare(r[:4096], d[:4096])
        t_cmp = _best(partial(metrics.compare, r, d), args.repeat)
        row = dict(case=name, elements=n, bytes=nbytes,
                   baseline_s=t_base, compare_s=t_cmp,
                   baseline_gbs=nbytes / t_base / 1e9, compare_gbs=nbytes / t_cmp / 1e9,
                   ratio=t_base / t_cmp)
        results.append(row)
        print(f"{name:<10} {nbytes / 2**20:>8.0f}Mi {row['baseline_gbs']:>12.2f} "
              f"{row['compare_gbs']:>13.2f} {row['ratio']:>7.3f}")
    summary = {"bench": "metrics.compare", "mib": args.mib, "repeat": args.repeat,
               "warmup_s": warm_s, "results": results}
    sys.stdout.flush()
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
