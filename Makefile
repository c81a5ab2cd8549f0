# Bootstrap and everyday commands. `make test` and `make demo` work on a fresh machine:
# they create .venv, install torch (CPU wheel pinned below; override TORCH for CUDA builds)
# and fastjudge itself (a real, non-editable `pip install .`, which compiles the C++ engine).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
SOURCES := pyproject.toml CMakeLists.txt $(shell find engine python -type f -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: install test demo bench bench-peers check-extras clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, so that nothing later asks for (and downloads) a different build.
$(VENV)/.installed: $(BIN)/python $(SOURCES)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q ".[test,serve]"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

demo: $(VENV)/.installed
	$(BIN)/fastjudge demo

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_lave_t5.py
	$(BIN)/python benchmarks/bench_lave_qwen.py

# fastjudge against CTranslate2 and vLLM's CPU build on the same token ids (benchmarks/peers).
# Each peer gets its own environment under benchmarks/peers/.envs, built on first use (large
# installs: not part of CI). PEERS_ARGS: more flags, e.g. PEERS_ARGS="--peers ctranslate2".
PEERS_ARGS ?=
bench-peers: $(VENV)/.installed
	PYTHON=$(PYTHON) TORCH="$(TORCH)" $(BIN)/python benchmarks/peers/bench_peers.py --repeats 3 $(PEERS_ARGS)

# Resolve the TensorRT-LLM extras against the package index (needs the network; installs nothing)
check-extras:
	bash benchmarks/check_extras.sh

clean:
	rm -rf $(VENV) build dist
