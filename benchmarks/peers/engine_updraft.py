"""Peer-benchmark worker: updraft, offline ``LLM.generate`` (see workload.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import workload

from updraft import LLM, SamplingParams


def main() -> None:
    args = workload.parse_args(__doc__)
    start = time.perf_counter()
    settings = {
        "dtype": "float32",
        "kv_cache_memory_gib": workload.KV_CACHE_GIB,
        "max_num_seqs": workload.MAX_NUM_SEQS,
        "max_num_batched_tokens": workload.MAX_NUM_BATCHED_TOKENS,
    }
    llm = LLM(args.model, **(settings | workload.options(args)))
    load_seconds = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]

    workload.run_workload(args, "updraft", generate, load_seconds)


if __name__ == "__main__":
    main()
