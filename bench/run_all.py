"""`make bench`: every figure beside its baseline, from one run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_compare  # noqa: E402
import bench_fanout  # noqa: E402
import bench_first_run  # noqa: E402
import bench_job  # noqa: E402
import bench_metrics  # noqa: E402
import bench_perf  # noqa: E402
import bench_small  # noqa: E402
import bench_stream  # noqa: E402
import bench_verdicts  # noqa: E402
import soak  # noqa: E402


def main() -> None:
    results = {"stream": bench_stream.main([]), "metrics": bench_metrics.main([]), "job": bench_job.main([]),
               "fanout": bench_fanout.main([]), "perf": bench_perf.main([]), "compare": bench_compare.main([]),
               "small": bench_small.main([]),
               # CPU only here (BF16 autocast): the first command after installing the wheel, against the next
               "first_run": bench_first_run.main(["--out", "bench-out", "--model", "tiny", "--device", "cpu",
                                                  "--precision", "bf16"]),
               # the full calibration (5 precisions, 6 bugs each) takes about an hour on 2 cores
               "verdicts": bench_verdicts.main(["--quick"]),
               "soak": soak.main([])}
    out = Path("bench-out")
    out.mkdir(exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nall figures: {out / 'results.json'}")


if __name__ == "__main__":
    main()
