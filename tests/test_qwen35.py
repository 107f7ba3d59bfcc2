"""Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Qwen3.5's multimodal text tower against
transformers' forward, driven step by step with the state tensors a hybrid model keeps.

Tiny random checkpoints (3 Gated DeltaNet layers, 1 gated full-attention layer) in
float32. Each model runs a prompt over several blocks of the chunked delta rule,
prefilled in chunks that continue from the state the last one left, then decodes token
by token and verifies 3 tokens at once from the state; every logits row is compared
with transformers' forward over the whole sequence. Through the engine: captured
decode and verify steps (padded buckets), n-gram and draft-model speculation. Also: the
chunked and the token-by-token forms of the delta rule agree, a rejected draft leaves
no trace, an MTP layer is left unread, and bad configs are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import checkpoints
from tests.checkpoints import built_once, tiny_config
from tests.helpers import greedy, own_block_inputs
from tests.probes import logits_of, probed, records
from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models import delta_rule
from updraft.models.loader import load_model

BLOCK = 16
BLOCKS_PER_REQUEST = 16  # 256 positions
DEPTH = 4  # room for a verify step of 3 tokens after the last accepted one
TOLERANCE = 2e-4

FAMILIES = ("qwen3.5", "qwen3.5-moe", "qwen3-next", "qwen3.5-multimodal")


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
        inputs = own_block_inputs(queries, BLOCK, BLOCKS_PER_REQUEST)
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind)``: the reference model of ``kind`` and its checkpoint
    directory, built once per module on first use."""
    return built_once(tmp_path_factory)


# Each step: (request, tokens) per request, continuing where its last step ended. A
# long prompt in chunks beside a short one; a decode beside a chunk; decodes; a verify
# step of 3 tokens for both; a decode beside a verify.
STEPS = (
    ((0, 130), (1, 30)),  # 130: three blocks of the chunked form
    ((1, 11), (0, 10)),
    ((1, 1), (0, 10)),
    ((0, 1), (1, 1)),
    ((0, 1), (1, 1)),
    ((0, 3), (1, 3)),
    ((1, 1), (0, 3)),
)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_prefill_in_chunks_then_decode_and_verify_match_transformers(checkpoint, kind):
    """Two requests of 158 and 48 tokens run through ``STEPS``: every query continues
    from the state its request's last one left (chunked or token by token), and each
    token's logits are transformers' over the whole sequence."""
    reference_model, directory = checkpoint(kind)
    hybrid = Hybrid.load(directory, requests=2)
    lengths = [sum(n for step in STEPS for r_, n in step if r_ == r) for r in (0, 1)]
    full = [s[:length] for s, length in zip(sequences(2, 160, seed=3), lengths, strict=True)]
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in STEPS:
        queries = [(r, done[r], full[r][done[r] : done[r] + n]) for r, n in step]
        for (r, _, tokens), logits in zip(queries, hybrid.step(queries), strict=True):
            got[r].append(logits)
            done[r] += len(tokens)
    for r in (0, 1):
        expected = reference(reference_model, full[r])
        difference = (torch.cat(got[r]) - expected).abs().max().item()
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


