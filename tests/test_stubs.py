"""The gRPC stubs are generated from proto/ by `make setup`, never edited:
regenerating them must give the same files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run([str(ROOT / "proto" / "generate.sh"), sys.executable, str(tmp_path)], check=True,
                   capture_output=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        current = ROOT / "proto" / rel
        assert current.exists(), f"{rel} missing: run `make stubs`"
        assert current.read_text() == (tmp_path / rel).read_text(), f"{rel} is out of date: run `make stubs`"
