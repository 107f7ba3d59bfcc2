#!/usr/bin/env bash
# Builds ik_llama.cpp's llama-bench for this machine's CPU, the peer bench_peers runs
# beside llama.cpp for GGUF files (ik_llama.cpp has no Python binding, so its own
# benchmark program is measured).
#
#   bash benchmarks/peers/setup_ik_llamacpp.sh [SOURCE]
#       -> benchmarks/peers/ik_llama.cpp-build/bin/llama-bench
#
# SOURCE is an unpacked ik_llama.cpp tree, or a git directory (a bare one too) whose
# pinned commit is unpacked first; without it the pinned commit is cloned from GitHub.
# Pinned: ikawrakow/ik_llama.cpp 8337e4cd3861406fc04e0854b1409cd1b027fbc9
# (2026-08-15, "Fix Qwen35+ MTP (#2322)"). Only llama-bench is built: 40 minutes on
# two busy cores at nice 19 (2026-12-06), less on quiet ones.
set -euo pipefail
commit=8337e4cd3861406fc04e0854b1409cd1b027fbc9
here="$(cd "$(dirname "$0")" && pwd)"
build="$here/ik_llama.cpp-build"
source_arg="${1:-}"
unpacked=""  # a tree this script unpacked or cloned, removed at exit
trap '[ -z "$unpacked" ] || rm -rf "$unpacked"' EXIT

unpack_git_dir() {
    # A snapshot may lack large blobs no build needs (web UI pages, vocab files), which
    # `git archive` stops at; so the tree is written blob by blob, skipping absent ones.
    local git_dir="$1" out="$2" meta path mode type hash
    git --git-dir="$git_dir" ls-tree -r -z "$commit" |
        while IFS=$'\t' read -r -d '' meta path; do
            read -r mode type hash <<<"$meta"
            [ "$type" = blob ] || continue
            mkdir -p "$out/$(dirname "$path")"
            if ! git --git-dir="$git_dir" cat-file blob "$hash" >"$out/$path" 2>/dev/null; then
                rm -f "$out/$path"
                echo "not in the snapshot, skipped: $path" >&2
            fi
            [ "$mode" != 100755 ] || chmod +x "$out/$path"
        done
}

if [ -z "$source_arg" ]; then
    unpacked="$(mktemp -d)"
    src="$unpacked/ik_llama.cpp"
    git clone --quiet --filter=blob:none https://github.com/ikawrakow/ik_llama.cpp "$src"
    git -C "$src" checkout --quiet "$commit"
elif [ -f "$source_arg/CMakeLists.txt" ]; then
    src="$(cd "$source_arg" && pwd)"
elif git --git-dir="$source_arg" rev-parse --verify --quiet "$commit^{commit}" >/dev/null 2>&1; then
    unpacked="$(mktemp -d)"
    src="$unpacked/ik_llama.cpp"
    unpack_git_dir "$source_arg" "$src"
else
    echo "setup_ik_llamacpp.sh: $source_arg is neither an ik_llama.cpp tree (no" \
        "CMakeLists.txt) nor a git directory holding commit $commit" >&2
    exit 2
fi

# Native CPU flags, as for llama.cpp: each peer is measured at its best on this
# machine. No CUDA, no curl, static libraries so the program stands alone; the
# flash-attention kernels for quantized KV caches are left out (the benchmark's cache
# is f16), which halves the build.
rm -rf "$build"  # its cache names the tree it was configured from, which is gone
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DGGML_CCACHE=OFF -DBUILD_SHARED_LIBS=OFF \
    -DGGML_IQK_FA_ALL_QUANTS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
cmake --build "$build" --target llama-bench -j2
"$build/bin/llama-bench" --help | head -1
