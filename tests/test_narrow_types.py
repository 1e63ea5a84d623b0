"""The narrow types an Ascend runtime dumps (HiFloat8, FP6, FP4, HiFloat4,
INT4/INT2/UINT2/UINT1): every code decoded exactly against a reference,
packed and one-per-byte layouts, wrong sizes refused with the field named,
dump files written with the vendor proto's codes read back with their
type, and the precision a node's verdict assumes following that type."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from layerdiff.analyzer.diagnose import errormodel as EM
from layerdiff.collector.dumps import ascend, narrow
from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.common.precision import PRECISIONS, node_precision, of_dtype
from layerdiff.vendor import ascend_dump_pb2 as dd

ml_dtypes = pytest.importorskip("ml_dtypes")

# our name -> the vendor proto's OutputDataType name
VENDOR = {"int4": "DT_INT4", "uint1": "DT_UINT1", "int2": "DT_INT2", "uint2": "DT_UINT2", "hifloat8": "DT_HIFLOAT8",
          "float6_e3m2": "DT_FLOAT6_E3M2", "float6_e2m3": "DT_FLOAT6_E2M3", "float4_e2m1": "DT_FLOAT4_E2M1",
          "float4_e1m2": "DT_FLOAT4_E1M2", "hifloat4": "DT_HIFLOAT4"}
# the formats ml_dtypes holds, and its type for each
ML = {"int4": "int4", "uint1": "uint1", "int2": "int2", "uint2": "uint2", "float6_e3m2": "float6_e3m2fn",
      "float6_e2m3": "float6_e2m3fn", "float4_e2m1": "float4_e2m1fn"}
BITS = {"int4": 4, "uint1": 1, "int2": 2, "uint2": 2, "float6_e3m2": 6, "float6_e2m3": 6, "float4_e2m1": 4,
        "float4_e1m2": 4, "hifloat4": 4, "hifloat8": 8}


# ------------------------------------------------------------ references

def hif8_reference(code: int) -> float:
    """One HiFloat8 code read field by field from its bit string, as
    "Ascend HiFloat8 Format for Deep Learning" (arXiv 2409.16626) defines
    it: sign, the prefix-coded Dot (11, 10, 01, 001, 0001: exponent widths
    4..0; 0000: denormal), a sign-magnitude exponent whose leading
    magnitude 1 is implicit, the mantissa in what is left."""
    bits = f"{code:08b}"
    sign, rest = (-1.0 if bits[0] == "1" else 1.0), bits[1:]
    if rest == "1101111":
        return sign * math.inf
    for dot, width in (("11", 4), ("10", 3), ("01", 2), ("001", 1), ("0001", 0)):
        if rest.startswith(dot):
            field, mantissa = rest[len(dot):len(dot) + width], rest[len(dot) + width:]
            exponent = 0 if width == 0 else int("1" + field[1:], 2) * (-1 if field[0] == "1" else 1)
            return sign * math.ldexp(1 + int(mantissa, 2) / 2 ** len(mantissa), exponent)
    m = int(rest[4:], 2)            # Dot 0000: the denormal mode, 2^(M - 23)
    if m == 0:
        return math.nan if sign < 0 else 0.0
    return sign * math.ldexp(1.0, m - 23)


def quarter_steps_reference(code: int) -> float:
    """FP4 E1M2 (and the HiFloat4 element): sign, then a 3-bit magnitude in
    quarters (exponent 0 subnormal m/4, exponent 1 1 + m/4): 0 .. 1.75."""
    return (-1.0 if code & 0b1000 else 1.0) * (code & 0b111) / 4


def reference(name: str, codes: np.ndarray) -> np.ndarray:
    """float32 values of one-per-byte codes, from a decoder other than narrow's."""
    if name in ML:
        return codes.view(getattr(ml_dtypes, ML[name])).astype(np.float32)
    if name == "hifloat8":
        return np.array([hif8_reference(int(c)) for c in codes], dtype=np.float32)
    return np.array([quarter_steps_reference(int(c)) for c in codes], dtype=np.float32)


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit (-0.0 is -0.0), NaN where the other has NaN."""
    if got.dtype != np.float32 or got.shape != want.shape or not np.array_equal(np.isnan(got), np.isnan(want)):
        return False
    ok = ~np.isnan(want)
    return bool(np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32)))


# ------------------------------------------------------------ every code

def test_every_hifloat8_code_decodes_as_the_paper_defines_it():
    codes = np.arange(256, dtype=np.uint8)
    got = narrow.decode("hifloat8", codes)
    assert same_bits(got, reference("hifloat8", codes))
    # the paper's special values: one zero, one NaN, +-Inf where 2^15 x 1.5 would be
    assert got[0x00] == 0 and not np.signbit(got[0x00]) and np.isnan(got[0x80]) and np.isnan(got).sum() == 1
    assert got[0x6F] == np.inf and got[0xEF] == -np.inf and np.isinf(got).sum() == 2
    assert got[0x08] == 1.0 and got[0x18] == 0.5 and got[0x01] == 2.0 ** -22
    assert got[np.isfinite(got)].max() == got[0x6E] == 2 ** 15
    # 31 normal binades (2^-15 .. 2^15) and 7 denormal ones below: 38, as the paper counts
    finite = got[np.isfinite(got) & (got > 0)].astype(np.float64)
    assert sorted(set(np.floor(np.log2(finite)).astype(int))) == list(range(-22, 16))


@pytest.mark.parametrize("name", sorted(ML))
def test_every_code_of_the_sub_byte_formats_decodes_as_ml_dtypes_does(name):
    """FP6 E3M2/E2M3, FP4 E2M1 and the small integers, every code, bit for
    bit (signed zeros, subnormals, the largest values)."""
    codes = np.arange(1 << BITS[name], dtype=np.uint8)
    assert same_bits(narrow.decode(name, codes), reference(name, codes))


@pytest.mark.parametrize("name", ["float4_e1m2", "hifloat4"])
def test_every_fp4_e1m2_and_hifloat4_code_is_a_signed_quarter_step(name):
    codes = np.arange(16, dtype=np.uint8)
    got = narrow.decode(name, codes)
    assert same_bits(got, reference(name, codes))
    assert got.max() == 1.75 and got.min() == -1.75 and np.signbit(got[8]) and not np.isnan(got).any()


def test_a_sign_extended_code_one_per_byte_reads_as_its_low_bits():
    """An INT4 held one per byte may come sign-extended (-3 as 0xFD): the
    code is its low 4 bits."""
    assert narrow.decode("int4", np.array([0xFD, 0x0D, 0x07, 0xF8], np.uint8)).tolist() == [-3, -3, 7, -8]


# ------------------------------------------------------------ dump files

def _vendor_file(path, tensors, op_name="q"):
    """A runtime dump file built by hand: (data_type, shape, bytes[, size])
    per output, the header's size the bytes' length unless given."""
    header = dd.DumpData(version="2.0", dump_time=1, op_name=op_name)
    for data_type, shape, blob, *size in tensors:
        t = header.output.add()
        t.data_type, t.format, t.size = data_type, dd.FORMAT_ND, size[0] if size else len(blob)
        t.shape.dim.extend(shape)
    raw = header.SerializeToString()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blob for _, _, blob, *_ in tensors))
    return path


def _records(leaf):
    return {(r.name, r.role, r.slot): r for r in DumpDirectory(str(leaf)).records()}


def _sample(name: str, shape: tuple, rng) -> tuple[object, np.ndarray]:
    """(what write_dump_file takes, the float32 values it must read back as)."""
    codes = rng.integers(0, 1 << BITS[name], size=shape).astype(np.uint8)
    codes.reshape(-1)[:2] = (1 << BITS[name]) - 1, 1       # the extremes: sign bits, the largest code
    if name in ML:
        arr = codes.view(getattr(ml_dtypes, ML[name]))
        return arr, arr.astype(np.float32)
    return narrow.Codes(name, codes), reference(name, codes.reshape(-1)).reshape(shape)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-per-byte"])
@pytest.mark.parametrize("name", sorted(VENDOR))
def test_an_ascend_dump_of_each_narrow_type_reads_exactly_with_its_type(tmp_path, name, packed):
    """A file carrying the type (its vendor code, an odd element count: a
    trailing part of a byte), as input and output, packed as the runtime
    packs it or one code per byte: read exactly, widened to float32, the
    record saying what the device stored."""
    rng = np.random.default_rng(7)
    inp, want_in = _sample(name, (3, 5), rng)
    out, want_out = _sample(name, (1, 7), rng)
    leaf = tmp_path / "dump"
    leaf.mkdir()
    path = ascend.write_dump_file(leaf / ascend.file_name("Quant", "q", 1, 0, 1_700_000_000_000_000), "q", [inp],
                                  [out], packed=packed)
    header, _, _ = ascend.read_header(path)
    assert header.input[0].data_type == header.output[0].data_type == dd.OutputDataType.Value(VENDOR[name])
    width = BITS[name] if packed else 8
    assert header.output[0].size == -(-7 * width // 8) and header.input[0].size == -(-15 * width // 8)
    recs = _records(leaf)
    got_in, got_out = recs[("q", "input", 0)], recs[("q", "output", 0)]
    assert same_bits(got_in.array, want_in) and same_bits(got_out.array, want_out)
    assert got_in.source_dtype == got_out.source_dtype == name


def test_packed_codes_go_first_in_the_low_bits(tmp_path):
    """Bytes laid out by hand as the runtime packs them: INT4 two to a byte,
    the first in the low nibble (0x21 0x03 is 1, 2, 3); FP6 four codes to 3
    bytes, little-endian bit stream; UINT1 eight to a byte, LSB first."""
    leaf = tmp_path / "dump"
    leaf.mkdir()
    e2m3 = [0x01, 0x08, 0x3F, 0x20]        # 0.125, 1.0, -7.5, -0.0
    fp6 = sum(c << (6 * i) for i, c in enumerate(e2m3)).to_bytes(3, "little")
    _vendor_file(leaf / ascend.file_name("Quant", "q", 1, 0, 1_700_000_000_000_000),
                 [(dd.DT_INT4, [3], bytes([0x21, 0x03])), (dd.DT_FLOAT6_E2M3, [4], fp6),
                  (dd.DT_UINT1, [10], bytes([0b10000101, 0b10]))])
    recs = _records(leaf)
    assert recs[("q", "output", 0)].array.tolist() == [1, 2, 3]
    got = recs[("q:1", "output", 1)].array
    assert got.tolist() == [0.125, 1.0, -7.5, 0.0] and np.signbit(got[3])
    assert recs[("q:2", "output", 2)].array.tolist() == [1, 0, 1, 0, 0, 0, 0, 1, 0, 1]


@pytest.mark.parametrize("data_type, count, size", [(dd.DT_INT4, 5, 4), (dd.DT_FLOAT6_E3M2, 4, 2),
                                                    (dd.DT_UINT1, 9, 3), (dd.DT_HIFLOAT8, 4, 2)])
def test_a_size_neither_packed_nor_one_per_byte_is_refused_naming_the_field(tmp_path, data_type, count, size):
    """A file mixing a good tensor and one whose header size fits neither
    layout: the good one reads, the other is refused on one line naming
    the field."""
    leaf = tmp_path / "dump"
    leaf.mkdir()
    _vendor_file(leaf / ascend.file_name("Quant", "q", 1, 0, 1_700_000_000_000_000),
                 [(dd.DT_INT4, [2], bytes([0xF7])), (data_type, [count], bytes(size))])
    recs = _records(leaf)
    assert recs[("q", "output", 0)].array.tolist() == [7, -1]
    bad = recs[("q:1", "output", 1)]
    assert bad.array is None and "field 'size'" in bad.message and "\n" not in bad.message
    assert f"the header says {size}" in bad.message


def test_a_file_with_a_decoded_and_a_refused_type_reads_the_decoded_one(tmp_path):
    """COMPLEX32 stays refused, with its type and field named; the HiFloat8
    beside it reads."""
    leaf = tmp_path / "dump"
    leaf.mkdir()
    _vendor_file(leaf / ascend.file_name("Quant", "q", 1, 0, 1_700_000_000_000_000),
                 [(dd.DT_COMPLEX32, [2], bytes(8)), (dd.DT_HIFLOAT8, [3], bytes([0x08, 0x18, 0xEE]))])
    recs = _records(leaf)
    refused = recs[("q", "output", 0)]
    assert refused.array is None and "complex32 (32) is not decoded" in refused.message
    assert "field 'data_type'" in refused.message
    hif8 = recs[("q:1", "output", 1)]
    assert hif8.array.tolist() == [1.0, 0.5, -32768.0] and hif8.source_dtype == "hifloat8"


def test_codes_of_a_format_without_a_vendor_code_are_refused_when_written(tmp_path):
    from layerdiff.common.errors import LayerdiffError

    with pytest.raises(LayerdiffError, match="field 'dtype'.*bfloat8"):
        ascend.write_dump_file(tmp_path / "Op.x.1.0.1", "x", [], [narrow.Codes("bfloat8", np.zeros(2, np.uint8))])


# ------------------------------------------------------------ precision

def _rounding_error(x: np.ndarray, name: str) -> float:
    """The relative RMS error of storing x in the narrow format ``name``
    (to the nearest of its finite values)."""
    if name in ("float8_e4m3fn",):
        y = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        codes = np.arange(1 << BITS[name], dtype=np.uint8)
        grid = np.unique(reference(name, codes)[np.isfinite(reference(name, codes))].astype(np.float64))
        idx = np.clip(np.searchsorted(grid, x), 1, grid.size - 1)
        y = np.where(np.abs(x - grid[idx - 1]) <= np.abs(grid[idx] - x), grid[idx - 1], grid[idx])
    return EM.rel_rms(y - x, x)


@pytest.mark.parametrize("name, scale", [("float8_e4m3fn", 1.0), ("hifloat8", 1000.0), ("float6_e2m3", 1.0),
                                         ("float4_e2m1", 1.0)])
def test_a_node_dumped_in_a_narrow_type_is_allowed_that_types_rounding(name, scale):
    """What a verdict assumes follows the dumped type: an Add whose output
    the device stored in ``name`` may differ by that type's rounding
    (before, a float8 output counted as BF16's, and its rounding as a
    fault)."""
    x = np.random.default_rng(3).standard_normal(4096) * scale
    policy = EM.ErrorPolicy()
    prec, why = policy.precision_of("add", "Add", name)
    assert prec.name == name and name in why
    assert prec.storage == 2.0 ** -(narrow_mantissa(name) + 1)
    err = _rounding_error(x, name)
    assert err <= EM.allowed(EM.budget("Add", prec))
    assert err > EM.allowed(EM.budget("Add", PRECISIONS["bf16"]))
    if name == "float8_e4m3fn":     # the FP8 products' precision stores in BF16: too strict for an FP8 output
        assert err > EM.allowed(EM.budget("Add", PRECISIONS["fp8_e4m3fn"]))


def test_a_builds_float32_tensors_keep_bf16s_budget_beside_fp8_ones():
    """Some tensors stored in FP8 say the build computes FP8 products; its
    other tensors, dumped in float32, are allowed BF16's output rounding
    (what such builds keep between products), never FP8's 16 times coarser
    storage: a 5 % error in one of them stays a fault."""
    policy = EM.ErrorPolicy()
    policy.seen("float8_e4m3fn")
    prec, why = policy.precision_of("add", "Add", "float32")
    assert prec.storage == PRECISIONS["bf16"].storage and "float8_e4m3fn" in why, (prec, why)
    assert EM.allowed(EM.budget("Add", prec)) < 0.05 < EM.allowed(EM.budget("Add", of_dtype("float8_e4m3fn")))
    stored, _ = policy.precision_of("q", "Add", "float8_e4m3fn")
    assert stored.storage == 2.0 ** -4


def narrow_mantissa(name: str) -> int:
    """Mantissa bits a format keeps (HiFloat8: its coarsest normal binades')."""
    return {"float8_e4m3fn": 3, "hifloat8": 1, "float6_e2m3": 3, "float4_e2m1": 1}[name]


def test_a_node_read_from_an_ascend_dump_assumes_its_dumped_precision(tmp_path):
    """The record's source_dtype, read from the vendor's code, is what
    node_precision is given: FP4 storage for an FP4 output, the FP32
    default for a float32 one."""
    leaf = tmp_path / "dump"
    leaf.mkdir()
    fp4 = np.array([0.5, -6.0, 3.0], np.float32).astype(ml_dtypes.float4_e2m1fn)
    ascend.write_dump_file(leaf / ascend.file_name("MatMul", "mm", 1, 0, 1_700_000_000_000_000), "mm",
                           [np.ones(3, np.float32)], [fp4])
    recs = _records(leaf)
    stored, why = node_precision("MatMul", job=None, stored_dtype=recs[("mm", "output", 0)].source_dtype)
    assert stored.name == "float4_e2m1" and stored.storage == 2.0 ** -2 and "float4_e2m1" in why
    assert node_precision("MatMul", job=None, stored_dtype=recs[("mm", "input", 0)].source_dtype)[0].name == "fp32"


def test_an_int4_dump_is_a_quantized_build_coarser_than_int8():
    """INT4 as INT8 is: quantized, products read its weights (coarser than
    INT8's), the float parts between compute in FP32."""
    p, why = node_precision("MatMul", job=None, stored_dtype="int4")
    assert p.name == "int4" and p.quantized and "int4" in why
    assert p.operand > PRECISIONS["int8"].operand and p.storage == PRECISIONS["int8"].storage
    policy = EM.ErrorPolicy()
    policy.seen("int4")
    assert policy.precision_of("fc", "Gemm", "float32")[0].name == "int4"
    assert policy.precision_of("relu", "Relu", "float32")[0].name == "fp32"
