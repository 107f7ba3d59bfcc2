"""What an int8 KV cache (``--kv-cache-dtype int8``) saves and costs, against float32 KV.

* **Bytes**: the KV of a 32k-token context (and per token) of a Gemma-3-shaped model
  (Gemma 3 1B's text config: 26 layers, 1 KV head of 256, five sliding layers in six;
  every layer keeps every block today), the 100M Qwen3 benchmark model and the demo
  model, from their cache layouts (``attention/cache_groups.py``), with the ratio.
* **Quality** on the demo model, measured as the weight formats are
  (``bench_quality.py``): held-out windows of the Python standard library, every
  position's next-token distribution with int8 KV against float32 KV's: mean KL,
  perplexity of each, and top-1 agreement. The windows are prefilled (their K/V written
  to the cache, rounded, then read back by every later query of the window).
* **Decode speed**: batch-1 decode at a ``--context``-token context (4k by default) on
  the 100M Qwen3 model (``make_random_qwen3``, 12 layers of 4 KV heads of 64), median
  time per streamed token with float32 and with int8 KV, rounds alternating; and the
  decode kernel alone over one Gemma-3-shaped layer's 4k context (4 query heads, 1 KV
  head of 256), per call.

    .venv/bin/python -m benchmarks.bench_kv_cache [--windows 32] [--context 4096] \\
        [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_hybrid_context import decode_seconds_per_token
from benchmarks.bench_quality import held_out_windows, updraft_log_probs
from benchmarks.common import machine, make_random_qwen3, markdown_table
from updraft import LLM
from updraft.attention.cache_groups import bytes_per_block, cache_groups
from updraft.demo import DEMO_MODEL_DIR
from updraft.kernels.attention_ops import paged_decode_attention_launch, write_kv_launch
from updraft.model_config import ModelConfig

KV_DTYPES = {"float32": torch.float32, "int8": torch.int8}
BLOCK = 16
# Gemma 3 1B's text config, the fields that shape its KV (and what from_dir needs).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
    ],
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "vocab_size": 262144,
}


def kv_bytes_rows(work: Path, qwen3: Path, context: int) -> list[list[str]]:
    gemma = work / "gemma3-1b-shape"
    gemma.mkdir(exist_ok=True)
    (gemma / "config.json").write_text(json.dumps(GEMMA3_1B))
    models = {
        "Gemma-3-shaped (1B: 26 layers, 1 KV head of 256)": gemma,
        "100M Qwen3 (12 layers, 4 KV heads of 64)": qwen3,
        "demo (6 layers, 4 KV heads of 32)": DEMO_MODEL_DIR,
    }
    rows = []
    for label, directory in models.items():
        config = ModelConfig.from_dir(directory)
        blocks = -(-context // BLOCK)
        sizes = {
            name: bytes_per_block(cache_groups(config, dtype), BLOCK) * blocks
            for name, dtype in KV_DTYPES.items()
        }
        rows.append(
            [
                label,
                f"{sizes['float32'] / 2**20:.1f}",
                f"{sizes['int8'] / 2**20:.1f}",
                f"{sizes['int8'] / sizes['float32']:.3f}",
            ]
        )
    return rows


def quality_rows(windows: torch.Tensor) -> list[list[str]]:
    reference = updraft_log_probs(DEMO_MODEL_DIR, windows)
    int8 = updraft_log_probs(DEMO_MODEL_DIR, windows, kv_cache_dtype="int8")
    rows = []
    for name, log_probs in (("float32", reference), ("int8", int8)):
        kl = F.kl_div(log_probs, reference, log_target=True, reduction="sum")
        nll = -log_probs.gather(-1, windows[:, 1:, None]).mean()
        agree = (log_probs.argmax(-1) == reference.argmax(-1)).float().mean()
        rows.append(
            [
                name,
                f"{float(kl) / log_probs[..., 0].numel():.6f}",
                f"{math.exp(float(nll)):.4f}",
                f"{float(agree):.4f}",
            ]
        )
    return rows


def decode_rows(model: Path, context: int, rounds: int, new_tokens: int) -> list[list[str]]:
    engines = {
        name: LLM(str(model), kv_cache_dtype=name, max_model_len=context + new_tokens + 1)
        for name in ("auto", "int8")
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            seconds = decode_seconds_per_token(
                engines[name], context, new_tokens, seed=round_index * 1000 + 7
            )
            times[name].append(seconds)
            print(f"round {round_index + 1} {name:5s} {seconds * 1e3:7.2f} ms/token", flush=True)
    for llm in engines.values():
        llm.engine.close()
    base = min(times["auto"])
    return [
        [
            "float32" if name == "auto" else name,
            f"{min(values) * 1e3:.2f}",
            f"{max(values) * 1e3:.2f}",
            f"{min(values) / base:.3f}",
        ]
        for name, values in times.items()
    ]


def kernel_rows(context: int, repeats: int) -> list[list[str]]:
    """The decode kernel alone: one Gemma-3-shaped layer (4 query heads, 1 KV head of
    256), one request over ``context`` positions, float32 against int8 rows."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 1, 256
    blocks = -(-context // BLOCK)
    keys, values = torch.randn(blocks * BLOCK, kv_heads, dim), torch.randn(blocks * BLOCK, 1, dim)
    table = torch.randperm(blocks)[None]
    lens, query = torch.tensor([context]), torch.randn(1, heads, dim)
    rows, base = [], None
    for name in KV_DTYPES:
        row = dim + (4 if name == "int8" else 0)
        cache = torch.zeros(2, blocks * BLOCK + 1, kv_heads, row, dtype=KV_DTYPES[name])
        write_kv_launch(cache, keys, values, torch.arange(blocks * BLOCK))()
        launch = paged_decode_attention_launch(query, cache, table, lens, BLOCK, 0.0625)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(20):
                launch()
            best = min(best, (time.perf_counter() - start) / 20)
        base = base or best
        rows.append([name, f"{best * 1e6:.1f}", f"{best / base:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=32, help="held-out windows")
    parser.add_argument("--length", type=int, default=256, help="tokens a window")
    parser.add_argument("--context", type=int, default=4096, help="decode context, tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bytes-context", type=int, default=32768, help="context of the bytes")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "kv-cache")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes")
    args = parser.parse_args()
    if args.quick:
        args.windows, args.length, args.context = 2, 64, 256
        args.new_tokens, args.rounds = 8, 1
    args.work_dir.mkdir(parents=True, exist_ok=True)
    positions = max(4096, args.context + args.new_tokens + 1)
    qwen3 = make_random_qwen3(args.work_dir / f"qwen3-100m-{positions}", max_positions=positions)
    print(machine())
    print(
        markdown_table(
            f"KV cache bytes at a {args.bytes_context}-token context",
            ["model", "float32 KV, MiB", "int8 KV, MiB", "int8 / float32"],
            kv_bytes_rows(args.work_dir, qwen3, args.bytes_context),
        )
    )
    windows = held_out_windows(args.windows, args.length)
    print(
        markdown_table(
            f"Quality, demo model, {args.windows} held-out windows x {args.length} tokens",
            ["KV", "mean KL from float32 KV, nats", "perplexity", "top-1 = float32 KV's"],
            quality_rows(windows),
        )
    )
    print(
        markdown_table(
            f"Decode kernel, one Gemma-3-shaped layer, batch 1, {args.context}-token context",
            ["KV", "us a call (best)", "/ float32"],
            kernel_rows(args.context, 3 if args.quick else 20),
        )
    )
    print(
        markdown_table(
            f"Batch-1 decode, 100M Qwen3, {args.context}-token context, {args.rounds} rounds",
            ["KV", "ms a token (best)", "worst round", "best / float32's"],
            decode_rows(qwen3, args.context, args.rounds, args.new_tokens),
        )
    )


if __name__ == "__main__":
    main()
