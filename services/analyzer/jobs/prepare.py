"""A job prepared at submit time: its spec checked, its reference opened,
its inputs read, its graphs aligned and its comparison options parsed, so
that bad input fails the Submit call itself (``prepare``); and the
aligner a job pairs device tensors with reference tensors by
(``make_aligner``), also rebuilt while the job runs."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from layerdiff.analyzer.align.names import Aligner
from layerdiff.analyzer.compare.tolerances import Tolerances
from layerdiff.analyzer.diagnose.minmax import parse_min_max
from layerdiff.analyzer.jobs.budget import MemoryBudget
from layerdiff.analyzer.reference.dump import DumpReference
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.analyzer.report.perf.settings import PerfSettings, check_perf_options
from layerdiff.collector.core import in_process
from layerdiff.common.artifacts import ArtifactStore
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import load_inputs
from layerdiff.common.precision import Precision
from layerdiff.common.precision import parse as parse_precision
from layerdiff.common.schema import check_dump_mode
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from layerdiff.analyzer.reference.tf import TFReference
    from layerdiff.collector.core import Collector
    from layerdiff.collector.service import CollectorClient

log = logging.getLogger(__name__)
DIFF_CNT_DEFAULT = 128
# Plots for the first failing nodes only: a person looks at a few; drawing
# every one of hundreds took 30 times the job (--max-plots all draws them)
MAX_PLOTS_DEFAULT = 20


@dataclass
class Prepared:
    """Everything checked at submit time, so bad input fails the Submit call."""
    reference: OnnxReference | TFReference | DumpReference
    feeds: dict
    aligner: Aligner
    tolerances: Tolerances
    diff_cnt: int = DIFF_CNT_DEFAULT
    max_cores: int = 0
    force_compare: bool = False
    quantized: bool = False
    show_graph: bool = False
    max_plots: int | None = MAX_PLOTS_DEFAULT   # failing nodes drawn at most (None: every one)
    max_bins: int = 128
    min_bins: int = 1
    given_ranges: dict = field(default_factory=dict)     # from a tensor_min_max.txt
    range_skips: list = field(default_factory=list)      # its lines that did not parse
    perf: PerfSettings = field(default_factory=PerfSettings)
    min_coverage: float | None = None   # None: the default (coverage.MIN_COVERAGE_DEFAULT)
    weights: list | None = None         # weights.csv rows where both models are at hand
    weights_aside: Future | None = None  # those rows being made for an FP16 build (started at submit)
    graph_aside: Future | None = None    # _device_model_facts, being made (started at submit)
    golden: bool = False                # the reference is a golden dump, streamed first (DumpReference)
    # the device's precision as the job gives it (None: read from the data), for the error model
    precision: Precision | None = None

    def settle_graph(self, options: pb.CompareOptions) -> None:
        """Join what the device model tells, once: the aligner and weights
        its graph alignment gives, and whether it quantizes (a failure
        fails the job)."""
        if self.graph_aside is None:
            return
        (graph, quantizes), self.graph_aside = self.graph_aside.result(), None
        self.aligner = make_aligner(self.reference, options, graph)
        self.weights = _weights(graph)
        self.quantized = self.quantized or quantizes

    def policy(self):
        """The error model's view of the device's precision (ErrorPolicy)."""
        from layerdiff.analyzer.diagnose.errormodel import ErrorPolicy

        return ErrorPolicy(job=self.precision, overrides=dict(self.tolerances.precisions), quantized=self.quantized,
                           layout=getattr(self.reference, "layout", "NCHW"))


def _check_collector(address: str) -> None:
    """The analyzer may connect to this collector (one serving in this
    process is not connected to: nothing to allow)."""
    if in_process(address) is None:
        from layerdiff.common.security import check_collector_allowed

        check_collector_allowed(address)


def prepare(spec: pb.JobSpec, store: ArtifactStore) -> Prepared:
    MemoryBudget.from_env()     # a malformed LAYERDIFF_MEMORY_BUDGET fails the Submit, naming it
    if spec.HasField("reference_dump"):
        return _prepare_dump_reference(spec, store)
    if not spec.collector:
        raise LayerdiffError("no collector address given", field="collector")
    _check_collector(spec.collector)
    # TensorFlow's reference (and its loaders) only for a job with a model
    from layerdiff.analyzer.reference.tf import TFReference, open_reference

    declared = parse_precision(spec.precision)
    model_name = spec.model_name or store.name(spec.model_artifact)
    reference = open_reference(store.read(spec.model_artifact, "model_artifact"), model_name, spec.signature,
                               key=spec.model_artifact)
    inputs_name = store.name(spec.inputs_artifact) if spec.inputs_artifact else "inputs"
    feeds = reference.check_inputs(load_inputs(store.read(spec.inputs_artifact, "inputs_artifact"), inputs_name),
                                   inputs_name)
    if spec.device_model_artifact:
        store.path(spec.device_model_artifact, "device_model_artifact")
    elif isinstance(reference, TFReference) and not spec.dump_path:
        reference.check_device_precision(spec.precision)
    # the device model's graph pairing (a second of a 90 MB model's weights
    # compared) is made beside the job's start, while the collector builds
    # and runs the device; names pair until it is joined (settle_graph)
    graph_aside = None
    if spec.device_model_artifact:
        aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphs")
        graph_aside = aside.submit(_device_model_facts, spec, store, reference)
        aside.shutdown(wait=False)
    aligner = make_aligner(reference, spec.options, None)
    options = _checked_options(spec)
    # a device model that quantizes says so once read (settle_graph)
    options["quantized"] = declared is not None and declared.quantized
    # a live build is the precision it was built in; a device model or dump
    # says its own where the job does not
    options["precision"] = declared if declared is not None or spec.device_model_artifact or spec.dump_path \
        else parse_precision("fp32")
    perf = options["perf"]
    if perf.enabled and not spec.dump_path:
        _check_live_perf(spec, store)
    if perf.only and spec.watch:
        raise LayerdiffError("watch streams tensors while the runtime writes them; a performance-only job reads "
                             "the counter files once: run it when the runtime has finished", field="watch")
    return Prepared(reference, feeds, aligner, graph_aside=graph_aside, **options)


def _checked_options(spec: pb.JobSpec) -> dict:
    """The comparison options of a job, checked: Prepared's fields."""
    o = spec.options
    tolerances = Tolerances(o.atol if o.has_atol or o.atol else None, o.rtol if o.has_rtol or o.rtol else None,
                            o.op_config_csv, dict(o.node_precision))
    if o.diff_cnt < 0:
        raise LayerdiffError("must be >= 0", field="diff_cnt")
    if o.max_cores < 0:
        raise LayerdiffError("must be >= 0", field="max_cores")
    if o.max_plots < -1:
        raise LayerdiffError(f"must be 1 or more, or -1 for every failing node, got {o.max_plots}",
                             field="max_plots")
    check_dump_mode(spec.dump_mode)
    max_bins = o.max_bins or 128
    min_bins = o.min_bins or 1
    if max_bins < 1 or max_bins > 4096:
        raise LayerdiffError(f"must be in [1, 4096], got {max_bins}", field="max_bins")
    if not 1 <= min_bins <= max_bins:
        raise LayerdiffError(f"must be in [1, max_bins={max_bins}], got {min_bins}", field="min_bins")
    given_ranges, range_skips = parse_min_max(o.min_max_text) if o.min_max_text.strip() else ({}, [])
    min_coverage = o.min_coverage if o.has_min_coverage or o.min_coverage else None
    if min_coverage is not None and not 0.0 <= min_coverage <= 1.0:
        raise LayerdiffError(f"must be in [0, 1], got {min_coverage:g}", field="min_coverage")
    return dict(tolerances=tolerances, diff_cnt=o.diff_cnt or DIFF_CNT_DEFAULT, max_cores=o.max_cores,
                force_compare=o.force_compare, show_graph=o.show_graph,
                max_plots=None if o.max_plots == -1 else (o.max_plots or MAX_PLOTS_DEFAULT),
                max_bins=max_bins, min_bins=min_bins,
                given_ranges=given_ranges, range_skips=range_skips, perf=check_perf_options(spec.perf),
                min_coverage=min_coverage)


