"""The ``layerdiff`` command: its parser, ``main`` (exit statuses, Ctrl-C,
one-line errors) and the job subcommands ``run``, ``compare``, ``watch`` and
``fetch``. The subcommands that run or probe the services are in
``cli_services``, those that work on local files in ``cli_tools``.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

# Every command compares on threads of its own (the analyzer's pools, the
# services'): OpenBLAS's threads, one a core and spinning after each call,
# only take those cores (a fifth of a two-dump job's CPU on two cores). Set
# before numpy loads, unless the user set it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# A dump's mapped tensors each hold a file descriptor: the soft limit
# raised to the hard one, and the descriptor table sized while this process
# has no thread yet (common/openfiles.py): before anything starts one.
from layerdiff.common.openfiles import allow_open_files  # noqa: E402

allow_open_files()

# The methods of the classes the command makes as it starts, compiled at
# set-up rather than in each command (common/dataclass_code.py): before the
# first of them is made.
from layerdiff.common import dataclass_code  # noqa: E402  (after allow_open_files())

dataclass_code.use()

from layerdiff.client.cli_services import add_health, add_service, add_worker  # noqa: E402  (after use())
from layerdiff.client.cli_tools import (  # noqa: E402
    add_convert,
    add_diff,
    add_dump,
    add_histogram,
    add_kernels,
    add_overflow,
    add_perf_diff,
)
from layerdiff.common.precision import NAMES as PRECISION_NAMES  # noqa: E402

# gRPC's own log lines (a failed TLS handshake, a refused connection) are not
# for the user: the command says in one line what went wrong. Set before the
# first import of grpc (the subcommand modules above import it only when a
# subcommand runs).
os.environ.setdefault("GRPC_VERBOSITY", "NONE")


EXIT_STATUS_HELP = """exit status:
  0  every compared node is within what its precision explains, and enough of the reference
     was compared (nodes past atol/rtol may be listed as rounding)
  1  something to fix: a computation error, or the outputs out of tolerance through
     accumulated precision loss
  2  bad input or usage (a missing, empty or unreadable file, a bad option, a model or dump refused)
  3  no answer: too little of the reference could be compared (--min-coverage), nodes that could
     not be judged, or a service or worker failed before the job could finish
  130 interrupted (Ctrl-C): the job is cancelled on the analyzer"""


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {v!r}")


def _precision_arg(v: str) -> str:
    """A precision name or alias (fp32, tf32, fp16, bf16, fp8_e4m3fn,
    fp8_e5m2, int8, auto), as the wire carries it."""
    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.precision import parse

    try:
        p = parse(v, field="")
    except LayerdiffError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return p.name if p is not None else ""


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="compare every node of a model on a device against its FP32 CPU reference",
                       description="Compare every node of MODEL on the device against its FP32 CPU reference, "
                                   "name the first node that departs, and write the reports into --out.",
                       epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="reference model (FP32): ONNX, TensorFlow frozen GraphDef (.pb), SavedModel "
                                 "directory or Keras .keras file")
    p.add_argument("--inputs", required=True, help=".npz of named model inputs")
    p.add_argument("--device", default="cpu", help="execution provider on the collector (cpu, cuda, tensorrt, ...)")
    p.add_argument("--precision", default="", type=_precision_arg, metavar="{" + ",".join(PRECISION_NAMES) + "}",
                   help="the live build's precision (default fp32; bf16, tf32 and fp8 are emulated on the CPU); for "
                        "a Keras model fp16 is its mixed_float16 run. With --dump or --device-model: the device's "
                        "precision for the verdicts (default: what its tensors' types say)")
    p.add_argument("--out", default="layerdiff-out", help="directory for the reports (default layerdiff-out)")
    p.add_argument("--device-model", help="a second model file (optimized, quantized, converted or mixed-precision "
                                          "export: ONNX, .pb, SavedModel directory, .keras) run as the device")
    p.add_argument("--signature", default="", help="SavedModel signature to run (default serving_default)")
    p.add_argument("--dump", help="read this dump directory on the collector host instead of a live run")
    p.add_argument("--dump-format", "--dump_format", default="",
                   choices=["", "npy", "npz", "onnx", "bin", "h5", "ascend"],
                   help="the dump's format (default: detected, per manifest entry or file extension)")
    p.add_argument("--dump-mode", "--dump_mode", default="output", choices=["output", "input", "all"],
                   help="node tensors to compare: outputs, the inputs each node read, or both (default output)")
    p.add_argument("--default-concat-dim", "--default_concat_dim", type=int, default=0,
                   help="splice axis of tiled nodes without grouping info; -1 = first axis of size != 1 (default 0)")
    p.add_argument("--watch", action="store_true",
                   help="with --dump: stream nodes while the runtime is still writing them")
    p.add_argument("--analyzer", help="HOST:PORT of a running analyzer (default: start one in-process)")
    p.add_argument("--collector", help="HOST:PORT of a running collector (default: start one in-process)")
    _add_compare_options(p)
    _add_perf_options(p)
    p.set_defaults(func=_cmd_run)


def _add_compare_options(p) -> None:
    """The comparison options ``run`` and ``compare`` share."""
    p.add_argument("--atol", type=float, help="absolute tolerance (default 0.005)")
    p.add_argument("--rtol", type=float, help="relative tolerance (default 0.2)")
    p.add_argument("--diff-cnt", "--diff_cnt", type=int, help="rows per failing-node CSV (default 128)")
    p.add_argument("--op-config", "--op_config_name",
                   help="op_config.csv with per-op op_name,atol,rtol (and optionally precision)")
    p.add_argument("--node-precision", action="append", metavar="NODE=PRECISION",
                   help="a node that computes in another precision than the job's (repeatable, comma-separated)")
    p.add_argument("--map-node-dict", "--map_node_dict",
                   help='JSON {"cpu_name": "npu_name"} or a file holding it')
    p.add_argument("--skip-keys", "--skip_keys", action="append",
                   help="skip nodes whose name contains any of these keys (comma-separated, repeatable)")
    p.add_argument("--exclude-node-list", "--exclude_node_list", action="append",
                   help="node names to ignore (comma-separated, repeatable, or a file with one per line)")
    p.add_argument("--force-compare", "--force_compare", nargs="?", const=True, default=False, type=_bool,
                   help="compare nodes whose shape differs but size matches")
    p.add_argument("--max-cores", "--max_cores", type=int, help="comparison workers (default: CPU count)")
    p.add_argument("--min-coverage", "--min_coverage", type=float,
                   help="share of the reference's computed tensors that must be compared for an answer; below "
                        "it the run answers 'no answer' with exit status 3 (default 0.5; 0 accepts any partial "
                        "dump)")
    p.add_argument("--show-graph", "--show_graph", nargs="?", const=True, default=False, type=_bool,
                   help="plots for the failing nodes: {op}_diff.png, {op}_diff_hist.png, {op}_hist.png")
    p.add_argument("--max-plots", "--max_plots", type=_plot_count, metavar="N|all",
                   help="with --show-graph: the first N failing nodes in execution order are drawn (default 20; "
                        "'all' draws every one)")
    p.add_argument("--max-bins", "--max_bins", type=int, help="histogram bins at most (default 128)")
    p.add_argument("--min-bins", "--min_bins", type=int, help="histogram bins at least (default 1)")
    p.add_argument("--min-max", "--tensor-min-max", help="tensor_min_max.txt: input ranges for the INT8 advice")
    p.add_argument("--listing", action="store_true",
                   help="also print every compared node as index.name OP_TYPE MSE COS RMSE")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _plot_count(text: str) -> int:
    """--max-plots: a count of 1 or more, or 'all' (-1 on the wire)."""
    if text.strip().lower() == "all":
        return -1
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or 'all'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} plots: give 1 or more, or 'all'")
    return n


def _compare_kwargs(a) -> dict:
    return dict(atol=a.atol, rtol=a.rtol, diff_cnt=a.diff_cnt, op_config=a.op_config, map_node_dict=a.map_node_dict,
                skip_keys=a.skip_keys, exclude_node_list=a.exclude_node_list, force_compare=a.force_compare,
                max_cores=a.max_cores, show_graph=a.show_graph, max_plots=a.max_plots, max_bins=a.max_bins,
                min_bins=a.min_bins,
                min_max=a.min_max, min_coverage=a.min_coverage, node_precision=a.node_precision)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="compare a device dump against a golden dump, with no model",
                       description="Compare every tensor of DEVICE_DUMP against the golden run REFERENCE_DUMP (a "
                                   "run on another host, device or framework: PyTorch on a GPU, a CPU build of the "
                                   "runtime) and name the first node that departs; no model is run. Each dump is "
                                   "read where it lies by its collector, in any dump format; repeated calls of an "
                                   "operator (HDF5 op@k) pair call by call.",
                       epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference_dump", metavar="REFERENCE_DUMP",
                   help="the golden dump: a directory on the reference collector's host")
    p.add_argument("device_dump", metavar="DEVICE_DUMP", help="the device's dump: a directory on the collector's host")
    p.add_argument("--model", help="an ONNX model (either side's) lending its graph: structure, op types and node "
                                   "order for alignment, and the isolated re-run of a failing node")
    p.add_argument("--reference-collector", help="HOST:PORT of the collector on the golden dump's host (default: "
                                                 "--collector)")
    p.add_argument("--collector", help="HOST:PORT of the collector on the device dump's host (default: start one "
                                       "in-process, reading both dumps)")
    p.add_argument("--analyzer", help="HOST:PORT of a running analyzer (default: start one in-process)")
    formats = ["", "npy", "npz", "onnx", "bin", "h5", "ascend"]
    p.add_argument("--reference-format", default="", choices=formats,
                   help="the golden dump's format (default: detected)")
    p.add_argument("--dump-format", "--dump_format", default="", choices=formats,
                   help="the device dump's format (default: detected)")
    p.add_argument("--dump-mode", "--dump_mode", default="output", choices=["output", "input", "all"],
                   help="node tensors to compare: outputs, the inputs each node read, or both; with all, a node "
                        "whose inputs agree while its output does not is a computation error (default output)")
    p.add_argument("--precision", default="", type=_precision_arg, metavar="{" + ",".join(PRECISION_NAMES) + "}",
                   help="the device's precision, which the verdicts judge its errors by (default: what the "
                        "dumped types say, FP32 for float32)")
    p.add_argument("--device", default="", help="the device's name, for the reports")
    p.add_argument("--default-concat-dim", "--default_concat_dim", type=int, default=0,
                   help="splice axis of tiled nodes without grouping info; -1 = first axis of size != 1 (default 0)")
    p.add_argument("--watch", action="store_true",
                   help="stream the device dump's nodes while the runtime is still writing them")
    p.add_argument("--out", default="layerdiff-out", help="directory for the reports (default layerdiff-out)")
    _add_compare_options(p)
    p.set_defaults(func=_cmd_compare)


def _add_watch_fetch(sub) -> None:
    def job_parser(name: str, help: str, description: str, analyzer_help: str):
        p = sub.add_parser(name, help=help, description=description, epilog=EXIT_STATUS_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("job_id", metavar="JOB_ID")
        p.add_argument("--analyzer", required=True, help=analyzer_help)
        p.add_argument("--out", default="layerdiff-out", help="directory for the reports (default layerdiff-out)")
        p.add_argument("--listing", action="store_true",
                       help="also print every compared node as index.name OP_TYPE MSE COS RMSE")
        return p

    p = job_parser("watch", "follow a job on a running analyzer to its end and fetch its reports",
                   "Follow job JOB_ID (the id `layerdiff run` prints) on a running analyzer to its end, as "
                   "`layerdiff run` would have, then fetch its reports into --out and print the same summary with "
                   "the same exit status. A job that has ended is shown at once. Ctrl-C cancels the job.",
                   "HOST:PORT of the analyzer running the job")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, help="give up after this many seconds (the job goes on; default: "
                                                 "wait for its end)")
    p.set_defaults(func=_cmd_watch)

    p = job_parser("fetch", "fetch the reports of a finished job from a running analyzer",
                   "Fetch the reports of finished job JOB_ID from a running analyzer into --out and print its "
                   "summary, with the exit status `layerdiff run` gave. A job that is not DONE is one line with its "
                   "state and reason (exit status 3, or the failed job's own); an unknown id exits with 2.",
                   "HOST:PORT of the analyzer that ran the job")
    p.set_defaults(func=_cmd_fetch)


def _add_perf_options(p) -> None:
    import os

    g = p.add_argument_group("performance data (DUMP_OP_PERF)")
    g.add_argument("--perf-mode", "--perf_mode", default=os.environ.get("DUMP_OP_PERF") or "accuracy",
                   choices=["accuracy", "perf", "both", "0", "1", "2"],
                   help="accuracy only (0, default), performance only (1) or both (2); default from DUMP_OP_PERF")
    g.add_argument("--perf-all-nodes", "--perf_all_nodes", nargs="?", const=True, default=True, type=_bool,
                   help="False: leave out nodes whose name contains _span (default True)")
    g.add_argument("--perf-runs", "--perf_runs", type=int, help="live: profiled runs after one warm-up (default 5)")
    g.add_argument("--clock-mhz", "--clock_mhz", type=float,
                   help="counters without a duration: time = mcu_cycle / clock (default 1000 MHz)")
    g.add_argument("--perf-graph-optimization", default="", choices=["all", "extended", "basic", "none"],
                   help="live: onnxruntime graph optimization of the profiled run (default extended: fused nodes "
                        "keep their first node's name; all: as deployed, x86 layout nodes renamed)")


def _job_line(a):
    """on_job for run and compare: the job id, and how to find it again."""
    if not a.verbose and not (a.analyzer and a.collector):
        # the services run in this process: what they log is for operators
        # (-v shows it); the job's own outcome reaches the user below
        logging.getLogger("layerdiff").setLevel(logging.CRITICAL)
    if not a.analyzer:
        # the comparisons run in this process: a wait for numba's compiler is the user's to know of
        kernels_log = logging.getLogger("layerdiff.analyzer.compare.compiled")
        said = logging.StreamHandler(sys.stderr)
        said.setFormatter(logging.Formatter("layerdiff: %(message)s"))
        kernels_log.addHandler(said)
        kernels_log.setLevel(logging.WARNING)
        kernels_log.propagate = False

    def on_job(job_id: str) -> None:
        # a job on running services outlives this process: say how to find it again
        from layerdiff.client.follow import reattach_command

        if a.analyzer and a.collector:
            line = f"job {job_id} on analyzer {a.analyzer} (reattach: {reattach_command(job_id, a.analyzer)})"
        elif a.analyzer:
            line = f"job {job_id} on analyzer {a.analyzer}"
        else:
            line = f"job {job_id}"
        print(f"layerdiff: {line}", file=sys.stderr, flush=True)

    return on_job


@contextmanager
def _one_job(watch: bool = False):
    """The command runs one job, and the job makes next to no reference
    cycles (82 objects of them in a two-dump job of 1352 tensors, 110 in a
    MiniLM run): the cyclic collector's 127 passes over objects that all
    survive cost it 12-15 ms of its interpreter. Paused while the job runs,
    on again after; left on for a watched dump, which may stream for hours."""
    was = gc.isenabled()
    if not watch:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _report_process_ahead(a, in_process: bool = False) -> None:
    """A job run in this process (no analyzer given) writes its reports
    with a process of its own: started now, it loads while this one does.
    ``in_process``: nothing of the job is served (two dumps read here), so
    that this process never loads pyarrow, and that one makes the tables."""
    if a.analyzer is None:
        from layerdiff.analyzer.report.writer import ReportProcess

        ReportProcess.prestart(tables=in_process)


def _cmd_run(a) -> int:
    from layerdiff.client import prefetch

    _report_process_ahead(a)
    prefetch.start([a.model, a.device_model])      # read while the job's code is imported
    from layerdiff.client.api import run

    with _one_job(a.watch):
        result = run(a.model, a.inputs, out=a.out, device=a.device, precision=a.precision,
                     device_model=a.device_model, dump=a.dump, dump_format=a.dump_format,
                     default_concat_dim=a.default_concat_dim, watch=a.watch, dump_mode=a.dump_mode,
                     analyzer=a.analyzer, collector=a.collector, progress=not a.no_progress, perf_mode=a.perf_mode,
                     perf_all_nodes=a.perf_all_nodes, perf_runs=a.perf_runs, clock_mhz=a.clock_mhz,
                     perf_graph_optimization=a.perf_graph_optimization, signature=a.signature,
                     on_job=_job_line(a), **_compare_kwargs(a))
    return _show(result, a.listing)


def _cmd_compare(a) -> int:
    # as client.api._run_job decides it
    _report_process_ahead(a, in_process=a.collector is None and a.reference_collector is None and not a.watch
                          and not os.environ.get("LAYERDIFF_BROKER_URL"))
    from layerdiff.client.api import compare

    with _one_job(a.watch):
        result = compare(a.reference_dump, a.device_dump, out=a.out, model=a.model,
                         reference_collector=a.reference_collector, collector=a.collector, analyzer=a.analyzer,
                         reference_format=a.reference_format, dump_format=a.dump_format,
                         default_concat_dim=a.default_concat_dim, watch=a.watch, dump_mode=a.dump_mode,
                         precision=a.precision, device=a.device, progress=not a.no_progress, on_job=_job_line(a),
                         **_compare_kwargs(a))
    return _show(result, a.listing)


def _show(result, listing: bool) -> int:
    """The summary `run`, `watch` and `fetch` print, and their exit status."""
    from layerdiff.client.summary_text import format_summary, terminal_width

    print(format_summary(result.summary, result.out, width=terminal_width()))
    if listing:
        from layerdiff.analyzer.report.listing import format_listing

        print(format_listing(result.summary))
    return result.exit_status


def _cmd_watch(a) -> int:
    from layerdiff.client.api import watch

    return _show(watch(a.job_id, analyzer=a.analyzer, out=a.out, progress=not a.no_progress, timeout=a.timeout),
                 a.listing)


def _cmd_fetch(a) -> int:
    from layerdiff.client.api import fetch

    return _show(fetch(a.job_id, analyzer=a.analyzer, out=a.out), a.listing)



def build_parser() -> argparse.ArgumentParser:
    from layerdiff import __version__

    parser = argparse.ArgumentParser(prog="layerdiff", description="Layer-wise accuracy debugger for models on "
                                     "accelerators: finds the first node that departs from the FP32 reference.")
    parser.add_argument("--version", action="version", version=f"layerdiff {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_compare(sub)
    _add_watch_fetch(sub)
    add_service(sub, "collector")
    add_service(sub, "analyzer")
    add_worker(sub)
    add_convert(sub)
    add_dump(sub)
    add_overflow(sub)
    add_diff(sub)
    add_perf_diff(sub)
    add_histogram(sub)
    add_health(sub)
    add_kernels(sub)
    return parser



def _on_sigint(signum, frame) -> None:
    # The first Ctrl-C stops the command (a job is cancelled on the way out,
    # in a bounded time); more presses while it winds down are ignored, so
    # that no traceback reaches the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _rpc_text(e: BaseException) -> str:
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    if callable(code) and callable(details):
        try:
            name = getattr(code(), "name", str(code()))
            return " ".join(f"{name}: {details() or ''}".split())
        except Exception:
            pass
    return " ".join(str(e).split()) or type(e).__name__


def _log_unraisable(u) -> None:
    logging.getLogger("layerdiff").info("ignored in %r: %s: %s", u.object, u.exc_type.__name__, u.exc_value)


def _log_thread_exception(a) -> None:
    if a.exc_type is SystemExit:
        return
    # After Ctrl-C, gRPC's own threads can trip over the calls cancelled under
    # them (seen once in hundreds of interrupted runs under load); the
    # command's one-line answer is the user's, such a thread's end is logged
    # for -v only
    interrupted = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    logging.getLogger("layerdiff").log(logging.INFO if interrupted else logging.ERROR, "thread %s failed: %s: %s",
                                       a.thread.name if a.thread else "?", a.exc_type.__name__, a.exc_value)


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if argv is None:
        # The command line has given its answer and closed what it opened.
        # It leaves without the interpreter's shutdown, where threads gRPC's
        # core still runs (a call cancelled by Ctrl-C) can corrupt the heap
        # as modules are torn down ("malloc(): unsorted double linked list
        # corrupted" after the one-line answer, seen once in about 80 runs).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    previous = None
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous = signal.signal(signal.SIGINT, _on_sigint)
    if argv is None:
        # The command line: what a library's destructor or a background
        # thread could not handle is logged (seen with -v), never printed
        # as a traceback (a Ctrl-C landing inside grpc's call set-up leaves
        # such an object behind).
        sys.unraisablehook = _log_unraisable
        threading.excepthook = _log_thread_exception
    verbose = False
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # A library's warning is not a message for the user: with -v it is logged.
        logging.captureWarnings(True)
        logging.getLogger("py.warnings").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
        from layerdiff.common.errors import JobFailed, LayerdiffError

        try:
            return args.func(args)
        except JobFailed as e:
            print(f"layerdiff: error: {e}", file=sys.stderr)
            return e.exit_status
        except LayerdiffError as e:
            print(f"layerdiff: error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt as e:
        # layerdiff.client.calls.Interrupted says what became of the job
        print(f"layerdiff: {getattr(e, 'message', None) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as e:
        from layerdiff.client.calls import by_ctrl_c, call_errors

        if by_ctrl_c(e):       # what a Ctrl-C broke on its way out
            print("layerdiff: interrupted", file=sys.stderr)
            return 130
        if not isinstance(e, (*call_errors(), OSError)):
            raise
        # a service or the system failed where no message was prepared: still one line
        where = "a service call failed" if isinstance(e, call_errors()) else "system error"
        print(f"layerdiff: error: {where}: {_rpc_text(e)}", file=sys.stderr)
        if verbose:
            import traceback

            traceback.print_exc()
        return 3
    finally:
        # A caller in this process gets its handler back. The command line
        # (argv from sys.argv) has given its answer: it ignores Ctrl-C through
        # the interpreter's shutdown, where one would only print a traceback.
        if previous is not None:
            signal.signal(signal.SIGINT, previous if argv is not None else signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
