"""layerdiff.torch: a PyTorch model's golden run written in the seed's HDF5
layout, read back by the dump reader as the same tensors, repeated calls as
op@k; the operator level records ATen operators."""
from __future__ import annotations

import numpy as np
import pytest

from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.common.schema import ROLE_INPUT, STATUS_OK

torch = pytest.importorskip("torch")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, 4)).eval()


def _records(path):
    return {(r.name, r.role, r.slot): r for r in DumpDirectory(str(path.parent), fmt="h5").records()}


def test_every_leaf_module_is_written_and_read_back_as_it_computed(tmp_path):
    from layerdiff.torch import capture

    model, x = net(), torch.randn(1, 3, 16, 16)
    seen = {}

    def keep(name):
        def hook(mod, inputs, output):
            seen[name] = output.detach().numpy().copy()
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    with capture(model, tmp_path / "cpu.h5"):
        model(x)
        model(x * 2)       # a second call of every module: op@1
    recs = _records(tmp_path / "cpu.h5")
    assert all(r.status == STATUS_OK for r in recs.values()), [r.message for r in recs.values() if r.message]
    for name, value in seen.items():
        np.testing.assert_array_equal(recs[(name, "output", 0)].array, value)
        assert (f"{name}@1", "output", 0) in recs
    # a node's input is the previous node's output, as the seed's layout keeps both
    np.testing.assert_array_equal(recs[("1", ROLE_INPUT, 0)].array, seen["0"])


def test_operators_and_a_bounded_number_of_calls(tmp_path):
    import h5py

    from layerdiff.torch import capture

    model, x = net(), torch.randn(1, 3, 16, 16)
    with capture(model, tmp_path / "ops.h5", level="operator", max_calls=1):
        model(x)
        model(x)
    with h5py.File(tmp_path / "ops.h5") as f:
        ops = list(f.keys())
        assert "aten.convolution.default" in ops and all(len(f[op]) == 1 for op in ops)
        assert f.attrs["calls_dropped"] > 0
    recs = _records(tmp_path / "ops.h5")
    conv = recs[("aten.convolution.default", "output", 0)].array
    assert conv.shape == (1, 8, 16, 16)


class Residual(torch.nn.Module):
    """A torchvision-style block: in-place ReLUs and a functional residual
    add that no module records; its result is the last Linear's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU(inplace=True)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = self.relu(y + x)
        return self.fc(y.mean((2, 3)))


@pytest.mark.parametrize("level", ["module", "operator"])
def test_in_place_inputs_are_recorded_as_read_and_the_model_output_is_marked(tmp_path, level):
    """An in-place ReLU overwrites its input before its call returns: the
    file holds what it read (negative values too), not what it wrote; the
    call that wrote the model's result says so (model_output), which a
    comparison without the graph judges the run by."""
    import h5py

    from layerdiff.torch import capture

    model, x = Residual().eval(), torch.randn(1, 4, 6, 6)
    with capture(model, tmp_path / "run.h5", level=level):
        out = model(x)
    recs = _records(tmp_path / "run.h5")
    relu = "relu" if level == "module" else "aten.relu_.default"
    read = recs[(relu, ROLE_INPUT, 0)].array
    wrote = recs[(relu, "output", 0)].array
    assert read.min() < 0 and wrote.min() >= 0
    np.testing.assert_array_equal(np.maximum(read, 0), wrote)
    last = "fc" if level == "module" else "aten.addmm.default"
    np.testing.assert_array_equal(recs[(last, "output", 0)].array, out.detach().numpy())
    with h5py.File(tmp_path / "run.h5") as f:
        marked = [f"{op}/{seq}" for op in f for seq in f[op] if "model_output" in f[op][seq].attrs]
        assert marked == [f"{last}/0"] and f[last]["0"].attrs["model_output"] == "[0]"


def test_bfloat16_is_kept_as_float32_with_its_dtype_named(tmp_path):
    import h5py

    from layerdiff.torch import capture

    model = net().to(torch.bfloat16)
    with capture(model, tmp_path / "bf16.h5"):
        model(torch.randn(1, 3, 8, 8, dtype=torch.bfloat16))
    with h5py.File(tmp_path / "bf16.h5") as f:
        ds = f["0"]["0"]["output"]["0"]
        assert ds.dtype == np.float32 and ds.attrs["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="level"):
        with capture(model, tmp_path / "x.h5", level="graph"):
            pass


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float8_e8m0fnu"])
@pytest.mark.parametrize("level", ["module", "operator"])
def test_a_float8_output_is_written_as_float32_and_read_back_with_its_dtype(tmp_path, dtype, level):
    """A module whose output is cast to a float8 type: the file holds the
    float8 values exactly (as float32, which NumPy can hold), and reading
    the dump back says what the model computed them in."""
    import h5py

    from layerdiff.common.precision import node_precision
    from layerdiff.torch import capture

    class Cast(torch.nn.Module):
        def forward(self, x):
            return x.to(getattr(torch, dtype))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), Cast()).eval()
    with capture(model, tmp_path / "run.h5", level=level):
        out = model(torch.randn(3, 4) * 50)
    want = out.to(torch.float32).numpy()
    name = "1" if level == "module" else "aten._to_copy.default"
    with h5py.File(tmp_path / "run.h5") as f:
        ds = f[name]["0"]["output"]["0"]
        assert ds.dtype == np.float32 and ds.attrs["dtype"] == dtype
    rec = _records(tmp_path / "run.h5")[(name, "output", 0)]
    assert rec.status == STATUS_OK and rec.source_dtype == dtype
    np.testing.assert_array_equal(rec.array, want)
    precision, why = node_precision("Cast", job=None, stored_dtype=rec.source_dtype)
    assert precision.name != "fp32" and dtype in why


def test_torch_is_imported_only_by_the_helper():
    import subprocess
    import sys

    code = "import sys, layerdiff.client.cli, layerdiff.collector.service, layerdiff.analyzer.jobs.runner; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
