#!/usr/bin/env bash
# Generates the Python and typed (.pyi) stubs for proto/layerdiff/v1 (the
# service contract) and proto/layerdiff/vendor (vendor file formats read by the
# collector) next to the .proto files, so that the import paths are
# layerdiff.v1.* and layerdiff.vendor.* with no rewriting.
# Usage: proto/generate.sh [PYTHON] [OUT_DIR]   (OUT_DIR defaults to proto/)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${1:-python3}"
out="${2:-$here}"
mkdir -p "$out"
PATH="$(dirname "$py"):$PATH" "$py" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" \
  "$here"/layerdiff/v1/*.proto "$here"/layerdiff/vendor/*.proto
