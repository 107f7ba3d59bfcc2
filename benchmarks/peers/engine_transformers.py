"""Peer-benchmark worker: transformers' ``generate``, one request at a time (see
workload.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import workload


def main() -> None:
    args = workload.parse_args(__doc__.split("\n")[0])
    import torch
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    load_seconds = time.perf_counter() - start

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        outputs = []
        for prompt, length in zip(prompts, lengths, strict=True):
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=length,
                    min_new_tokens=length,
                    do_sample=False,
                    pad_token_id=0,
                )
            outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    workload.run_workload(args, "transformers", generate, load_seconds)


if __name__ == "__main__":
    main()
