"""Weight-only int8 against float32: speed in updraft, and what it costs in quality.

Quality: the demo model's held-out cross-entropy (the same held-out windows of the
Python standard library that scripts/train_demo.py reports), in transformers, with
float32 weights and with every linear weight (the LM head included, the embedding not)
replaced by its int8 per-channel dequantization, which is exactly what updraft's int8
layers multiply by. Speed: batch-1 decode and 32 mixed requests (the peer workload),
float32 and int8 alternating in one run, best of the rounds.

    .venv/bin/python -m benchmarks.bench_int8 [--rounds 3] [--model demo|100m|both]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from benchmarks.bench_peers import prepare_model
from benchmarks.common import markdown_table
from benchmarks.peers import workload
from benchmarks.peers.workload import best_time
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.models.int8_linear import quantize_weight

TRAIN_DEMO = Path(__file__).parents[1] / "scripts" / "train_demo.py"


def train_demo_module():
    spec = importlib.util.spec_from_file_location("train_demo", TRAIN_DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def heldout_losses(windows: int, seq_len: int) -> tuple[float, float]:
    """(float32, int8) held-out cross-entropy of the demo model, nats per token."""
    demo = train_demo_module()
    corpus = demo.load_corpus(demo.stdlib_dir())
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    data = demo.encode_files(tokenizer, [text for _, text in corpus.heldout])
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    full = demo.heldout_loss(model, data, windows, seq_len, seed=1)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # untie
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            q, scale = quantize_weight(module.weight)
            module.weight.copy_(q.float() * scale[:, None])
    return full, demo.heldout_loss(model, data, windows, seq_len, seed=1)


def speeds(model: Path, vocab: int, quantization: str | None) -> tuple[float, float]:
    """(batch-1 decode tokens/s, 32 mixed requests output tokens/s)."""
    llm = LLM(
        model,
        dtype="float32",
        quantization=quantization,
        kv_cache_memory_gib=workload.KV_CACHE_GIB,
        max_num_seqs=workload.MAX_NUM_SEQS,
        max_num_batched_tokens=workload.MAX_NUM_BATCHED_TOKENS,
    )
    prompt = workload.batch1_prompt(vocab)

    def run(prompts, lengths) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        return best_time(lambda: llm.generate(prompts, params))

    new = workload.BATCH1_NEW_TOKENS
    decode = (new - 1) / (run([prompt], [new]) - run([prompt], [1]))
    mixed = workload.mixed_requests(vocab)
    seconds = run([p for p, _ in mixed], [n for _, n in mixed])
    return decode, sum(n for _, n in mixed) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["demo", "100m", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=256, help="held-out windows")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    names = ["demo", "100m"] if args.model == "both" else [args.model]
    rows = []
    for name in names:
        model, vocab = prepare_model(name, args.work_dir)
        results: dict[str | None, list[tuple[float, float]]] = {None: [], "int8": []}
        for round_index in range(args.rounds):
            order = [None, "int8"] if round_index % 2 == 0 else ["int8", None]
            for quantization in order:
                results[quantization].append(speeds(model, vocab, quantization))
        for column, label in [(0, "decode tokens/s, batch 1"), (1, "32 mixed, output tok/s")]:
            full = [r[column] for r in results[None]]
            int8 = [r[column] for r in results["int8"]]
            rows.append(
                [
                    f"{name}: {label}",
                    f"{max(full):.1f} ({min(full):.1f}-{max(full):.1f})",
                    f"{max(int8):.1f} ({min(int8):.1f}-{max(int8):.1f})",
                    f"{max(int8) / max(full):.2f}x",
                ]
            )
    full_loss, int8_loss = heldout_losses(args.windows, 256)
    rows.append(
        [
            f"demo: held-out loss, nats/token ({args.windows} windows x 256)",
            f"{full_loss:.4f} (ppl {math.exp(full_loss):.2f})",
            f"{int8_loss:.4f} (ppl {math.exp(int8_loss):.2f})",
            f"{int8_loss - full_loss:+.4f}",
        ]
    )
    print(
        markdown_table(
            f"weight-only int8 vs float32, best of {args.rounds} alternating rounds",
            ["measure", "float32", "int8", "int8 / float32"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
