#!/usr/bin/env bash
# Generates the Python and typed (.pyi) stubs for proto/layerdiff/v1 next to the
# .proto files, so that the import path is layerdiff.v1.* with no rewriting.
# Usage: proto/generate.sh [PYTHON] [OUT_DIR]   (OUT_DIR defaults to proto/)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${1:-python3}"
out="${2:-$here}"
mkdir -p "$out"
PATH="$(dirname "$py"):$PATH" "$py" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" \
  "$here"/layerdiff/v1/*.proto
