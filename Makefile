# Bootstrap and everyday commands. `make test` and `make demo` work on a fresh machine:
# they create .venv, install torch (the version pinned below, from the package index pip is
# configured with -- on Linux the default index serves the CUDA build; TORCH_INDEX picks another
# index, e.g. PyTorch's CPU wheels: make TORCH_INDEX=https://download.pytorch.org/whl/cpu),
# fastjudge's build requirements (so that `pip install --no-build-isolation -e .` works in the
# venv) and fastjudge itself (a real, non-editable `pip install .`, which compiles the C++ engine).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
BUILD_REQUIRES := "scikit-build-core>=0.10" "pybind11>=2.12"
BIN := $(VENV)/bin
SOURCES := pyproject.toml CMakeLists.txt $(shell find engine python -type f -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: install editable test demo bench bench-peers check-extras clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, so that nothing later asks for (and downloads) a different build.
$(VENV)/.installed: $(BIN)/python $(SOURCES)
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	$(BIN)/pip install -q $(BUILD_REQUIRES)
	$(BIN)/pip install -q ".[test,serve]"
	touch $@

install: $(VENV)/.installed

# fastjudge as an editable install over the one above (rerun after changing C++ sources)
editable: $(VENV)/.installed
	$(BIN)/pip install -q --no-build-isolation -e ".[test,serve]"

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

demo: $(VENV)/.installed
	$(BIN)/fastjudge demo

# the short side-by-side benchmarks (planner, LAVE on T5 and Qwen; docs/benchmarks.md)
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
