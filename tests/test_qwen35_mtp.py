"""The hybrid Qwen families' multi-token prediction layer (``mtp.*``) as a draft head, in
tiny random Qwen3.5 and Qwen3.5-MoE checkpoints that carry one.

The reference is transformers' own MTP layer (``MtpLayer``: projection over [normed
embedding ; normed hidden state], a decoder block, a final norm) around the model's own
decoder layer made full attention, its weights under the checkpoint's names. Through the
engine: greedy tokens under MTP speculation equal transformers' greedy decoding (k = 1
and 3, batch 1 and 8, eager and graphs), every proposal is what the reference drafts
from the same tokens, preemption keeps the tokens, and a head graph that replays stale
hidden states or block tables is caught. Refusals: a checkpoint without MTP layers (or
announcing one it lacks), a GGUF file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_layers import MtpLayer

from tests.checkpoints import saved_model
from tests.heads import prefill_then_decode
from tests.helpers import generate_logits, greedy, recorded_proposals, token_ids
from tests.mutations import forget_refresh
from updraft import LLM
from updraft.attention.cache_groups import CacheSizes, allocate_caches, cache_groups
from updraft.checkpoints.gguf import LINK
from updraft.model_config import ModelConfig
from updraft.models.draft_head import mtp_head
from updraft.models.loader import load_model
from updraft.models.qwen35_mtp import load_mtp_layer
from updraft.speculative.head import HeadProposer

MAX_TOKENS = 10
LENGTHS = (41, 7, 23, 3, 30, 12, 18, 9)
# Prefill in chunks (the head's mirror follows each), over a few blocks; decode and
# verify buckets of 1 and 8 requests only.
SMALL_STEPS = {"max_num_batched_tokens": 32, "block_size": 8, "capture_sizes": (1, 8)}
# transformers' module names of the MTP layer -> the checkpoint's, below ``mtp.``.
CHECKPOINT_NAMES = (
    ("eh_proj.", "fc."),
    ("enorm.", "pre_fc_norm_embedding."),
    ("hnorm.", "pre_fc_norm_hidden."),
    ("mtp_block.", "layers.0."),
    ("post_norm.", "norm."),
)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 256, (LENGTHS[i % len(LENGTHS)],), generator=generator).tolist()
        for i in range(count)
    ]


class Reference(NamedTuple):
    """transformers' main model and its MTP layer."""

    main: nn.Module
    layer: MtpLayer

    @torch.no_grad()
    def run(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Entries 0.. (token i + 1 beside the main model's state i) -> [1, T, H]."""
        length = hidden.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        return self.layer(
            self.main.model.embed_tokens(torch.tensor([next_tokens])),
            hidden,
            position_embeddings=self.main.model.rotary_emb(hidden, positions),
            attention_mask=mask,
            position_ids=positions,
            cache=None,
        )

    @torch.no_grad()
    def logits_over(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's final hidden states at positions 0..T-2, and the layer's
        logits there, fed the tokens at 1..T-1."""
        hidden = self.main.model(torch.tensor([tokens[:-1]])).last_hidden_state
        return hidden[0], self.main.lm_head(self.run(tokens[1:], hidden))[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the layer drafts after ``tokens``: entry n - 2 from the main model's last
        state, then its own output chained with each draft."""
        hidden = self.main.model(torch.tensor([tokens[:-1]])).last_hidden_state
        inputs, drafts = tokens[1:], []
        for _ in range(k):
            out = self.run(inputs, hidden)
            drafts.append(int(self.main.lm_head(out[:, -1]).argmax()))
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            inputs = [*inputs, drafts[-1]]
        return drafts


def mtp_layer_of(main: nn.Module) -> MtpLayer:
    """A random MTP layer around the model's own decoder layer, made full attention."""
    config = copy.deepcopy(main.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    decoder = main.model.layers[0]
    norm = type(decoder.input_layernorm)
    torch.manual_seed(2)
    layer = MtpLayer(config, type(decoder), norm, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:  # zero-centred: 1 + weight scales
                param.copy_(0.3 * torch.randn(param.shape))
            else:
                param.normal_(0, 0.2)
    return layer


def with_mtp(kind: str, directory: Path, announce: bool = True) -> Reference:
    """A tiny checkpoint of ``kind`` with a random MTP layer written beside its tensors,
    named as the published checkpoints name it (experts one tensor each); with
    ``announce``, its config.json says so (Qwen3-Next's released config does not)."""
    main = saved_model(kind, directory)
    layer = mtp_layer_of(main)
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in layer.state_dict().items():
        for old, new in CHECKPOINT_NAMES:
            name = name.replace(old, new, 1) if name.startswith(old) else name
        prefix = f"mtp.{name}".rpartition("experts.")[0]
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}experts.{expert}.gate_proj.weight"] = gate[expert].clone()
                tensors[f"{prefix}experts.{expert}.up_proj.weight"] = up[expert].clone()
        elif name.endswith("experts.down_proj"):
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}experts.{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            tensors[f"mtp.{name}"] = tensor.clone().contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if announce:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return Reference(main.eval(), layer)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> tuple[Reference, Path]:
    directory = tmp_path_factory.mktemp("qwen3.5-mtp")
    return with_mtp("qwen3.5", directory), directory


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory) -> tuple[Reference, Path]:
    directory = tmp_path_factory.mktemp("qwen3.5-moe-mtp")
    return with_mtp("qwen3.5-moe", directory), directory


@pytest.fixture(scope="module")
def expected(qwen35) -> list[list[int]]:
    """Greedy tokens for ``prompts(8)`` without speculation (``test_hybrid_engine.py``:
    they are transformers')."""
    _, directory = qwen35
    llm = LLM(str(directory), **SMALL_STEPS, enforce_eager=True)
    return token_ids(llm.generate(prompts(8), [greedy(MAX_TOKENS)] * 8))


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3.5-moe", "qwen3-next"])
@torch.inference_mode()
def test_the_head_equals_transformers_mtp_layer(kind, request, tmp_path):
    """The head's logits over a prefill chunk and a decode (read from its paged cache)
    equal the reference layer's over the whole sequence; its cache is paged KV alone.
    Qwen3-Next's config announces no MTP layer: its tensors are found all the same."""
    if kind == "qwen3-next":
        reference, directory = with_mtp(kind, tmp_path, announce=False), tmp_path
    else:
        reference, directory = request.getfixturevalue(kind.replace(".", "").replace("-", "_"))
    tokens = prompts(1, seed=3)[0][:20]
    features, want = reference.logits_over(tokens)
    config = ModelConfig.from_dir(directory)
    target = load_model(config, directory, torch.float32)
    head, head_config = mtp_head(target, config, directory, torch.float32, "cpu")
    groups = cache_groups(head_config, torch.float32)
    assert [group.kind for group in groups] == ["paged"]
    caches = allocate_caches(groups, head_config.num_layers, CacheSizes(8, 0), 4, "cpu")
    got = []
    for first, last, metadata in prefill_then_decode(len(tokens) - 1):
        out = head(
            torch.tensor(tokens[first + 1 : last + 1]),
            torch.arange(first, last),
            caches,
            metadata,
            features[first:last],
        )
        got.append(head.compute_logits(out))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=0)


class Run(NamedTuple):
    tokens: list[list[int]]
    proposals: list[tuple[list[int], list[int]]]  # (the tokens it was made from, drafts)
    llm: LLM


def mtp_run(directory, batch, monkeypatch, k: int, eager: bool) -> Run:
    """Greedy decoding of ``batch`` with the MTP head drafting ``k`` tokens, recording
    every proposal."""
    with monkeypatch.context() as patch:
        proposals = recorded_proposals(patch, HeadProposer)
        llm = LLM(
            str(directory),
            **SMALL_STEPS,
            speculative_method="mtp",
            num_speculative_tokens=k,
            enforce_eager=eager,
        )
        got = token_ids(llm.generate(batch, [greedy(MAX_TOKENS)] * len(batch)))
    return Run(got, proposals, llm)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculation_keeps_greedy_tokens_at_batch_1_and_8(
    qwen35, expected, monkeypatch, k, eager
):
    """Greedy tokens with the head drafting equal transformers'; acceptance is counted;
    the state slots and blocks all come back; with graphs, the head's steps replay."""
    reference, directory = qwen35
    for batch in (1, 8):
        run = mtp_run(directory, prompts(batch), monkeypatch, k, eager)
        assert run.tokens == expected[:batch]
        stats = run.llm.engine.stats()
        metrics = stats.speculative
        assert metrics.rounds > 0 and len(metrics.proposed) == len(metrics.accepted) == k
        assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
        assert ("graph" in stats.draft_steps) != eager, stats.draft_steps
    # Every proposal of the batch of 8 is what the reference drafts from its tokens.
    for tokens, drafts in run.proposals[::3]:
        assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)


@pytest.mark.parametrize("stale", ["hidden_states", "block_table"])
def test_a_head_graph_that_replays_a_stale_input_is_caught(qwen35, monkeypatch, stale):
    """A head graph that keeps its hidden states or block table from the step it was
    captured at (or an earlier one) drafts other tokens than the reference, which the
    graphs' proposals above equal."""
    reference, directory = qwen35
    forget_refresh(monkeypatch, stale, "head")
    run = mtp_run(directory, prompts(8), monkeypatch, 3, eager=False)
    assert run.llm.engine.stats().draft_steps["graph"] > 0
    right = [drafts == reference.drafts(tokens, len(drafts)) for tokens, drafts in run.proposals]
    assert not all(right)


def test_qwen35_moe_mtp_speculation_keeps_greedy_tokens(qwen35_moe, monkeypatch):
    reference, directory = qwen35_moe
    batch = prompts(8, seed=1)
    plain = LLM(str(directory), **SMALL_STEPS, enforce_eager=True)
    want = token_ids(plain.generate(batch, [greedy(MAX_TOKENS)] * 8))
    run = mtp_run(directory, batch, monkeypatch, 3, eager=False)
    assert run.tokens == want
    assert run.llm.engine.stats().speculative.rounds > 0
    for tokens, drafts in run.proposals[::4]:
        assert drafts == reference.drafts(tokens, len(drafts))


def test_the_main_model_skips_the_mtp_tensors(qwen35):
    """Served without speculation, the checkpoint's main model equals transformers'."""
    reference, directory = qwen35
    prompt = prompts(4)[3]
    got = LLM(str(directory), **SMALL_STEPS).generate([prompt], greedy(MAX_TOKENS))
    assert token_ids(got) == [generate_logits(reference.main, prompt, MAX_TOKENS)[0]]


def test_a_checkpoint_without_its_mtp_layer_is_refused(qwen35, tmp_path):
    """A checkpoint without the layer's tensors (its config announcing none, or one, as
    a model saved by transformers does), and a GGUF file, are refused by name."""
    _, directory = qwen35
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / LINK).write_text(json.dumps({"files": [str(gguf / "model.gguf")]}))
    config = ModelConfig.from_dir(directory)
    with pytest.raises(ValueError, match="GGUF file, whose multi-token prediction layer"):
        load_mtp_layer(config, gguf, torch.float32, "cpu")
    saved_model("qwen3.5", tmp_path)
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        LLM(str(tmp_path), speculative_method="mtp", enforce_eager=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"mtp_num_hidden_layers.*hold no mtp\.layers\.0\."):
        LLM(str(tmp_path), speculative_method="mtp", enforce_eager=True)


def test_preemption_keeps_greedy_tokens_with_the_head(qwen35, expected):
    """Few blocks: running requests are preempted, give their state slot back and are
    computed again from a zero state, and the head's mirror writes their entries again."""
    _, directory = qwen35
    llm = LLM(
        str(directory),
        **SMALL_STEPS,
        num_kv_blocks=12,
        max_num_seqs=4,
        speculative_method="mtp",
        num_speculative_tokens=3,
    )
    outputs = llm.generate(prompts(8), [greedy(MAX_TOKENS)] * 8)
    assert sum(output.metrics.num_preemptions for output in outputs) > 0
    assert token_ids(outputs) == expected
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