def test_a_rejected_draft_leaves_no_trace(checkpoint):
    """A verify step of 3 tokens of which only the first is accepted: the next step
    continues from the state after that token (its row, the later rows left behind)
    with a token of its own, and matches transformers over the accepted sequence."""
    reference_model, directory = checkpoint("qwen3.5")
    hybrid = Hybrid.load(directory, requests=1)
    (tokens,) = sequences(1, 60, seed=5)
    hybrid.step([(0, 0, tokens[:40])])
    hybrid.step([(0, 40, tokens[40:43])])  # the verify step: 40 accepted, 41 and 42 not
    other = (tokens[41] + 1) % 256
    got = hybrid.step([(0, 41, [other, tokens[50]])])[0]  # 2 tokens: token by token too
    expected = reference(reference_model, [*tokens[:41], other, tokens[50]])[41:]
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(
    ("kind", "speculation"),
    [("qwen3.5", "draft"), ("qwen3-next", "ngram")],
    ids=["qwen3.5-itself-as-draft", "qwen3-next-ngram"],
)
def test_the_engine_matches_transformers_with_graphs_and_speculation(checkpoint, kind, speculation):
    """Through ``LLM``: prompts prefilled in chunks of at most 24 tokens, decodes and
    verify steps of 3 drafts replayed from captured graphs (each replay checked against
    eager), every emitted token's logits those of transformers' forward over the
    sequence. N-gram drafts are mostly rejected (each rejection must leave no trace);
    the model as its own draft model has every draft accepted: its decode steps and
    the verify steps run the same per-token arithmetic."""
    reference_model, directory = checkpoint(kind)
    prompts = [[5, 6, 7, 8] * 12, [200, 17] * 3, list(range(40, 77))]
    if speculation == "draft":
        method = {"speculative_model": str(directory)}
    else:
        method = {"speculative_method": "ngram"}
    llm = probed(
        directory,
        block_size=8,
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        sanitize=True,
        num_speculative_tokens=3,
        capture_sizes=(4,),  # three requests and a padding one
        **method,
    )
    outputs = llm.generate(prompts, greedy(10))
    stats = llm.engine.stats()
    assert stats.steps.get("graph", 0) > 0
    assert stats.sanitize.healthy, stats.sanitize.summary()
    assert sum(stats.speculative.proposed) > 0
    if speculation == "draft":
        assert stats.speculative.accepted == stats.speculative.proposed
    seen = records(llm)
    for prompt, output in zip(prompts, outputs, strict=True):
        sequence = prompt + output.outputs[0].token_ids
        expected = reference(reference_model, sequence)[len(prompt) - 1 : len(sequence) - 1]
        assert (logits_of(seen, output) - expected).abs().max().item() < TOLERANCE


def _config(kind: str = "qwen3-next", **changes) -> dict:
    """config.json of the tiny ``kind`` as transformers writes it, with ``changes``."""
    raw = tiny_config(kind).to_dict()
    raw["architectures"] = [checkpoints.FAMILIES[kind].model_class]
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not None or key in changes}


def test_configs_are_read_as_transformers_reads_them():
    config = ModelConfig.from_dict(_config("qwen3.5"))
    assert config.linear_layers == {0, 1, 2} and config.attention_layers == (3,)
    assert config.rotary_dim == 4  # a quarter of head_dim 16
    assert (config.norm_offset, config.qk_norm, config.attention_output_gate) == (1.0, True, True)
    assert config.linear_attention.state_width == (2 * 32 + 32) * 3 + 4 * 16 * 8
    raw = _config("qwen3-next")
    del raw["layer_types"]
    raw["full_attention_interval"] = 2
    next_config = ModelConfig.from_dict(raw)
    assert next_config.linear_layers == {0, 2}
    assert next_config.dense_layers == {2} and next_config.moe.shared_expert_gate
    multimodal = ModelConfig.from_dict(_config("qwen3.5-multimodal"))
    assert multimodal.num_layers == 4 and multimodal.linear_layers == {0, 1, 2}
    # transformers ties the LM head by the outer config's word
    tied = _config("qwen3.5-multimodal", tie_word_embeddings=True)
    tied["text_config"]["tie_word_embeddings"] = False
    assert ModelConfig.from_dict(tied).tie_word_embeddings
    assert ModelConfig.from_dict(_config("qwen3.5", mtp_num_hidden_layers=1)).mtp_layers == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of"),
        ({"linear_key_head_dim": None}, "lacks 'linear_key_head_dim'"),
        ({"head_dim": None}, "lacks 'head_dim'"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types must list"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 4 experts"),
        ({"shared_expert_intermediate_size": None}, "lacks 'shared_expert_intermediate_size'"),
    ],
)
def test_bad_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(**changes))


def test_a_multimodal_config_needs_its_text_config():
    with pytest.raises(ValueError, match="lacks its text_config"):
        ModelConfig.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})


def test_the_mtp_layer_is_not_read_into_the_decoder(checkpoint, tmp_path):
    """A checkpoint with an ``mtp.*`` layer (as Qwen3.5 publishes them) loads the
    decoder as before: the MTP tensors are left for the MTP head."""
    _, directory = checkpoint("qwen3.5")
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    loaded = ModelConfig.from_dir(tmp_path)
    assert loaded.mtp_layers == 1
    load_model(loaded, tmp_path, torch.float32)
