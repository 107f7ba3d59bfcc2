"""Peer-benchmark worker: vLLM's CPU backend, offline ``LLM.generate`` (see workload.py).

Runs in benchmarks/peers/.venv-vllm (setup_vllm.sh). The engine runs in this process
(no engine-core subprocess, so its memory is this process's) and without a tokenizer:
prompts are token ids.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import workload


def main() -> None:
    args = workload.parse_args(__doc__.split("\n")[0])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(workload.KV_CACHE_GIB))
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    settings = {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_num_seqs": workload.MAX_NUM_SEQS,
        "max_num_batched_tokens": workload.MAX_NUM_BATCHED_TOKENS,
        "seed": 0,
    }
    llm = LLM(model=args.model, **(settings | workload.options(args)))
    load_seconds = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in lengths
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    workload.run_workload(args, "vllm", generate, load_seconds)


if __name__ == "__main__":
    main()
