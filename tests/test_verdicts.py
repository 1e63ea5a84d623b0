"""Verdicts from the error model, on the cases that a threshold test gets
wrong, over the real services: quiet on rounding (clean BF16, FP16, TF32
devices; one element past atol), loud on bugs (an FP32 device 1.1x off
inside rtol 0.2, a block of a MatMul's channels under BF16 noise, a
PyTorch BF16 autocast run with a kernel bug, at module and operator level,
judged from two dumps), the INT8 break named where the mask is quantized,
and the headline always agreeing with the exit status."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from planted import build

from layerdiff.client.api import compare, run

SEQ, HIDDEN = 16, 64


def _encoder() -> tuple[onnx.ModelProto, dict]:
    """A two-layer MiniLM-shaped encoder (random weights) with a -3.4e38
    attention mask hiding the last quarter of the tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from smallmodel import minilm, minilm_inputs

    m = minilm(layers=2, hidden=HIDDEN, heads=4, seq=SEQ, ffn=4 * HIDDEN)
    feeds = minilm_inputs(hidden=HIDDEN, seq=SEQ)
    mask = np.ones_like(feeds["mask"])
    mask[..., 3 * SEQ // 4:] = 0
    return m, {**feeds, "mask": mask}


def _run(services, tmp_path, model, feeds, device=None, **kw):
    collector, analyzer = services
    tmp_path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(tmp_path / "model.onnx"))
    np.savez(tmp_path / "inputs.npz", **feeds)
    if device is not None:
        onnx.save(device, str(tmp_path / "device.onnx"))
        kw["device_model"] = tmp_path / "device.onnx"
    return run(tmp_path / "model.onnx", tmp_path / "inputs.npz", out=tmp_path / "out", analyzer=analyzer.address,
               collector=collector.address, progress=False, **kw)


def _comp(s: dict) -> str | None:
    first = s["first_computation_error"] or next(iter(s["benign_computation_errors"]), None)
    return first["node"] if first else None


def _agree(r) -> None:
    """The headline and the exit status say the same thing."""
    head = r.summary["diagnosis"]["headline"]
    to_fix = head.startswith(("Computation error", "Accumulated precision error", "No node's own error",
                              "NaN first appears"))
    assert (r.exit_status == 1) == to_fix, (r.exit_status, head)
    assert r.exit_status != 0 or head.startswith("Every compared node")


# ------------------------------------------------------ quiet on rounding

@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp16"])
def test_clean_reduced_precision_devices_are_no_computation_error(services, tmp_path, precision):
    """The CNN and the encoder as BF16, TF32 and FP16 devices (emulated or
    converted live): nodes past the seed's atol/rtol are rounding, no node
    is called broken, and the answer's exit status says what its headline
    says."""
    for name, (model, feeds) in {"cnn": (small_cnn(width=16, side=32), {
            "input": np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)}),
            "encoder": _encoder()}.items():
        r = _run(services, tmp_path / name, model, feeds, precision=precision)
        s = r.summary
        assert _comp(s) is None, (name, s["diagnosis"]["headline"])
        assert not s["diagnosis"]["headline"].startswith("Computation error")
        assert s["counts"]["compared"] > 5
        _agree(r)


def test_one_element_past_atol_is_rounding_and_exit_0(services, tmp_path):
    """An FP16 device whose outputs stay within tolerance while one element
    of a node is a hair past atol: the seed's statistic lists the node, the
    verdict is that FP16 explains it, exit status 0."""
    model = small_cnn()
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    r = _run(services, tmp_path, model, feeds, precision="fp16", atol=2e-4, rtol=0.0)
    s = r.summary
    assert s["failing_nodes"] and _comp(s) is None
    _agree(r)


# --------------------------------------------------------- loud on bugs

@pytest.mark.parametrize("scale", [1.1, 1.02])
def test_an_fp32_device_off_inside_rtol_is_a_computation_error(services, tmp_path, scale):
    """An FP32 device whose conv2 computes 1.1x (and 1.02x) its output:
    within the seed's rtol 0.2 everywhere, yet FP32 explains 1e-7."""
    model = small_cnn()
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    device = small_cnn()
    w = next(i for i in device.graph.initializer if i.name == "conv2.weight")
    b = next(i for i in device.graph.initializer if i.name == "conv2.bias")
    for t in (w, b):
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.float32(scale), t.name))
    r = _run(services, tmp_path, model, feeds, device)
    s = r.summary
    assert "conv2_out" not in s["failing_nodes"]        # the seed's allclose sees nothing wrong there
    assert _comp(s) == "conv2", s["diagnosis"]["headline"]
    first = s["first_computation_error"] or s["benign_computation_errors"][0]
    assert any("explains" in e and "fp32" in e for e in first["evidence"]), first["evidence"]
    # a stricter rtol changes the seed's statistic, not the verdict
    r2 = _run(services, tmp_path / "rtol", model, feeds, device, rtol=0.05)
    assert _comp(r2.summary) == "conv2" and r2.exit_status == 1
    assert not any("reduced-precision" in e for v in r2.summary["verdicts"] for e in v["evidence"])
    _agree(r)


