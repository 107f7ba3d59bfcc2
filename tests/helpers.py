"""What many tests build their runs from: greedy sampling, prompts of token ids, the
tokens of outputs."""

from __future__ import annotations

import random
from typing import Any

from updraft import RequestOutput, SamplingParams


def greedy(max_tokens: int = 16, **params: Any) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored, unless told)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **{"ignore_eos": True, **params})


def token_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 3 to 40 random token ids below 256 (the tiny models' vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def generate_logits(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], Any]:
    """transformers' greedy ``generate`` with its cache: the prompt in one forward, then
    a token at a time (so LongRoPE switches as the sequence grows, as it does there), its
    ``new_tokens`` tokens and the logits of each."""
    import torch

    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)
