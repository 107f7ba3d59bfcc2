"""updraft vs transformers on the same random ~120M DeepSeek-V3-shape model (MLA, 16
routed experts of which 2 per token, 1 shared, layer 0 dense), float32; with
``--sparse``, the V3.2 shape (the same, plus DSA's indexer: each query attends to its
64 best-scored positions).

1. Decode tokens/s at batch 1: (N - 1) new tokens over t(N) - t(1), prefill excluded
   on both sides. updraft runs with FULL graphs (the CPU default) and PIECEWISE ones;
   each of its times is the best of 3 after a warm-up, transformers' of 1.
2. Output tokens/s for 16 requests of mixed prompt and output lengths: updraft with
   continuous batching, transformers as one left-padded batch to the longest output.
3. KV cache bytes per token: what updraft's latent cache holds (kv_lora_rank +
   qk_rope_head_dim per layer), what transformers' cache holds after a generate, and
   what expanded per-head keys and values would take.

    .venv/bin/python -m benchmarks.bench_deepseek [--quick] [--model-dir DIR] [--sparse]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from functools import partial
from pathlib import Path

import torch
import transformers

from benchmarks.bench_generate import hf_generate
from benchmarks.common import markdown_table
from benchmarks.peers.workload import best_time
from updraft import LLM, SamplingParams
from updraft.attention.cache_groups import cache_groups
from updraft.model_config import ModelConfig

VOCAB = 32000


def make_random_deepseek_v3(directory: Path, seed: int = 0, sparse: bool = False) -> Path:
    """The checkpoint in ``directory``, made there unless it is; ``sparse``: V3.2's."""
    if (directory / "config.json").is_file():
        return directory
    indexer = dict(index_topk=64, index_head_dim=64, index_n_heads=16) if sparse else {}
    config_class = transformers.DeepseekV32Config if sparse else transformers.DeepseekV3Config
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        moe_intermediate_size=256,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=256,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        **indexer,
    )
    torch.manual_seed(seed)
    model_class = (
        transformers.DeepseekV32ForCausalLM if sparse else transformers.DeepseekV3ForCausalLM
    )
    model_class(config).save_pretrained(directory)
    return directory


def transformers_cache_bytes_per_token(model, prompt: list[int]) -> float:
    with torch.inference_mode():
        cache = model(torch.tensor([prompt]), use_cache=True).cache
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total / len(prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved model")
    parser.add_argument("--sparse", action="store_true", help="the V3.2 shape, with DSA")
    args = parser.parse_args()
    new_tokens = 16 if args.quick else 128
    num_requests = 4 if args.quick else 16
    name = "deepseek-v3.2-120m" if args.sparse else "deepseek-v3-120m"
    model_dir = args.model_dir or Path(tempfile.mkdtemp()) / name
    make_random_deepseek_v3(model_dir, sparse=args.sparse)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # The default graph mode here (auto) is full; piecewise beside it, in the same run.
    llms = {
        mode: LLM(
            model_dir,
            dtype="float32",
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            graph_mode=mode,
        )
        for mode in ("full", "piecewise")
    }
    config = hf.config
    parameters = sum(p.numel() for p in hf.parameters()) / 1e6
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(32)]

    def updraft_run(llm: LLM, n: int) -> None:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    hf_decode = (new_tokens - 1) / (
        best_time(lambda: hf_generate(hf, [prompt], new_tokens))
        - best_time(lambda: hf_generate(hf, [prompt], 1))
    )

    def decode_rate(llm: LLM) -> float:
        return (new_tokens - 1) / (
            best_time(lambda: updraft_run(llm, new_tokens), 3)
            - best_time(lambda: updraft_run(llm, 1), 3)
        )

    ours_decode = {mode: decode_rate(llm) for mode, llm in llms.items()}

    prompts = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(16, 256))] for _ in range(num_requests)
    ]
    outputs = [rng.randint(16, new_tokens) for _ in range(num_requests)]
    useful = sum(outputs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    ours_batch = {
        mode: best_time(partial(llm.generate, prompts, params), 3) for mode, llm in llms.items()
    }
    hf_batch = best_time(lambda: hf_generate(hf, prompts, max(outputs)))

    ours_config = ModelConfig.from_dir(llms["full"].engine.config.model)
    # what KV planning charges: bytes per block / block
    ours_kv = cache_groups(ours_config, torch.float32)[0].bytes_per_slot
    hf_kv = transformers_cache_bytes_per_token(hf, prompt)
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    expanded = config.num_hidden_layers * config.num_attention_heads * per_head * 4

    rows = [
        [
            "decode tokens/s, batch 1",
            f"{hf_decode:.1f}",
            f"{ours_decode['full']:.1f}",
            f"{ours_decode['piecewise']:.1f}",
            f"{ours_decode['full'] / hf_decode:.2f}x",
        ],
        [
            f"{num_requests} mixed requests, output tokens/s (vs one padded batch)",
            f"{useful / hf_batch:.1f}",
            f"{useful / ours_batch['full']:.1f}",
            f"{useful / ours_batch['piecewise']:.1f}",
            f"{hf_batch / ours_batch['full']:.2f}x",
        ],
        [
            "KV cache bytes per token (all layers)",
            f"{hf_kv:,.0f}",
            f"{ours_kv:,.0f}",
            f"{ours_kv:,.0f}",
            f"expanded K/V: {expanded:,}",
        ],
    ]
    print(
        markdown_table(
            f"updraft vs transformers {transformers.__version__}, random DeepSeek-V3 shape "
            f"{parameters:.0f}M, float32",
            ["measure", "transformers", "updraft (full)", "updraft (piecewise)", "full vs hf"],
            rows,
        )
    )
    print(
        f"\nbatch 1: 32-token prompt, {new_tokens} new tokens. Mixed: prompts 16-256 tokens, "
        f"outputs 16-{new_tokens} tokens ({useful} in all), greedy, seeded. "
        f"Engine steps (full): {llms['full'].engine.stats().describe_steps()}."
    )


if __name__ == "__main__":
    main()
