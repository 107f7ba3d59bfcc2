"""Speculative decoding on the demo pair: updraft with no speculation, the demo draft
model, n-gram prompt lookup and the demo's EAGLE head, against transformers' assisted
generation on the same models and prompts (transformers has no EAGLE).

Prompts are code: windows of about 150 tokens from the Python standard library files the
demo models were not trained on (the held-out split of ``scripts/train_demo.py``), each
ending at a line break; every request generates 128 greedy tokens (EOS ignored).
Batch 1 runs the first 4 prompts one after another; batch 16 runs 16 at once (updraft
only: transformers' assisted generation takes one sequence at a time). updraft replays
captured verify and draft steps. Each rate is the best of 3 runs, interleaved across
setups so that the machine's drift hits them alike. Beside each proposer: its time per
proposal at batch 1 (for a model, the steps that write its cache and draft k tokens).

    .venv/bin/python -m benchmarks.bench_speculative [--quick]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from benchmarks.common import markdown_table
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 128
DRAFT_K = 3  # drafts per step for the draft model
NGRAM_K = 8  # and for prompt lookup
EAGLE_KS = (3, 4, 5)  # and for the EAGLE head


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


def updraft_run(llm: LLM, prompts: list[list[int]], batch: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if batch == 1:
        for prompt in prompts:
            llm.generate([prompt], params)
    else:
        llm.generate(prompts, params)


def transformers_run(model, prompts: list[list[int]], **assist) -> None:
    for prompt in prompts:
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **assist,
        )


def proposal_clock(llm: LLM) -> tuple[float, int]:
    """(seconds spent proposing, steps) of the engine so far: each step proposes once."""
    stats = llm.engine.stats()
    return stats.phase_seconds.get("propose", 0.0), stats.num_steps


def best_rates(runs: dict[str, Callable[[], None]], tokens: int, rounds: int) -> dict[str, float]:
    """Tokens/s of each run, the best of ``rounds``, the runs interleaved so that the
    machine's drift hits them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():  # warm-up
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: tokens / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    args = parser.parse_args()
    base = LLM(enforce_eager=False)
    prompts = code_prompts(base.tokenizer, 16)
    single = prompts[:2] if args.quick else prompts[:4]
    batched = prompts[:4] if args.quick else prompts
    rounds = 1 if args.quick else 3

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
        **{
            f"EAGLE head, k={k}": (
                {"speculative_method": "eagle", "num_speculative_tokens": k},
                None,
            )
            for k in EAGLE_KS
        },
    }
    engines = {
        name: LLM(enforce_eager=False, **engine_args) if engine_args else base
        for name, (engine_args, _) in setups.items()
    }
    drafting = {name: llm for name, llm in engines.items() if llm is not base}
    with torch.inference_mode():
        hf_rates = best_rates(
            {
                name: functools.partial(transformers_run, hf, single, **assist)
                for name, (_, assist) in setups.items()
                if assist is not None
            },
            NEW_TOKENS * len(single),
            rounds,
        )
        rates = {}
        per_proposal_ms = {}
        for batch, batch_prompts in ((1, single), (16, batched)):
            clocks = {name: proposal_clock(llm) for name, llm in drafting.items()}
            rates[batch] = best_rates(
                {
                    name: functools.partial(updraft_run, llm, batch_prompts, batch)
                    for name, llm in engines.items()
                },
                NEW_TOKENS * len(batch_prompts),
                rounds,
            )
            if batch == 1:
                per_proposal_ms = {}
                for name, llm in drafting.items():
                    seconds, steps = proposal_clock(llm)
                    before_seconds, before_steps = clocks[name]
                    per_proposal_ms[name] = (
                        1e3 * (seconds - before_seconds) / (steps - before_steps)
                    )
    rows = []
    for name in setups:
        metrics = engines[name].engine.stats().speculative
        for batch in (1, 16):
            rate = rates[batch][name]
            peer = hf_rates.get(name) if batch == 1 else None
            rows.append(
                [
                    name,
                    str(batch),
                    f"{rate:.1f}",
                    f"{rate / rates[batch]['no speculation']:.2f}x",
                    f"{metrics.mean_accepted_length:.2f}" if metrics else "-",
                    f"{metrics.acceptance_rate:.2f}" if metrics else "-",
                    "/".join(f"{a:.2f}" for a in metrics.acceptance_per_position())
                    if metrics
                    else "-",
                    f"{per_proposal_ms[name]:.2f}" if name in per_proposal_ms else "-",
                    f"{peer:.1f}" if peer else "-",
                    f"{peer / hf_rates['no speculation']:.2f}x" if peer else "-",
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
                "accepted length",
                "acceptance",
                "acceptance per position",
                "ms per proposal (batch 1, mean)",
                f"transformers {transformers.__version__} tok/s",
                "transformers speedup",
            ],
            rows,
        )
    )
    print(
        "\naccepted length: tokens per verify step that carried drafts (over both batch "
        "sizes); acceptance: accepted drafts over proposed ones."
    )


if __name__ == "__main__":
    main()
