#!/usr/bin/env bash
# The GPU check: one prepared command for a short GPU rental. Stages run in the order of what they
# prove, each under its own time cap (`timeout`), and OUT_DIR/gpu_check.json is rewritten after
# every stage, so a run cut short still reports what it reached:
#
#   0 setup     install the carried wheels (--wheels DIR or $FASTJUDGE_WHEELS); build fastjudge
#               in place, offline, if it is not importable
#   1 verify    `fastjudge verify` on the tiny judges on CUDA, float32 and bfloat16
#               (benchmarks/verify_tiny.py)
#   2 kernels   the Triton kernels (choice head, crop encode) against their references, and the
#               FP8 GEMM (benchmarks/gpu_check.py --only kernels)
#   3 compiled  the compiled decoding steps with CUDA graphs: outputs equal to eager, graph
#               replays per decode step, FAIL on any graph inductor skipped ("skipping
#               cudagraphs" with TORCH_LOGS=perf_hints,cudagraphs, and inductor's
#               cudagraph_skips counter) (benchmarks/bench_compiled.py --cuda-graph-report)
#   4 speed     the speed ratios (benchmarks/gpu_speed.py via gpu_check.py --only speed), then
#     roofline  benchmarks/bench_roofline.py: each stage's FLOP/s or bytes/s against the measured
#               peaks (--quick unless --full)
#     route     benchmarks/bench_prefix_route.py: the prefix route against whole prompts, to
#               measure the device's pass_tokens (backends/qwen/routing.py; an estimate on CUDA)
#   5 trtllm    the TensorRT-LLM backend against the torch backend (benchmarks/gpu_check_trtllm.py),
#               only where TensorRT-LLM is installed
#
# Without --full the caps add up to 400 s, so the whole check ends within 7 minutes on one
# H100/H200 whatever happens (the stage estimates are guesses until a GPU has run it). --full
# keeps the longer run: larger sizes, the backends' faithfulness tests on CUDA, the CTranslate2
# comparison, the TensorRT-LLM tests. --dry-run runs every stage on the CPU with the smallest
# sizes and prints each stage's time and the estimated GPU total.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [--wheels DIR] [--lave-repo DIR]   # on the CUDA machine
#   bash benchmarks/gpu_check.sh OUT_DIR --full                              # the longer run
#   bash benchmarks/gpu_check.sh OUT_DIR --dry-run                           # here, on the CPU
set -uo pipefail
USAGE="usage: benchmarks/gpu_check.sh OUT_DIR [--dry-run] [--full] [--wheels DIR] [--lave-repo DIR]"
case "${1:-}" in
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  ""|-*) echo "$USAGE" >&2; exit 2 ;;  # OUT_DIR first: never an option taken for a directory
esac
OUT="$1"
shift
DRY=0 FULL=0 LAVE_REPO="${FASTJUDGE_LAVE_REPO:-}" WHEELS="${FASTJUDGE_WHEELS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --full) FULL=1 ;;
    --lave-repo) LAVE_REPO="${2:?--lave-repo needs a directory}"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
JSON="$OUT/gpu_check.json"
rm -f "$JSON"
unset TRITON_INTERPRET
DEV=cuda MODE=quick
[ "$DRY" = 1 ] && DEV=cpu
[ "$FULL" = 1 ] && MODE=full
[ "$DRY" = 1 ] && MODE="dry-run"
T_START=$(date +%s.%N)

# "CAP EST GPU_CAP" of a stage: its cap in this mode (quick | full | dry-run), its estimated
# seconds on one H100/H200 (a guess until a GPU has run it; a dry run gives the quick run's),
# and its cap on the GPU (the quick run's for a dry run)
limits() {
  local own gpu
  own=$(caps "$MODE" "$1")
  if [ "$MODE" = dry-run ]; then gpu=$(caps quick "$1"); else gpu=$own; fi
  echo "${own% *} ${gpu#* } ${gpu% *}"
}
caps() {  # MODE NAME -> "cap est"
  local MODE="$1"
  case "$MODE:$2" in
    quick:setup) echo "45 20" ;;     full:setup) echo "180 60" ;;     dry-run:setup) echo "120 20" ;;
    quick:verify) echo "80 60" ;;    full:verify) echo "150 100" ;;   dry-run:verify) echo "240 60" ;;
    quick:kernels) echo "35 25" ;;   full:kernels) echo "120 60" ;;   dry-run:kernels) echo "120 25" ;;
    quick:compiled) echo "70 50" ;;  full:compiled) echo "240 150" ;; dry-run:compiled) echo "420 50" ;;
    quick:speed) echo "45 35" ;;     full:speed) echo "180 150" ;;    dry-run:speed) echo "300 35" ;;
    quick:roofline) echo "20 15" ;;  full:roofline) echo "90 60" ;;   dry-run:roofline) echo "120 15" ;;
    quick:route) echo "15 8" ;;      full:route) echo "60 30" ;;      dry-run:route) echo "240 8" ;;
    full:tests) echo "300 240" ;;    full:peers) echo "90 90" ;;
    quick:trtllm) echo "90 80" ;;    full:trtllm) echo "420 300" ;;   dry-run:trtllm) echo "30 80" ;;
    *) echo "0 0" ;;
  esac
}

