import math

import pytest

from layerdiff.analyzer.report import listing


@pytest.mark.parametrize("value, text", [
    (0.0, "0.000000"),
    (4.6e-5, "0.000046"),
    (0.999898, "0.999898"),
    (-0.5, "-0.500000"),
    (1e-5, "0.000010"),
    (123456.7, "123456.700000"),
    (1e70, "1e+70"),
    (1.2345678e70, "1.23457e+70"),
    (1e6, "1e+06"),
    (3.2e-9, "3.2e-09"),
    (-2.5e-12, "-2.5e-12"),
    (math.nan, "nan"),
    (None, "nan"),
    (math.inf, "inf"),
    (-math.inf, "-inf"),
    ("inf", "inf"),
    ("not a number", "not a number"),
    (object(), "nan"),
])
def test_numbers_are_readable(value, text):
    assert listing._num(value) == text


def test_huge_and_tiny_numbers_keep_the_columns_aligned():
    nodes = [
        {"node": "conv1", "op_type": "Conv", "order": 0, "mse": 4.6e-5, "cosine": 0.999898,
         "rmse": 0.01431, "passed": True},
        {"node": "blowup", "op_type": "MatMul", "order": 1, "mse": 1e70, "cosine": -0.123456,
         "rmse": 1e35, "passed": False},
        {"node": "tiny", "op_type": "Relu", "order": 2, "mse": 3.2e-9, "cosine": math.nan,
         "rmse": 5.6e-5, "passed": False},
        {"node": "wide", "op_type": "Add", "order": 3, "mse": 123456.7, "cosine": -1e-300,
         "rmse": None, "passed": True},
    ]
    lines = listing.format_listing({"nodes": nodes}).splitlines()
    assert len(lines) == 4
    assert "MSE:0.000046 " in lines[0] and "COS:0.999898 " in lines[0]
    assert "MSE:1e+70 " in lines[1] and "RMSE:1e+35" in lines[1] and "FAIL" in lines[1]
    assert "MSE:3.2e-09 " in lines[2] and "COS:nan " in lines[2]
    assert "MSE:123456.700000 " in lines[3] and "COS:-1e-300 " in lines[3]
    assert lines[3].endswith("RMSE:nan")
    for tag in ("OP_TYPE:", " MSE:", " COS:", " RMSE:"):
        assert len({line.index(tag) for line in lines}) == 1, tag
    assert max(len(line) for line in lines) < 160


def test_ordinary_listing_keeps_the_debug_script_widths():
    nodes = [{"node": "a", "op_type": "Conv", "order": 0, "mse": 0.5, "cosine": 0.25, "rmse": 1.0}]
    line = listing.format_listing({"nodes": nodes})
    # 11-wide MSE and COS columns, as the vendor's script prints them
    assert "MSE:0.500000    COS:0.250000    RMSE:1.000000" in line
