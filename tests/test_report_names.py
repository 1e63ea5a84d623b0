"""Report file names come from node names: they stay inside the report
directory, readable, and unique."""
from __future__ import annotations

from layerdiff.analyzer.align.names import Aligner, normalize
from layerdiff.analyzer.compare.tolerances import Tolerances
from layerdiff.common.names import safe_filename
from layerdiff.common.onnxgraph import TensorSite


def test_file_names_never_leave_the_directory_and_stay_unique():
    taken: set[str] = set()
    names = ["p2o.Conv.1", "/backbone/conv1/Conv", "../../etc/passwd", "..", "a\x00b", "x" * 300, "Conv", "conv",
             "/backbone_conv1/Conv"]
    got = [safe_filename(n, taken) for n in names]
    assert got[0] == "p2o.Conv.1" and got[1] == "_backbone_conv1_Conv"
    for g in got:
        assert "/" not in g and "\x00" not in g and not g.startswith(".") and ".." not in g and len(g) <= 130
    assert len({g.lower() for g in got}) == len(got)   # Conv/conv and the two backbone names kept apart


def test_normalized_names_and_map_node_dict():
    sites = [TensorSite("/backbone/conv1/Conv_output_0", "/backbone/conv1/Conv", "Conv", 0, 0),
             TensorSite("relu.out", "relu 1", "Relu", 1, 0)]
    assert normalize("a/b.c\\d e") == "a_b_c_d_e"
    al = Aligner(sites, map_node_dict={"relu 1": "npu_relu"}, skip_keys=["skipme"], exclude_node_list=["relu 1"])
    assert al.match("_backbone_conv1_Conv").site is sites[0]              # node name, normalized
    assert al.match("/backbone/conv1/Conv_output_0").site is sites[0]     # tensor name
    assert al.match("npu_relu").site is sites[1]
    assert al.match("npu_relu").skip_reason == "listed in exclude_node_list"
    assert al.match("unknown").site is None
    assert al.match("skipme_1").skip_reason.startswith("name contains skip key")


def test_op_config_overrides_per_node():
    tol = Tolerances(None, 0.1, "op_name,atol,rtol\n/backbone/conv1/Conv,0.5,NA\n")
    assert tol.for_node("_backbone_conv1_Conv").atol == 0.5 and tol.for_node("_backbone_conv1_Conv").rtol == 0.1
    assert tol.for_node("other").atol == 0.005
