"""Draft heads for tests: random EAGLE-1 heads and DeepSeek MTP layers saved in the
layouts they are published in, and what each drafts according to references built from
transformers' own layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_layers import MtpModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.conftest import DEEPSEEK, DEEPSEEK_TINY, make_deepseek_checkpoint, make_tiny_checkpoint
from updraft.attention.metadata import AttentionMetadata, GroupShape
from updraft.models.draft_head import eagle_head, mtp_head

# -- EAGLE ---------------------------------------------------------------------------------


def eagle_head_checkpoint(directory: Path, target_dir: Path, seed: int = 1) -> Path:
    """A random one-layer EAGLE-1 head for ``target_dir``: fc with a bias, layer 0
    without an input norm, and a copy of an embedding (published heads carry one) that
    must not be read."""
    target = json.loads((target_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=target["vocab_size"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, 0)
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
    tensors = {"fc.weight": fc.weight, "fc.bias": fc.bias}
    for name, tensor in layer.state_dict().items():
        if name.startswith("input_layernorm."):
            continue
        if "layernorm" in name:
            tensor = 1 + 0.2 * torch.randn_like(tensor)
        tensors[f"layers.0.{name}"] = tensor
    tensors["embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.detach().contiguous() for name, t in tensors.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    raw = config.to_dict()
    raw.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", bias=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def make_pair(kind: str, root: Path) -> tuple[Path, Path]:
    """(target, head) directories."""
    target = make_tiny_checkpoint(kind, root / "target")
    return target, eagle_head_checkpoint(root / "head", target)


class ReferenceHead(nn.Module):
    """EAGLE-1 in transformers' own layer: fc, then LlamaDecoderLayer without its input
    norm, over a whole sequence with a causal mask, positions 0.., and the target's
    embedding and LM head."""

    def __init__(self, target: nn.Module, head_dir: Path) -> None:
        super().__init__()
        config = transformers.LlamaConfig.from_pretrained(head_dir)
        config._attn_implementation = "eager"
        tensors = load_file(head_dir / "model.safetensors")
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = nn.Identity()
        prefix = "layers.0."
        self.layer.load_state_dict(
            {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
        )
        self.rotary = LlamaRotaryEmbedding(config)
        self.target = target

    @torch.no_grad()
    def features(self, tokens: list[int]) -> torch.Tensor:
        """The target's final hidden states over ``tokens`` [1, T, H]."""
        return self.target.model(torch.tensor([tokens])).last_hidden_state

    @torch.no_grad()
    def forward(self, next_tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Entries 0.. (token i + 1 beside feature i) -> the head's output [1, T, H]."""
        hidden = self.fc(
            torch.cat([self.target.model.embed_tokens(torch.tensor([next_tokens])), features], -1)
        )
        length = hidden.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        return self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )

    def logits_over(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final hidden states at positions 0..T-2 [T - 1, H], and the
        head's logits there [T - 1, V], fed the tokens at 1..T-1."""
        features = self.features(tokens[:-1])
        with torch.no_grad():
            return features[0], self.target.lm_head(self(tokens[1:], features))[0]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the head drafts after ``tokens``: entry n - 2 from the target's last
        feature, then its own output chained with each draft, over the whole sequence."""
        features = self.features(tokens[:-1])
        inputs = tokens[1:]
        drafts = []
        for _ in range(k):
            out = self(inputs, features)
            drafts.append(int(self.target.lm_head(out[:, -1]).argmax()))
            features = torch.cat([features, out[:, -1:]], dim=1)
            inputs = [*inputs, drafts[-1]]
        return drafts


def reference_for(target_dir: Path, head_dir: Path) -> ReferenceHead:
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return ReferenceHead(target.eval(), head_dir).eval()


# -- MTP -----------------------------------------------------------------------------------


def mtp_checkpoint(directory: Path, kind: str = "deepseek-v3") -> Path:
    """Save a tiny V3 (or V3.2) main model, then write a random MTP layer beside it
    under the names DeepSeek's checkpoints use: the block's tensors at the layer's top
    level, ``shared_head.norm`` for the output norm, one tensor per expert."""
    if kind == "deepseek-v3":
        config = transformers.DeepseekV3Config(
            **DEEPSEEK_TINY, **DEEPSEEK[kind], num_nextn_predict_layers=1
        )
        torch.manual_seed(0)
        main = transformers.DeepseekV3ForCausalLM(config).eval()
        main.save_pretrained(directory)
        block = mtp_block_of_v3(main)
    else:
        make_deepseek_checkpoint(kind, directory)
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
        block = mtp_block_of_v32()
    layer = DEEPSEEK_TINY["num_hidden_layers"]
    tensors = load_file(directory / "model.safetensors")
    prefix = f"model.layers.{layer}."
    for rest, tensor in block.items():
        if rest.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate[expert].clone()
                tensors[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up[expert].clone()
        elif rest.endswith("experts.down_proj"):
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            tensors[prefix + rest] = tensor.clone().contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def randomized(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s tensors, parameters drawn from N(0, 0.2) and the routers' score
    biases from N(0, 0.5) (so that they change which experts win)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.normal_(0, 0.2)
        for name, tensor in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.5)
    return module.state_dict()


def mtp_block_of_v3(main: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' own MTP layer for ``main``, under the names of the layer's top
    level in DeepSeek's checkpoints."""
    tensors = randomized(MtpModel(main, 1).layers[0], seed=1)
    return {
        name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm."): tensor
        for name, tensor in tensors.items()
    }


def mtp_block_of_v32() -> dict[str, torch.Tensor]:
    """A V3.2 MTP layer: a decoder block with experts and the indexer (transformers has
    no MTP layer for V3.2: its block comes from a V3.2 model one layer deeper) and the
    depth's own norms and projection."""
    layers = DEEPSEEK_TINY["num_hidden_layers"]
    config = transformers.DeepseekV32Config(
        **{**DEEPSEEK_TINY, "num_hidden_layers": layers + 1}, **DEEPSEEK["deepseek-v3.2"]
    )
    deeper = transformers.DeepseekV32ForCausalLM(config)
    tensors = randomized(deeper.model.layers[layers], seed=1)
    hidden = config.hidden_size
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{name}.weight"] = 1 + 0.2 * torch.randn(hidden)
    tensors["eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden)
    return tensors


class MTPReference:
    """transformers' main model and its ``MtpModel`` over a checkpoint with MTP layers."""

    def __init__(self, model_dir: Path) -> None:
        main = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        layer = main.config.num_hidden_layers
        # transformers looks for DeepSeek-V3's own MTP layer index (61); this model has 3.
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}\..*"]
        self.main = main.eval()
        self.mtp = MtpModel.from_pretrained(main).eval()

    @torch.no_grad()
    def logits_over(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's final hidden states at positions 0..T-2, and the MTP layer's
        logits there, fed the tokens at 1..T-1."""
        ids = torch.tensor([tokens])
        hidden = self.main.model(ids[:, :-1]).last_hidden_state
        positions = torch.arange(1, len(tokens))[None]
        out = self.mtp.forward_layer(0, hidden, positions, None, input_ids=ids[:, 1:])
        return hidden[0], self.mtp._project_to_logits(out)[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the MTP layer drafts after ``tokens``, reused k times: entry n - 2 (the
        newest token beside the main model's last hidden state), then its own output
        chained with each draft, over the whole sequence at once."""
        ids = torch.tensor([tokens])
        hidden = self.main.model(ids[:, :-1]).last_hidden_state
        inputs = tokens[1:]
        drafts = []
        for _ in range(k):
            positions = torch.arange(1, len(inputs) + 1)[None]
            out = self.mtp.forward_layer(
                0, hidden, positions, None, input_ids=torch.tensor([inputs])
            )
            draft = int(self.mtp._project_to_logits(out[:, -1]).argmax())
            drafts.append(draft)
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            inputs = [*inputs, draft]
        return drafts


# -- a head's layer over one request, outside the engine ------------------------------------


def prefill_then_decode(count: int, positions_per_block: int = 4):
    """A request's entries 0..count-1 in two steps through blocks 0, 1, 2... in order:
    the first count - 1 as one prefill chunk (gathered or expanded attention), the last
    as a decode (read in place) -> ((first, last, metadata) of each step)."""
    block_table = torch.arange(-(-count // positions_per_block))[None]
    steps = []
    for first, last in ((0, count - 1), (count - 1, count)):
        rows = last - first
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(first, last),
            block_table=block_table,
            seq_lens=torch.tensor([last]),
            query_start_loc=torch.tensor([0, rows]),
            shapes=(GroupShape(0, 1, 0, rows, rows, last),),
            positions_per_block=positions_per_block,
        )
        steps.append((first, last, metadata))
    return steps


# -- a head of either kind, for the shared tests ------------------------------------------


@dataclass(frozen=True)
class Head:
    """A target, the engine arguments that draft for it with a head, the head's loader
    and directory, and the reference that says what the head computes and drafts
    (``logits_over(tokens)``, ``drafts(tokens, k)``)."""

    target: Path
    args: dict[str, Any]
    load: Callable
    directory: Path
    reference: Callable[[], Any]


def make_head(kind: str, root: Path) -> Head:
    if kind in ("mtp", "mtp-dsa"):
        version = {"mtp": "deepseek-v3", "mtp-dsa": "deepseek-v3.2"}[kind]
        target = mtp_checkpoint(root / kind, version)
        return Head(
            target, {"speculative_method": "mtp"}, mtp_head, target, lambda: MTPReference(target)
        )
    target, head_dir = make_pair(kind.removeprefix("eagle-"), root)
    args = {"speculative_method": "eagle", "speculative_model": str(head_dir)}
    return Head(target, args, eagle_head, head_dir, lambda: reference_for(target, head_dir))
