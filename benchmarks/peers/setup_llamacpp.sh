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
# Native CPU flags: the peer is measured at its best on this machine, but for AMX:
# llama.cpp 0.3.36's AMX path segfaults in its first decode on a quantized file (Q4_0,
# Q8_0) on a Xeon with AMX, so the AMX instructions are left out (the AVX-512
# repacked kernels serve those types instead; the flags do nothing on other CPUs).
no_amx="-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" \
    "$venv/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36
"$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