def _scale_features(model: onnx.ModelProto, weight: str, share: float, factor: float) -> onnx.ModelProto:
    """A copy of ``model`` whose MatMul weight ``weight`` has its first
    ``share`` of output features (columns) scaled: that MatMul's output is
    ``factor`` off there, as a kernel with a wrong scale in one tile."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    w = next(i for i in m.graph.initializer if i.name == weight)
    a = onnx.numpy_helper.to_array(w).copy()
    a[:, : int(a.shape[1] * share)] *= np.float32(factor)
    w.CopyFrom(onnx.numpy_helper.from_array(a, weight))
    return m


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_block_of_a_matmuls_channels_is_named_at_that_matmul(services, tmp_path, precision):
    """The encoder as an FP32 device (a MiniLM case: 1.2x on the first
    eighth of a MatMul's output channels, cosine 0.998 where FP32 gives
    1 - 1e-12) and as a BF16 one: named at that MatMul, not the Add after
    it; the evidence gives what it adds against what its precision over K
    explains."""
    model, feeds = _encoder()
    device = _scale_features(model, "layer.1/intermediate.w", 1 / 8, 1.2)
    if precision == "bf16":
        device, _ = build(device, "bf16", feeds)
    r = _run(services, tmp_path, model, feeds, device, precision=precision)
    s = r.summary
    assert _comp(s) == "layer.1/intermediate/matmul", s["diagnosis"]["headline"]
    ev = " | ".join((s["first_computation_error"] or s["benign_computation_errors"][0])["evidence"])
    assert f"{precision} over K=64 explains" in ev, ev
    _agree(r)


def test_the_int8_mask_break_is_named_where_the_mask_is_quantized(services, tmp_path):
    """The encoder statically quantized with every op: the attention scores
    plus the -3.4e38 mask are handed over in INT8 on a grid whose step is
    the mask's, and the Softmax reads noise. Named at that Add, with its
    step and the step the scores' own range would have had."""
    model, feeds = _encoder()
    r = _run(services, tmp_path, model, feeds, precision="int8")
    s = r.summary
    first = s["first_computation_error"]
    assert first is not None and first["node"] == "layer.0/attention/masked", s["diagnosis"]["headline"]
    assert first["cause"] == "quantization" and "softmax" in s["diagnosis"]["headline"]
    ev = " | ".join(first["evidence"])
    assert "coarser than the values it carries" in ev and "a step of about" in ev, ev
    _agree(r)


# ------------------------------------------------------- two dumps, PyTorch

def _torch_net(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).eval()


