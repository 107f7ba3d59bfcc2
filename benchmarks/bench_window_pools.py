"""KV held on a long context by a Gemma-3-shaped model, with one block pool for every
layer and with a pool per kind (``--kv-pools-per-kind``).

The model has Gemma 3's layer pattern and window: five windowed layers in six (window
1024, as Gemma 3 4B and up), the sixth full, with small widths (hidden 256, 4 query
heads, 1 KV head of 64, 12 layers) and random weights: what is measured is block
accounting, which does not depend on the widths. One request: a prompt of ``--context``
fresh random tokens, prefilled in chunks of ``--chunk``, then ``--new-tokens`` greedy
tokens. After every step the engine's stats give the blocks in use of each pool; the
table shows them at the last step (the context at its longest) and at their most over
the steps, with their bytes: each kind's blocks times what a block costs in that kind's
layers (float32). Within a step the windowed pool holds a prefill chunk's blocks too,
(window + chunk) / block_size + 2 at most, which the capacity plan reserves per running
request (``runner/cache_sizes.py``).

* **shared** (``--no-kv-pools-per-kind``, the engine before per-kind pools): one block id
  names a slot range in every layer's cache, so every layer keeps every block;
* **per kind**: the full layers keep every block of their own pool, the windowed layers
  hold only the blocks their window still reads.

The aim: the windowed layers hold no more than window / context of the shared pool's
blocks (at block granularity: a window of W positions spans W / block_size + 1 blocks
where it does not start on a block boundary). The last rows project the bytes onto
Gemma 3 4B's own shape (34 layers, 4 KV heads of 256, float32 and bfloat16) from the
same block counts.

    .venv/bin/python -m benchmarks.bench_window_pools [--context 32768] [--chunk 1024] \\
        [--block-size 16] [--new-tokens 8] [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from updraft import LLM, SamplingParams
from updraft.attention.cache_groups import bytes_per_block, cache_groups
from updraft.model_config import ModelConfig

LAYERS, PATTERN = 12, 6  # one full layer in six, as Gemma 3
GEMMA3_4B = {"layers": 34, "kv_heads": 4, "head_dim": 256}


def make_random_gemma3(directory: Path, window: int, max_positions: int) -> Path:
    import transformers

    if (directory / "config.json").is_file():
        return directory
    layer_types = [
        "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)
    ]
    config = transformers.Gemma3TextConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=window,
        layer_types=layer_types,
        max_position_embeddings=max_positions,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return directory


def held_blocks(llm: LLM, context: int, new_tokens: int) -> dict[str, tuple[int, int]]:
    """(at the last step, at the peak) blocks in use, per kind, over one request."""
    engine = llm.engine
    rng = random.Random(context)
    prompt = [rng.randrange(3, 32000) for _ in range(context)]
    engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    )
    seen: list[tuple[int, int]] = []
    while engine.has_unfinished:
        engine.step()
        stats = engine.stats()
        if engine.has_unfinished:  # a finished request's blocks are back already
            seen.append((stats.kv_blocks_used, stats.window_blocks_used))
    shared = stats.window_blocks_total == 0
    full = [f for f, _ in seen]
    windowed = [f if shared else w for f, w in seen]
    return {"full": (full[-1], max(full)), "windowed": (windowed[-1], max(windowed))}


def run(model: Path, args: argparse.Namespace, pools: bool) -> dict[str, tuple[int, int]]:
    longest = args.context + args.new_tokens
    llm = LLM(
        model,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=longest,
        num_kv_blocks=-(-longest // args.block_size) + 8,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
        enforce_eager=True,  # blocks, not speed, are measured
        kv_pools_per_kind=pools,
    )
    start = time.perf_counter()
    held = held_blocks(llm, args.context, args.new_tokens)
    print(f"{'per kind' if pools else 'shared'}: {time.perf_counter() - start:.0f} s", flush=True)
    llm.engine.close()
    return held


def kind_bytes(model: Path, block_size: int) -> dict[str, int]:
    """What one block costs in each kind's layers of ``model`` (float32)."""
    groups = cache_groups(ModelConfig.from_dir(model), torch.float32)
    return {
        "full": bytes_per_block(groups, block_size, windowed=False),
        "windowed": bytes_per_block(groups, block_size, windowed=True),
    }


def table(results: dict[str, dict], costs: dict[str, int], args: argparse.Namespace) -> str:
    mib = 2**20
    rows = []
    shared_windowed = results["shared"]["windowed"][0]
    for label, held in results.items():
        for kind in ("full", "windowed"):
            last, peak = held[kind]
            ratio = f"{last / shared_windowed:.4f}" if kind == "windowed" else "-"
            rows.append(
                [
                    label,
                    kind,
                    f"{last}",
                    f"{peak}",
                    f"{last * costs[kind] / mib:.1f}",
                    f"{peak * costs[kind] / mib:.1f}",
                    ratio,
                ]
            )
    aim = args.window / (args.context + args.new_tokens)
    header = [
        "pools",
        "layers",
        "blocks held, last step",
        "most after a step",
        "MiB, last step",
        "most MiB",
        f"windowed blocks / shared (aim <= window / context = {aim:.4f})",
    ]
    title = (
        f"KV on a {args.context}-token context: {LAYERS} layers, one full in {PATTERN}, "
        f"window {args.window}, block size {args.block_size}, prefill chunks of {args.chunk}"
    )
    return markdown_table(title, header, rows)


def projected(results: dict[str, dict], args: argparse.Namespace) -> str:
    """The same block counts in Gemma 3 4B's layers."""
    full_layers = GEMMA3_4B["layers"] // PATTERN
    layers = {"full": full_layers, "windowed": GEMMA3_4B["layers"] - full_layers}
    rows = []
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        per_layer = 2 * GEMMA3_4B["kv_heads"] * GEMMA3_4B["head_dim"] * size * args.block_size
        for label, held in results.items():
            total = sum(held[kind][0] * layers[kind] * per_layer for kind in layers)
            rows.append([dtype, label, f"{total / 2**30:.2f}"])
    return markdown_table(
        "projected onto Gemma 3 4B's shape (34 layers, 4 KV heads of 256), last step",
        ["dtype", "pools", "KV GiB"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a 2048-token context, window 256")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "window-pools"
    )
    args = parser.parse_args()
    if args.quick:
        args.context, args.window, args.chunk = 2048, 256, 512
    longest = args.context + args.new_tokens
    positions = max(longest, 4096)
    model = make_random_gemma3(
        args.work_dir / f"gemma3-shaped-window-{args.window}-positions-{positions}",
        args.window,
        positions,
    )
    results = {"shared": run(model, args, pools=False), "per kind": run(model, args, pools=True)}
    print()
    print(table(results, kind_bytes(model, args.block_size), args))
    print()
    print(projected(results, args))


if __name__ == "__main__":
    main()
