"""The ``layerdiff`` command."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

# gRPC's own log lines (a failed TLS handshake, a refused connection) are not
# for the user: the command says in one line what went wrong. Set before the
# first import of grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")


EXIT_STATUS_HELP = """exit status:
  0  every compared node is within tolerance, and enough of the reference was compared
  1  failing nodes found
  2  bad input or usage (a missing, empty or unreadable file, a bad option, a model or dump refused)
  3  no answer: too little of the reference could be compared (--min-coverage), or a service
     or worker failed before the job could finish
  130 interrupted (Ctrl-C): the job is cancelled on the analyzer"""


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {v!r}")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="compare every node of a model on a device against its FP32 CPU reference",
                       description="Compare every node of MODEL on the device against its FP32 CPU reference, "
                                   "name the first node that departs, and write the reports into --out.",
                       epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="reference model (FP32): ONNX, TensorFlow frozen GraphDef (.pb), SavedModel "
                                 "directory or Keras .keras file")
    p.add_argument("--inputs", required=True, help=".npz of named model inputs")
    p.add_argument("--device", default="cpu", help="execution provider on the collector (cpu, cuda, tensorrt, ...)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="device precision for a live run (default fp32); for a Keras model fp16 is its "
                        "mixed_float16 run")
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
    p.add_argument("--op-config", "--op_config_name", help="op_config.csv with per-op op_name,atol,rtol")
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
                   help="plots for every failing node: {op}_diff.png, {op}_diff_hist.png, {op}_hist.png")
    p.add_argument("--max-bins", "--max_bins", type=int, help="histogram bins at most (default 128)")
    p.add_argument("--min-bins", "--min_bins", type=int, help="histogram bins at least (default 1)")
    p.add_argument("--min-max", "--tensor-min-max", help="tensor_min_max.txt: input ranges for the INT8 advice")
    p.add_argument("--listing", action="store_true",
                   help="also print every compared node as index.name OP_TYPE MSE COS RMSE")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _compare_kwargs(a) -> dict:
    return dict(atol=a.atol, rtol=a.rtol, diff_cnt=a.diff_cnt, op_config=a.op_config, map_node_dict=a.map_node_dict,
                skip_keys=a.skip_keys, exclude_node_list=a.exclude_node_list, force_compare=a.force_compare,
                max_cores=a.max_cores, show_graph=a.show_graph, max_bins=a.max_bins, min_bins=a.min_bins,
                min_max=a.min_max, min_coverage=a.min_coverage)


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
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="the device's precision, for the reasoning that depends on it (default fp32)")
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

    def on_job(job_id: str) -> None:
        # a job on running services outlives this process: say how to find it again
        from layerdiff.client.api import reattach_command

        if a.analyzer and a.collector:
            line = f"job {job_id} on analyzer {a.analyzer} (reattach: {reattach_command(job_id, a.analyzer)})"
        elif a.analyzer:
            line = f"job {job_id} on analyzer {a.analyzer}"
        else:
            line = f"job {job_id}"
        print(f"layerdiff: {line}", file=sys.stderr, flush=True)

    return on_job


def _cmd_run(a) -> int:
    from layerdiff.client.api import run

    result = run(a.model, a.inputs, out=a.out, device=a.device, precision=a.precision, device_model=a.device_model,
                 dump=a.dump, dump_format=a.dump_format, default_concat_dim=a.default_concat_dim, watch=a.watch,
                 dump_mode=a.dump_mode, analyzer=a.analyzer, collector=a.collector, progress=not a.no_progress,
                 perf_mode=a.perf_mode, perf_all_nodes=a.perf_all_nodes, perf_runs=a.perf_runs,
                 clock_mhz=a.clock_mhz, perf_graph_optimization=a.perf_graph_optimization, signature=a.signature,
                 on_job=_job_line(a), **_compare_kwargs(a))
    return _show(result, a.listing)


def _cmd_compare(a) -> int:
    from layerdiff.client.api import compare

    result = compare(a.reference_dump, a.device_dump, out=a.out, model=a.model,
                     reference_collector=a.reference_collector, collector=a.collector, analyzer=a.analyzer,
                     reference_format=a.reference_format, dump_format=a.dump_format,
                     default_concat_dim=a.default_concat_dim, watch=a.watch, dump_mode=a.dump_mode,
                     precision=a.precision, device=a.device, progress=not a.no_progress, on_job=_job_line(a),
                     **_compare_kwargs(a))
    return _show(result, a.listing)


def _show(result, listing: bool) -> int:
    """The summary `run`, `watch` and `fetch` print, and their exit status."""
    from layerdiff.client.api import format_summary

    print(format_summary(result.summary, result.out))
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


def _serve(server_cls, a, **kw) -> int:
    server = server_cls(host=a.host, port=a.port, workdir=a.workdir, **kw)
    print(f"{a.service} listening on {server.address}", flush=True)
    stop = lambda *_: server.stop(grace=2.0)  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.wait()
    return 0


def _add_service(sub, name: str) -> None:
    p = sub.add_parser(name, help=f"the {name} service")
    s = p.add_subparsers(dest="action", required=True)
    serve = s.add_parser("serve", help=f"run the {name} gRPC service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    serve.add_argument("--workdir", help="private working directory (default: a temporary one)")
    serve.add_argument("--token-file", help="accepted tokens, one a line (default: LAYERDIFF_TOKEN_FILE)")
    serve.add_argument("--tls-cert", help="server certificate, PEM (default: LAYERDIFF_TLS_CERT)")
    serve.add_argument("--tls-key", help="its private key, PEM (default: LAYERDIFF_TLS_KEY)")
    serve.add_argument("--tls-ca", help="CA client certificates must chain to: mutual TLS (default: LAYERDIFF_TLS_CA)")
    if name == "collector":
        serve.add_argument("--dump-roots", help="':'-separated directories dumps may be read from "
                                                "(default: LAYERDIFF_DUMP_ROOTS)")
        serve.add_argument("--health-port", type=int, default=None,
                           help="also serve grpc.health.v1 on this port (default: LAYERDIFF_HEALTH_PORT; none)")
    if name == "analyzer":
        serve.add_argument("--broker", help="Redis URL: fan comparisons out to Celery workers "
                                            "(default: LAYERDIFF_BROKER_URL; none = local pool)")
    serve.set_defaults(func=_cmd_serve, service=name)


def _cmd_serve(a) -> int:
    from layerdiff.common.security import ServerSecurity

    security = ServerSecurity.from_env(token_file=a.token_file, cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca)
    if a.service == "collector":
        from layerdiff.collector.service import CollectorServer

        return _serve(CollectorServer, a, security=security, dump_roots=a.dump_roots, health_port=a.health_port)
    from layerdiff.analyzer.service import AnalyzerServer

    return _serve(AnalyzerServer, a, broker_url=a.broker, security=security)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a dump to .npy (and .txt) files with shape and dtype sidecars")
    p.add_argument("dump", help="dump directory")
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
    print(f"converted {res['converted']} tensors, skipped {res['skipped']} (see convert_skip.log) into {res['out']}")
    return 0


def _add_dump(sub) -> None:
    p = sub.add_parser("dump", help="run a model on the device and write a dump as an acl.json-style file asks",
                       description="Run MODEL on the device the way the collector does and write the dump that "
                                   "the configuration (the runtime's acl.json: dump_path, dump_list, dump_mode, "
                                   "dump_op_switch, dump_debug) asks for.")
    p.add_argument("model", help="ONNX model")
    p.add_argument("--inputs", required=True, help=".npz of named model inputs")
    p.add_argument("--config", required=True, help="dump configuration (acl.json)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"])
    p.add_argument("--device-model", help="run this export as the device instead")
    p.add_argument("--format", default="ascend", choices=["ascend", "npy", "npz", "onnx", "bin", "h5"],
                   help="dump format (default ascend: vendor-named files under {time}/{device}/{model}/{index})")
    p.set_defaults(func=_cmd_dump)


def _cmd_dump(a) -> int:
    from layerdiff.collector.dumps.config import dump_live_run

    res = dump_live_run(a.model, a.inputs, a.config, precision=a.precision, device=a.device,
                        device_model=a.device_model, fmt=a.format)
    print(f"wrote {res['records']} tensors ({res['mode']}, {res['format']}) into {res['dump_path']}")
    if res["overflowing_nodes"]:
        print(f"overflowing nodes: {', '.join(res['overflowing_nodes'])}")
    return 0


def _add_overflow(sub) -> None:
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


def _add_histogram(sub) -> None:
    p = sub.add_parser("histogram", help="one histogram per dumped tensor, min/max as red dashed lines",
                       description="Draw the value histogram of every tensor in DUMP (any dump format layerdiff "
                                   "reads) with the layer's min and max as red dashed lines: from --min-max "
                                   "(a tensor_min_max.txt range file, lines 'name min max') where it names the "
                                   "tensor, else the tensor's own. An existing output directory that holds files "
                                   "is left as it is: the histograms then go to a fresh Histograms_N beside it.")
    p.add_argument("dump", help="dump directory")
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


def _add_worker(sub) -> None:
    p = sub.add_parser("worker", help="a Celery worker for the analyzer's per-node comparisons",
                       description="Start a Celery worker that compares nodes for any analyzer using the same "
                                   "broker. It needs nothing but the broker address.")
    p.add_argument("--broker", help="Redis URL (default: LAYERDIFF_BROKER_URL)")
    p.add_argument("--max-cores", "--max_cores", type=int, help="worker processes (default: CPU count)")
    p.add_argument("--loglevel", default="WARNING")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(a) -> int:
    import os

    from layerdiff.analyzer.execute.local import default_cores
    from layerdiff.common.errors import LayerdiffError

    broker = a.broker or os.environ.get("LAYERDIFF_BROKER_URL")
    if not broker:
        raise LayerdiffError("no broker: give --broker or set LAYERDIFF_BROKER_URL", field="broker")
    os.environ["LAYERDIFF_BROKER_URL"] = broker
    from layerdiff.analyzer.execute.celery_app import QUEUE, make_app

    app = make_app(broker)
    app.worker_main(["worker", f"--loglevel={a.loglevel}", f"--concurrency={a.max_cores or default_cores()}",
                     "-Q", QUEUE, "--pool=prefork", "-n", f"layerdiff-{os.getpid()}@%h", "--without-gossip",
                     "--without-mingle"])
    return 0


def _add_perf_diff(sub) -> None:
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

    from layerdiff.analyzer.report.perfdiff import format_diff, perf_diff

    d = perf_diff(a.base, a.new, threshold=a.threshold, min_us=a.min_us, top=a.top)
    print(format_diff(d))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1)
    return 1 if d["regressed"] else 0


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
    _add_service(sub, "collector")
    _add_service(sub, "analyzer")
    _add_worker(sub)
    _add_convert(sub)
    _add_dump(sub)
    _add_overflow(sub)
    _add_perf_diff(sub)
    _add_histogram(sub)
    _add_health(sub)
    return parser


def _add_health(sub) -> None:
    p = sub.add_parser("health", help="probe a service's health (grpc.health.v1): exit 0 when SERVING, "
                                      "1 when not ready, 3 when it does not answer")
    p.add_argument("address", help="HOST:PORT of an analyzer, or of a collector (its Flight or health port)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.set_defaults(func=_cmd_health)


def _cmd_health(a) -> int:
    from layerdiff.client.health import probe

    status, line = probe(a.address, a.timeout)
    print(line, flush=True)
    return status


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
    logging.getLogger("layerdiff").error("thread %s failed: %s: %s", a.thread.name if a.thread else "?",
                                         a.exc_type.__name__, a.exc_value)


def main(argv: list[str] | None = None) -> int:
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
        # layerdiff.client.api.Interrupted says what became of the job
        print(f"layerdiff: {getattr(e, 'message', None) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as e:
        import grpc

        if not isinstance(e, (grpc.RpcError, OSError)):
            raise
        # a service or the system failed where no message was prepared: still one line
        where = "a service call failed" if isinstance(e, grpc.RpcError) else "system error"
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
