# layerdiff: `make setup` then `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SHELL := /bin/bash

.PHONY: setup stubs kernels classes test lint docs demo bench clean

setup:
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
# headless Chromium reads report.html back in the tests (only when missing)
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# the versions the images install (deploy/constraints.txt): what is tested is what is deployed
	$(BIN)/pip install -q --upgrade pip setuptools wheel -c deploy/constraints.txt
	$(BIN)/pip install -q -c deploy/constraints.txt -e '.[dev,bench,tf,torch,notebook]'
	# The demo model ships its weights inside this wheel; its runtime
	# dependencies are not needed because only the .onnx files are read.
	$(BIN)/pip install -q --no-deps rapidocr-onnxruntime==1.4.4
	$(MAKE) stubs
	# Compiled now, not on a new user's first command: the project's bytecode,
	# the methods its dataclasses write, and the metric kernels for this CPU
	$(BIN)/python -m compileall -q services >/dev/null
	$(MAKE) classes
	$(MAKE) kernels

# The metric kernels built ahead of time for this CPU (compare/compiled.py);
# rebuilt when what they are built from changes. Where they cannot be built,
# numba compiles them on first use and caches them (warmed here).
KERNELS := services/analyzer/compare
$(KERNELS)/_kernels.sha256: $(KERNELS)/kernel.py $(KERNELS)/contract.py $(KERNELS)/compiled.py $(KERNELS)/build.py
	$(BIN)/layerdiff kernels
	$(BIN)/python -c "from layerdiff.analyzer.compare import compiled; compiled.warmup(just_in_time=True)"

kernels: $(KERNELS)/_kernels.sha256

# The code of the methods layerdiff's dataclasses write, compiled for the
# command's start-up (common/dataclass_code.py); made again before the tests,
# as a module may have changed (a second).
classes:
	$(BIN)/python -m layerdiff.common.dataclass_code >/dev/null

stubs:
	proto/generate.sh $(BIN)/python

# Test modules run side by side on the cores (pytest-xdist), each module in
# one process so that its fixtures are built once.
test: lint kernels classes docs
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 2 --dist loadfile tests

# The manual (docs/, MkDocs) built strictly: a broken link or anchor fails it;
# its reference page is generated from the program and must be up to date.
docs:
	$(BIN)/python docs/gen_reference.py --check
	$(BIN)/mkdocs build --strict --site-dir build/site 2>&1 | { grep -v '^INFO' || true; }; test $${PIPESTATUS[0]} -eq 0

# mypy reads the package as it imports: layerdiff is src/layerdiff (services/,
# with the generated stubs linked in).
lint:
	$(BIN)/ruff check services tests bench docs
	MYPYPATH=src $(BIN)/mypy --config-file pyproject.toml

demo:
	$(BIN)/python -m layerdiff.client.demo

bench:
	$(BIN)/python bench/run_all.py

clean:
	rm -rf demo-out bench-out
