"""updraft vs transformers' ``generate`` on the same random ~100M Qwen3-style model.

1. Decode tokens/s at batch 1: (N - 1) new tokens over t(N) - t(1), so prefill is
   excluded on both sides.
2. Throughput for 32 requests of mixed prompt and output lengths: updraft serves them
   with continuous batching; transformers gets them as one left-padded batch running to
   the longest output (its best static-batch setting), and, as a second peer, one
   request at a time. Only the requested output tokens count.

    .venv/bin/python benchmarks/bench_generate.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
import transformers

from benchmarks.common import make_random_qwen3, markdown_table
from benchmarks.peers.workload import best_time
from updraft import LLM, SamplingParams


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generate wants
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved model")
    args = parser.parse_args()
    new_tokens = 16 if args.quick else 128
    num_requests = 8 if args.quick else 32
    model_dir = args.model_dir or Path(tempfile.mkdtemp()) / "qwen3-100m"
    make_random_qwen3(model_dir)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048)
    parameters = sum(p.numel() for p in hf.parameters()) / 1e6
    rng = random.Random(0)
    prompt = [rng.randrange(32000) for _ in range(32)]

    def updraft_run(n: int) -> None:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    hf_decode = (new_tokens - 1) / (
        best_time(lambda: hf_generate(hf, [prompt], new_tokens))
        - best_time(lambda: hf_generate(hf, [prompt], 1))
    )
    ours_decode = (new_tokens - 1) / (
        best_time(lambda: updraft_run(new_tokens)) - best_time(lambda: updraft_run(1))
    )

    prompts = [
        [rng.randrange(32000) for _ in range(rng.randint(16, 256))] for _ in range(num_requests)
    ]
    outputs = [rng.randint(16, new_tokens) for _ in range(num_requests)]
    useful = sum(outputs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    ours_batch = best_time(lambda: llm.generate(prompts, params))
    hf_batch = best_time(lambda: hf_generate(hf, prompts, max(outputs)))
    hf_serial = best_time(
        lambda: [hf_generate(hf, [p], n) for p, n in zip(prompts, outputs, strict=True)], 1
    )

    rows = [
        [
            "decode tokens/s, batch 1",
            f"{hf_decode:.1f}",
            f"{ours_decode:.1f}",
            f"{ours_decode / hf_decode:.2f}x",
        ],
        [
            f"{num_requests} mixed requests, output tokens/s (vs one padded batch)",
            f"{useful / hf_batch:.1f}",
            f"{useful / ours_batch:.1f}",
            f"{hf_batch / ours_batch:.2f}x",
        ],
        [
            f"{num_requests} mixed requests, output tokens/s (vs one at a time)",
            f"{useful / hf_serial:.1f}",
            f"{useful / ours_batch:.1f}",
            f"{hf_serial / ours_batch:.2f}x",
        ],
    ]
    print(
        markdown_table(
            f"updraft vs transformers {transformers.__version__} generate, random Qwen3 "
            f"{parameters:.0f}M, float32",
            ["measure", "transformers", "updraft", "speedup"],
            rows,
        )
    )
    print(
        f"\nbatch 1: 32-token prompt, {new_tokens} new tokens. Mixed: prompts 16-256 tokens, "
        f"outputs 16-{new_tokens} tokens ({useful} in all), greedy, seeded."
    )


if __name__ == "__main__":
    main()
