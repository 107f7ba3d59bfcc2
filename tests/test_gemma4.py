"""Gemma 4's text model (dense E-style, with its MoE block, and the multimodal model's
text tower) against transformers' forward, on tiny random float32 checkpoints
(tests/checkpoints.py): KV-shared layers, per-layer inputs, double-wide MLPs, full
layers with heads of their own whose values are their keys, proportional RoPE, a
sliding window shorter than the prompts and capped logits.

Driven step by step over paged caches (chunked prefill, decodes, a 3-token verify
step), and through the engine with captured graphs and n-gram speculation. Also: KV is
allocated for the writing layers only, a bfloat16 checkpoint's per-layer table stays
mapped from its file in bfloat16, configs are read as transformers reads them and what
is not built is refused by name.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import FAMILIES, build_checkpoint, built_once, tiny_config
from tests.helpers import greedy, own_block_inputs, token_ids
from tests.probes import logits_of, probed, records
from updraft import LLM
from updraft.attention.cache_groups import (
    PAGED,
    CacheSizes,
    allocate_caches,
    bytes_per_block,
    cache_groups,
    split_budget,
)
from updraft.attention.metadata import AttentionMetadata
from updraft.config import ParallelSizes
from updraft.model_config import ModelConfig
from updraft.models.loader import load_model
from updraft.models.tensor_parallel import check_parallel

BLOCK = 8
BLOCKS_PER_REQUEST = 12
TOLERANCE = 2e-4
KINDS = ("gemma4", "gemma4-moe", "gemma4-multimodal")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind)``: the reference model of ``kind`` and its checkpoint
    directory, built once per module on first use."""
    return built_once(tmp_path_factory)


def reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class Paged:
    """An updraft model over its paged caches (as the runner allocates them), each
    request with blocks of its own."""

    def __init__(self, directory, requests: int) -> None:
        self.config = ModelConfig.from_dir(directory)
        self.model = load_model(self.config, directory, torch.float32)
        groups = cache_groups(self.config, torch.float32)
        sources = [self.config.kv_source(i) for i in range(self.config.num_layers)]
        sizes = CacheSizes(requests * BLOCKS_PER_REQUEST, 0)
        self.caches = allocate_caches(groups, self.config.num_layers, sizes, BLOCK, "cpu", sources)

    @torch.no_grad()
    def step(self, queries: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``queries`` (request, first position, tokens): each query's
        logits [len(tokens), vocab]."""
        inputs = own_block_inputs(queries, BLOCK, BLOCKS_PER_REQUEST)
        metadata = AttentionMetadata.from_step(inputs, BLOCK, "cpu")
        hidden = self.model(inputs.input_ids, inputs.positions, self.caches, metadata)
        logits = self.model.compute_logits(hidden)
        return list(logits.split([len(tokens) for _, _, tokens in queries]))


# Each step: (request, tokens) per request, continuing where its last step ended: a
# prompt in chunks beside a short one, a decode beside a chunk, decodes, a verify step
# of 3 tokens for both.
STEPS = (
    ((0, 20), (1, 5)),
    ((1, 11), (0, 17)),
    ((0, 1), (1, 1)),
    ((0, 3), (1, 3)),
    ((1, 1), (0, 1)),
)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_in_chunks_then_decode_and_verify_match_transformers(checkpoint, kind):
    """Two requests of 42 and 21 tokens (both past the window of 8) run through
    ``STEPS``; every token's logits are transformers' over the whole sequence."""
    reference_model, directory = checkpoint(kind)
    paged = Paged(directory, requests=2)
    generator = torch.Generator().manual_seed(3)
    lengths = [sum(n for step in STEPS for r_, n in step if r_ == r) for r in (0, 1)]
    full = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in STEPS:
        queries = [(r, done[r], full[r][done[r] : done[r] + n]) for r, n in step]
        for (r, _, tokens), logits in zip(queries, paged.step(queries), strict=True):
            got[r].append(logits)
            done[r] += len(tokens)
    for r in (0, 1):
        difference = (torch.cat(got[r]) - reference(reference_model, full[r])).abs().max()
        assert difference.item() < TOLERANCE, (r, difference)


PROMPTS = [[5, 6, 7, 8] * 6, [200, 17] * 3, list(range(40, 77))]


def test_the_engine_matches_transformers_with_graphs_and_ngram_speculation(checkpoint):
    """Through ``LLM``: prompts prefilled in chunks of at most 24 tokens, decode and
    verify steps of 3 n-gram drafts replayed from captured graphs (each replay checked
    against eager), every emitted token's logits those of transformers' forward over
    the sequence and each token its greedy choice; the same tokens come eagerly with
    n-gram speculation and without."""
    reference_model, directory = checkpoint("gemma4")
    engine = dict(block_size=BLOCK, num_kv_blocks=48, max_num_batched_tokens=24)
    ngram = dict(speculative_method="ngram", num_speculative_tokens=3)
    llm = probed(
        directory, sanitize=True, capture_sizes=(4,), enforce_eager=False, **engine, **ngram
    )
    outputs = llm.generate(PROMPTS, greedy(10))
    stats = llm.engine.stats()
    assert stats.steps.get("graph", 0) > 0
    assert stats.sanitize.healthy, stats.sanitize.summary()
    assert sum(stats.speculative.proposed) > 0
    seen = records(llm)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        sequence = prompt + output.outputs[0].token_ids
        expected = reference(reference_model, sequence)[len(prompt) - 1 : len(sequence) - 1]
        assert (logits_of(seen, output) - expected).abs().max().item() < TOLERANCE
        assert expected.argmax(-1).tolist() == output.outputs[0].token_ids
    tokens = token_ids(outputs)
    eager = LLM(str(directory), enforce_eager=True, **engine, **ngram)
    assert token_ids(eager.generate(PROMPTS, greedy(10))) == tokens
    plain = LLM(str(directory), enforce_eager=True, **engine)
    assert token_ids(plain.generate(PROMPTS, greedy(10))) == tokens


def test_kv_is_kept_for_the_writing_layers_only(checkpoint):
    """Layers 4 and 5 read layers 2's and 3's KV: no cache of their own, but those very
    tensors; the sliding and the full layers' caches are two paged groups of their own
    shapes over one block count, and a block costs what the writing layers keep."""
    _, directory = checkpoint("gemma4")
    config = ModelConfig.from_dir(directory)
    assert [config.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert config.kv_store_layers() == {"sliding_attention": 2, "full_attention": 3}
    groups = cache_groups(config, torch.float32)
    assert [(g.kind, g.layers, g.layout.per_slot) for g in groups] == [
        (PAGED, (0, 2), (2, 16)),
        (PAGED, (1, 3), (1, 32)),
    ]
    per_block = BLOCK * 4 * 2 * 2 * (2 * 16 + 32)  # K and V, 2 layers of each kind
    assert bytes_per_block(groups, BLOCK) == per_block
    sizes = split_budget(groups, 10 * per_block + 5, BLOCK, max_num_seqs=4)
    assert sizes.num_blocks == 10
    sources = [config.kv_source(i) for i in range(6)]
    caches = allocate_caches(groups, 6, sizes, BLOCK, "cpu", sources)
    assert caches[4] is caches[2] and caches[5] is caches[3]
    distinct = {id(cache): cache for cache in caches}.values()
    assert len(distinct) == 4
    spare = sum(cache.nbytes // cache.shape[1] for cache in distinct)  # one slot each
    assert sum(cache.nbytes for cache in distinct) == sizes.num_blocks * per_block + spare


def test_a_bfloat16_per_layer_table_stays_mapped_from_its_file(tmp_path):
    """Computing in float32 from a bfloat16 checkpoint: the per-layer input table is the
    file's bytes, mapped (not a parameter, not widened), and the model runs."""
    build_checkpoint("gemma4", tmp_path, dtype=torch.bfloat16)
    config = ModelConfig.from_dir(tmp_path)
    model = load_model(config, tmp_path, torch.float32)
    table = model.model.embed_tokens_per_layer.weight
    assert table.dtype == torch.bfloat16 and table.shape == (256, 6 * 8)
    assert all(param is not table for param in model.parameters())
    address = table.data_ptr()
    with open("/proc/self/maps") as maps:
        mapped = [
            line.split()[-1]
            for line in maps
            if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
        ]
    assert mapped and mapped[0].endswith("model.safetensors"), mapped
    rows = model.model.embed_tokens_per_layer(torch.tensor([3, 7]), torch.float32)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, table[[3, 7]].float() * 8**0.5)


