"""Shared pieces of the benchmarks: a random Qwen3-style checkpoint, timing, tables."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The benchmarks of steady speed time compiled steps from an engine's first step on, so
# every graph is made before it (bench_startup.py measures the start that makes them in
# the background, the default).
os.environ.setdefault("UPDRAFT_GRAPHS_IN_BACKGROUND", "0")


def make_random_qwen3(
    directory: Path,
    seed: int = 0,
    max_positions: int = 4096,
    vocab_size: int = 32000,
    eos_token_id: int | None = None,
    scale: int = 1,
) -> Path:
    """A ~100M-parameter Qwen3-style model with random weights, saved in float32 (more
    with a larger vocabulary: its embedding is the head too). ``scale`` 2 doubles its
    width and depth: about 0.55B parameters, weights rather than per-step work dominating
    a decode step."""
    import transformers

    if (directory / "config.json").is_file():
        return directory
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=768 * scale,
        intermediate_size=2048 * scale,
        num_hidden_layers=12 * scale,
        num_attention_heads=12 * scale,
        num_key_value_heads=4 * scale,
        head_dim=64,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def make_random_qwen35(
    directory: Path,
    seed: int = 0,
    full_attention_every: int = 4,
    max_positions: int = 16384,
) -> Path:
    """A Qwen3.5-style hybrid (``Qwen3_5ForCausalLM``) with random weights in float32,
    about 116M parameters, shaped as the 100M Qwen3 model is where the two share parts:
    hidden 768, 12 layers, MLP 2048, a tied 32k vocabulary; full-attention layers of 12
    query heads (gated, so q_proj makes twice that) and 4 KV heads of 64, a quarter of
    each head rotated; Gated DeltaNet layers of 8 key heads and 16 value heads of 64
    (value heads twice the key heads, as in the published models), conv kernel 4.

    Every ``full_attention_every``-th layer is full attention (4: layers 3, 7 and 11, as
    the published models interleave them; 1: all twelve, the same model with no linear
    layer, against which the hybrid's growth with the context is measured)."""
    import transformers

    if (directory / "config.json").is_file():
        return directory
    layers = 12
    config = transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % full_attention_every == 0 else "linear_attention"
            for i in range(layers)
        ],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(directory)
    return directory


def make_random_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE-style model with random weights in float32: 8 experts of which 2 are
    active per token, sized so that a token reads about 110 MB of weights (hidden 512, 8
    layers, experts of 512 rows, a 16k vocabulary) out of about 310 MB."""
    import transformers

    if (directory / "config.json").is_file():
        return directory
    config = transformers.Qwen3MoeConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def make_random_gpt_oss(directory: Path, seed: int = 0) -> Path:
    """A gpt-oss-shaped model with random weights: 32 experts of which 4 are active per
    token, sliding (128) and full layers alternating, attention sinks, YaRN, its experts
    in MXFP4 as OpenAI publishes them and the rest in float32 (hidden 768, 12 layers,
    experts of 768 rows, a 32k vocabulary: about 390 MB, a token reading about 160 MB)."""
    import transformers

    from tests.checkpoints import write_mxfp4_experts

    if (directory / "config.json").is_file():
        return directory
    config = transformers.GptOssConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.GptOssForCausalLM(config).save_pretrained(directory)
    return write_mxfp4_experts(directory)


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of reading a large float32 tensor (a sum over it), best of a few."""
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def machine() -> str:
    return (
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def markdown_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [
        f"### {title} ({date.today().isoformat()}, {machine()})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stored_in(model: Path, dtype: torch.dtype, work: Path) -> Path:
    """A copy of ``model`` whose tensors are stored in ``dtype``."""
    out = work / f"{model.name}-{str(dtype).removeprefix('torch.')}"
    if not out.is_dir():
        shutil.copytree(model, out)
        tensors = load_file(out / "model.safetensors")
        save_file({k: v.to(dtype) for k, v in tensors.items()}, out / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config))
    return out


def active_expert_fraction(model: Path) -> float:
    """The share of a mixture's expert weights one token reads: top-k of the experts (1
    for a model without experts)."""
    config = json.loads((Path(model) / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts")
    return config["num_experts_per_tok"] / experts if experts else 1.0


def updraft_weight_bytes(model: Path, engine: dict) -> int:
    """Bytes an updraft decode step reads: every packed linear's codes, scales and zeros,
    and the active share of the packed experts' (``engine``: LLM settings)."""
    from updraft import LLM
    from updraft.models.moe import RoutedExperts
    from updraft.models.packed_linear import PackedLinear

    llm = LLM(model, num_kv_blocks=16, enforce_eager=True, **engine)
    runner = llm.engine._runner  # noqa: SLF001 - a benchmark's look inside
    total = 0.0
    for module in runner.model.modules():
        if isinstance(module, PackedLinear):
            total += sum(
                t.nbytes for t in (module.codes, module.scales, module.zeros) if t is not None
            )
        elif isinstance(module, RoutedExperts):  # packed, in GGUF or MXFP4 blocks
            experts = sum(t.nbytes for t in (*module.buffers(), *module.parameters()))
            total += experts * active_expert_fraction(model)
    llm.engine.close()
    return int(total)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, parents first."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop(0)
        tree.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return tree


def status_mib(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM, ...) in MiB; 0 if the process
    is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    line = next((x for x in status.splitlines() if x.startswith(field + ":")), None)
    return 0.0 if line is None else int(line.split()[1]) / 1024
