"""The narrow types the Ascend runtime dumps for quantized models
(``dump_data.proto``'s OutputDataType), decoded exactly to float32 (the
integer ones too: every value they hold is a float32): every code of a
format through a table built from its definition.

What each format is, and where that is written down:

- FP8 E4M3FN, E5M2 and the E8M0 block scale: the OCP 8-bit floating point
  and Microscaling (MX) v1.0 specifications. E5M2 keeps IEEE's Inf and NaN;
  E4M3FN has no Inf and one NaN per sign (S.1111.111); E8M0 is 2^(e - 127),
  0xFF NaN.
- FP6 E3M2 (bias 3), FP6 E2M3 (bias 1), FP4 E2M1 (bias 1): the OCP MX v1.0
  specification: sign, exponent, mantissa, subnormals, no Inf, no NaN.
- FP4 E1M2: CANN's ``opdev/float4_e1m2.h`` (cann/opbase): sign, 1 exponent
  bit of bias 1, 2 mantissa bits, no Inf, no NaN: 0, 0.25 ... 1.75.
- HiFloat4: CANN's ``opdev/hifloat4.h`` (cann/opbase) defines the element
  code as the same S1E1M2 layout (bias 1, +-1.75 at most, no Inf, no NaN).
  The block scales the HiFloat4 paper (arXiv 2602.11287) shares among 64
  elements are not part of these codes: a dump of the elements holds the
  elements alone, as an FP4 tensor holds no MX scale.
- HiFloat8: "Ascend HiFloat8 Format for Deep Learning" (Luo et al., 2024,
  arXiv 2409.16626), as CANN's ``HiFloat8`` (cann/opbase
  ``src/nnopbase/common/utils/hifloat8.cpp``) and MindSpore's
  ``core/base/hifloat8.h`` decode it. After the sign, a prefix-coded dot
  field gives the exponent's stored width D: ``11`` D=4, ``10`` D=3,
  ``01`` D=2, ``001`` D=1, ``0001`` D=0, ``0000`` the denormal mode. The
  exponent is sign-magnitude with an implicit leading 1 (D=1: +-1; D=2:
  +-2..3; D=3: +-4..7; D=4: +-8..15; D=0: 0) and the mantissa fills what
  is left (3, 3, 3, 2, 1 bits): +-2^E x 1.M. The denormal mode's 3 low
  bits M give +-2^(M - 23) (2^-22 .. 2^-16); M = 0 is zero (sign 0, the
  only zero) or NaN (0x80). 0x6F and 0xEF, where 2^15 x 1.5 would be, are
  +Inf and -Inf: 32768 is the largest finite value.
- INT4, INT2 (two's complement), UINT2, UINT1: integers.

How a dump lays them out: the runtime dumps a tensor's ``CalcShapeBytes``
(cann/opbase, ``indv_dump.cpp``), from the sizes of GE's
``GetSizeByDataType`` (cann/metadef, ``inc/external/graph/types.h``): a
byte a code for the 8-bit formats, and for the sub-byte ones (INT4, UINT1,
INT2, UINT2, FP6, FP4, HiFloat4) a width in bits, N codes taking
ceil(N x bits / 8) bytes: packed. ``aclnnConvertWeightToINT4Pack``
(cann/ops-nn) packs INT4 and FP4 E2M1 two to a byte, the first element in
the low nibble. The same order is taken for the other widths (the element
i at bits i x bits .. of a little-endian bit stream, FP6 four codes to 3
bytes); it is written down for INT4 and FP4 only. Where the header's
``size`` is N bytes instead, the tensor holds one code per byte, in the
low bits (``layout`` decides; any other size is refused).

COMPLEX32 is named and refused per tensor: a pair of float16s is not a
real tensor to compare."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

# OutputDataType code -> the name reports and the error model use
DECODED = {28: "int4", 29: "uint1", 30: "int2", 31: "uint2", 33: "hifloat8", 34: "float8_e5m2",
           35: "float8_e4m3fn", 36: "float8_e8m0", 37: "float6_e3m2", 38: "float6_e2m3", 39: "float4_e2m1",
           40: "float4_e1m2", 41: "hifloat4"}
NOT_DECODED = {32: "complex32"}
CODE = {name: code for code, name in DECODED.items()}
# ml_dtypes' name of a format -> ours (a dump can be written from its arrays)
ML_DTYPES = {"int4": "int4", "uint1": "uint1", "int2": "int2", "uint2": "uint2", "float8_e5m2": "float8_e5m2",
             "float8_e4m3fn": "float8_e4m3fn", "float8_e8m0fnu": "float8_e8m0", "float6_e3m2fn": "float6_e3m2",
             "float6_e2m3fn": "float6_e2m3", "float4_e2m1fn": "float4_e2m1"}
# bits a code takes where the runtime packs them (the 8-bit formats take a byte)
WIDTH = {"int4": 4, "uint1": 1, "int2": 2, "uint2": 2, "float6_e3m2": 6, "float6_e2m3": 6, "float4_e2m1": 4,
         "float4_e1m2": 4, "hifloat4": 4}
# sign, exponent bits, mantissa bits and bias of the formats without Inf or NaN
_MINIFLOATS = {"float6_e3m2": (3, 2, 3), "float6_e2m3": (2, 3, 1), "float4_e2m1": (2, 1, 1),
               "float4_e1m2": (1, 2, 1), "hifloat4": (1, 2, 1)}
# HiFloat8: the 4 bits after the sign -> (dot width, stored exponent width D); None: the denormal mode
_HIF8_DOT = [None, (4, 0), (3, 1), (3, 1)] + [(2, 2)] * 4 + [(2, 3)] * 4 + [(2, 4)] * 4


@dataclass(frozen=True, eq=False)     # an array has no one truth value to compare by
class Codes:
    """A tensor's raw codes (uint8, one per element, in the low bits) in the
    format ``name``: how to write a type NumPy and ml_dtypes lack
    (hifloat8, float4_e1m2, hifloat4) into a dump."""
    name: str
    codes: np.ndarray


@cache
def table(name: str) -> np.ndarray:
    """The float32 value of each code of a format (256 of an 8-bit one,
    2^bits of a sub-byte one)."""
    if name == "hifloat8":
        return _hifloat8()
    if name in ("int4", "int2"):
        n = 1 << WIDTH[name]
        return np.array([c - n if c >= n // 2 else c for c in range(n)], dtype=np.float32)
    if name in ("uint1", "uint2"):
        return np.arange(1 << WIDTH[name], dtype=np.float32)
    if name in _MINIFLOATS:
        return _minifloat(*_MINIFLOATS[name])
    b = np.arange(256, dtype=np.int64)
    if name == "float8_e8m0":          # an exponent alone (a block scale): 2^(e - 127), 0xFF is NaN
        out = np.ldexp(np.float64(1.0), b - 127)
        out[255] = np.nan
        return out.astype(np.float32)
    ebits, mbits, bias = {"float8_e5m2": (5, 2, 15), "float8_e4m3fn": (4, 3, 7)}[name]
    value = _minifloat(ebits, mbits, bias).astype(np.float64)
    e = (b >> mbits) & ((1 << ebits) - 1)
    m = b & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    sign = np.where(b >> 7, -1.0, 1.0)
    if name == "float8_e5m2":          # IEEE-like: the top exponent holds Inf and NaN
        value = np.where(e == top, np.where(m == 0, sign * np.inf, np.nan), value)
    else:                              # finite-only: S.1111.111 is NaN, the rest of the top exponent numbers
        value = np.where((e == top) & (m == (1 << mbits) - 1), np.nan, value)
    return value.astype(np.float32)


def _minifloat(ebits: int, mbits: int, bias: int) -> np.ndarray:
    """Every code of a sign-exponent-mantissa format read as numbers, its
    exponent 0 subnormal (the top exponent too: special values are the
    caller's)."""
    b = np.arange(1 << (1 + ebits + mbits), dtype=np.int64)
    sign = np.where(b >> (ebits + mbits), -1.0, 1.0)
    e = (b >> mbits) & ((1 << ebits) - 1)
    frac = (b & ((1 << mbits) - 1)) / float(1 << mbits)
    value = np.where(e == 0, np.ldexp(frac, 1 - bias), np.ldexp(1.0 + frac, e - bias))
    return (sign * value).astype(np.float32)


def _hifloat8() -> np.ndarray:
    out = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        low = code & 0x7F
        dot = _HIF8_DOT[low >> 3]
        if dot is None:                    # the denormal mode: 2^(M - 23); M = 0 is zero, or NaN signed
            m = low & 0x7
            out[code] = (np.nan if code & 0x80 else 0.0) if m == 0 else sign * 2.0 ** (m - 23)
            continue
        dot_bits, d = dot
        mbits = 7 - dot_bits - d
        field = (low >> mbits) & ((1 << d) - 1)
        # sign-magnitude exponent, its leading magnitude bit implicit
        e = 0 if d == 0 else (-1 if field >> (d - 1) else 1) * ((1 << (d - 1)) | (field & ((1 << (d - 1)) - 1)))
        out[code] = sign * 2.0 ** e * (1 + (low & ((1 << mbits) - 1)) / (1 << mbits))
    out[0x6F], out[0xEF] = np.inf, -np.inf    # where 2^15 x 1.5 would be
    return out.astype(np.float32)


def decode(name: str, raw: np.ndarray) -> np.ndarray:
    """The float32 values of codes ``raw`` (uint8, one per element) of
    ``name``; bits above a sub-byte code's width are not read (a signed
    code may come sign-extended)."""
    codes = np.asarray(raw, dtype=np.uint8)
    if name in WIDTH:
        codes = codes & np.uint8((1 << WIDTH[name]) - 1)
    return table(name)[codes]


def packed_size(name: str, count: int) -> int:
    """The bytes the runtime gives ``count`` codes of ``name``."""
    return (count * WIDTH.get(name, 8) + 7) // 8


def layout(name: str, count: int, size: int) -> bool | None:
    """Whether a tensor of ``count`` codes whose header says ``size`` bytes
    is packed (True), one code per byte (False), or neither (None)."""
    if size == packed_size(name, count):
        return name in WIDTH
    return False if size == count else None


def _group(bits: int) -> tuple[int, int]:
    """(bytes, codes) of the smallest whole run of packed codes: a byte of
    4-, 2- or 1-bit codes, 3 bytes of four 6-bit ones."""
    nbytes = 3 if bits == 6 else 1
    return nbytes, nbytes * 8 // bits


def unpack(name: str, raw: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` codes (uint8, one per element) packed in ``raw``
    (uint8), the first in the lowest bits. Worked in bytes: a tensor's
    codes take no more memory than one byte each."""
    bits = WIDTH[name]
    nbytes, per = _group(bits)
    runs = -(-count // per)
    buf = np.zeros(runs * nbytes, dtype=np.uint8)
    buf[:min(raw.size, buf.size)] = raw[:buf.size]
    if nbytes == 1:
        shifts = (bits * np.arange(per)).astype(np.uint8)
        codes = (buf[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    else:                      # four 6-bit codes across 3 bytes
        b0, b1, b2 = buf[0::3], buf[1::3], buf[2::3]
        codes = np.stack([b0 & 0x3F, (b0 >> 6) | ((b1 & 0x0F) << 2), (b1 >> 4) | ((b2 & 0x03) << 4), b2 >> 2],
                         axis=1)
    return codes.reshape(-1)[:count]


def pack(name: str, codes: np.ndarray) -> bytes:
    """``codes`` (one per byte, in the low bits) packed as the runtime
    packs them: the inverse of ``unpack``."""
    bits = WIDTH[name]
    nbytes, per = _group(bits)
    flat = np.asarray(codes, dtype=np.uint8).reshape(-1) & np.uint8((1 << bits) - 1)
    runs = -(-flat.size // per)
    buf = np.zeros(runs * per, dtype=np.uint32)
    buf[:flat.size] = flat
    words = (buf.reshape(runs, per) << (bits * np.arange(per, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    out = (words[:, None] >> (8 * np.arange(nbytes, dtype=np.uint32))) & np.uint32(0xFF)
    return out.astype(np.uint8).reshape(-1)[:packed_size(name, flat.size)].tobytes()


def widen(name: str, raw: np.ndarray, count: int, packed: bool) -> np.ndarray:
    """The float32 values of a tensor's ``count`` codes of ``name``, read
    from its bytes ``raw`` (uint8) as ``layout`` found them."""
    return decode(name, unpack(name, raw, count) if packed else raw[:count])
