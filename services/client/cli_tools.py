"""The ``layerdiff`` subcommands that work on local files, with no service:
``convert``, ``dump``, ``overflow``, ``histogram``, ``perf-diff`` and
``kernels``. Each imports what it needs only when it runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

from layerdiff.common.precision import NAMES as PRECISION_NAMES


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a dump to .npy (and .txt) files with shape and dtype sidecars")
    p.add_argument("dump", help="dump directory, or one dump file (.h5, .npz, .npy, .pb)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--txt", action="store_true", help="also write each tensor flattened as text")
    p.add_argument("--dump-format", "--dump_format", default="",
                   choices=["", "npy", "npz", "onnx", "bin", "h5", "ascend"])
    p.add_argument("--default-concat-dim", "--default_concat_dim", type=int, default=0,
                   help="splice axis of tiled nodes without grouping info; -1 = first axis of size != 1")
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(a) -> int:
    from layerdiff.collector.dumps.convert import convert

    res = convert(a.dump, a.out, txt=a.txt, fmt=a.dump_format, default_concat_dim=a.default_concat_dim)
    log = Path(res["out"]) / "convert_skip.log"
    if not res["converted"]:
        first = f" ({res['skips'][0]})" if res["skips"] else ""
        print(f"layerdiff convert: {a.dump}: no readable tensor: {res['skipped']} skipped{first}; every one with its "
              f"reason in {log}", file=sys.stderr)
        return 2
    print(f"converted {res['converted']} tensors, skipped {res['skipped']}"
          + (f" (each with its reason in {log})" if res["skipped"] else "") + f" into {res['out']}")
    for line in res["skips"]:
        print(f"  skipped {line}")
    return 0


def add_dump(sub) -> None:
    p = sub.add_parser("dump", help="run a model on the device and write a dump as an acl.json-style file asks",
                       description="Run MODEL on the device the way the collector does and write the dump that "
                                   "the configuration (the runtime's acl.json: dump_path, dump_list, dump_mode, "
                                   "dump_op_switch, dump_debug) asks for.")
    p.add_argument("model", help="ONNX model")
    p.add_argument("--inputs", required=True, help=".npz of named model inputs")
    p.add_argument("--config", required=True, help="dump configuration (acl.json)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=list(PRECISION_NAMES),
                   help="the live build's precision (default fp32; bf16, tf32 and fp8 are emulated on the CPU)")
    p.add_argument("--device-model", help="run this export as the device instead")
    p.add_argument("--format", default="ascend", choices=["ascend", "npy", "npz", "onnx", "bin", "h5"],
                   help="dump format (default ascend: vendor-named files under {time}/{device}/{model}/{index})")
    p.set_defaults(func=_cmd_dump)


def _cmd_dump(a) -> int:
    from layerdiff.collector.dumps.config import dump_live_run

    res = dump_live_run(a.model, a.inputs, a.config, precision=a.precision, device=a.device,
                        device_model=a.device_model, fmt=a.format)
    if not res["records"]:
        first = f" ({res['skips'][0]})" if res["skips"] else ""
        print(f"layerdiff dump: {a.model}: no tensor to write: {res['skipped']} skipped{first}"
              + (f"; every one with its reason in {res['skip_log']}" if res["skip_log"] else ""), file=sys.stderr)
        return 2
    print(f"wrote {res['records']} tensors ({res['mode']}, {res['format']}) into {res['dump_path']}"
          + (f"; skipped {res['skipped']}, each with its reason in {res['skip_log']}" if res["skipped"] else ""))
    for line in res["skips"]:
        print(f"  skipped {line}")
    if res["overflowing_nodes"]:
        print(f"overflowing nodes: {', '.join(res['overflowing_nodes'])}")
    return 0


def add_overflow(sub) -> None:
    p = sub.add_parser("overflow", help="decode overflow records (Opdebug.Node_OpDebug.*) into their causes",
                       description="Decode every overflow record in FILE or under DIR: the vendor's JSON "
                                   "(model_id, stream_id, task_id, task_type, pc_start, para_base, kernel_code, "
                                   "block_idx, status), then the causes behind each status, and the operator "
                                   "dump files of the flagged tasks.")
    p.add_argument("path", help="an overflow record file, or a dump directory")
    p.add_argument("--json", action="store_true", help="one JSON document for all records, causes included")
    p.set_defaults(func=_cmd_overflow)


def _cmd_overflow(a) -> int:
    import json

    from layerdiff.collector.dumps.overflow import scan

    found = scan(a.path)
    if a.json:
        print(json.dumps(found, indent=1))
        return 0 if found["records"] else 1
    for rec in found["records"]:
        print(f"== {rec['file']}")
        print(json.dumps(rec["record"], indent=1))
        for flag in rec["flagged"]:
            print(f"{flag['unit']}: stream {flag['stream_id']} task {flag['task_id']} status {flag['status']} "
                  f"= 0x{flag['status']:08x}")
            for c in flag["causes"]:
                print(f"  {c}")
            for op in flag["operators"]:
                print(f"  operator dump: {op}")
    for shown, reason in found["unreadable"]:
        print(f"unreadable: {shown}: {reason}")
    if not found["records"]:
        print(f"no overflow records in {a.path}")
        return 1
    return 0


def add_histogram(sub) -> None:
    p = sub.add_parser("histogram", help="one histogram per dumped tensor, min/max as red dashed lines",
                       description="Draw the value histogram of every tensor in DUMP (any dump format layerdiff "
                                   "reads) with the layer's min and max as red dashed lines: from --min-max "
                                   "(a tensor_min_max.txt range file, lines 'name min max') where it names the "
                                   "tensor, else the tensor's own. An existing output directory that holds files "
                                   "is left as it is: the histograms then go to a fresh Histograms_N beside it.")
    p.add_argument("dump", help="dump directory, or one dump file (.h5, .npz, .npy, .pb)")
    p.add_argument("--min-max", "--min_max", help="range file (tensor_min_max.txt): 'name min max' per line")
    p.add_argument("--out", default="Histograms", help="output directory (default ./Histograms)")
    p.add_argument("--max-bins", "--max_bins", type=int, help="most bins per histogram (default 128)")
    p.add_argument("--min-bins", "--min_bins", type=int, help="fewest bins per histogram, 1..max-bins (default 1)")
    p.add_argument("--dump-format", "--dump_format", default="",
                   choices=["", "npy", "npz", "onnx", "bin", "h5", "ascend"])
    p.add_argument("--default-concat-dim", "--default_concat_dim", type=int, default=0,
                   help="splice axis of tiled nodes without grouping info; -1 = first axis of size != 1")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_histogram)


def _cmd_histogram(a) -> int:
    from layerdiff.client.histogram import WIDE_RANGE, write_histograms

    res = write_histograms(a.dump, a.out, min_max=a.min_max, max_bins=a.max_bins, min_bins=a.min_bins,
                           fmt=a.dump_format, default_concat_dim=a.default_concat_dim, progress=not a.no_progress)
    if res["note"]:
        print(f"note: {res['note']}")
    print(f"wrote {len(res['written'])} histograms into {res['out']}, skipped {len(res['skipped'])} tensors "
          f"and {len(res['range_lines_skipped'])} range-file lines (see histogram_skip.log)")
    if res["wide"]:
        print(f"min-max range above {WIDE_RANGE:g} (consider INT16 for the convolution reading them): "
              + ", ".join(res["wide"]))
    return 0



def add_diff(sub) -> None:
    p = sub.add_parser("diff", help="compare two reports of the same model: a regression gate",
                       description="Compare two reports node by node (read from their nodes.parquet): the nodes "
                                   "whose verdict got worse or better, whose relative RMS error grew or shrank past "
                                   "--error-factor (and past what the node may add), and those compared in one "
                                   "report only. Exit status 1 when anything got worse, 0 when nothing did, 2 "
                                   "when a report cannot be read, 3 when they share no tensor.")
    p.add_argument("old", help="the earlier report (its directory)")
    p.add_argument("new", help="the report to check")
    p.add_argument("--error-factor", type=float, default=2.0,
                   help="how many times larger an error must get to count (default 2)")
    p.add_argument("--json", help="also write every change as JSON to this file")
    p.set_defaults(func=_cmd_diff)


def _cmd_diff(a) -> int:
    import json

    from layerdiff.client.regress import diff_reports, format_diff
    from layerdiff.common.errors import EXIT_NO_ANSWER, LayerdiffError

    if not a.error_factor >= 1.0:
        raise LayerdiffError(f"--error-factor {a.error_factor:g} is not a factor of 1 or more", field="error_factor")
    d = diff_reports(a.old, a.new, error_factor=a.error_factor)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(d.as_dict(), f, indent=1)
    if not d.common:
        print(f"NO ANSWER: the reports share no tensor ({a.old}, {a.new}): not the same model")
        return EXIT_NO_ANSWER
    print(format_diff(d))
    return 1 if d.worse else 0


def add_perf_diff(sub) -> None:
    p = sub.add_parser("perf-diff", help="compare the performance of two runs against a baseline",
                       description="List the nodes whose time or counters changed between BASE and NEW beyond "
                                   "--threshold, flag more pld bytes (repeated moves) and more L1/IMB conflict "
                                   "cycles (bank conflicts), and show NEW's top nodes by mcu_cycle (or time) with "
                                   "a data-bound / compute-bound hint. Exit status 1 when a time or a counter grew.")
    p.add_argument("base", help="baseline: a report directory, a dump directory or an op_perf.csv")
    p.add_argument("new", help="the run to check, same kinds")
    p.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10)")
    p.add_argument("--min-us", type=float, default=1.0, help="time changes smaller than this are noise (default 1)")
    p.add_argument("--top", type=int, default=5, help="top nodes of NEW to show (default 5)")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.set_defaults(func=_cmd_perf_diff)


def _cmd_perf_diff(a) -> int:
    import json

    from layerdiff.analyzer.report.perf.diff import format_diff, perf_diff

    d = perf_diff(a.base, a.new, threshold=a.threshold, min_us=a.min_us, top=a.top)
    print(format_diff(d))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1)
    return 1 if d["regressed"] else 0


def add_kernels(sub) -> None:
    p = sub.add_parser("kernels", help="build the metric kernels for this CPU ahead of time (once, after installing)",
                       description="Build the compiled kernels every comparison runs, for this CPU, beside the "
                                   "installed package, so that no command waits for them to be compiled (make setup "
                                   "does it for a clone; run it once after installing layerdiff from a wheel). "
                                   "Where no build can be made (no C compiler or Python headers), numba compiles "
                                   "them into its cache instead. Exit status 0 when the next command finds them "
                                   "ready, 1 when neither way worked.")
    # x86-64-v3 is compiled.PORTABLE_CPU, spelt out: building the parser imports nothing of the analyzer
    p.add_argument("--portable", action="store_true",
                   help="build for any x86-64-v3 CPU (AVX2, FMA: Intel since Haswell, AMD since Excavator) instead "
                        "of this one, as an image built here and run on other machines needs")
    p.add_argument("--no-fallback", action="store_true",
                   help="where no build can be made, exit with status 1 instead of filling numba's cache (an image "
                        "build wants the build)")
    p.set_defaults(func=_cmd_kernels)


def _cmd_kernels(a) -> int:
    from layerdiff.analyzer.compare import build

    return build.run(portable=a.portable, fallback=not a.no_fallback)