def _prepare_dump_reference(spec: pb.JobSpec, store: ArtifactStore) -> Prepared:
    """Two dumps: the golden one (read by its collector first, in the job)
    is the reference; an ONNX model, if given, lends its graph."""
    golden = spec.reference_dump
    if not golden.collector:
        raise LayerdiffError("no collector address given for the reference dump", field="reference_dump.collector")
    if not golden.dump.path:
        raise LayerdiffError("no reference dump path given", field="reference_dump.dump.path")
    if golden.dump.watch:
        raise LayerdiffError("the reference dump is read once, whole: it cannot be watched",
                             field="reference_dump.dump.watch")
    if not spec.collector:
        raise LayerdiffError("no collector address given for the device dump", field="collector")
    if not spec.dump_path:
        raise LayerdiffError("a reference dump is compared with a device dump: give the device dump's path",
                             field="dump_path")
    if spec.device_model_artifact:
        raise LayerdiffError("two dumps are compared without running a device model", field="device_model_artifact")
    declared = parse_precision(spec.precision)
    for address in (golden.collector, spec.collector):
        _check_collector(address)
    model = None
    if spec.model_artifact:
        from layerdiff.common.onnxgraph import load_model
        from layerdiff.common.tf.format import is_tensorflow

        name = store.name(spec.model_artifact)
        data = store.read(spec.model_artifact, "model_artifact")
        if is_tensorflow(name, data):
            raise LayerdiffError("only an ONNX model lends its graph to a comparison of two dumps", file=name,
                                 field="model")
        model = load_model(data, name)
    options = _checked_options(spec)
    if options["perf"].enabled:
        raise LayerdiffError("a comparison of two dumps is of accuracy only", field="perf")
    provenance = {"collector": golden.collector, "dump_path": golden.dump.path,
                  "format": golden.dump.format or "detected"}
    reference = DumpReference(spec.model_name or f"reference dump {golden.dump.path}", model=model,
                              provenance=provenance)
    # the aligner needs the golden dump's tensors: built once it has streamed (JobRunner._receive_golden)
    return Prepared(reference, {}, Aligner([]), quantized=declared is not None and declared.quantized, golden=True,
                    precision=declared, **options)


