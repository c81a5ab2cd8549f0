#!/usr/bin/env bash
# GPU check of the Triton kernels, the backends' faithfulness, FP8 GEMMs and (where TensorRT-LLM
# is installed) the trtllm backend on a CUDA machine with PyTorch, Triton and transformers
# preinstalled (no network). Under 8 minutes; prints a table and writes OUT_DIR/gpu_check.json.
#
#   bash benchmarks/gpu_check.sh OUT_DIR            # on the CUDA machine
#   bash benchmarks/gpu_check.sh OUT_DIR --dry-run  # the same code on CPU with the torch reference
set -euo pipefail
OUT="${1:?usage: benchmarks/gpu_check.sh OUT_DIR [--dry-run] [more gpu_check.py flags]}"
shift
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

# fastjudge must be importable for the faithfulness tests. Build it in place when it is not
# installed and the build tools are there (no network: no build isolation, no dependencies);
# otherwise the kernel checks still run from python/fastjudge/kernels/ and the test step reports the failure.
if ! "$PY" -c "import fastjudge._engine, fastjudge.kernels" 2>/dev/null; then
  echo "gpu_check: fastjudge not installed; trying an offline build" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index . >"$OUT/pip_install.log" 2>&1 \
    || echo "gpu_check: offline build failed (see $OUT/pip_install.log)" >&2
fi

# The trtllm backend's checks run only where TensorRT-LLM is installed (the trtllm extra:
# 1.3.0rc22 to below 1.5, both judges on the LLM API's PyTorch backend; docs/gpu.md, "Version
# matrix"). Say up front whether this environment runs them and, if not, why.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorrt_llm') is None)" 2>/dev/null; then
  "$PY" - >&2 <<'EOF' || true
from importlib import metadata
from fastjudge.backends.trtllm import trtllm_mismatch
print(f"gpu_check: TensorRT-LLM {metadata.version('tensorrt_llm')} found")
for kind, model_type in (("flan-t5", "t5"), ("qwen3.5", "qwen3_5")):
    why = trtllm_mismatch(kind, model_type)
    print(f"gpu_check:   {kind}: " + ("its trtllm checks will run" if why is None else f"skipped: {why}"))
EOF
else
  echo "gpu_check: TensorRT-LLM not installed: the trtllm backend's checks are skipped" >&2
fi

# ---- begin: fastjudge verify on the tiny checkpoints (float32 and bfloat16) ----------------
# benchmarks/verify_tiny.py runs `fastjudge verify` for every judge and mode against its
# reference path; reports in OUT_DIR/verify_tiny.txt, the table in OUT_DIR/verify/verify_tiny.json.
# At most 150 s; its result is printed and does not stop the checks after it.
VERIFY_ARGS=(--device cuda --sample 8)
prev=""
for a in "$@"; do
  [ "$a" = "--dry-run" ] && VERIFY_ARGS[1]=cpu && VERIFY_ARGS+=(--quick)
  [ "$prev" = "--lave-repo" ] && VERIFY_ARGS+=(--lave-repo "$a")
  prev="$a"
done
if timeout 150 "$PY" benchmarks/verify_tiny.py "$OUT/verify" "${VERIFY_ARGS[@]}" >"$OUT/verify_tiny.txt" 2>"$OUT/verify_tiny.err"; then
  echo "gpu_check: fastjudge verify on the tiny checkpoints: PASS ($OUT/verify_tiny.txt)" >&2
else
  echo "gpu_check: fastjudge verify on the tiny checkpoints: FAIL (status $?; $OUT/verify_tiny.txt)" >&2
fi
# ---- end: fastjudge verify ----------------------------------------------------------------
# ---- peers: fastjudge vs CTranslate2 (benchmarks/peers), only where ctranslate2 imports ------
# Flan-T5 small (tiny with --dry-run), LAVE score-only and rationale, float32 and int8_float16
# (int8 on the CPU), on this interpreter;
# at most 90 s, its table in OUT_DIR/peers_ctranslate2.log. It adds to the check's time.
if "$PY" -c "import ctranslate2" 2>/dev/null; then
  peers_device=cuda peers_types="float32 int8_float16" peers_shape=small
  case " $* " in *" --dry-run "*) peers_device=cpu peers_types="float32 int8" peers_shape=tiny ;; esac
  # shellcheck disable=SC2086
  timeout 90 "$PY" benchmarks/peers/bench_peers.py --peers ctranslate2 --ctranslate2-python "$PY" \
      --device "$peers_device" --ct2-compute-types $peers_types --t5-shape "$peers_shape" \
      --items 32 --gen-items 8 --repeats 2 \
      >"$OUT/peers_ctranslate2.log" 2>&1 \
    && sed -n '/^fastjudge vs peers/,$p' "$OUT/peers_ctranslate2.log" >&2 \
    || echo "gpu_check: CTranslate2 comparison failed or timed out (see $OUT/peers_ctranslate2.log)" >&2
else
  echo "gpu_check: ctranslate2 not installed: the CTranslate2 comparison is skipped" >&2
fi
# ---- end of peers block ---------------------------------------------------------------------

unset TRITON_INTERPRET
exec timeout 470 "$PY" benchmarks/gpu_check.py "$OUT" "$@"