# Merge one stage's result into gpu_check.json (written whole, then renamed: never half a file).
record() {  # NAME STATUS SECONDS CAP EST GPU_CAP LOG REASON
  "$PY" - "$JSON" "$MODE" "$@" <<'EOF'
import json, os, sys
path, mode, name, status, seconds, cap, est, gpu_cap, log, reason = sys.argv[1:11]
try:
    with open(path) as f:
        report = json.load(f)
except (OSError, ValueError):
    report = {"mode": mode, "stages": {}}
tail = ""
if log and os.path.exists(log):
    with open(log, errors="replace") as f:
        tail = f.read()[-3000:]
cap, est, gpu_cap = (int(x) for x in (cap, est, gpu_cap))
report["stages"][name] = {"status": status, "seconds": round(float(seconds), 1), "cap_s": cap,
                          "gpu_estimate_s": est, "gpu_cap_s": gpu_cap, "log": log or None,
                          "reason": reason or None, "log_tail": tail}
stages = report["stages"].values()
report["failures"] = [n for n, s in report["stages"].items() if s["status"] in ("FAIL", "TIMEOUT")]
report["seconds_total"] = round(sum(s["seconds"] for s in stages), 1)
# what a GPU run costs: the stages that ran (a dry run: every stage, its GPU estimate and cap
# being the quick run's, skipped ones included since a GPU run has them)
counted = [s for s in stages if mode == "dry-run" or s["status"] != "SKIP"]
report["gpu_estimate_total_s"] = sum(s["gpu_estimate_s"] for s in counted)
report["gpu_cap_total_s"] = sum(s["gpu_cap_s"] for s in counted)
with open(path + ".tmp", "w") as f:
    json.dump(report, f, indent=2)
os.replace(path + ".tmp", path)
EOF
}

SUMMARY=()
# stage NAME CMD...: run CMD under the stage's cap, its output to OUT/NAME.log; PASS, FAIL or
# TIMEOUT; a stage's own extra check (CHECK, a shell test on its log) can turn PASS into FAIL.
stage() {
  local name="$1"; shift
  local cap est gpu_cap log="$OUT/$name.log" t0 t1 rc status secs
  read -r cap est gpu_cap < <(limits "$name")
  echo "gpu_check: stage $name (cap ${cap} s) ..." >&2
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$cap" "$@" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}')
  case $rc in 0) status=PASS ;; 124|137) status=TIMEOUT ;; *) status=FAIL ;; esac
  if [ "$status" = PASS ] && [ -n "${CHECK:-}" ] && ! eval "$CHECK"; then status=FAIL; fi
  record "$name" "$status" "$secs" "$cap" "$est" "$gpu_cap" "$log" "${REASON:-}"
  SUMMARY+=("$(printf '%-9s %-7s %7s s  (cap %4s s, GPU estimate %4s s)' "$name" "$status" "$secs" "$cap" "$est")")
  echo "gpu_check: stage $name: $status in $secs s ($log)" >&2
}
skip() {  # NAME REASON
  local cap est gpu_cap
  read -r cap est gpu_cap < <(limits "$1")
  record "$1" SKIP 0 "$cap" "$est" "$gpu_cap" "" "$2"
  SUMMARY+=("$(printf '%-9s %-7s %7s    %s' "$1" SKIP - "$2")")
  echo "gpu_check: stage $1: skipped: $2" >&2
}

# ---- 0 setup -------------------------------------------------------------------------------
# No network there: carried wheels without dependency resolution, then fastjudge itself built
# in place if it does not import (no build isolation, no dependencies).
stage setup bash -c '
  PY="$1" WHEELS="$2"
  if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || exit 1
  fi
  if ! "$PY" -c "import fastjudge._engine, fastjudge.kernels" 2>/dev/null; then
    echo "fastjudge not installed: building it in place, offline"
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index . || exit 1
  fi
  "$PY" -c "import torch, fastjudge; print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())"
' _ "$PY" "$WHEELS"

# ---- 1 verify ------------------------------------------------------------------------------
case $MODE in
  quick) VERIFY=(--device cuda --sample 4) ;;
  full) VERIFY=(--device cuda --sample 8) ;;
  dry-run) VERIFY=(--device cpu --sample 2 --quick) ;;