def make_aligner(reference, o: pb.CompareOptions, graph) -> Aligner:
    """The job's aligner: the user's mapping, then the graphs' pairs, then names."""
    return Aligner(reference.sites, map_node_dict=dict(o.map_node_dict), skip_keys=list(o.skip_keys),
                   exclude_node_list=list(o.exclude_node_list), pairs=graph.pairs if graph else None,
                   fused=graph.fused if graph else None, groups=graph.groups if graph else None,
                   unpaired=graph.lost if graph else None, folded=graph.folded if graph else None,
                   attributed=graph.attributed if graph else None)


def _weights(graph) -> list | None:
    """The device model's weights against the reference's (weights.csv rows),
    from the graph alignment of a device model."""
    from layerdiff.analyzer.diagnose import weights

    if graph is None or not getattr(graph, "weights", None):
        return None
    return weights.compare(graph.weights)


def is_fp16_build(spec: pb.JobSpec, reference) -> bool:
    """Does the collector run an FP16 build it makes of an ONNX reference?"""
    return isinstance(reference, OnnxReference) and not spec.device_model_artifact and not spec.dump_path \
        and spec.precision == "fp16"


def fp16_build_weights(spec: pb.JobSpec, reference) -> list | None:
    """For a live FP16 build of an ONNX reference, its weights against the
    reference's, from the same conversion the collector makes (beside the
    job, not in the Submit call: it costs a conversion of the model)."""
    if not is_fp16_build(spec, reference):
        return None
    from layerdiff.analyzer.align.graph import weights_by_name
    from layerdiff.collector.live.onnxrt import to_fp16

    try:   # the build keeps every node's name: nodes pair by name
        return _weights(weights_by_name(reference.model, to_fp16(reference.split, spec.model_artifact)))
    except Exception as e:    # the collector's conversion reports its own failure
        log.warning("comparing the FP16 build's weights failed (%s: %s)", type(e).__name__, e)
        return None