@pytest.mark.parametrize("level", ["module", "operator"])
def test_pytorch_bf16_autocast_captures_with_a_bug_at_a_random_conv(services, tmp_path, level):
    """A CPU FP32 capture against CPU BF16 autocast captures (layerdiff.torch):
    the clean one is quiet; a kernel bug (1.2x on a block of 1/16 of the
    channels) at a conv drawn at random is named there. At operator level
    the node is replayed in FP32 from the device's inputs (no model)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from layerdiff.torch import capture

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = int(np.random.default_rng(4).integers(1, 4))          # the 1st, 2nd or 3rd conv
    convs = [0, 3, 5]

    class Bug(TorchDispatchMode):
        """The ``target``-th convolution writes 1.2x into its first 4 of 64 (or 2 of 32) channels."""

        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "convolution" in str(func):
                self.seen += 1
                if self.seen == target:
                    out = out.clone()
                    out[:, : out.shape[1] // 16] *= 1.2
            return out

    def dump(name: str, device: bool, bug: bool):
        path = tmp_path / name
        path.mkdir()
        m = _torch_net(torch)
        hooks = []
        if bug and level == "module":
            def hook(mod, inputs, out):
                out = out.clone()
                out[:, : out.shape[1] // 16] *= 1.2
                return out
            hooks.append(m[convs[target - 1]].register_forward_hook(hook))     # before capture's own hooks
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=device):
            if bug and level == "operator":
                with Bug(), capture(m, path / "run.h5", level=level):
                    m(x)
            else:
                with capture(m, path / "run.h5", level=level):
                    m(x)
        for h in hooks:
            h.remove()
        return path

    golden = dump("cpu", False, False)
    collector, analyzer = services
    for name, bug in (("clean", False), ("bug", True)):
        r = compare(str(golden), str(dump(name, True, bug)), out=tmp_path / f"out-{name}", progress=False,
                    collector=collector.address, analyzer=analyzer.address, dump_mode="all")
        s = r.summary
        if not bug:
            assert _comp(s) is None and r.exit_status == 0, s["diagnosis"]["headline"]
            continue
        want = str(convs[target - 1]) if level == "module" else \
            "aten.convolution.default" + ("" if target == 1 else f"@{target - 1}")
        assert _comp(s) == want, (target, s["diagnosis"]["headline"])
        first = s["first_computation_error"] or s["benign_computation_errors"][0]
        ev = " | ".join(first["evidence"])
        assert "bf16 over K=" in ev, ev
        if level == "operator":
            assert "re-run alone on its device inputs" in ev or "added here" in ev, ev
        _agree(r)


def _encoder_block(torch, fp32_norms: bool):
    """A ViT-shaped block: a class-token row whose mean dwarfs its spread,
    computed in BF16, joined to the tokens (functional ops no module
    records), LayerNorms
    that run in FP32 under autocast as CUDA runs them (``fp32_norms``),
    in-place activations, a residual add, a head on the class token."""
    nn = torch.nn

    class LayerNorm(nn.LayerNorm):
        def forward(self, x):
            if not fp32_norms:
                return super().forward(x)
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(64, 256)
            self.cls = nn.Linear(64, 256)         # the class token's row: mean 20, spread 0.3, in BF16
            self.cls.weight.data *= 0.5
            self.cls.bias.data += 20.0
            self.pos = nn.Parameter(torch.randn(1, 33, 256) * 0.5)
            self.ln1, self.ln2 = LayerNorm(256), LayerNorm(256)
            self.fc1, self.act, self.fc2 = nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)
            self.head = nn.Linear(256, 10)

        def forward(self, x):
            h = torch.cat([self.cls(x[:, :1]), self.embed(x[:, 1:])], 1) + self.pos
            h = h + self.fc2(self.act(self.fc1(self.ln1(h))))
            return self.head(self.ln2(h)[:, 0])
    return Block().eval()


@pytest.mark.parametrize("fp32_norms", [True, False])
def test_pytorch_encoder_bf16_quiet_on_rounding_and_blocks_of_5_percent_named(services, tmp_path, fp32_norms):
    """A BF16 autocast capture of an encoder block against its CPU FP32
    capture, dump against dump. Clean: a LayerNorm that computes in FP32
    reads the class token's row, whose large mean makes it pass on the
    Linear's BF16 rounding many times over relative to its output: that is
    what it read, not its own error. A 5 % bug on a sixteenth of a Linear's
    features, starting anywhere, is named at that Linear, not at the
    LayerNorm after it; the model's output is the head's (the capture marks
    it), not a tensor a functional add reads."""
    torch = pytest.importorskip("torch")
    from layerdiff.torch import capture

    x = torch.randn(2, 33, 64, generator=torch.Generator().manual_seed(1))
    collector, analyzer = services

    def dump(name: str, device: bool, site: str = "", start: int = 0):
        m = _encoder_block(torch, fp32_norms)
        hooks = []
        if site:
            def hook(mod, inputs, out):
                out = out.clone()
                out[..., start:start + out.shape[-1] // 16] *= 1.05
                return out
            hooks.append(getattr(m, site).register_forward_hook(hook))
        path = tmp_path / name
        path.mkdir()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=device), capture(m, path / "run.h5"):
            m(x)
        for h in hooks:
            h.remove()
        return path

    # the LayerNorms computing in FP32 are judged so (as a CUDA TF32 or BF16 run's are)
    norms = {"ln1": "fp32", "ln2": "fp32"} if fp32_norms else None
    golden = dump("cpu", False)
    r = compare(str(golden), str(dump("clean", True)), out=tmp_path / "o-clean", progress=False,
                collector=collector.address, analyzer=analyzer.address, dump_mode="all", node_precision=norms)
    assert _comp(r.summary) is None, r.summary["diagnosis"]["headline"]
    _agree(r)
    for site, start in (("fc1", 77), ("fc2", 201), ("embed", 5)):
        r = compare(str(golden), str(dump(f"bug-{site}", True, site, start)), out=tmp_path / f"o-{site}",
                    progress=False, collector=collector.address, analyzer=analyzer.address, dump_mode="all",
                    node_precision=norms)
        assert _comp(r.summary) == site, (site, r.summary["diagnosis"]["headline"])
        ev = " | ".join((r.summary["first_computation_error"] or r.summary["benign_computation_errors"][0])
                        ["evidence"])
        width = {"fc1": 512}.get(site, 256) // 16
        assert f"features {start}..{start + width - 1}" in ev, ev
        # past the first node the block is told from what came in by how it stands out of its tensor
        assert site == "embed" or "the rest of the tensor's" in ev, ev
        _agree(r)
