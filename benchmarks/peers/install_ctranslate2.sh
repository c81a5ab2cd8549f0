#!/usr/bin/env bash
# Build CTranslate2's own virtual environment for the peer benchmarks (never the project's .venv).
#
#   bash benchmarks/peers/install_ctranslate2.sh [ENV_DIR]
#
# CTranslate2 itself needs no torch; its transformers converter loads the checkpoint with
# transformers, which does, so torch comes first at the project's pinned CPU build
# (override TORCH as for `make install`) and nothing later may replace it.
# (transformers 5 and CTranslate2 4.8.5's T5 converter disagree on the output rescaling;
# run_ctranslate2.py corrects the converter, see t5_loader_for_transformers_5 there.)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_dir="${1:-$here/.envs/ctranslate2}"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
CTRANSLATE2="${CTRANSLATE2:-ctranslate2==4.8.5}"
TRANSFORMERS="${TRANSFORMERS:-transformers==5.19.0}"

if [ ! -x "$env_dir/bin/python" ]; then
  "$PYTHON" -m venv "$env_dir"
  "$env_dir/bin/pip" install -q --upgrade pip
fi
pip="$env_dir/bin/pip"
"$pip" install -q "$TORCH"
torch_version="$("$env_dir/bin/python" -c 'import torch; print(torch.__version__)')"
# Pin the torch just installed, so the resolver keeps it.
"$pip" install -q "$CTRANSLATE2" "$TRANSFORMERS" sentencepiece safetensors "torch==$torch_version"
"$env_dir/bin/python" -c 'import ctranslate2, torch, transformers; print("ctranslate2", ctranslate2.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
touch "$env_dir/.installed"
