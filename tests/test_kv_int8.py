"""The int8 KV cache (``--kv-cache-dtype int8``): the one write op rounds each head row
to int8 codes and a scale, and every reader (the decode kernel in place, the gathered
path) attends over exactly those rounded values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import greedy, short_query_metadata, token_ids, token_prompts
from tests.probes import logits_of, probed, records
from updraft import LLM
from updraft.attention import gqa
from updraft.attention.gqa import PagedKV
from updraft.attention.kv_int8 import dequantize_rows, quantize_rows
from updraft.attention.loop import attend
from updraft.kernels.attention_ops import paged_decode_attention_launch, write_kv_launch
from updraft.kernels.build import kernel_builds

pytestmark = pytest.mark.skipif(
    not kernel_builds("paged_attention"), reason="needs a C compiler to build the kernel"
)
# The machine's own build, one for AVX2 without AVX-512, and one for a CPU without any
# vector extension.
MARCHES = ("native", "haswell", "x86-64")


def codes_and_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's rows [..., D + 4] read apart, without the module's dequantizer:
    the codes as int64 and each row's scale as float64 [..., 1]."""
    dim = rows.shape[-1] - 4
    scale = rows[..., dim:].contiguous().view(torch.float32).double()
    return rows[..., :dim].long(), scale


