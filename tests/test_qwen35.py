"""Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Qwen3.5's multimodal text tower against
transformers' forward, driven step by step with the state tensors a hybrid model keeps.

Tiny random checkpoints (3 Gated DeltaNet layers, 1 gated full-attention layer) in
float32. Each model runs prompts longer than several blocks of the chunked delta rule,
prefilled in chunks that continue from the state the last one left, then decodes token
by token and verifies 3 tokens at once from the state; every logits row is compared
with transformers' forward over the whole sequence. Also: the chunked and the
token-by-token forms of the delta rule agree, and bad configs are refused by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import transformers

from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models import delta_rule
from updraft.models.loader import load_model
from updraft.step.inputs import ForwardInputs

BLOCK = 16
BLOCKS_PER_REQUEST = 16  # 256 positions
DEPTH = 4  # room for a verify step of 3 tokens after the last accepted one
TOLERANCE = 2e-4

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
FAMILIES = {
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TEXT),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**TEXT, **EXPERTS}),
    # layer 2 dense (mlp_only_layers); layer 1 full attention, by the interval
    "qwen3-next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **{k: v for k, v in TEXT.items()},
            **EXPERTS,
            "mlp_only_layers": [2],
            "full_attention_interval": 2,
        },
    ),
    "qwen3.5-multimodal": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        {"text_config": TEXT, "vision_config": VISION},
    ),
}


def _randomize(model: torch.nn.Module) -> None:
    """Norms, decays and routers away from their initial values, so that a norm's
    offset, a decay's sign or an expert's choice mixed up shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0, generator=generator)


def build(kind: str, directory) -> torch.nn.Module:
    config_class, model_class, values = FAMILIES[kind]
    values = copy.deepcopy(values)
    if kind == "qwen3-next":
        values.pop("full_attention_interval")
        values["layer_types"] = None
        config = getattr(transformers, config_class)(**values, full_attention_interval=2)
    else:
        config = getattr(transformers, config_class)(**values)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    _randomize(model)
    model.eval().save_pretrained(directory)
    return model


@dataclass
class Hybrid:
    """An updraft model with its caches: one paged KV tensor per full-attention layer,
    one state tensor per linear layer, and each request's blocks and state slot."""

    model: torch.nn.Module
    config: ModelConfig
    caches: list[torch.Tensor]

    @classmethod
    def load(cls, directory, requests: int) -> Hybrid:
        config = ModelConfig.from_dir(directory)
        model = load_model(config, directory, torch.float32)
        slots = requests * BLOCKS_PER_REQUEST * BLOCK + 1
        layout = cache_layout(config)
        width = config.linear_attention.state_width
        caches = [
            torch.zeros(requests + 1, DEPTH, width)
            if config.is_linear(i)
            else torch.zeros(layout.shape(slots))
            for i in range(config.num_layers)
        ]
        return cls(model, config, caches)

    @torch.no_grad()
    def step(self, queries: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``queries`` (request, first position, tokens): each query's
        logits [len(tokens), vocab]."""
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for request, start, tokens in queries:
            ids += tokens
            span = range(start, start + len(tokens))
            positions += span
            first_slot = request * BLOCKS_PER_REQUEST * BLOCK
            slots += [first_slot + p for p in span]
            seq_lens.append(start + len(tokens))
            starts.append(starts[-1] + len(tokens))
        table = [
            list(range(r * BLOCKS_PER_REQUEST, (r + 1) * BLOCKS_PER_REQUEST)) for r, _, _ in queries
        ]
        inputs = ForwardInputs(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            block_table=torch.tensor(table),
            seq_lens=torch.tensor(seq_lens),
            query_start_loc=torch.tensor(starts),
        )
        metadata = AttentionMetadata.from_step(inputs, BLOCK, "cpu")
        state_slots = torch.tensor([request for request, _, _ in queries])
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.caches, metadata, state_slots=state_slots
        )
        logits = self.model.compute_logits(hidden)
        return list(logits.split([len(tokens) for _, _, tokens in queries]))


def reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def sequences(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=generator).tolist() for _ in range(count)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return build(request.param, directory), directory


def test_prefill_in_chunks_then_decode_and_verify_match_transformers(family):
    """Two requests of 150 and 97 prompt tokens (over several blocks of the chunked
    form), prefilled together in chunks of different lengths, each continuing from the
    state its last chunk left; then three decode steps and one verify step of 3 tokens
    (the state after every token kept, the next step reading the last one's)."""
    reference_model, directory = family
    hybrid = Hybrid.load(directory, requests=2)
    full = [s[:length] for s, length in zip(sequences(2, 160, seed=3), (157, 104), strict=True)]
    prompts = [full[0][:150], full[1][:97]]
    expected = [reference(reference_model, tokens) for tokens in full]
    got: list[list[torch.Tensor]] = [[], []]
    # Prefill chunks: (request, start, end) per step; the second step mixes a request's
    # last chunk with the other's middle one.
    for step in ([(0, 0, 70), (1, 0, 30)], [(0, 70, 150), (1, 30, 90)], [(1, 90, 97)]):
        queries = [(r, start, prompts[r][start:end]) for r, start, end in step]
        for (r, _, _), logits in zip(queries, hybrid.step(queries), strict=True):
            got[r].append(logits)
    for offset in range(3):  # decodes
        queries = [
            (r, len(prompts[r]) + offset, [full[r][len(prompts[r]) + offset]]) for r in (0, 1)
        ]
        for r, logits in enumerate(hybrid.step(queries)):
            got[r].append(logits)
    verify = [
        (r, len(prompts[r]) + 3, full[r][len(prompts[r]) + 3 : len(prompts[r]) + 6]) for r in (0, 1)
    ]
    for r, logits in enumerate(hybrid.step(verify)):
        got[r].append(logits)
    for r in (0, 1):
        logits = torch.cat(got[r])
        assert logits.shape == expected[r][: len(full[r]) - 1].shape
        difference = (logits - expected[r][: len(full[r]) - 1]).abs().max().item()
        assert difference < TOLERANCE, (r, difference)


def test_the_chunked_form_is_the_recurrence():
    """Over 150 tokens (two whole blocks and a part) from a state already written, the
    chunked delta rule gives every token's output and the final state that the
    token-by-token recurrence gives; and a sequence split in two runs, the second from
    the first's state, gives the sequence's outputs."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, length, key_dim, value_dim = 2, 3, 150, 8, 5

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q = delta_rule.l2norm(draw(batch, heads, length, key_dim)) * key_dim**-0.5
    k = delta_rule.l2norm(draw(batch, heads, length, key_dim))
    v = draw(batch, heads, length, value_dim)
    g = -torch.rand(batch, heads, length, generator=generator)
    beta = torch.rand(batch, heads, length, generator=generator)
    state = draw(batch, heads, key_dim, value_dim)
    outputs, recurrent = [], state
    for t in range(length):
        out, recurrent = delta_rule.recurrent_step(
            q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], recurrent
        )
        outputs.append(out)
    expected = torch.stack(outputs, dim=2)
    got, final = delta_rule.chunked(q, k, v, g, beta, state)
    assert (got - expected).abs().max() < 1e-4
    assert (final - recurrent).abs().max() < 1e-4
    split = 70
    first, middle = delta_rule.chunked(*(x[:, :, :split] for x in (q, k, v, g, beta)), state)
    second, end = delta_rule.chunked(*(x[:, :, split:] for x in (q, k, v, g, beta)), middle)
    assert (torch.cat([first, second], dim=2) - expected).abs().max() < 1e-4
    assert (end - recurrent).abs().max() < 1e-4
