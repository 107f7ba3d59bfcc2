"""Tensor and context parallelism on this machine's cores: one process with every core
against two processes with an equal share each, on a random 100M Qwen3-style checkpoint
with 16,384 positions, in float32 with captured steps.

Setups: one process; ``tensor_parallel_size=2``; TP=2 with
``decode_context_parallel_size=2`` (each rank keeps every other position of every
context); ``prefill_context_parallel_size=2`` (each rank runs half of every long
prefill, and K/V are all-gathered per layer).

Measures, per setup: batch-1 decode tokens/s (32-token prompt, 128 new tokens, prefill
excluded), output tokens/s of the peer benchmark's 32 mixed requests, and the time to
first token of one 2,048- and one 8,192-token prompt (prefilled in chunks of 2,048).
Each setup runs in a fresh process per round (parallelism changes the process's thread
count), rounds alternate the order; the table shows the best round and the range. Every
setup's tokens are compared with the first's.

With ``--proposers``: speculation whose model runs on every rank, against the same
proposer in one process and against no speculation, under TP=2 and PCP=2: the demo
target with its trained EAGLE head (k = 3) and with its draft model split over the
tensor ranks (k = 3), and a tiny random DeepSeek-V3 with a random MTP layer (k = 2;
a random layer is rarely right, so its row shows what the head costs, not what it
gains). Per setup: batch-1 decode tokens/s over 4 held-out code prompts (128 tokens
each), tokens per verify round, and the messages rank 0 sends per step.

    .venv/bin/python -m benchmarks.bench_parallel [--rounds 2] [--proposers]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import make_random_qwen3, markdown_table
from benchmarks.peers.workload import batch1_prompt, mixed_requests

SETUPS = {
    "1 process, 2 threads": {},
    "TP=2": {"tensor_parallel_size": 2},
    "TP=2, DCP=2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "PCP=2": {"prefill_context_parallel_size": 2},
}
LONG_PROMPTS = (2048, 8192)
LAYOUTS = {
    "1 process": {},
    "TP=2": {"tensor_parallel_size": 2},
    "PCP=2": {"prefill_context_parallel_size": 2},
}
PROPOSERS = ("none", "EAGLE", "draft model", "MTP (random)")


def measure(model: Path, layout: dict) -> dict:
    from updraft import LLM, SamplingParams

    llm = LLM(
        str(model),
        kv_cache_memory_gib=1,
        max_num_batched_tokens=2048,
        max_model_len=LONG_PROMPTS[-1] + 64,
        **layout,
    )
    prompt = batch1_prompt()

    def generate(prompts, lengths):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]

    generate([prompt], [128])  # warm-up
    one, _ = generate([prompt], [1])
    full, batch1_tokens = generate([prompt], [128])
    mixed = mixed_requests()
    mixed_seconds, mixed_tokens = generate([p for p, _ in mixed], [n for _, n in mixed])
    result = {
        "batch1": 127 / (full - one),
        "mixed": sum(n for _, n in mixed) / mixed_seconds,
        "tokens": batch1_tokens + mixed_tokens,
    }
    for length in LONG_PROMPTS:
        long_prompt = [random.Random(length).randrange(32000) for _ in range(length)]
        result[f"ttft{length}"], first = generate([long_prompt], [1])
        result["tokens"] += first
    return result


def proposer_args(proposer: str, layout: dict, work_dir: Path) -> tuple[str, dict]:
    """(model, engine arguments) of ``proposer`` under ``layout``."""
    from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

    if proposer == "MTP (random)":
        from tests.checkpoints import mtp_checkpoint

        directory = work_dir / "deepseek-v3-tiny-mtp"
        if not (directory / "config.json").is_file():
            mtp_checkpoint(directory)
        return str(directory), {"speculative_method": "mtp", "num_speculative_tokens": 2}
    speculation = {
        "none": {},
        "EAGLE": {"speculative_method": "eagle", "num_speculative_tokens": 3},
        "draft model": {
            "speculative_model": str(DEMO_DRAFT_DIR),
            "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": layout.get("tensor_parallel_size", 1),
        },
    }[proposer]
    return str(DEMO_MODEL_DIR), speculation


def measure_proposer(proposer: str, layout: dict, work_dir: Path) -> dict:
    from benchmarks.bench_speculative import code_prompts
    from updraft import LLM, SamplingParams
    from updraft.tokenizer import Tokenizer

    model, speculation = proposer_args(proposer, layout, work_dir)
    llm = LLM(model, **speculation, **layout, capture_sizes=(1,))  # batch 1 only
    if proposer == "MTP (random)":  # a model without a tokenizer: token ids as prompts
        prompts = [[random.Random(i).randrange(256) for _ in range(150)] for i in range(4)]
    else:
        prompts = code_prompts(Tokenizer.from_dir(model), 4)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    before = llm.engine.stats()
    tokens, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        tokens += [o.outputs[0].token_ids for o in llm.generate([prompt], params)]
        seconds += time.perf_counter() - start
    stats = llm.engine.stats()
    spec = stats.speculative
    rounds = spec.rounds - before.speculative.rounds if spec else 0
    emitted = spec.emitted - before.speculative.emitted if spec else 0
    messages = sum((stats.rank_messages or {}).values()) - sum(
        (before.rank_messages or {}).values()
    )
    return {
        "batch1": 128 * len(prompts) / seconds,
        "per_round": emitted / rounds if rounds else 1.0,
        "messages": messages / (stats.num_steps - before.num_steps),
        "tokens": tokens,
    }


def run_worker(args: argparse.Namespace, name: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_parallel", "--worker", name]
    if args.proposers:
        command.append("--proposers")
    done = subprocess.run(
        [*command, "--work-dir", str(args.work_dir)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def proposers_main(args: argparse.Namespace) -> None:
    setups = [f"{proposer} | {layout}" for proposer in PROPOSERS for layout in LAYOUTS]
    results: dict[str, list[dict]] = {name: [] for name in setups}
    for round_ in range(args.rounds):
        for name in setups if round_ % 2 == 0 else list(reversed(setups)):
            result = run_worker(args, name)
            results[name].append(result)
            print(
                f"round {round_ + 1} {name}: batch 1 {result['batch1']:.1f} tok/s, "
                f"{result['per_round']:.2f} tokens/round, {result['messages']:.1f} messages/step",
                flush=True,
            )
    rows = []
    for proposer in PROPOSERS:
        alone = results[f"{proposer} | 1 process"]
        for layout in LAYOUTS:
            runs = results[f"{proposer} | {layout}"]
            rates = [r["batch1"] for r in runs]
            plain = max(r["batch1"] for r in results[f"none | {layout}"])
            rows.append(
                [
                    proposer,
                    layout,
                    f"**{max(rates):.1f}** ({min(rates):.1f}-{max(rates):.1f})",
                    f"{max(rates) / max(r['batch1'] for r in alone):.2f}x",
                    # MTP's model is another one than the demo target the none rows run
                    "-" if proposer.startswith("MTP") else f"{max(rates) / plain:.2f}x",
                    f"{runs[0]['per_round']:.2f}",
                    f"{runs[0]['messages']:.1f}",
                    str(all(r["tokens"] == alone[0]["tokens"] for r in runs)),
                ]
            )
    header = ["proposer", "layout", "decode tok/s, batch 1", "vs 1 process", "vs no speculation"]
    header += ["tokens per round", "messages per step", "1 process's tokens"]
    title = f"proposers on every rank, 2 cores, best of {args.rounds}"
    print(markdown_table(title, header, rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--proposers", action="store_true", help="speculation on every rank")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proposers:
        if args.worker is not None:
            proposer, layout = args.worker.split(" | ")
            print(json.dumps(measure_proposer(proposer, LAYOUTS[layout], args.work_dir)))
        else:
            proposers_main(args)
        return
    model = make_random_qwen3(args.work_dir / "qwen3-100m-16k", max_positions=16384)
    if args.worker is not None:
        print(json.dumps(measure(model, SETUPS[args.worker])))
        return
    results: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for round_ in range(args.rounds):
        order = list(SETUPS) if round_ % 2 == 0 else list(reversed(SETUPS))
        for name in order:
            result = run_worker(args, name)
            results[name].append(result)
            ttfts = ", ".join(f"TTFT {n} {result[f'ttft{n}']:.2f} s" for n in LONG_PROMPTS)
            print(
                f"round {round_ + 1} {name}: batch 1 {result['batch1']:.1f} tok/s, "
                f"mixed {result['mixed']:.1f} tok/s, {ttfts}",
                flush=True,
            )
    first = results[next(iter(SETUPS))][0]["tokens"]

    def cell(name: str, key: str, best=max, fmt="{:.1f}") -> str:
        values = [r[key] for r in results[name]]
        return (
            f"**{fmt.format(best(values))}** ({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    rows = [
        ["decode tokens/s, batch 1", *(cell(n, "batch1") for n in SETUPS)],
        ["output tokens/s, 32 mixed requests", *(cell(n, "mixed") for n in SETUPS)],
        *(
            [
                f"time to first token, {length}-token prompt, s",
                *(cell(n, f"ttft{length}", min, "{:.2f}") for n in SETUPS),
            ]
            for length in LONG_PROMPTS
        ),
        [
            "same tokens as the first setup",
            *(str(all(r["tokens"] == first for r in results[n])) for n in SETUPS),
        ],
    ]
    title = f"tensor and context parallelism on 2 cores, 100m model, best of {args.rounds}"
    print(markdown_table(title, ["measure", *SETUPS], rows))


if __name__ == "__main__":
    main()
