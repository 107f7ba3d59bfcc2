#!/usr/bin/env bash
# Makes the virtual environment llama.cpp's Python binding runs in, outside CI.
# llama-cpp-python compiles llama.cpp from source: about 15 minutes on two cores.
#   bash benchmarks/peers/setup_llamacpp.sh   ->  benchmarks/peers/.venv-llamacpp
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-llamacpp"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# gguf writes the checkpoint llama.cpp reads; numpy and safetensors read ours.
"$venv/bin/pip" install -q numpy safetensors gguf
# Native CPU flags: the peer is measured at its best on this machine.
CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install -q llama-cpp-python==0.3.36
"$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
