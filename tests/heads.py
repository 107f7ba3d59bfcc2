"""Draft heads for tests: what random EAGLE-1 heads and DeepSeek MTP layers (written by
tests/checkpoints.py in the layouts they are published in) draft according to
references built from transformers' own layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers.modeling_layers import MtpModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.checkpoints import build_checkpoint, eagle_head_checkpoint, mtp_checkpoint
from updraft.attention.metadata import AttentionMetadata, GroupShape
from updraft.models.draft_head import eagle_head, mtp_head

# -- EAGLE ---------------------------------------------------------------------------------


def make_pair(kind: str, root: Path) -> tuple[Path, Path]:
    """(target, head) directories."""
    target = build_checkpoint(kind, root / "target")
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
