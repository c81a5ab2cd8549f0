#!/usr/bin/env bash
# Wheels for running fastjudge and benchmarks/gpu_check.sh on a CUDA machine without network
# access whose Python already has PyTorch, Triton and transformers (a typical GPU image):
# fastjudge's other runtime dependencies, downloaded here for that machine's Python and
# platform, with no dependency resolution (each needed one is named below).
#
#   bash benchmarks/offline_wheels.sh WHEEL_DIR [PYTHON_VERSION]   # here: default 3.12
#   python3 -m pip install --no-index --no-deps WHEEL_DIR/*.whl     # there, then:
#   python3 -m pip install --no-deps --no-build-isolation --no-index .
#
# Versions: xgrammar at the version the tests run (0.2.9); the rest at their newest.
set -euo pipefail
DIR="${1:?usage: benchmarks/offline_wheels.sh WHEEL_DIR [PYTHON_VERSION]}"
PYVER="${2:-3.12}"
PIP="${PIP:-python3 -m pip}"
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64)
# xgrammar and its requirements, orjson (fastjudge's JSON lines), typing-extensions (pydantic
# needs a newer one than some images carry)
PACKAGES=(xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
          typing-extensions orjson)
mkdir -p "$DIR"
for p in "${PACKAGES[@]}"; do
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DIR" "$p"
done
ls "$DIR"
