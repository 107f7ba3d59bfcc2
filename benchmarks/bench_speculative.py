"""Speculative decoding on the demo pair: updraft with no speculation, the demo draft
model and n-gram prompt lookup, against transformers' assisted generation on the same
models and prompts.

Prompts are code: windows of about 150 tokens from the Python standard library files the
demo models were not trained on (the held-out split of ``scripts/train_demo.py``), each
ending at a line break; every request generates 128 greedy tokens (EOS ignored).
Batch 1 runs the first 4 prompts one after another; batch 16 runs 16 at once (updraft
only: transformers' assisted generation takes one sequence at a time). updraft replays
captured verify and draft steps.

    .venv/bin/python -m benchmarks.bench_speculative [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import transformers

from benchmarks.common import markdown_table
from updraft import LLM, SamplingParams
from updraft.engine.llm import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 128
DRAFT_K = 3  # drafts per step for the draft model
NGRAM_K = 5  # and for prompt lookup


def code_prompts(tokenizer, count: int, prompt_tokens: int = 150) -> list[list[int]]:
    """Windows of held-out standard library code, one per file, ending at a newline."""
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts/train_demo.py")
    train_demo = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = train_demo  # its dataclasses look their module up
    spec.loader.exec_module(train_demo)
    corpus = train_demo.load_corpus(train_demo.stdlib_dir())
    prompts = []
    for _, text in corpus.heldout:
        lines = text.splitlines(keepends=True)
        window = "".join(lines[len(lines) // 3 :])  # past the imports and docstring
        ids = tokenizer.encode(window)
        if len(ids) < prompt_tokens + NEW_TOKENS:
            continue
        ids = ids[:prompt_tokens]
        newline = max(i for i, t in enumerate(ids) if "\n" in tokenizer.decode([t]))
        prompts.append(ids[: newline + 1])
        if len(prompts) == count:
            break
    return prompts


def updraft_rate(llm: LLM, prompts: list[list[int]], batch: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    if batch == 1:
        for prompt in prompts:
            llm.generate([prompt], params)
    else:
        llm.generate(prompts, params)
    return NEW_TOKENS * len(prompts) / (time.perf_counter() - start)


def transformers_rate(model, prompts: list[list[int]], **assist) -> float:
    def run(prompt: list[int]) -> None:
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **assist,
        )

    run(prompts[0][:16])  # warm-up
    start = time.perf_counter()
    for prompt in prompts:
        run(prompt)
    return NEW_TOKENS * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    args = parser.parse_args()
    base = LLM(enforce_eager=False)
    prompts = code_prompts(base.tokenizer, 16)
    single = prompts[:2] if args.quick else prompts[:4]
    batched = prompts[:4] if args.quick else prompts

    def load(path: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    hf, hf_draft = load(DEMO_MODEL_DIR), load(DEMO_DRAFT_DIR)
    hf_draft.generation_config.num_assistant_tokens = DRAFT_K
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    setups = {
        "no speculation": ({}, {}),
        f"draft model, k={DRAFT_K}": (
            {"speculative_model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": DRAFT_K},
            {"assistant_model": hf_draft},
        ),
        f"n-gram, k={NGRAM_K}": (
            {"speculative_method": "ngram", "num_speculative_tokens": NGRAM_K},
            {"prompt_lookup_num_tokens": NGRAM_K},
        ),
    }
    rows = []
    baseline: dict[int, float] = {}
    hf_baseline = 0.0
    with torch.inference_mode():
        for name, (engine_args, assist) in setups.items():
            hf_rate = transformers_rate(hf, single, **assist)
            hf_baseline = hf_baseline or hf_rate
            for batch, batch_prompts in ((1, single), (16, batched)):
                llm = LLM(enforce_eager=False, **engine_args) if engine_args else base
                rate = updraft_rate(llm, batch_prompts, batch)
                baseline.setdefault(batch, rate)
                metrics = llm.engine.speculator.metrics if llm.engine.speculator else None
                rows.append(
                    [
                        name,
                        str(batch),
                        f"{rate:.1f}",
                        f"{rate / baseline[batch]:.2f}x",
                        f"{metrics.mean_accepted_length:.2f}" if metrics else "-",
                        f"{metrics.acceptance_rate:.2f}" if metrics else "-",
                        f"{hf_rate:.1f}" if batch == 1 else "-",
                        f"{hf_rate / hf_baseline:.2f}x" if batch == 1 else "-",
                    ]
                )
    print(
        markdown_table(
            f"speculative decoding on the demo pair, code prompts, greedy, {NEW_TOKENS} tokens",
            [
                "setup",
                "batch",
                "updraft tok/s",
                "speedup",
                "mean accepted length",
                "acceptance",
                f"transformers {transformers.__version__} tok/s",
                "transformers speedup",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
