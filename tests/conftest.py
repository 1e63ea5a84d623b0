"""Shared fixtures: real services in separate processes on loopback ports,
and small ONNX models built here."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import opset17

ROOT = Path(__file__).resolve().parents[1]


class ServiceProcess:
    """`layerdiff <service> serve --port 0` in its own working directory."""

    def __init__(self, service: str, workdir: Path, env: dict | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "service.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerdiff.client.cli", service, "serve", "--port", "0",
             "--workdir", str(workdir / "state")],
            cwd=workdir, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"{service} did not start: {line!r}")
        self.address = m.group(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """A collector and an analyzer as separate processes, separate directories."""
    base = tmp_path_factory.mktemp("services")
    collector = ServiceProcess("collector", base / "collector")
    analyzer = ServiceProcess("analyzer", base / "analyzer")
    try:
        yield collector, analyzer
    finally:
        analyzer.stop()
        collector.stop()


def _conv(name, x, w, b, out):
    return helper.make_node("Conv", [x, w, b], [out], name=name, pads=[1, 1, 1, 1])


def small_cnn(seed: int = 0, bug_in: str | None = None, bug_scale: float = 1.8, *, in_channels: int = 3,
              width: int = 8, side: int = 16) -> onnx.ModelProto:
    """conv1 -> relu1 -> conv2 -> relu2 -> add(residual relu1) -> conv3 -> pool -> flatten -> fc
    on a 1 x in_channels x side x side input; conv1 and conv2 have ``width``
    channels, conv3 twice as many. ``bug_in`` perturbs the weights of that
    conv (a planted kernel bug)."""
    c, c3 = width, 2 * width
    rng = np.random.default_rng(seed)
    inits = []

    def w(name, shape, scale):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if bug_in and name.startswith(bug_in + "."):
            a = a * bug_scale + 0.05
        inits.append(numpy_helper.from_array(a, name))
        return name

    nodes = [
        _conv("conv1", "input", w("conv1.weight", (c, in_channels, 3, 3), 0.3), w("conv1.bias", (c,), 0.1),
              "conv1_out"),
        helper.make_node("Relu", ["conv1_out"], ["relu1_out"], name="relu1"),
        _conv("conv2", "relu1_out", w("conv2.weight", (c, c, 3, 3), 0.15), w("conv2.bias", (c,), 0.1), "conv2_out"),
        helper.make_node("Relu", ["conv2_out"], ["relu2_out"], name="relu2"),
        helper.make_node("Add", ["relu2_out", "relu1_out"], ["add_out"], name="residual/add"),
        _conv("conv3", "add_out", w("conv3.weight", (c3, c, 3, 3), 0.15), w("conv3.bias", (c3,), 0.1), "conv3_out"),
        helper.make_node("GlobalAveragePool", ["conv3_out"], ["pool_out"], name="pool"),
        helper.make_node("Flatten", ["pool_out"], ["flat_out"], name="flatten"),
        helper.make_node("Gemm", ["flat_out", w("fc.weight", (10, c3), 0.3), w("fc.bias", (10,), 0.1)],
                         ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "small_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, in_channels, side, side])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        initializer=inits)
    model = opset17(graph)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def cnn_files(tmp_path):
    """(model.onnx, inputs.npz, buggy device model with conv2 perturbed)."""
    model = tmp_path / "model.onnx"
    onnx.save_model(small_cnn(), str(model))
    device = tmp_path / "device.onnx"
    onnx.save_model(small_cnn(bug_in="conv2"), str(device))
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32))
    return model, inputs, device


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Popen arguments for a command a test sends Ctrl-C: it gets SIGINT as from a
# terminal however the suite was started (started in the background, the
# suite ignores SIGINT, and every child inherits that)
INTERRUPTIBLE = {"preexec_fn": _sigint_as_from_a_terminal}


def wait_for(pred, timeout=30.0, every=0.1):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(every)
    return False


os.environ.setdefault("PYTHONUNBUFFERED", "1")