def test_a_kv_shared_layer_s_own_key_and_value_tensors_are_left_unread(checkpoint, tmp_path):
    """Some checkpoints carry k/v projections and norms for the KV-shared layers, which
    the reference ignores: they load and change nothing; any other stray tensor is
    still refused by name."""
    _, directory = checkpoint("gemma4")
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.4.self_attn.k_proj.weight"] = torch.ones(2 * 16, 64)
    tensors["model.layers.5.self_attn.v_norm.weight"] = torch.ones(32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    config = ModelConfig.from_dir(tmp_path)
    load_model(config, tmp_path, torch.float32)
    tensors["model.layers.3.self_attn.v_proj.weight"] = torch.ones(32, 64)  # k_eq_v: none
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.3.self_attn.v_proj"):
        load_model(config, tmp_path, torch.float32)


def _config(kind: str = "gemma4", **changes) -> dict:
    """config.json of the tiny ``kind`` as transformers writes it, with ``changes``."""
    raw = tiny_config(kind).to_dict()
    raw["architectures"] = [FAMILIES[kind].model_class]
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not None or key in changes}


def test_configs_are_read_as_transformers_reads_them():
    """transformers' own per_layer_config and a published config's global_head_dim and
    num_global_key_value_heads say the same; the multimodal config's text tower too."""
    written = ModelConfig.from_dict(_config())
    assert (written.full_head_dim, written.full_kv_heads) == (32, 1)
    assert [written.layer_head_dim(i) for i in range(2)] == [16, 32]
    assert written.rope.kind == "proportional" and written.rope.proportion == 0.25
    assert written.local_rope.theta == 10.0 and written.attention_scale == 1.0
    published = _config(global_head_dim=32, num_global_key_value_heads=1)
    del published["per_layer_config"]
    assert ModelConfig.from_dict(published) == written
    # without k_eq_v the global KV heads are not read, as transformers does not
    no_k_eq_v = ModelConfig.from_dict({**published, "attention_k_eq_v": False})
    assert no_k_eq_v.full_kv_heads is None and no_k_eq_v.full_head_dim == 32
    multimodal = ModelConfig.from_dict(_config("gemma4-multimodal"))
    assert multimodal.num_kv_shared_layers == 2 and multimodal.per_layer_input_size == 8
    assert ModelConfig.from_dict(_config("gemma4-moe")).moe.activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers must be 0 to 5"),
        (
            {
                "num_kv_shared_layers": 5,
                "layer_types": ["full_attention"] + ["sliding_attention"] * 5,
                "per_layer_config": None,
            },
            "no writing layer of kind",
        ),
        ({"per_layer_config": {"0": {"head_dim": 8}}}, "overrides sliding layer 0"),
        ({"per_layer_config": {"1": {"intermediate_size": 8}}}, "only head_dim and"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "default"}}, "each layer kind's RoPE"),
    ],
)
def test_bad_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(**changes))


@pytest.mark.parametrize(
    "sizes",
    [ParallelSizes(tensor=2), ParallelSizes(prefill_context=2), ParallelSizes(2, 1, 2)],
)
def test_splitting_over_ranks_is_refused_by_name(sizes):
    config = ModelConfig.from_dict(_config())
    with pytest.raises(ValueError, match="Gemma 4 is not split over ranks"):
        check_parallel(config, sizes)
