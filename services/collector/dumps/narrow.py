"""The narrow types the Ascend runtime dumps for quantized models
(``dump_data.proto``'s OutputDataType), decoded exactly to float32: every
code point of an 8-bit format through a 256-entry table built from its
definition (sign, exponent, mantissa, bias; which codes are NaN or Inf).

BF16 (27) is read as the upper half of a float32 where the tensor is read
(ascend._tensor). The sub-byte and tapered types are named and refused per
tensor: their packing in a dump is not fixed by the proto, and a wrong guess
would compare garbage without a word."""
from __future__ import annotations

from functools import cache

import numpy as np

# OutputDataType code -> the name reports and the error model use
DECODED = {34: "float8_e5m2", 35: "float8_e4m3fn", 36: "float8_e8m0"}
NOT_DECODED = {28: "int4", 29: "uint1", 30: "int2", 31: "uint2", 32: "complex32", 33: "hifloat8",
               37: "float6_e3m2", 38: "float6_e2m3", 39: "float4_e2m1", 40: "float4_e1m2", 41: "hifloat4"}


@cache
def table(name: str) -> np.ndarray:
    """The float32 value of each of the 256 codes of an 8-bit format."""
    b = np.arange(256, dtype=np.int64)
    if name == "float8_e8m0":          # an exponent alone (a block scale): 2^(e - 127), 0xFF is NaN
        out = np.ldexp(np.float64(1.0), b - 127)
        out[255] = np.nan
        return out.astype(np.float32)
    ebits, mbits, bias = {"float8_e5m2": (5, 2, 15), "float8_e4m3fn": (4, 3, 7)}[name]
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> mbits) & ((1 << ebits) - 1)
    m = b & ((1 << mbits) - 1)
    frac = m / float(1 << mbits)
    value = np.where(e == 0, np.ldexp(frac, 1 - bias), np.ldexp(1.0 + frac, e - bias))
    top = (1 << ebits) - 1
    if name == "float8_e5m2":          # IEEE-like: the top exponent holds Inf and NaN
        value = np.where(e == top, np.where(m == 0, np.inf, np.nan), value)
    else:                              # finite-only: S.1111.111 is NaN, the rest of the top exponent numbers
        value = np.where((e == top) & (m == (1 << mbits) - 1), np.nan, value)
    return (sign * value).astype(np.float32)


def decode(name: str, raw: np.ndarray) -> np.ndarray:
    """The float32 values of codes ``raw`` (uint8) of ``name``."""
    return table(name)[np.asarray(raw, dtype=np.uint8)]
