"""Peer-benchmark worker: llama.cpp through llama-cpp-python (see workload.py).

Runs in benchmarks/peers/.venv-llamacpp (setup_llamacpp.sh) on a GGUF file written by
make_gguf.py. The binding runs one sequence at a time, so it is a batch-1 peer.
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
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(
        model_path=args.model,
        n_ctx=2048,
        n_batch=512,
        n_threads=os.cpu_count(),
        n_threads_batch=os.cpu_count(),
        seed=0,
        verbose=False,
        **workload.options(args),
    )
    load_seconds = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        outputs = []
        for prompt, length in zip(prompts, lengths, strict=True):
            llm.reset()  # no reuse of the previous run's KV
            tokens: list[int] = []
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
                tokens.append(token)
                if len(tokens) == length:
                    break
            outputs.append(tokens)
        return outputs

    workload.run_workload(args, "llama.cpp", generate, load_seconds)


if __name__ == "__main__":
    main()
