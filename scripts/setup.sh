#!/usr/bin/env bash
# Set up updraft in ./.venv on a fresh machine: PyTorch first (the exact build for this
# machine, so that pip never swaps in another), then updraft with its test tools.
#
#   UPDRAFT_TORCH   the torch requirement to install (default: torch==2.13.0, which is
#                   the CPU build on a CPU-only machine). On a CUDA machine, for example:
#                   UPDRAFT_TORCH="torch==2.11.0" UPDRAFT_TORCH_INDEX=https://download.pytorch.org/whl/cu130
#   UPDRAFT_TORCH_INDEX  an extra index URL for the torch wheel (optional)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=(.venv/bin/python -m pip --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    torch_requirement="${UPDRAFT_TORCH:-torch==2.13.0}"
    if [[ -n "${UPDRAFT_TORCH_INDEX:-}" ]]; then
        "${pip[@]}" install "$torch_requirement" --extra-index-url "$UPDRAFT_TORCH_INDEX"
    else
        "${pip[@]}" install "$torch_requirement"
    fi
fi
"${pip[@]}" install -e '.[dev]'