def float64_reference(query, cache, block_table, seq_lens, block_size, scale, starts=None):
    """Each request's one query over the dequantized codes of its context, in float64."""
    keys, key_scales = codes_and_scales(cache[0])
    values, value_scales = codes_and_scales(cache[1])
    keys, values = keys * key_scales, values * value_scales
    heads, kv_heads = query.shape[1], cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        first = 0 if starts is None else int(starts[b])
        if length <= first:
            continue
        positions = torch.arange(first, length)
        slots = block_table[b, positions // block_size] * block_size + positions % block_size
        k = keys[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = values[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(query[b].double()[:, None], k, v, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("march", MARCHES)
def test_the_write_rounds_each_head_row_to_codes_and_a_scale(march):
    """Every head row of a written slot is codes c in [-127, 127] and a scale s with
    |x - c s| <= s / 2 and max |c| = 127, bit for bit what the torch rounding gives;
    slot -1 lands in the spare last slot; keys and values may be strided views."""
    torch.manual_seed(1)
    heads, dim, slots = 3, 40, 17
    fused = torch.randn(6, 3 * heads * dim) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(
        heads * dim
    )
    fused[2, heads * dim : heads * dim + dim] = 0  # a key row of zeros
    key = fused[:, heads * dim : 2 * heads * dim].view(6, heads, dim)
    value = fused[:, 2 * heads * dim :].view(6, heads, dim)
    slot_mapping = torch.tensor([4, 0, 11, -1, 15, 7])
    cache = torch.zeros(2, slots, heads, dim + 4, dtype=torch.int8)
    write_kv_launch(cache, key, value, slot_mapping, march=march)()
    written = slot_mapping.remainder(slots)
    for half, source in ((0, key), (1, value)):
        rows = cache[half, written]
        assert torch.equal(rows, quantize_rows(source))
        codes, scale = codes_and_scales(rows)
        x = source.double()
        assert codes.abs().max() <= 127
        assert (codes.abs().amax(-1) == 127).sum() == rows.shape[0] * heads - (half == 0)
        # half a step, and the few float32 roundings of the scale and its inverse
        assert ((x - codes * scale).abs() <= scale * (0.5 + 1e-4)).all()
        torch.testing.assert_close(scale[..., 0], x.abs().amax(-1) / 127, rtol=1e-6, atol=0)
    untouched = torch.ones(slots, dtype=torch.bool).index_fill_(0, written, False)
    assert cache[:, untouched].eq(0).all()


@pytest.mark.parametrize("march", MARCHES)
# 24: one position and column at a time; 136: four positions at a time, and an output of
# two 64-column slices kept in registers and 8 columns left over
@pytest.mark.parametrize("head_dim", [24, 136])
@pytest.mark.usefixtures("all_cores")
def test_the_kernel_attends_over_the_rounded_values(march, head_dim):
    """The decode kernel over an int8 cache (three query heads to each of two KV heads)
    equals float64 attention over the codes times their scales, within float32
    rounding, with and without a window's starts."""
    heads, kv_heads = 6, 2
    torch.manual_seed(head_dim)
    block_size, num_blocks = 4, 48
    cache = torch.zeros(2, num_blocks * block_size + 1, kv_heads, head_dim + 4, dtype=torch.int8)
    rows = num_blocks * block_size
    keys, values = torch.randn(rows, kv_heads, head_dim) * 2, torch.randn(rows, kv_heads, head_dim)
    write_kv_launch(cache, keys, values, torch.arange(rows), march=march)()
    seq_lens = torch.tensor([1, 17, 0, 33, 5])
    block_table = torch.randperm(num_blocks)[:45].view(5, 9)
    query = torch.randn(5, heads, head_dim)
    for starts in (None, torch.tensor([0, 9, 0, 30, 2])):
        got, lse = paged_decode_attention_launch(
            query, cache, block_table, seq_lens, block_size, 0.3, True, starts, march=march
        )()
        want = float64_reference(query, cache, block_table, seq_lens, block_size, 0.3, starts)
        # float32 sums' rounding; a value off by one rounding step would be ~1e-2 off
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
        assert got[2].eq(0).all() and (lse[2] == -1e30).all()


def test_the_gathered_path_and_the_torch_write_read_the_same_rounded_values(monkeypatch):
    """Without the C write (a GPU's cache) the torch rounding writes the same bytes, and
    a group of short queries read in place equals the same group gathered and
    dequantized."""
    torch.manual_seed(5)
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    cache = torch.zeros(2, 40 * block_size + 1, kv_heads, head_dim + 4, dtype=torch.int8)
    keys, values = torch.randn(160, kv_heads, head_dim), torch.randn(160, kv_heads, head_dim)
    slots = torch.randperm(160)
    gqa.write_kv(cache, keys, values, slots)
    monkeypatch.setattr(gqa, "writes_kv_in_one_call", lambda *args: False)
    by_torch = torch.zeros_like(cache)
    gqa.write_kv(by_torch, keys, values, slots)
    assert torch.equal(by_torch, cache)

    metadata = short_query_metadata(torch.randperm(40)[:18].view(3, 6), block_size)
    query = torch.randn(9, heads, head_dim)
    group = metadata.group(0)
    gathered, _ = PagedKV(query, cache, 0.25).gathered(slice(0, 9), group, group.mask, False)
    dequantized = torch.stack([dequantize_rows(cache[0]), dequantize_rows(cache[1])])
    as_float, _ = PagedKV(query, dequantized, 0.25).gathered(slice(0, 9), group, group.mask, False)
    torch.testing.assert_close(gathered, as_float, atol=0, rtol=0)
    in_place = attend(PagedKV(query, cache, 0.25), metadata)
    torch.testing.assert_close(in_place, gathered.flatten(1), atol=1e-5, rtol=1e-5)


def rounded_in_a_float_cache(monkeypatch) -> None:
    """Make every write into a float cache store its keys and values rounded as an int8
    cache keeps them: the reference an int8 engine must match."""
    original = gqa.write_kv

    def write_rounded(kv_cache, key, value, slot_mapping):
        if kv_cache.dtype == torch.float32:
            key, value = dequantize_rows(quantize_rows(key)), dequantize_rows(quantize_rows(value))
        original(kv_cache, key, value, slot_mapping)

    monkeypatch.setattr(gqa, "write_kv", write_rounded)


# gemma4: sliding windows beside full layers, KV-shared layers, keys as values, two head
# sizes; gpt-oss: sinks (and a window)
@pytest.mark.parametrize("kind", ["gemma4", "gpt-oss"])
def test_an_int8_engine_equals_a_float_engine_over_the_same_rounded_values(
    kind, tmp_path_factory, monkeypatch
):
    """Greedy generation with an int8 cache (captured decode steps, checked against eager
    by sanitize) gives the tokens and logits of an eager engine whose float cache holds
    the same rounded values; and stays close to the float cache's own."""
    from tests.checkpoints import build_checkpoint

    model = build_checkpoint(kind, tmp_path_factory.mktemp(kind))
    prompts, params = token_prompts(4, seed=3), greedy(12)
    args = dict(block_size=4, num_kv_blocks=128, max_num_seqs=4)
    int8 = probed(model, kv_cache_dtype="int8", sanitize=True, capture_sizes=(1, 2, 4), **args)
    got = int8.generate(prompts, params)
    assert int8.engine.stats().sanitize.healthy
    got_seen = records(int8)
    exact = probed(model, enforce_eager=True, **args)
    plain = exact.generate(prompts, params)
    plain_seen = records(exact)
    with monkeypatch.context() as patch:
        rounded_in_a_float_cache(patch)
        reference = probed(model, enforce_eager=True, **args)
        want = reference.generate(prompts, params)
        want_seen = records(reference)
    assert token_ids(got) == token_ids(want)
    for mine, theirs, float_kv in zip(got, want, plain, strict=True):
        torch.testing.assert_close(
            logits_of(got_seen, mine), logits_of(want_seen, theirs), atol=1e-4, rtol=0
        )
        # Close to the float cache's own where the tokens have not parted yet (a tiny
        # random model's near-ties may part them later): the first token's next-token
        # distribution within a small KL of float KV's.
        mine_first = logits_of(got_seen, mine)[0].log_softmax(-1)
        float_first = logits_of(plain_seen, float_kv)[0].log_softmax(-1)
        assert F.kl_div(mine_first, float_first, log_target=True, reduction="sum") < 0.01


def test_speculation_under_int8_kv_gives_the_tokens_of_plain_decoding(tiny_llama):
    """n-gram drafts verified over an int8 cache: verify steps read the same rounded
    K/V as decode steps, so greedy tokens do not change."""
    prompts = [p * 3 for p in token_prompts(4, seed=7)]  # repeats for n-gram drafts
    params = greedy(16)
    args = dict(block_size=4, num_kv_blocks=256, kv_cache_dtype="int8")
    plain = LLM(tiny_llama, **args).generate(prompts, params)
    llm = LLM(tiny_llama, speculative_method="ngram", num_speculative_tokens=3, **args)
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
    assert llm.engine.stats().speculative.rounds > 0


def test_unsupported_kv_cache_dtypes_are_refused_by_name(tmp_path):
    from tests.checkpoints import build_checkpoint

    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}' is not supported"):
            LLM(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        LLM(kv_cache_dtype="int4")
    model = build_checkpoint("deepseek-v3", tmp_path)
    with pytest.raises(ValueError, match="does not cover the latent cache"):
        LLM(str(model), kv_cache_dtype="int8", num_kv_blocks=16)


def test_the_same_budget_holds_the_blocks_int8_rows_make_room_for(tiny_llama):
    """A block costs its int8 rows' bytes (codes and a scale per head row), so a budget
    holds (4 * head_dim) / (head_dim + 4) times the blocks of float32 KV."""
    from updraft.attention.cache_groups import bytes_per_block, cache_groups
    from updraft.model_config import ModelConfig

    config = ModelConfig.from_dir(tiny_llama)
    kv_heads, dim = config.layer_kv_heads(0), config.layer_head_dim(0)
    per_position = config.num_layers * 2 * kv_heads
    assert bytes_per_block(cache_groups(config, torch.int8), 4) == 4 * per_position * (dim + 4)
    assert bytes_per_block(cache_groups(config, torch.float32), 4) == 4 * per_position * dim * 4
    budget = 2**20
    blocks = {
        kv: LLM(
            tiny_llama,
            kv_cache_dtype=kv,
            kv_cache_memory_gib=budget / 2**30,
            block_size=4,
            enforce_eager=True,
        )
        .engine.stats()
        .kv_blocks_total
        for kv in ("auto", "int8")
    }
    assert blocks["auto"] == budget // (4 * per_position * dim * 4)
    assert blocks["int8"] == budget // (4 * per_position * (dim + 4))
