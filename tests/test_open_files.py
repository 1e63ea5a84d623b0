"""The open-files limit: a dump's mapped tensors each hold a file
descriptor for as long as they are kept, so a golden dump of more large
tensors than a shell's soft limit (often 1024) would fail half-way. The
command raises its soft limit to the hard one as it starts; where even the
hard limit is too low, the job says so in one line, with what to raise."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerdiff.collector.dumps.directory import write_dump
from layerdiff.common.openfiles import open_files_limit, too_many_open_files
from layerdiff.common.schema import NodeRecord

# more large tensors (each mapped, not read: over 64 KiB) than the limit the test sets
TENSORS = 96
LIMIT = 64


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    base = tmp_path_factory.mktemp("open_files")
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(20_000).astype(np.float32) for _ in range(TENSORS)]
    golden = write_dump(base / "golden", [NodeRecord(name=f"t{i}", op_type="Relu", order=i, array=v)
                                          for i, v in enumerate(values)], "npy")
    device = write_dump(base / "device", [NodeRecord(name=f"t{i}", op_type="Relu", order=i,
                                                     array=v * np.float32(1.5) if i == 40 else v)
                                          for i, v in enumerate(values)], "npy")
    return golden, device


def _compare(golden: Path, device: Path, out: Path, soft: int, hard: int) -> subprocess.CompletedProcess:
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "compare", str(golden), str(device),
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300,
                          preexec_fn=limited)


def test_a_dump_of_more_tensors_than_the_soft_limit_is_compared_in_full(dumps, tmp_path):
    golden, device = dumps
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4 * TENSORS:
        pytest.skip(f"this machine's hard limit on open files ({hard}) is too low to raise the soft one past it")
    done = _compare(golden, device, tmp_path / "out", LIMIT, hard)
    assert done.returncode == 1, done.stderr
    assert "COVERAGE: 96 of 96 reference tensors compared" in done.stdout, done.stdout
    assert "FIRST COMPUTATION ERROR: t40" in done.stdout, done.stdout


def test_a_hard_limit_too_low_for_the_dump_is_said_in_one_line(dumps, tmp_path):
    golden, device = dumps
    done = _compare(golden, device, tmp_path / "out", LIMIT, LIMIT)
    assert done.returncode == 3, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "too many open files" in errors[0] and f"may hold {LIMIT}" in errors[0] \
        and "ulimit -n" in errors[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout and "Warning" not in done.stderr


def test_the_limit_is_raised_once_and_a_lower_hard_limit_is_kept():
    """In a process of its own: the soft limit goes up to the hard one, and
    no further; what the table was sized for is then free again."""
    script = """
import os, resource
from layerdiff.common.openfiles import allow_open_files
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 300))
got = allow_open_files()
print(got, resource.getrlimit(resource.RLIMIT_NOFILE), len(os.listdir("/proc/self/fd")) < 20)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["300", "(300,", "300)", "True"], (out.stdout, out.stderr)


def test_running_out_of_descriptors_is_told_from_other_failures():
    assert too_many_open_files(OSError(24, "Too many open files"))
    wrapped = RuntimeError("reading the dump")
    wrapped.__cause__ = OSError(23, "Too many open files in system")
    assert too_many_open_files(wrapped)
    assert not too_many_open_files(OSError(28, "No space left on device")) and not too_many_open_files(None)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert open_files_limit() == (-1 if soft == resource.RLIM_INFINITY else soft)
