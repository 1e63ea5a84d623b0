"""Name alignment survives what converters do to names (prefixes, suffixes,
``:0``, case, whitespace, Keras scope instances, repeated dumps), takes a
relaxed name only when it stands for exactly one reference tensor, and says
how every pairing was made."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerdiff.analyzer.align.names import LEARN_AFTER, Aligner, Decision, Pairing, canonical
from layerdiff.client.api import run
from layerdiff.client.demo import packaged_model
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import TensorSite, load_model, tensor_sites

PREFIXES = ["", "npu_model/", "model/", "graph_0/", "npu_model/graph_0/", "NPU_MODEL\\"]
SUFFIXES = ["", "_npu", "-npu", ".om", "_int8", "_fp16", "_quant"]
CASES = [lambda s: s, str.upper, str.lower, str.swapcase]
SPACES = ["", " ", "  ", "\t"]


@pytest.fixture(scope="module")
def detector_sites() -> list[TensorSite]:
    """The sites the analyzer aligns to for the packaged PP-OCR detector (as
    OnnxReference builds them: tensor_sites of the model)."""
    path = packaged_model()
    return tensor_sites(load_model(path.read_bytes(), path.name))


@pytest.fixture(scope="module")
def cnn_sites() -> list[TensorSite]:
    return tensor_sites(small_cnn())


def _site(sites, tensor):
    return next(s for s in sites if s.tensor == tensor)


# ------------------------------------------------------------------ basics

def test_decision_keeps_its_old_constructor_and_exact_names_are_certain(cnn_sites):
    d = Decision(None, "why")
    assert (d.site, d.skip_reason, d.method, d.confidence, d.note) == (None, "why", "name", 1.0, "")
    al = Aligner(cnn_sites)
    for name, tensor in [("conv1_out", "conv1_out"), ("conv1", "conv1_out"), ("residual_add", "add_out"),
                         ("conv2:0", "conv2_out")]:
        d = al.match(name)
        assert d.site is _site(cnn_sites, tensor) and (d.method, d.confidence) == ("name", 1.0), name


def test_exact_beats_relaxed_and_case_collisions_stay_unmatched():
    sites = [TensorSite("conv1_out", "conv1", "Conv", 0, 0),
             TensorSite("npu_conv1_out", "other", "Conv", 1, 0),
             TensorSite("Feat", "a", "Relu", 2, 0),
             TensorSite("feat", "b", "Relu", 3, 0)]
    al = Aligner(sites)
    assert al.match("npu_conv1_out").site is sites[1]          # exact, though dropping 'npu_' fits too
    assert al.match("feat").site is sites[3] and al.match("Feat").site is sites[2]
    d = al.match("FEAT")                                        # either of two: never guessed
    assert d.site is None and "ambiguous" in d.note and "'Feat'" in d.note and "'feat'" in d.note
    assert set(al.closest("FEAT")) == {"Feat", "feat"}
    d = al.match(" CONV1_OUT\t")
    assert d.site is sites[0] and d.confidence < 1.0 and "case" in d.note and "whitespace" in d.note
    # two reference tensors whose names normalize alike: each pairs with its own name, whichever comes first
    sites = [TensorSite("a/b", "n1", "Relu", 0, 0), TensorSite("a_b", "n2", "Relu", 1, 0)]
    for device in (["a_b", "a/b"], ["a/b", "a_b"]):
        al = Aligner(sites)
        assert {name: al.match(name).site.tensor for name in device} == {"a_b": "a_b", "a/b": "a/b"}


def test_output_suffixes_and_repeated_dumps():
    sites = [TensorSite("x", "split", "Split", 0, 0), TensorSite("y", "split", "Split", 0, 1),
             TensorSite("z", "relu", "Relu", 1, 0)]
    al = Aligner(sites)
    assert al.match("split:1").site is sites[1]       # output 1 of node split
    assert al.match("y:0").site is sites[1]           # tensor y
    assert al.match("split:0").site is sites[0] and al.match("relu:0").site is sites[2]
    assert al.match("y:1").site is None               # a tensor has no output 1
    d = al.match("relu@1")                            # HDF5: the op's second call
    assert d.site is sites[2] and "repeated dump" in d.note
    assert al.match("split@3:1").site is sites[1]
    assert al.match("npu_model/split@2:1").site is sites[1]


def test_a_nodes_name_pairs_with_its_output_tensors_either_way():
    """One dump names nodes (``/Clip``, an HDF5 dump), the other the tensors
    they write (``/Clip_output_0``, sanitized by a user's script as
    ``_Clip_output_0``): the same thing, paired either way round, output N
    as ``node:N``, and said so in the alignment note; an exact name still
    wins, and a name that fits two is left unmatched."""
    golden = [TensorSite("_Clip_output_0", "_Clip_output_0", "", 0, 0),
              TensorSite("_Split_output_1", "_Split_output_1", "", 1, 0),
              TensorSite("_Mul", "_Mul", "", 2, 0)]
    al = Aligner(golden)
    d = al.match("/Clip")
    assert d.site is golden[0] and d.confidence < 1.0 and "read as its output tensor" in d.note
    assert "case" not in d.note
    d = al.match("/Mul_output_0")
    assert d.site is golden[2] and "read as output 0 of its node" in d.note
    nodes = [TensorSite("/Split", "/Split", "Split", 0, 0), TensorSite("/Split:1", "/Split", "Split", 0, 1),
             TensorSite("/Relu", "/Relu", "Relu", 1, 0)]
    al = Aligner(nodes)
    assert al.match("_Split_output_1").site is nodes[1] and al.match("_Split_output_0").site is nodes[0]
    assert al.match("_Relu_output_0").site is nodes[2]
    both = [TensorSite("a_output_0", "n1", "", 0, 0), TensorSite("a", "n2", "", 1, 0)]
    al = Aligner(both)
    assert al.match("a").site is both[1] and al.match("a_output_0").site is both[0]     # exact names first
    amb = Aligner([TensorSite("b_output_0", "n1", "", 0, 0), TensorSite("b:0", "n3", "", 1, 0),
                   TensorSite("b", "n2", "", 2, 0)])
    assert amb.match("B_OUTPUT_0").site is None


def test_names_sanitized_for_file_names_pair_either_way():
    """A user's script writes every sign of a name as '_' (``conv1/Relu:0``
    as ``conv1_Relu_0``, ``blk-2/add`` as ``blk_2_add``): paired with the
    original either way round, said so; TensorFlow's ``X:1`` pairs with an
    exporter's ``X_output_1``; a sanitized name that fits two stays
    unmatched, and an exact name still wins."""
    tf = [TensorSite("conv1/Relu:0", "conv1/Relu", "Relu", 0, 0), TensorSite("blk-2/add:0", "blk-2/add", "Add", 1, 0),
          TensorSite("split:1", "split", "Split", 2, 1)]
    al = Aligner(tf)
    d = al.match("conv1_Relu_0")
    assert d.site is tf[0] and d.confidence < 1.0 and "signs written as '_'" in d.note, d
    assert al.match("blk_2_add_0").site is tf[1] and al.match("split_1").site is tf[2]
    sanitized = [TensorSite("conv1_Relu_0", "conv1_Relu_0", "", 0, 0),
                 TensorSite("blk_2_add_0", "blk_2_add_0", "", 1, 0)]
    al = Aligner(sanitized)
    assert al.match("conv1/Relu:0").site is sanitized[0] and al.match("blk-2/add:0").site is sanitized[1]
    exported = [TensorSite("_Split_output_1", "_Split_output_1", "", 0, 0)]
    d = Aligner(exported).match("/Split:1")
    assert d.site is exported[0] and "read as output 1 of its node" in d.note, d
    amb = Aligner([TensorSite("a-b", "n1", "", 0, 0), TensorSite("a:b", "n2", "", 1, 0)])
    assert amb.match("a_b").site is None and "ambiguous" in amb.match("a_b").note
    exact = [TensorSite("x_0", "n1", "", 0, 0), TensorSite("x:0", "n2", "", 1, 0)]
    assert Aligner(exact).match("x_0").site is exact[0]


def test_a_repeated_dump_is_a_duplicate_not_a_missing_node(cnn_sites):
    """The consumer reports the second call of an op as a duplicate of the
    tensor already paired: op@k must find the op."""
    al = Aligner(cnn_sites)
    first, again = al.match("conv2"), al.match("conv2@1")
    assert first.site is again.site is _site(cnn_sites, "conv2_out")


# ------------------------------------------------------------- property tests

STYLE = st.tuples(st.sampled_from(PREFIXES), st.sampled_from(SUFFIXES), st.sampled_from(["", ":0"]),
                  st.sampled_from(CASES), st.sampled_from(SPACES), st.sampled_from(SPACES))


def _renamed(name: str, style) -> str:
    prefix, suffix, colon, case, lead, trail = style
    return lead + case(prefix + name + suffix + colon) + trail


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(styles=st.lists(STYLE, min_size=1, max_size=12), rnd=st.randoms(use_true_random=False))
def test_converter_renames_align_back_to_every_original_site(detector_sites, styles, rnd):
    """Every tensor of the detector, renamed as a converter does (prefix,
    suffix, ':0', case, whitespace; a mix of styles over the names), pairs
    with its own site: never another, and none is lost."""
    al = Aligner(detector_sites)
    for s in detector_sites:
        style = rnd.choice(styles)
        name = _renamed(s.tensor, style)
        d = al.match(name)
        assert d.site is s, (name, d)
        assert d.method == "name" and 0 < d.confidence <= 1
        if style[0] or style[1]:
            assert "dropping" in d.note or "dropped" in d.note, d.note
    rows = al.rows()
    assert len(rows) == len(detector_sites)
    assert all(r["reference_tensor"] == s.tensor for r, s in zip(rows, detector_sites))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_one_converter_affix_is_learned_and_named(detector_sites, data):
    """One prefix and one suffix on every name (as a converter applies
    them): after a few records the affix is learned and the note says so."""
    prefix = data.draw(st.sampled_from(PREFIXES[1:]))
    suffix = data.draw(st.sampled_from(SUFFIXES))
    colon = data.draw(st.sampled_from(["", ":0"]))
    al = Aligner(detector_sites)
    computed = [s for s in detector_sites if not s.is_constant]
    for i, s in enumerate(computed):
        d = al.match(prefix + s.tensor + suffix + colon)
        assert d.site is s
        if i >= LEARN_AFTER:
            assert "learned from" in d.note and repr(prefix) in d.note, d.note


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_names_that_collide_after_relaxation_are_never_guessed(detector_sites, data):
    """A reference that also holds 'model/<name>' for some names: the device
    name 'npu_model/<name>' could be either, and is left unmatched (with both
    as "did you mean") until the records have shown which prefix the
    converter adds; the others pair as before, never with a shadow."""
    computed = [s for s in detector_sites if not s.is_constant]
    shadowed = data.draw(st.lists(st.sampled_from(computed), min_size=1, max_size=20, unique=True))
    shadows = [TensorSite("model/" + s.tensor, "shadow_" + s.node, s.op_type, 10_000 + i, 0)
               for i, s in enumerate(shadowed)]
    sites = detector_sites + shadows
    al = Aligner(sites)
    for s, shadow in zip(shadowed, shadows):
        name = data.draw(st.sampled_from([str.upper, str.lower, lambda x: x]))("npu_model/" + s.tensor)
        d = al.match(name)
        assert d.site is None and d.note.startswith("ambiguous"), (name, d)
        assert set(al.closest(name, 5)) >= {s.tensor, shadow.tensor}
    rest = [s for s in computed if s not in shadowed]
    for s in rest:
        d = al.match("npu_model/" + s.tensor)
        assert d.site is s, d
    # learned: the converter's prefix is 'npu_model/', which settles the shadowed names
    for s in shadowed:
        d = al.match("npu_model/" + s.tensor + " ")
        assert d.site is s and "learned from" in d.note


def test_an_unknown_suffix_is_taken_only_once_several_names_carry_it(cnn_sites):
    """'conv3_raw' may be the device's own tensor before a layout change, not
    conv3 renamed: a suffix no converter is known for pairs nothing until
    it has been seen on several names."""
    al = Aligner(cnn_sites)
    d = al.match("conv3_raw")
    assert d.site is None and "'_raw'" in d.note and al.closest("conv3_raw")[0] == "conv3"
    names = ["conv1_out_xq", "relu1_out_xq", "conv2_out_xq", "relu2_out_xq", "add_out_xq"]
    got = [al.match(n).site for n in names]
    assert got[:LEARN_AFTER - 1] == [None] * (LEARN_AFTER - 1)
    assert [s.tensor for s in got[LEARN_AFTER - 1:]] == ["conv2_out", "relu2_out", "add_out"]
    assert "learned from" in al.match("conv3_out_xq").note


def test_case_and_relaxation_collisions_in_a_real_model(detector_sites):
    """A second copy of each name differing only in case: the exact
    spelling finds its own, any other spelling is ambiguous."""
    twins = [TensorSite(s.tensor.upper(), s.node.upper() + "_T", s.op_type, s.order, 0) for s in detector_sites[:50]]
    al = Aligner(detector_sites + twins)
    for s, t in zip(detector_sites[:50], twins):
        assert al.match(s.tensor).site is s and al.match(t.tensor).site is t
        assert al.match(s.tensor.swapcase() + "_npu").site is None


# ---------------------------------------------------------- Keras / TF scopes

def _tf_sites(names):
    return [TensorSite(f"{n}:0", n, "Conv2D", i, 0) for i, n in enumerate(names)]


def test_keras_scope_instances_pair_only_when_unambiguous():
    sites = _tf_sites(["functional_1/conv_in_1/convolution", "functional_1/conv_in_1/Relu",
                       "functional_1/down_0/conv/convolution", "sequential/dense/BiasAdd",
                       "block/layer_2/MatMul"])
    al = Aligner(sites)
    d = al.match("functional_1_1/conv_in_1/convolution:0")      # the model's second instance
    assert d.site is sites[0] and d.confidence < 1 and "scope instance" in d.note
    assert al.match("functional_1_1/conv_in_1/Relu").site is sites[1]
    assert al.match("functional_1_1_down_0_conv_convolution").site is sites[2]   # flattened by a dump
    assert al.match("sequential_3/dense/BiasAdd:0").site is sites[3]
    assert al.match("functional_1/conv_in/convolution:0").site is sites[0]       # conv_in_1 vs conv_in
    assert al.match("block/layer_3/MatMul:0").site is None      # another layer, not another instance
    # conv_in and conv_in_1 both exist: conv_in_2 could be either
    sites2 = _tf_sites(["m/conv_in/convolution", "m/conv_in_1/convolution"])
    al2 = Aligner(sites2)
    assert al2.match("m/conv_in_1/convolution:0").site is sites2[1]
    assert al2.match("m_1/conv_in_2/convolution:0").site is None


# ----------------------------------------------------------- options, pairs

def test_skip_keys_and_exclude_list_ignore_case_and_spelling(cnn_sites):
    al = Aligner(cnn_sites, skip_keys=["CONV3"], exclude_node_list=[" Relu1 ", "residual/ADD:0", "nope"])
    assert al.match("conv3_out").skip_reason == "name contains skip key 'CONV3'"
    assert al.match("relu1_out").skip_reason == "listed in exclude_node_list"
    assert al.match("npu_model/add_out_npu").skip_reason == "listed in exclude_node_list"
    assert al.skip_reason_for(_site(cnn_sites, "add_out")) == "listed in exclude_node_list"
    assert al.match("conv1_out").skip_reason == ""
    assert al.unknown_excludes == ["nope"] and al.unused_skip_keys == []
    assert Aligner(cnn_sites, skip_keys=["Conv9"]).unused_skip_keys == ["Conv9"]


def test_precedence_map_then_pairs_then_names(cnn_sites):
    pairs = {"dev_a": Pairing("conv2_out", "graph", 0.9, "same op type and position"),
             "conv1_out": Pairing("relu1_out", "fused", 0.7, "conv1+relu1 fused"),
             "dev_b": Pairing("conv3_out", "value", 0.6, "value fingerprint")}
    al = Aligner(cnn_sites, map_node_dict={"fc": "dev_a", "conv3": "conv3_typo"}, pairs=pairs)
    d = al.match("dev_a")
    assert d.site is _site(cnn_sites, "logits") and d.method == "map" and "'fc'" in d.note
    d = al.match("conv1_out")                 # the graph's pairing beats the name
    assert d.site is _site(cnn_sites, "relu1_out") and (d.method, d.confidence) == ("fused", 0.7)
    d = al.match("DEV_B")                     # pairs are looked up like names
    assert d.site is None    # conv3 is map_node_dict's to pair, whatever the graphs say
    # a reference tensor that map_node_dict or pairs decide is never taken by a relaxed name
    assert al.match("npu_model/conv3_out").site is None
    assert al.match("npu_model/relu1_out").site is None
    assert al.match("npu_model/relu2_out").site is _site(cnn_sites, "relu2_out")
    methods = [r["method"] for r in al.rows()]
    assert methods[:2] == ["map", "fused"]


def test_a_pair_to_an_unknown_reference_tensor_is_an_error(cnn_sites):
    with pytest.raises(LayerdiffError, match="no_such_tensor"):
        Aligner(cnn_sites, pairs={"d": Pairing("no_such_tensor", "graph", 0.9, "")})


def test_rows_list_every_decision_once_in_order(cnn_sites):
    al = Aligner(cnn_sites)
    for n in ["conv1_out", "npu_model/conv2_out:0", "nothing_like_it", "conv1_out", "RELU1_OUT"]:
        al.match(n)
    rows = al.rows()
    assert [(r["device_tensor"], r["reference_tensor"]) for r in rows] == [
        ("conv1_out", "conv1_out"), ("npu_model/conv2_out:0", "conv2_out"), ("RELU1_OUT", "relu1_out")]
    assert set(rows[0]) == {"reference_tensor", "device_tensor", "method", "confidence", "note"}
    assert rows[0]["confidence"] == 1.0 and rows[1]["confidence"] < 1.0
    assert "prefix 'npu_model/'" in rows[1]["note"] and "':0'" in rows[1]["note"]


def test_did_you_mean_sees_through_converter_renames(detector_sites, cnn_sites):
    al = Aligner(cnn_sites)
    # a fused conv1 + relu1 writes what relu1 writes: the node it ends in
    assert al.match("npu_model/conv1_relu1").site is _site(cnn_sites, "relu1_out")
    assert al.match("npu_model/conv1_relu").site is None       # 'relu' is no converter suffix
    assert al.closest("npu_model/conv1_relu")[0] == "conv1"
    assert al.closest("NPU_MODEL/Relu2_OUT:0")[0] == "relu2_out"
    al = Aligner(detector_sites)
    name = "om_graph/sub_0/batch_norm_1.tmp_3_fused_relu"
    assert al.match(name).site is None
    assert al.closest(name)[0] == "batch_norm_1.tmp_3"


def test_canonical_spelling():
    assert canonical("  NPU_Model/Conv.1 ") == "npu_model_conv_1"


# ------------------------------------------------------------- end to end

def _records(model: onnx.ModelProto, feeds):
    return list(LiveRunner(model.SerializeToString(), feeds).records())


def test_renamed_npy_dump_compares_like_the_original(tmp_path):
    """A device dump whose files carry the converter's 'npu_model/' prefix
    (flattened) and ':0': the same coverage as the dump with the reference's
    names, and the planted bug named at conv2."""
    model = tmp_path / "model.onnx"
    onnx.save_model(small_cnn(), str(model))
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    recs = _records(small_cnn(bug_in="conv2"), feeds)
    plain = write_dump(tmp_path / "plain", recs)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for r in recs:
        np.save(renamed / f"npu_model_{r.name}:0.npy", r.array, allow_pickle=False)
    results = {}
    for label, dump in [("plain", plain), ("renamed", renamed)]:
        results[label] = run(model, feeds, dump=str(dump), out=tmp_path / f"out-{label}", progress=False,
                             timeout=240)
    a, b = results["plain"], results["renamed"]
    assert a.summary["coverage"]["compared"] == b.summary["coverage"]["compared"] == 9
    assert b.summary["coverage"]["device_unmatched"] == 0
    assert (a.outcome, b.outcome) == ("fail", "fail")
    assert a.first_failing_node == b.first_failing_node == "conv2"
    failing = {n["node"] for n in b.summary["nodes"] if not n["passed"]}
    assert failing == {n["node"] for n in a.summary["nodes"] if not n["passed"]} and "conv2" in failing


def test_the_runtimes_original_op_pairs_before_names_and_after_a_users_map(cnn_sites):
    """A device output the runtime says stands for relu1's output pairs with
    it whatever its own name (even one that names another reference tensor);
    the user's map_node_dict still decides over it; an original_op the
    reference lacks, or that another pairing claimed, leaves the name to
    decide; attributes that are not such a record are ignored."""
    from layerdiff.common.schema import original_op

    al = Aligner(cnn_sites)
    d = al.match("conv1", "conv1", 0, original=("relu1", 0))
    assert d.site.tensor == "relu1_out" and d.method == "original_op" and d.confidence == 1.0, d
    assert al.match("fused_7", original=("RELU2 ", 0)).site.tensor == "relu2_out"     # relaxed as names are
    assert al.match("conv3_out", original=("no_such_op", 0)).site.tensor == "conv3_out"
    al = Aligner(cnn_sites, map_node_dict={"conv2_out": "fused_9"})
    assert al.match("fused_9", original=("relu2", 0)).method == "map"
    assert al.match("other", original=("conv2", 0)).site is None       # conv2_out belongs to the map
    assert original_op('{"original_op": {"name": "relu1", "output_index": 1}}') == ("relu1", 1)
    for bad in ("", "not json", '{"original_op": 3}', '{"original_op": {"name": "a\\u0000b"}}',
                '{"original_op": {"name": "x", "output_index": -1}}', '{"original_op": {"name": "' + "x" * 2000 + '"}}',
                '{"original_op": {"name": "x", "output_index": true}}', '["original_op"]'):
        assert original_op(bad) is None, bad


_NAME_CHARS = st.sampled_from(list("abcdeconvrelu_.0123456789/:"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(word=st.text(_NAME_CHARS, min_size=0, max_size=30), n=st.integers(1, 6),
       cutoff=st.sampled_from([0.0, 0.3, 0.6, 0.8]))
def test_close_matches_are_difflibs(detector_sites, word, n, cutoff):
    """The "did you mean" names: difflib's best matches, the same names in
    the same order, whatever the name (ties, names shorter or longer)."""
    import difflib

    from layerdiff.analyzer.align.names import close_matches

    names = sorted({s.tensor for s in detector_sites} | {s.node for s in detector_sites})
    assert close_matches(word, names, n=n, cutoff=cutoff) == difflib.get_close_matches(word, names, n=n,
                                                                                       cutoff=cutoff)


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.text(st.sampled_from(list("ab_.0/:éᐁ𝒳")), max_size=12), max_size=12),
       word=st.text(st.sampled_from(list("ab_.0/:éᐁ𝒳")), max_size=12), n=st.integers(1, 4),
       cutoff=st.sampled_from([0.0, 0.5, 0.75]))
def test_close_matches_of_any_names_are_difflibs(names, word, n, cutoff):
    """The bounds taken for every name at once (letters counted once)
    leave difflib's answer as it is, for names of any letters, empty ones
    and repeated ones included."""
    import difflib

    from layerdiff.analyzer.align.names import close_matches

    assert close_matches(word, names, n=n, cutoff=cutoff) == difflib.get_close_matches(word, names, n=n,
                                                                                       cutoff=cutoff)


@settings(max_examples=400, deadline=None)
@given(a=st.text(st.sampled_from(list("ab_.0/:éᐁ")), max_size=40), b=st.text(st.sampled_from(list("ab_.0/:éᐁ")),
                                                                             max_size=40))
def test_the_compiled_match_is_difflibs(a, b):
    """The compiled matcher behind the "did you mean" names shares as many
    characters as difflib's matching blocks (its ratio's numerator), for
    repeats, ties and characters past ASCII alike."""
    import difflib

    from layerdiff.analyzer.align.names import _codes
    from layerdiff.analyzer.compare.compiled import kernels

    want = sum(m.size for m in difflib.SequenceMatcher(None, a, b).get_matching_blocks())
    assert kernels()._matched(_codes(a), _codes(b)) == want


def test_closest_asked_again_answers_the_same(detector_sites):
    """Each report asks for an unmatched name's closest names (n 1, 3, 5),
    answered from one longer answer kept: each is what a look for exactly
    n names finds, and a match in between forgets what was kept."""
    al = Aligner(detector_sites)
    for name in ("conv2d_45.tmp_0x", "graph_input_cast_0", "batch_norm_0.w_2_cast"):
        assert al.match(name).site is None
        for n in (3, 1, 5, 3):
            fresh = Aligner(detector_sites)
            assert fresh.match(name).site is None
            assert al.closest(name, n) == fresh._find_closest(name, n), (name, n)
    kept = dict(al._closest)
    assert kept and al.match(detector_sites[5].tensor).site is not None and not al._closest
