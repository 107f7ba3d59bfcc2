"""Peer-benchmark worker: ik_llama.cpp through its own ``llama-bench`` (see workload.py).

ik_llama.cpp has no Python binding, so its benchmark program is timed: ``tg`` (batch-1
generation from an empty context, the batch-1 workload's new tokens) and ``pp`` (one
256-token prompt processed whole, fresh KV every repetition: the cold prefill of
256-token prompts). ``--option rtr=1`` repacks the quantized rows at load into ik's
row-interleaved layouts (``-rtr 1``); its default is 0. Other workloads are not run:
the program takes no token ids and returns no tokens, so nothing is compared.

Standard library only; run by any Python. The program is built by
setup_ik_llamacpp.sh into benchmarks/peers/ik_llama.cpp-build.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import workload

LLAMA_BENCH = Path(__file__).parent / "ik_llama.cpp-build" / "bin" / "llama-bench"


def bench_arguments(args, rtr: int) -> list[str]:
    """llama-bench's command line for the workload: generation only or prompt only."""
    if args.workload == "batch1":
        sizes = ["-p", "0", "-n", str(16 if args.quick else workload.BATCH1_NEW_TOKENS)]
    elif args.workload == "prefill256":
        sizes = ["-p", str(workload.PREFILL_PROMPT_TOKENS), "-n", "0"]
    else:
        raise SystemExit(
            f"ik_llama.cpp's llama-bench runs batch1 and prefill256, not {args.workload}"
        )
    program = [str(LLAMA_BENCH), "-m", args.model, "-t", str(os.cpu_count())]
    return [*program, *sizes, "-r", str(max(1, args.repeats)), "-rtr", str(rtr), "-o", "json"]


def main() -> None:
    args = workload.parse_args(__doc__.split("\n")[0])
    rtr = int(workload.options(args).get("rtr", 0))
    start = time.perf_counter()
    done = subprocess.run(bench_arguments(args, rtr), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (test,) = json.loads(done.stdout)  # one model, one size: one test
    report = {
        "engine": "ik_llama.cpp",
        "load_seconds": seconds,  # the whole program: load, warm-up and repetitions
        # best repetition, as the other workers report their best time
        "tokens_per_second": max(test["samples_ts"]),
        "tokens": [],
        "build": f"{test.get('build_commit', '?')} ({test.get('build_number', '?')})",
        # the program's peak, as this small process's only child (kilobytes on Linux)
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    if args.workload == "prefill256":
        report["prompt_tokens"] = test["n_prompt"]
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
