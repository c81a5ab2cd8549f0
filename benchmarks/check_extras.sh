#!/usr/bin/env bash
# Resolve the TensorRT-LLM extra of fastjudge (with the core dependencies) against the package
# index for Linux x86_64 and the Python versions TensorRT-LLM 1.3 ships wheels for, and print
# OK with the versions chosen, or the conflict. Needs the network; changes no environment (the
# resolver writes only to a temporary folder). CI does not run it.
#
#   bash benchmarks/check_extras.sh                  # or: make check-extras
#   EXTRAS="trtllm" PYTHONS="3.12" bash benchmarks/check_extras.sh
#
# Why uv and not `pip install --dry-run`: TensorRT-LLM is on the index as source distributions
# whose build step downloads the real wheel from NVIDIA's own index. pip must run that build to
# learn the dependencies; uv reads them from the sdist's static metadata (PKG-INFO 2.2+). A few
# NVIDIA packages beneath it (tensorrt-cu13-libs, ...) are such stubs without static metadata;
# they are resolved as leaves here (their own dependencies, CUDA runtime libraries, unchecked).
# TensorRT-LLM 1.3 wants the CUDA 13 torch from PyTorch's index; where that index cannot be
# reached, torch is pinned by version only and its CUDA dependencies are left unchecked.
set -uo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-trtllm}"
PYTHONS="${PYTHONS:-3.10 3.12}"
PLATFORM="${PLATFORM:-x86_64-manylinux_2_28}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}"
# wheel-stub packages whose sdists declare no dependencies (resolved as leaves, see above)
STUBS="${STUBS:-tensorrt-cu13-libs tensorrt-cu13-bindings tensorrt-cu12-libs tensorrt-cu12-bindings}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export UV_CACHE_DIR="${UV_CACHE_DIR:-$TMP/cache}" UV_PYTHON_DOWNLOADS=never UV_NO_CONFIG=1

UV="${UV:-$(command -v uv || true)}"
if [ -z "$UV" ]; then  # a throwaway copy of uv, outside any project environment
  python3 -m venv "$TMP/uv" && "$TMP/uv/bin/pip" install -q uv >/dev/null 2>&1 && UV="$TMP/uv/bin/uv"
  [ -x "$UV" ] || { echo "check_extras: needs uv (pip install uv) and the network" >&2; exit 2; }
fi

{
  for pkg in $STUBS; do printf '[[dependency-metadata]]\nname = "%s"\nrequires-dist = []\n\n' "$pkg"; done
} >"$TMP/uv.toml"
index_args=()
if curl -fsI --max-time 10 "$TORCH_INDEX/torch/" >/dev/null 2>&1; then
  index_args=(--extra-index-url "$TORCH_INDEX" --index-strategy unsafe-best-match)
  echo "check_extras: torch from $TORCH_INDEX"
else
  printf '[[dependency-metadata]]\nname = "torch"\nrequires-dist = []\n\n' >>"$TMP/uv.toml"
  echo "check_extras: $TORCH_INDEX unreachable: torch resolved by version only (its CUDA dependencies unchecked)"
fi

status=0
for extra in $EXTRAS; do
  for py in $PYTHONS; do
    out="$TMP/$extra-$py.txt"
    if "$UV" pip compile pyproject.toml --extra "$extra" --config-file "$TMP/uv.toml" "${index_args[@]}" \
        --python-version "$py" --python-platform "$PLATFORM" --no-header --no-annotate -q \
        -o "$out" 2>"$TMP/err"; then
      picked=$(grep -E '^(tensorrt-llm|torch|transformers|xgrammar|nvidia-modelopt|tensorrt)==' "$out" | tr '\n' ' ')
      echo "OK    [$extra] python $py: $picked"
    else
      status=1
      echo "FAIL  [$extra] python $py:"
      grep -v -e '^warning' -e '^  cause' "$TMP/err" | sed 's/^/      /' | head -40
    fi
  done
done
exit $status