esac
[ -n "$LAVE_REPO" ] && [ "$MODE" = full ] && VERIFY+=(--lave-repo "$LAVE_REPO")
stage verify "$PY" benchmarks/verify_tiny.py "$OUT/verify" "${VERIFY[@]}"

# ---- 2 kernels -----------------------------------------------------------------------------
case $MODE in
  quick) KERNELS=(--runs 10) ;; full) KERNELS=() ;; dry-run) KERNELS=(--dry-run --runs 2) ;;
esac
stage kernels "$PY" benchmarks/gpu_check.py "$OUT/kernels" --only kernels "${KERNELS[@]}"

# ---- 3 compiled steps with CUDA graphs -----------------------------------------------------
case $MODE in
  quick) COMPILED=(--shape mini --rows 1 16 --max-new-tokens 32 --repeats 2) ;;
  full) COMPILED=(--shape mini --rows 1 16 64 --repeats 3) ;;
  dry-run) COMPILED=(--shape tiny --rows 1 --max-new-tokens 4 --repeats 1) ;;
esac
CHECK="! grep -q 'skipping cudagraphs' \"\$log\"" TORCH_LOGS="${TORCH_LOGS:-perf_hints,cudagraphs}" \
  stage compiled "$PY" benchmarks/bench_compiled.py --device "$DEV" "${COMPILED[@]}" --cuda-graph-report

# ---- 4 speed ratios, roofline --------------------------------------------------------------
SPEED=(--only speed)
read -r speed_cap _ _ < <(limits speed)
SPEED+=(--budget-s "$((speed_cap - 10))" --speed-s "$((speed_cap - 10))")
[ "$MODE" != full ] && SPEED+=(--quick)
[ "$DRY" = 1 ] && SPEED+=(--dry-run)
[ -n "$LAVE_REPO" ] && SPEED+=(--lave-repo "$LAVE_REPO")
stage speed "$PY" benchmarks/gpu_check.py "$OUT/speed" "${SPEED[@]}"
ROOF=(--device "$DEV" --json "$OUT/roofline.json")
[ "$MODE" != full ] && ROOF+=(--quick)
stage roofline "$PY" benchmarks/bench_roofline.py "${ROOF[@]}"
ROUTE=(--device "$DEV" --sharing 1 2 --repeats 3)
if [ "$MODE" = full ]; then ROUTE+=(--shape mini --prefix 64 256 1024 4096); else ROUTE+=(--shape tiny --prefix 64 512 2048); fi
stage route "$PY" benchmarks/bench_prefix_route.py "${ROUTE[@]}"

# ---- full run only: faithfulness tests on CUDA, CTranslate2 ---------------------------------
if [ "$MODE" = full ]; then
  stage tests "$PY" benchmarks/gpu_check.py "$OUT/tests" --only tests
  if "$PY" -c "import ctranslate2" 2>/dev/null; then
    stage peers "$PY" benchmarks/peers/bench_peers.py --peers ctranslate2 --ctranslate2-python "$PY" \
      --device cuda --ct2-compute-types float32 int8_float16 --t5-shape small --items 32 --gen-items 8 --repeats 2
  else
    skip peers "ctranslate2 is not installed"
  fi
fi

# ---- 5 TensorRT-LLM ------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  skip trtllm "dry run (no CUDA device)"
elif ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorrt_llm') is None)" 2>/dev/null; then
  skip trtllm "TensorRT-LLM is not installed (pip install 'fastjudge[trtllm]', or its wheel in --wheels)"
elif [ "$MODE" = full ]; then
  stage trtllm "$PY" benchmarks/gpu_check_trtllm.py "$OUT/trtllm" --items 128
else
  stage trtllm "$PY" benchmarks/gpu_check_trtllm.py "$OUT/trtllm" --items 32
fi

# ---- summary -------------------------------------------------------------------------------
T_END=$(date +%s.%N)
echo
echo "gpu_check ($MODE, $DEV): stage    status    time"
printf '  %s\n' "${SUMMARY[@]}"
"$PY" - "$JSON" "$T_START" "$T_END" <<'EOF'
import json, sys
path, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with open(path) as f:
    report = json.load(f)
report["wall_s"] = round(t1 - t0, 1)
with open(path, "w") as f:
    json.dump(report, f, indent=2)
what = "every stage, quick run" if report["mode"] == "dry-run" else "the stages that ran"
print(f"wall {report['wall_s']} s here; estimated GPU total {report['gpu_estimate_total_s']} s, "
      f"caps {report['gpu_cap_total_s']} s ({what}; estimates unmeasured until a GPU run); "
      + ("FAILURES: " + ", ".join(report["failures"]) if report["failures"] else "no stage failed"))
print(f"wrote {path}")
sys.exit(1 if report["failures"] else 0)
EOF
