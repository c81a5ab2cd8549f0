#!/usr/bin/env bash
# Wheels for running fastjudge and benchmarks/gpu_check.sh on a CUDA machine without network
# access whose Python already has PyTorch, Triton and transformers (a typical GPU image):
# fastjudge's other runtime dependencies, downloaded here for that machine's Python and
# platform, with no dependency resolution (each needed one is named below).
#
#   bash benchmarks/offline_wheels.sh WHEEL_DIR [PYTHON_VERSION]   # here: default 3.12
#   bash benchmarks/gpu_check.sh OUT_DIR --wheels WHEEL_DIR         # there: installs them, then checks
#
# Where this machine's python3 is PYTHON_VERSION, fastjudge's own wheel is built into WHEEL_DIR
# too, so the GPU check's setup stage installs it instead of compiling fastjudge there (which
# would take most of that stage's 45 s cap).
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
here="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$here" = "$PYVER" ]; then
  $PIP wheel -q --no-deps -w "$DIR" "$(dirname "$0")/.." \
    || echo "offline_wheels: fastjudge's own wheel did not build (the GPU check will build it there)" >&2
else
  echo "offline_wheels: python3 here is $here, not $PYVER: fastjudge's own wheel is not built" >&2
fi
ls "$DIR"
