"""How a hybrid model's decode step grows with the context: through its full-attention
layers alone.

Two random models of one shape (``make_random_qwen35``: hidden 768, 12 layers, about
116M parameters) that differ only in their layer kinds:

* **hybrid**: Gated DeltaNet in 9 layers, gated full attention in 3 (layers 3, 7, 11),
  as Qwen3.5 interleaves them;
* **full**: gated full attention in all 12.

A Gated DeltaNet layer keeps a fixed-size state per request (a conv window and a
heads x key x value matrix), so its cost per token does not depend on the context; a
full-attention layer reads the context's whole KV. Their attention layers are alike,
so if nothing else grows, the hybrid's growth from the shortest context is 3/12 of the
full model's: ``t_hybrid(C) - t_hybrid(C0) = 0.25 (t_full(C) - t_full(C0))``. The table
prints each model's batch-1 decode time per token at each context, the growth of each,
the measured ratio of the two growths against that 0.25, and the two growths split
into a part per attention layer and a part outside the attention layers (the same in
both models: the step's host work, the cache): ``growth = layers x per_layer +
outside``, solved from the two models. The claim holds when ``outside`` is about 0.

Each measurement is a fresh random prompt of C tokens (no prefix to reuse) and
``--new-tokens`` greedy tokens streamed from ``LLM.generate_stream``; the time per
token is the median gap between consecutive tokens after the first (prefill excluded).
Rounds alternate the models; the table shows the best round and the range.

    .venv/bin/python -m benchmarks.bench_hybrid_context [--contexts 128,512,2048,8192] \\
        [--rounds 3] [--new-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import make_random_qwen35, markdown_table
from updraft import LLM, SamplingParams

# The models compared: (label, every how many layers one is full attention).
MODELS = (("hybrid (3 of 12 full)", 4), ("full (12 of 12)", 1))
FULL_LAYERS = {4: 3, 1: 12}


def decode_seconds_per_token(llm: LLM, context: int, new_tokens: int, seed: int) -> float:
    """Median gap between streamed tokens after the first, for one request whose
    prompt is ``context`` fresh random tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(32000) for _ in range(context)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    stamps = []
    for output in llm.generate_stream([prompt], params):
        stamps.extend([time.perf_counter()] * len(output.outputs[0].delta_token_ids))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps)


Times = dict[tuple[str, int], list[float]]


def measure(engines: dict[str, LLM], contexts: list[int], rounds: int, new_tokens: int) -> Times:
    """Seconds per decoded token of each (model, context), one value a round; rounds
    alternate the models' order."""
    times: Times = {}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for label in order:
            for context in contexts:
                seconds = decode_seconds_per_token(
                    engines[label], context, new_tokens, seed=round_index * 100_000 + context
                )
                times.setdefault((label, context), []).append(seconds)
                print(
                    f"round {round_index + 1} {label:24s} context {context:6d} "
                    f"{seconds * 1e3:7.2f} ms/token",
                    flush=True,
                )
    return times


def table(times: Times, contexts: list[int], rounds: int) -> str:
    """Best times, the growths from the shortest context, their ratio, and the growths
    split into a part per attention layer and a part outside the attention layers."""

    def best(label: str, context: int) -> float:
        return min(times[(label, context)]) * 1e3

    def cell(label: str, context: int) -> str:
        values = [t * 1e3 for t in times[(label, context)]]
        spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
        return f"**{min(values):.2f}**{spread}"

    hybrid, full = (label for label, _ in MODELS)
    hybrid_layers, full_layers = FULL_LAYERS[4], FULL_LAYERS[1]
    rows = []
    for context in contexts:
        grow_hybrid = best(hybrid, context) - best(hybrid, contexts[0])
        grow_full = best(full, context) - best(full, contexts[0])
        # growth = layers x growth per attention layer + growth outside them, the same
        # for both models: solved from the two
        per_layer = (grow_full - grow_hybrid) / (full_layers - hybrid_layers)
        outside = grow_hybrid - hybrid_layers * per_layer
        ratio = f"{grow_hybrid / grow_full:.2f}" if grow_full > 0 else "-"
        rows.append(
            [
                f"{context}",
                cell(hybrid, context),
                cell(full, context),
                f"{grow_hybrid:+.2f}",
                f"{grow_full:+.2f}",
                ratio,
                f"{per_layer:+.2f}",
                f"{outside:+.2f}",
            ]
        )
    header = [
        "context",
        f"{hybrid}, ms/token",
        f"{full}, ms/token",
        f"hybrid growth from {contexts[0]}",
        "full growth",
        f"hybrid / full growth (expected {hybrid_layers / full_layers:.2f})",
        "growth per attention layer",
        "growth outside the attention layers",
    ]
    title = f"batch-1 decode per token against the context, best of {rounds}"
    return markdown_table(title, header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="128,512,2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="128,512,2048; 1 round; 16 tokens")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "hybrid-context"
    )
    args = parser.parse_args()
    contexts = [int(c) for c in ("128,512,2048" if args.quick else args.contexts).split(",")]
    rounds = 1 if args.quick else args.rounds
    new_tokens = 16 if args.quick else args.new_tokens
    longest = max(contexts) + new_tokens

    engines = {}
    for label, every in MODELS:
        model = make_random_qwen35(
            args.work_dir / f"qwen3.5-100m-full-every-{every}",
            full_attention_every=every,
            max_positions=max(16384, longest),
        )
        engines[label] = LLM(model, dtype="float32", kv_cache_memory_gib=1, max_model_len=longest)
        # warm up: captured decode steps and the prefill path, before any timing
        decode_seconds_per_token(engines[label], contexts[0], 8, seed=-1)

    times = measure(engines, contexts, rounds, new_tokens)
    for label, llm in engines.items():  # how the steps ran: decodes should all replay
        print(f"{label}: steps {llm.engine.stats().steps}")
    print()
    print(table(times, contexts, rounds))
    for llm in engines.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
