"""Write a Llama, Qwen2, Qwen3 or Qwen3-MoE checkpoint directory (config.json + safetensors) as
a GGUF F32 file for llama.cpp, with the ``gguf`` package's writer and tensor-name map.
A MoE layer's per-expert projections are stacked into one [experts, rows, columns]
tensor each, as llama.cpp reads them.

llama.cpp's own converter wants a tokenizer it recognises; the benchmark's checkpoints
have none (prompts are token ids), so the file carries no vocabulary, only its size.

    benchmarks/peers/.venv-llamacpp/bin/python benchmarks/peers/make_gguf.py DIR OUT.gguf
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def halves_to_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first half | second half] order to interleaved pairs."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``...mlp.experts.E.gate_proj.weight`` for every E -> ``...mlp.experts.gate_proj.weight``
    [E, rows, columns]; other tensors unchanged."""
    out, parts = {}, {}
    for name, array in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = array
        else:
            key = f"{match[1]}.{match[3]}.weight"
            parts.setdefault(key, {})[int(match[2])] = array
    for key, by_expert in parts.items():
        out[key] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


# What a tensor is written as: (its data, its ggml type when not the data's dtype).
Convert = Callable[[str, np.ndarray], tuple[np.ndarray, "gguf.GGMLQuantizationType | None"]]


def as_float32(name: str, array: np.ndarray) -> tuple[np.ndarray, None]:
    return array.astype(np.float32), None


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    """The checkpoint's byte-level BPE tokenizer.json (GPT-2's split, as the demo
    model's) as llama.cpp stores one: tokens in id order, merges, token types, chat
    template; none (``no_vocab``) where the checkpoint has no tokenizer."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        writer.add_tokenizer_model("no_vocab")
        writer.add_vocab_size(config["vocab_size"])
        return
    tokenizer = json.loads(path.read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control if t in special else normal for t in tokens])
    settings_path = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        text = settings.get(f"{name}_token")
        if isinstance(text, str) and text in vocab:
            add(vocab[text])
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


def main(
    model_dir: Path, out: Path, convert: Convert = as_float32, split_max_tensors: int = 0
) -> None:
    """``convert(gguf_name, float32 array)``: each tensor as written (after llama.cpp's
    q/k permutation); ``split_max_tensors``: split the file into parts of that many."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = {
        "qwen3": gguf.MODEL_ARCH.QWEN3,
        "qwen2": gguf.MODEL_ARCH.QWEN2,
        "llama": gguf.MODEL_ARCH.LLAMA,
        "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    }.get(config["model_type"])
    if arch is None:
        raise SystemExit(
            f"only llama, qwen2, qwen3 and qwen3_moe are converted, got {config['model_type']}"
        )
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = gguf.GGUFWriter(
        str(out), gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors
    )
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e6)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        experts = config.get("num_experts") or config["num_local_experts"]
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_tokenizer(writer, model_dir, config)

    names = gguf.get_tensor_name_map(arch, layers)
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    tensors = stack_experts(tensors)
    for hf_name, array in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SystemExit(f"no GGUF name for {hf_name}")
        array = array.astype(np.float32)
        # llama.cpp's Llama RoPE rotates interleaved pairs where HF rotates the two
        # halves of each head: reorder q/k rows to match. Its Qwen3 RoPE is HF's.
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                config["num_attention_heads"]
                if "q_proj" in hf_name
                else config["num_key_value_heads"]
            )
            array = halves_to_pairs(array, heads)
        data, raw_dtype = convert(name, np.ascontiguousarray(array))
        if raw_dtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if not split_max_tensors:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
