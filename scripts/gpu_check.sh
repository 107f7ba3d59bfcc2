#!/usr/bin/env bash
# CUDA checks, run on a machine with a GPU from the repository root:
#   bash scripts/gpu_check.sh            # results under $OUT (default: gpu-check-out/)
# 1. the CUDA graph tests (engine on CUDA vs eager, FULL and PIECEWISE graphs, for GQA
#    and for DeepSeek's MLA and DSA; graph-vs-eager acceptance of MTP and EAGLE drafts,
#    and of a draft model under prefill context parallelism, FULL and PIECEWISE, with
#    both ranks on one GPU; MTP (MLA and DSA) and EAGLE heads on both PCP ranks of one
#    GPU, FULL and PIECEWISE; with two GPUs or more, TP=2 and PCP=2 over NCCL against one
#    process, heads split over two tensor ranks included, and with four, heads under
#    PCP=2 x TP=2 over NCCL), and the reference tests under that machine's torch build;
# 2. updraft doctor on the demo model on CUDA (replay vs eager, sanitize mode), with
#    PIECEWISE and with FULL graphs, and with the demo's EAGLE head;
# 3. the graph-vs-eager decode step benchmark on CUDA.
# It uses the python on PATH, whose torch must be a CUDA build; pytest, hypothesis and
# transformers must be importable (the dev extras), and updraft runs from this tree.
set -uo pipefail
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
status=0

run() {  # name, command...: log to $OUT/name.log, remember failures
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "   ok" | tee -a "$OUT/summary.txt"
  else
    echo "   FAILED (exit $?), see $name.log" | tee -a "$OUT/summary.txt"
    status=1
  fi
  tail -n 15 "$OUT/$name.log" >>"$OUT/summary.txt"
}

"$PYTHON" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$OUT/summary.txt"
run cuda_tests "$PYTHON" -m pytest -q -rs tests/test_cuda_graph.py
run reference_tests "$PYTHON" -m pytest -q -x tests/test_reference_models.py tests/test_graph_engine.py \
  tests/test_deepseek.py tests/test_mtp.py tests/test_eagle.py
run doctor "$PYTHON" -m updraft doctor --device cuda --dtype float32
run doctor_full "$PYTHON" -m updraft doctor --device cuda --dtype float32 --graph-mode full
run doctor_eagle "$PYTHON" -m updraft doctor --device cuda --dtype float32 --speculative-method eagle
run doctor_eagle_full "$PYTHON" -m updraft doctor --device cuda --dtype float32 \
  --speculative-method eagle --graph-mode full
run bench_graphs "$PYTHON" -m benchmarks.bench_graphs --device cuda
exit $status