def dump_graph_alignment(spec: pb.JobSpec, reference, collector: CollectorClient | Collector):
    """A dump whose manifest describes its graph (op types and inputs) pairs
    with an ONNX reference by structure, as a device model does; None where
    it describes none (names decide)."""
    if not spec.dump_path or spec.device_model_artifact or spec.watch or not isinstance(reference, OnnxReference):
        return None
    from layerdiff.analyzer.align.graph import align_graphs
    from layerdiff.analyzer.align.manifest import skeleton

    try:
        graph = collector.dump_graph(pb.DumpSource(path=spec.dump_path, format=spec.dump_format,
                                                   default_concat_dim=spec.default_concat_dim))
        return align_graphs(reference.model, skeleton(graph, reference.model)) if graph.nodes else None
    except LayerdiffError as e:    # the stream says what is wrong with the dump; names pair what they can
        log.warning("the dump's graph could not be read (%s); pairing by names", e)
    except Exception as e:
        log.warning("aligning the dump's graph failed (%s: %s); pairing by names", type(e).__name__, e)
    return None


def _device_model_facts(spec: pb.JobSpec, store: ArtifactStore, reference) -> tuple:
    """What the device model tells beside the job's start, read and parsed
    once: its tensors paired with the reference's by the two graphs (by
    structure when both are ONNX: renamed, fused, folded builds; layer by
    layer when both are Keras models; None otherwise, and names decide),
    and whether it quantizes."""
    from layerdiff.analyzer.align.graph import GraphAlignment, align_graphs
    from layerdiff.analyzer.reference.tf import TFReference
    from layerdiff.common.onnxgraph import PARSED
    from layerdiff.common.tf.format import FORMAT_KERAS, is_tensorflow, onnx_by_name
    from layerdiff.common.tf.load import load_tf_model

    name = store.name(spec.device_model_artifact)
    # an ONNX file is read only if no one in this process holds it parsed
    # (the embedded collector running it): see onnxgraph.PARSED
    data = None if onnx_by_name(name) else store.read(spec.device_model_artifact, "device_model_artifact")
    if data is not None and is_tensorflow(name, data):
        if not (isinstance(reference, TFReference) and reference.format == FORMAT_KERAS):
            return None, False
        try:
            from layerdiff.analyzer.align.keras import keras_pairs

            device = load_tf_model(data, name)
            return (GraphAlignment(pairs=keras_pairs(reference.graph, device))
                    if device.format == FORMAT_KERAS else None), False
        except LayerdiffError:
            raise
        except Exception as e:   # the names still pair what they can: say so, never fail the job on it
            log.warning("graph alignment of %s failed (%s: %s); pairing by names only", name, type(e).__name__, e)
            return None, False
    parse = partial(_parse_device_model, store, spec.device_model_artifact, name, data)
    del data
    try:
        held = PARSED.hold(spec.device_model_artifact, parse)
    except LayerdiffError:
        if isinstance(reference, OnnxReference):
            raise
        return None, False      # the collector says what is wrong with it
    del parse       # the parsed model holds the weights: the file's bytes go before the alignment
    model = held.model
    quantizes = any(n.op_type in ("QuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger")
                    for n in model.graph.node)
    if not isinstance(reference, OnnxReference):
        return None, quantizes
    try:
        return align_graphs(reference.model, model), quantizes
    except LayerdiffError:
        raise
    except Exception as e:   # the names still pair what they can: say so, never fail the job on it
        log.warning("graph alignment of %s failed (%s: %s); pairing by names only", name, type(e).__name__, e)
        return None, quantizes


def _parse_device_model(store: ArtifactStore, artifact: str, name: str, data: bytes | None):
    """The device model parsed, from its bytes or (None) its stored file."""
    from layerdiff.common.onnxgraph import load_model

    return load_model(data if data is not None else store.read(artifact, "device_model_artifact"), name)


def _check_live_perf(spec: pb.JobSpec, store: ArtifactStore) -> None:
    """Live performance data is onnxruntime's profiler: the file that runs as
    the device must be ONNX."""
    from layerdiff.common.tf.format import is_tensorflow

    artifact = spec.device_model_artifact or spec.model_artifact
    name = store.name(artifact)
    if is_tensorflow(name, store.read(artifact)):
        raise LayerdiffError("performance data of a live run comes from onnxruntime's profiler, and this is a "
                             "TensorFlow model; give the runtime's counter files as a dump, or an ONNX device model",
                             file=name, field="perf")
