"""The error model against measured rounding: products of random matrices
rounded as each precision rounds them (operands, FP32 sums, stored output)
stay within the stated factor of what the model explains, and the model is
within 10x of what is observed, with and without cancellation; what a
precision is read from; the emulated device builds round as the formats
do; the worst block of a tensor finds a local error."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from layerdiff.analyzer.compare.tolerances import Tolerances
from layerdiff.analyzer.diagnose import errormodel as EM
from layerdiff.client.api import parse_node_precision
from layerdiff.collector.live.emulate import emulated, fp8_scaled, round_like_device
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.precision import BITS, PRECISIONS, node_precision, parse, round_significand

FLOATS = ("fp16", "bf16", "tf32", "fp8_e4m3fn", "fp8_e5m2", "fp32")


def _round(x: np.ndarray, name: str) -> np.ndarray:
    return round_significand(np.asarray(x, np.float32), BITS[name])


def _product(x: np.ndarray, w: np.ndarray, name: str) -> np.ndarray:
    """x @ w as a device in ``name`` computes it: operands rounded, FP32
    sums, the output stored in its storage format."""
    p = PRECISIONS[name]
    y = (_round(x, name) @ _round(w, name)).astype(np.float32)
    store = "bf16" if p.storage == PRECISIONS["bf16"].storage else ("fp16" if name == "fp16" else "fp32")
    return _round(y, store) if store != "fp32" else y


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(FLOATS), k=st.sampled_from([8, 64, 512, 3072]), seed=st.integers(0, 2**31 - 1),
       offset=st.sampled_from([0.0, 0.5, 3.0]), scale=st.floats(1e-3, 1e3))
def test_products_stay_within_the_budget_and_the_budget_within_10x_of_them(name, k, seed, offset, scale):
    """Random products, some with inputs far from zero mean (their terms
    cancel: ρ > 1, from the magnitudes): the observed relative RMS error is
    never above FACTOR times E1 (the bound holds in every draw) and never
    below a tenth of it."""
    rng = np.random.default_rng(seed)
    x = ((rng.standard_normal((48, k)) + offset) * scale).astype(np.float32)
    w = (rng.standard_normal((k, 32)) / math.sqrt(k)).astype(np.float32)
    w -= w.mean(axis=0, keepdims=True) * (offset > 0)       # columns summing to ~0: the mean cancels
    exact = x.astype(np.float64) @ w.astype(np.float64)
    observed = EM.rel_rms(_product(x, w, name) - exact, exact)
    rho = EM.product_rho("MatMul", x, w, exact, {})
    b = EM.budget("MatMul", PRECISIONS[name], k, rho)
    assert observed <= EM.FACTOR * b.rel, (observed, b)
    assert observed >= b.rel / 10, (observed, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rho_is_its_definition_for_every_product_layout(dtype):
    """ρ = sqrt(Σ_k (x_k w_k)² summed over the output / Σ y²), written out
    term by term, against product_rho (which sums squares without copies)."""
    rng = np.random.default_rng(3)

    def rho_by_terms(terms: np.ndarray, y: np.ndarray) -> float:
        squares = float(np.sum(np.square(terms, dtype=np.float64)))
        return math.sqrt(squares / float(np.sum(np.square(y, dtype=np.float64))))

    # MatMul, batched: terms[b, m, n, k] = x[b, m, k] w[k, n]
    x = rng.standard_normal((2, 5, 6)).astype(dtype)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    y = (x.astype(np.float64) @ w).astype(np.float32)
    terms = x.astype(np.float64)[:, :, None, :] * w.T[None, None, :, :]
    assert math.isclose(EM.product_rho("MatMul", x, w, y, {}), rho_by_terms(terms, y), rel_tol=1e-9)
    # Gemm with A and B transposed, alpha: terms[m, n, k] = alpha x[k, m] w[n, k]
    x = rng.standard_normal((6, 5)).astype(dtype)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    y = rng.standard_normal((5, 4)).astype(np.float32)
    terms = 0.5 * x.astype(np.float64).T[:, None, :] * w[None, :, :]
    got = EM.product_rho("Gemm", x, w, y, {"transA": 1, "transB": 1, "alpha": 0.5})
    assert math.isclose(got, rho_by_terms(terms, y), rel_tol=1e-9)
    # a 1x1 grouped Conv (no border): terms[n, o, h, w, i] = x[n, g*cin+i, h, w] w[o, i]
    x = rng.standard_normal((2, 8, 3, 3)).astype(dtype)
    w = rng.standard_normal((4, 2, 1, 1)).astype(np.float32)
    y = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    xs = x.astype(np.float64).reshape(2, 4, 2, 3, 3)            # groups of 2 input channels
    terms = xs[:, :, :, :, :] * w[:, :, 0, 0][None, :, :, None, None]
    assert math.isclose(EM.product_rho("Conv", x, w, y, {"group": 4}), rho_by_terms(terms, y), rel_tol=1e-9)
    y[0, 0, 0, 0] = np.inf
    assert EM.product_rho("Conv", x, w, y, {"group": 4}) is None


@pytest.mark.parametrize("name", FLOATS)
def test_the_model_names_its_terms(name):
    b = EM.budget("Conv", PRECISIONS[name], 3072)
    assert b.words.startswith(f"{name} over K=3072") and b.explains().startswith(f"{name} over K=3072 explains")
    assert EM.budget("Reshape", PRECISIONS[name]).kind == "exact"
    relu = EM.budget("Relu", PRECISIONS["fp32"])
    assert relu.rel < 1e-7 and relu.allowed == EM.FLOOR
    # FP32 is near-exact: a 1 % error is past what it allows, by far
    assert EM.budget("MatMul", PRECISIONS["fp32"], 4096).allowed < 1e-4


def test_reduction_lengths_from_the_graph():
    w = {"w": (64, 16, 3, 3), "wt": (128, 256)}
    conv = helper.make_node("Conv", ["x", "w"], ["y"], group=1)
    assert EM.onnx_reduction_length(conv, {"x": (1, 16, 8, 8)}, w) == 144
    mm = helper.make_node("MatMul", ["x", "wt"], ["y"])
    assert EM.onnx_reduction_length(mm, {"x": (1, 7, 128)}, w) == 128
    gemm = helper.make_node("Gemm", ["x", "wt"], ["y"], transA=1)
    assert EM.onnx_reduction_length(gemm, {"x": (300, 5)}, w) == 300
    sm = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    assert EM.onnx_reduction_length(sm, {"x": (2, 10, 3)}, w) == 10
    ln = helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=-2)
    assert EM.onnx_reduction_length(ln, {"x": (2, 10, 3)}, w) == 30
    rm = helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3])
    assert EM.onnx_reduction_length(rm, {"x": (1, 4, 5, 6)}, w) == 30
    gap = helper.make_node("GlobalAveragePool", ["x"], ["y"])
    assert EM.onnx_reduction_length(gap, {"x": (1, 4, 5, 6)}, w) == 30
    assert EM.torch_reduction_length("aten.convolution.default", [(1, 16, 8, 8), (64, 16, 3, 3)], {}) == 144
    assert EM.torch_reduction_length("layer1.0.conv1", [(1, 16, 8, 8)],
                                     {"class": "Conv2d", "in_channels": 16, "kernel_size": [3, 3], "groups": 1}) == 144
    assert EM.torch_reduction_length("fc", [(2, 512)], {"class": "Linear", "in_features": 512}) == 512


# --------------------------------------------------------------- precisions

def test_precisions_by_name_alias_and_data_type():
    assert parse("BF16").name == "bf16" and parse("bfloat16").name == "bf16" and parse("e4m3").name == "fp8_e4m3fn"
    assert parse("") is None and parse("auto") is None
    with pytest.raises(LayerdiffError, match="unknown precision 'fp12'.*fp32, tf32, fp16, bf16"):
        parse("fp12")
    p, why = node_precision("MatMul", job=None, stored_dtype="bfloat16")
    assert p.name == "bf16" and "bfloat16" in why
    assert node_precision("Softmax", job=None, stored_dtype="float32")[0].name == "fp32"
    # TF32 rounds products only
    assert node_precision("Conv", job=parse("tf32"))[0].name == "tf32"
    assert node_precision("aten.convolution.default", job=parse("tf32"))[0].name == "tf32"
    assert node_precision("Add", job=parse("tf32"))[0].name == "fp32"
    # a float32 dump of a job that says bf16 was widened: the job's precision stands
    assert node_precision("Add", job=parse("bf16"), stored_dtype="float32")[0].name == "bf16"
    # an override wins over both
    assert node_precision("Add", job=parse("bf16"), stored_dtype="float16", override=parse("fp32"))[0].name == "fp32"


def test_a_job_without_a_precision_reads_it_from_what_the_device_stored():
    policy = EM.ErrorPolicy()
    assert policy.precision_of("fc", "Gemm", "float32")[0].name == "fp32"
    policy.seen("float16")
    # a converted build keeps some outputs in float32: they count as the build's precision
    p, why = policy.precision_of("fc", "Gemm", "float32")
    assert p.name == "fp16" and "stores its tensors in fp16" in why
    assert policy.precision_of("fc", "Gemm", "float32", strict=True)[0].name == "fp32"


def test_per_node_precisions_from_op_config_and_the_command_line():
    t = Tolerances(op_config_csv="op_name,atol,rtol,precision\nconv1,NA,NA,bf16\nfc,0.1,NA,\n",
                   node_precision={"head/MatMul": "fp8_e5m2"})
    assert t.precisions["conv1"].name == "bf16" and "fc" not in t.precisions
    assert next(iter(v for k, v in t.precisions.items() if "head" in k)).name == "fp8_e5m2"
    with pytest.raises(LayerdiffError, match="op_config.csv.*'conv2'.*line 2.*unknown precision 'half-ish'"):
        Tolerances(op_config_csv="op_name,atol,rtol,precision\nconv2,NA,NA,half-ish\n")
    assert parse_node_precision(["conv1=bf16,fc=fp32", "x=float16"]) == {"conv1": "bf16", "fc": "fp32",
                                                                         "x": "fp16"}
    with pytest.raises(LayerdiffError, match="expected NODE=PRECISION"):
        parse_node_precision("conv1")


# ------------------------------------------------------------ emulated builds

def test_bf16_and_fp8_rounding_is_the_formats():
    torch = pytest.importorskip("torch")
    x = (np.random.default_rng(0).standard_normal(200_000) * 30).astype(np.float32)
    x[:5] = [0.0, -0.0, 1e-40, 3.0e38, -3.39e38]
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    got = round_like_device(x, "bf16")
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isfinite(got).all()            # beyond BF16's range a weight is held at its largest value
    for name, tdtype in (("fp8_e4m3fn", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        inside = np.clip(x, -400, 400) / 10
        np.testing.assert_array_equal(round_like_device(inside, name),
                                      torch.from_numpy(inside).to(tdtype).float().numpy())
    assert round_like_device(np.array([1e6, -1e6], np.float32), "fp8_e4m3fn").tolist() == [448.0, -448.0]
    w = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e-3
    s = fp8_scaled(w, "fp8_e4m3fn")
    assert np.max(np.abs(s)) == pytest.approx(np.max(np.abs(w)), rel=1e-6)     # scaled into range, not flushed
    assert 0.005 < EM.rel_rms(s - w, w) < 0.06


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp8_e4m3fn"])
def test_an_emulated_build_rounds_where_the_device_does(precision):
    """A MatMul -> Add -> Relu: in BF16 every stored value is on the BF16
    grid; in TF32 the MatMul's operands are, its output is FP32's."""
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
             helper.make_node("Relu", ["add"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], initializer=[w, b])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    build, view = emulated(model, precision)
    names = [view.get(t, t) for t in ("mm", "add", "y")]
    m = onnx.ModelProto()
    m.CopyFrom(build)
    m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    out = dict(zip(names, ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                   .run(names, {"x": x})))
    exact = x.astype(np.float64) @ numpy_helper.to_array(w).astype(np.float64)
    mm = out[view.get("mm", "mm")]
    if precision == "tf32":
        want = (_round(x, "tf32") @ _round(numpy_helper.to_array(w), "tf32")).astype(np.float32)
        np.testing.assert_allclose(mm, want, rtol=1e-6, atol=1e-6)
        assert not view
    else:
        stored = "bf16"
        for t in ("mm", "add", "y"):
            v = out[view[t]]
            np.testing.assert_array_equal(v, round_like_device(v, stored))
    assert 0 < EM.rel_rms(mm - exact, exact) < 20 * EM.budget("MatMul", PRECISIONS[precision], 32).rel


# ----------------------------------------------------------------- blocks

def test_the_worst_block_finds_a_local_error_and_not_spread_noise():
    rng = np.random.default_rng(0)
    r = rng.standard_normal((1, 64, 32, 32)).astype(np.float32)
    noise = r * rng.standard_normal(r.shape).astype(np.float32) * 1e-3
    b = EM.worst_blocks(noise, r)[0]
    assert b is not None and b.rel < 2e-3
    bug = noise.copy()
    bug[:, 8:12] += r[:, 8:12] * 0.05
    b = EM.worst_blocks(bug, r)[0]
    assert b.where == "channels 8..11" and 0.045 < b.rel < 0.055 and b.share == pytest.approx(1 / 16)
    tile = noise.copy()
    tile[:, :, 8:16, 16:24] = -r[:, :, 8:16, 16:24]
    b = EM.worst_blocks(tile, r)[0]
    assert b.where == "rows 8..15, columns 16..23" and b.rel == pytest.approx(1.0, abs=1e-2)
    # tokens x features: the feature groups and the rows are cut
    t = rng.standard_normal((1, 32, 384)).astype(np.float32)
    e = np.zeros_like(t)
    e[:, 4:6] = t[:, 4:6] * 0.2
    b = EM.worst_blocks(e, t)[0]
    assert b.where == "rows 4..5 of axis 1" and b.rel == pytest.approx(0.2, rel=1e-3)
    e = np.zeros_like(t)
    e[..., 48:72] = t[..., 48:72] * 0.05
    assert EM.worst_blocks(e, t)[0].where == "features 48..71"
    # near-zero values do not read as a large relative error
    z = r.copy()
    z[:, :4] *= 1e-6
    assert EM.worst_blocks(noise, z)[0].rel < 0.01


def test_a_block_is_found_at_any_offset():
    """A broken kernel's block of a sixteenth of the channels need not start
    where a sixteenth does: found whole, wherever it starts."""
    rng = np.random.default_rng(1)
    r = rng.standard_normal((2, 64, 20, 20)).astype(np.float32)
    noise = r * rng.standard_normal(r.shape).astype(np.float32) * 1e-3
    for start in (1, 6, 29, 60):
        bug = noise.copy()
        bug[:, start:start + 4] += r[:, start:start + 4] * 0.05
        b = EM.worst_blocks(bug, r)[0]
        assert b.where == f"channels {start}..{start + 3}" and 0.045 < b.rel < 0.055, (start, b)
    t = rng.standard_normal((1, 197, 768)).astype(np.float32)
    e = np.zeros_like(t)
    e[..., 301:349] = t[..., 301:349] * 0.05
    assert EM.worst_blocks(e, t)[0].where == "features 301..348"
    tile = noise.copy()
    tile[..., 3:8, 11:16] = -r[..., 3:8, 11:16]
    b = EM.worst_blocks(tile, r)[0]
    assert b.where == "rows 3..7, columns 11..15" and b.rel == pytest.approx(1.0, abs=1e-2)


def test_a_layernorm_reads_its_rows_error_over_their_spread():
    """A row whose mean dwarfs its spread (a class token) hands a LayerNorm
    an error many times larger, relative to the output, than relative to
    the row: the worst sixteenth of the rows says so, the whole less."""
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 32, 256)).astype(np.float32)
    ref[:, 0] += 20.0
    err = ref * rng.standard_normal(ref.shape).astype(np.float32) * 1e-3
    whole, worst = EM.normalized_read(err, ref, "std")
    assert worst == pytest.approx(1e-3 * np.sqrt(401 / 2), rel=0.1)     # row 0: |x| ~ 20 over a spread of 1
    assert EM.rel_rms(err, ref) < 2e-3 < whole < worst
    whole_rms, _ = EM.normalized_read(err, ref, "rms")                 # RMSNorm: over the row's RMS
    assert whole_rms == pytest.approx(1e-3, rel=0.1)
    assert EM.row_norm("LayerNorm") == "std" and EM.row_norm("aten.native_layer_norm.default") == "std"
    assert EM.row_norm("RMSNorm") == "rms" and EM.row_norm("BatchNorm2d") == ""


@pytest.mark.parametrize("precision, op, k, want", [
    ("bf16", "Conv", 576, True), ("bf16", "aten.addmm.default", 256, True), ("bf16", "Conv", 9, False),
    ("bf16", "Conv", None, False), ("bf16", "Add", None, False), ("int8", "Conv", 576, False)])
def test_a_window_of_a_products_channels_that_stands_out_is_its_own(precision, op, k, want):
    """A window of a product's output channels 10x the rest's relative
    error, past what the precision explains, is the product's own: each of
    its channels sums over every channel it read. Not where K is unknown or
    a kernel's size (a depthwise convolution keeps channels apart), not for
    an element-wise op (a block can come in), not on an INT8 grid; and
    spread rounding never."""
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((1, 64, 16, 16)).astype(np.float32)
    noise = ref * rng.standard_normal(ref.shape).astype(np.float32) * 4e-3
    bug = noise.copy()
    bug[:, 21:25] += ref[:, 21:25] * 0.05
    blk = EM.worst_blocks(bug, ref)[0]
    assert (blk.key, blk.start, blk.stop) == ("channels", 21, 25) and 10 < blk.contrast < 16
    b = EM.budget(op, parse(precision), k)
    assert EM.local_own(blk, b) is want
    quiet = EM.worst_blocks(noise, ref)[0]
    assert quiet.contrast < 2 and not EM.local_own(quiet, b)


def test_a_block_of_channels_is_measured_without_a_row_that_stands_out():
    """A class token's row inherits 40 times the others' error: a 5 %
    block of features is measured without it too (worst_blocks' second),
    where it stands out again."""
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((2, 33, 512)).astype(np.float32)
    err = ref * rng.standard_normal(ref.shape).astype(np.float32) * 4e-3
    err[:, 0] *= 40
    err[..., 77:109] += ref[..., 77:109] * 0.05
    blk, axis = EM.worst_blocks(err, ref)
    assert blk.where == "rows 0..1 of axis 1" and axis.where == "features 77..108 (outside rows 0..1 of axis 1)"
    assert axis.contrast > EM.LOCAL_CONTRAST and axis.rel > 0.045
    assert EM.local_own(axis, EM.budget("Linear", parse("bf16"), 256))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
def test_square_sums_are_numpys_squares_summed_along_the_kept_axes(dtype):
    """The error model's blocks are cut from sums of squares taken in one
    pass: for every split of a tensor (kept axes, the axes after them) they
    are numpy's squares (in the tensor's float type, float16 and integers
    widened to float32) summed in float64, a square that is not finite (NaN,
    Inf, or beyond float32) counted as zero; a view that is not contiguous
    gives what its copy gives."""
    from layerdiff.analyzer.compare.squares import square_sums

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 5, 6, 7)) * 50).astype(dtype)
    if np.dtype(dtype).kind == "f":
        x.flat[3], x.flat[40] = np.nan, np.inf
        if dtype == np.float32:
            x.flat[77] = 3e20         # its square overflows float32
    own = np.float64 if dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        sq = np.square(x.astype(own))
    sq = np.where(np.isfinite(sq), sq, 0).astype(np.float64)
    for first, last in ((0, 0), (1, 1), (1, 2), (2, 3), (0, 3)):
        by_kept, by_after = square_sums(x, first, last)
        before, after = tuple(range(first)), tuple(range(last + 1, 4))
        np.testing.assert_allclose(by_kept, sq.sum(axis=before + after), rtol=1e-12)
        np.testing.assert_allclose(by_after, sq.sum(axis=tuple(range(last + 1))), rtol=1e-12)
    view = x.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(square_sums(view, 1, 1)[0], square_sums(view.copy(), 1, 1)[0], rtol=0)


@pytest.mark.parametrize("dev_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("row", [1, 100, 256, 700, 2500])
def test_pair_square_sums_are_numpys_for_rows_short_and_long(dev_dtype, row):
    """The error's and the reference's sums of squares taken from the two
    tensors in one pass (a long row read a piece at a time, its memory
    asked for ahead) are numpy's: the error made in float32, each square in
    float32, one that is not finite counted as zero, summed in float64."""
    from layerdiff.analyzer.compare.squares import pair_square_sums

    rng = np.random.default_rng(5)
    ref = (rng.standard_normal((2, 3, row)) * 40).astype(np.float32)
    dev = (ref + rng.standard_normal(ref.shape) * 0.5).astype(dev_dtype)
    ref.flat[3], dev.flat[-2] = np.nan, np.inf
    ref.flat[-1] = 3e20         # its square overflows float32
    with np.errstate(all="ignore"):
        err = np.subtract(dev, ref, dtype=np.float32)
        e2, r2 = np.square(err), np.square(ref)
    e2, r2 = (np.where(np.isfinite(x), x, 0).astype(np.float64) for x in (e2, r2))
    (ek, rk), (eq, rq) = pair_square_sums(ref, dev, 1, 1)
    np.testing.assert_allclose(ek, e2.sum(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(rk, r2.sum(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(eq, e2.sum(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(rq, r2.sum(axis=(0, 1)), rtol=1e-12)


@pytest.mark.parametrize("ref_dtype,dev_dtype", [(np.float32, np.float32), (np.float32, np.float16),
                                                 (np.float16, np.float32), (np.float64, np.float64),
                                                 (np.float32, np.float64)])
def test_worst_blocks_from_the_two_tensors_are_those_of_their_error(ref_dtype, dev_dtype):
    """The worst blocks found from the reference and device tensors (the
    error's sums taken in one pass, the error never made whole) are those
    found from the error made as numpy makes it, for every type pair, with
    a broken block, NaN, Inf and a square beyond float32 in them."""
    from layerdiff.analyzer.diagnose.errormodel import worst_blocks

    rng = np.random.default_rng(11)
    for shape, layout in (((1, 32, 24, 24), "NCHW"), ((1, 24, 24, 32), "NHWC"), ((48, 64), ""), ((3, 9, 40), "")):
        ref = rng.standard_normal(shape).astype(ref_dtype)
        dev = (ref.astype(np.float64) + rng.standard_normal(shape) * 1e-2).astype(dev_dtype)
        dev[(slice(None),) * (len(shape) - 1) + (slice(0, 4),)] += 1.0       # a broken block
        dev.flat[17], ref.flat[40] = np.nan, np.inf
        if dev_dtype == np.float32:
            dev.flat[90] = 3e30
        wide = np.float64 if np.dtype(ref_dtype) == np.float64 else np.float32
        with np.errstate(all="ignore"):
            err = np.subtract(dev, ref, dtype=wide)
        whole = worst_blocks(err, ref, layout or "NCHW")
        paired = worst_blocks(None, ref, layout or "NCHW", dev=dev)
        assert whole[0] is not None
        for a, b in zip(whole, paired):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.where == b.where and a.share == b.share
                assert a.rel == pytest.approx(b.rel, rel=1e-9) and a.rest == pytest.approx(b.rest, rel=1e-9)


def test_the_worst_window_is_the_one_numpy_finds():
    """The compiled window search behind worst_blocks picks the window
    numpy's running sums and argmax pick (the first of equal ones, one whose
    reference is zero taken relative to the floor), with the same figures,
    for one axis and for tiles, sums with a negative rounding residue (a
    part taken out) and a NaN among them, squares whose roots round equal."""
    from layerdiff.analyzer.compare.compiled import kernels

    rng = np.random.default_rng(21)
    cases = []
    for shape, size in (((1, 64), (1, 4)), ((17, 23), (4, 6)), ((8, 8), (2, 2)), ((1, 5), (1, 5)),
                        ((40, 9), (1, 3)), ((31, 31), (8, 8))):
        se, sr = rng.random(shape) * 4, rng.random(shape)
        cases.append((se, sr, size))
        ties = np.ones(shape)
        cases.append((ties, ties.copy(), size))                   # every window alike: the first
        hole = sr.copy()
        hole[:, :2] = 0.0
        cases.append((se, hole, size))
        rest = se - rng.random(shape) * 1e-16                      # what is left once a part is taken out
        rest[0, 0] = -1e-18
        cases.append((rest, sr, size))
        nan = se.copy()
        nan.flat[rng.integers(0, nan.size)] = np.nan
        cases.append((nan, sr, size))
    # squares a rounding apart whose roots are equal: the first window stays
    cases.append((np.array([[0.5, 1.0, np.nextafter(1.0, 2.0), 0.25]]) * 3, np.ones((1, 4)), (1, 1)))
    for se, sr, (wh, ww) in cases:
        n, floor = float(wh * ww * 3), float(sr.sum() / sr.size / 16)
        se_w, sr_w = EM._window_sums(se, (wh, ww)), EM._window_sums(sr, (wh, ww))
        den = np.maximum(sr_w / n, floor)
        with np.errstate(all="ignore"):
            rel = np.where(den > 0, np.sqrt(se_w / n / np.where(den > 0, den, 1.0)), -1.0)
        want = int(np.argmax(rel))
        got = np.zeros(4)
        i = kernels()._best_window(np.ascontiguousarray(se), np.ascontiguousarray(sr), wh, ww, n, floor, got)
        assert i == want
        np.testing.assert_array_equal(got, [rel.flat[i], den.flat[i], se_w.flat[i], sr_w.flat[i]])
    got = np.zeros(4)
    assert kernels()._best_window(np.ones((2, 3)), np.ones((2, 3)), 3, 1, 1.0, 0.0, got) == -1    # no window fits


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_median_scale_of_mask_values_is_numpys_to_the_bit(dtype):
    """The median that tells mask-like values apart is np.median's, odd and
    even sizes, tiny to huge magnitudes (float16's two largest averaged
    without overflowing, as np.mean does)."""
    from layerdiff.analyzer.diagnose.evidence import median

    rng = np.random.default_rng(3)
    for n in [*range(1, 24), 1000, 1001, 4096, 4097]:
        for scale in (1e-3, 1.0, 1e3):
            v = np.abs(rng.standard_normal(n) * scale).astype(dtype)
            assert median(v) == float(np.median(v)), (n, scale)
    top = np.array([65504, 65504, 1, 60000], np.float64).astype(dtype)
    assert median(top) == float(np.median(top))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_figures_told_the_comparison_are_those_looked_for_value_by_value(layout):
    """The error model's figures of a pair given its comparison's metrics
    (which spare the look for the largest value where the sums of squares
    rule out a mask) are those it finds without them: attention masks of
    -1e4 and of finfo.min, one outlier past 1000 times the median and one
    just under it, half zeros (a median of 0), NaN, a row of features."""
    from layerdiff.analyzer.compare.node import compare_node
    from layerdiff.analyzer.compare.tolerances import Tolerance
    from layerdiff.analyzer.diagnose.examiner import error_stats

    rng = np.random.default_rng(11)
    plain = rng.standard_normal((1, 16, 24, 24)).astype(np.float32)
    mask = plain.copy()
    mask[..., ::5] = -1e4
    sentinel = plain.copy()
    sentinel[0, 3, 4, 5] = np.finfo(np.float32).min
    med = float(np.median(np.abs(plain)))
    outlier, under = plain.copy(), plain.copy()
    outlier[0, 2, 2, 2] = 1e3 * med * 1.5
    under[0, 2, 2, 2] = 1e3 * med * 0.9
    relu = np.maximum(plain, 0)
    nan = plain.copy()
    nan[0, 0, 0, 0] = np.nan
    rows = rng.standard_normal((4, 96, 64)).astype(np.float32)
    looked = 0
    for ref in (plain, mask, sentinel, outlier, under, relu, nan, rows):
        with np.errstate(all="ignore"):
            dev = (ref * (1 + 1e-3 * rng.standard_normal(ref.shape))).astype(np.float16)
        metrics = compare_node(ref, dev, Tolerance(0.005, 0.2), 128).metrics
        told, alone = error_stats(ref, dev, False, metrics, layout=layout), error_stats(ref, dev, False, layout=layout)
        assert told == alone
        looked += bool(alone.masked)
    assert looked == 3      # the two masks and the outlier, each found either way
