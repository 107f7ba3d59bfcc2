"""The decode-attention kernel reads the paged cache in place and computes what softmax
attention over each request's gathered context computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import SHORT_SEQ_LENS, short_query_metadata
from updraft import LLM, SamplingParams
from updraft.attention.gqa import PagedKV
from updraft.attention.in_place import IN_PLACE_MAX_QUERY
from updraft.attention.loop import attend
from updraft.kernels.build import kernel_builds

pytestmark = pytest.mark.skipif(
    not kernel_builds("paged_attention"), reason="needs a C compiler to build the kernel"
)


def reference(query, kv_cache, block_table, seq_lens, block_size, scale):
    """Softmax attention of each request's one query over its context, gathered."""
    heads, kv_heads = query.shape[1], kv_cache.shape[2]
    out = torch.zeros_like(query)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        positions = torch.arange(length)
        slots = block_table[b, positions // block_size] * block_size + positions % block_size
        k = kv_cache[0, slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = kv_cache[1, slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        q = query[b][:, None]  # [H, 1, D]
        out[b] = F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
# 24: one position and column at a time; 136: four positions at a time, and an output of
# two 64-column slices kept in registers and 8 columns left over
@pytest.mark.parametrize("head_dim", [24, 136])
@pytest.mark.usefixtures("all_cores")
def test_kernel_equals_attention_over_the_gathered_context(heads, kv_heads, head_dim):
    torch.manual_seed(heads * 10 + kv_heads)
    block_size, num_blocks = 4, 40
    kv_cache = torch.randn(2, num_blocks * block_size + 1, kv_heads, head_dim)
    seq_lens = torch.tensor([1, 17, 0, 33, 5])  # a padding row with no context
    block_table = torch.full((5, 9), -1)
    order = torch.randperm(num_blocks)  # blocks anywhere in the cache, in any order
    used = 0
    for b, length in enumerate(seq_lens.tolist()):
        count = -(-length // block_size)
        block_table[b, :count] = order[used : used + count]
        used += count
    query = torch.randn(5, heads, head_dim)
    got, lse = torch.ops.updraft.paged_decode_attention(
        query, kv_cache, block_table, seq_lens, block_size, 0.3
    )
    assert lse.numel() == 0  # not asked for
    want = reference(query, kv_cache, block_table, seq_lens, block_size, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[2].eq(0).all()


def test_asked_for_it_returns_each_head_s_log_sum_exp():
    """What decode context parallelism merges shards by: the same output, and per head
    the log-sum-exp of its scaled scores; -1e30 (weight 0 in a merge) for no context."""
    torch.manual_seed(5)
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 16
    kv_cache = torch.randn(2, 20 * block_size + 1, kv_heads, head_dim)
    block_table = torch.randperm(20)[:12].view(3, 4)
    seq_lens = torch.tensor([13, 0, 16])
    query = torch.randn(3, heads, head_dim)
    out, lse = torch.ops.updraft.paged_decode_attention(
        query, kv_cache, block_table, seq_lens, block_size, 0.4, True
    )
    plain, _ = torch.ops.updraft.paged_decode_attention(
        query, kv_cache, block_table, seq_lens, block_size, 0.4
    )
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    for b in (0, 2):
        positions = torch.arange(int(seq_lens[b]))
        slots = block_table[b, positions // block_size] * block_size + positions % block_size
        keys = kv_cache[0, slots].repeat_interleave(heads // kv_heads, dim=1)  # [K, H, D]
        scores = torch.einsum("hd,khd->hk", query[b], keys) * 0.4
        torch.testing.assert_close(lse[b], scores.logsumexp(dim=-1), atol=1e-5, rtol=1e-5)
    assert (lse[1] == -1e30).all() and out[1].eq(0).all()


@pytest.mark.usefixtures("all_cores")
def test_latent_kernel_is_multi_query_attention_over_the_rows_it_names():
    """MLA's absorbed decode: one KV head whose key is the first W columns of a latent
    row and whose value is its first L; the rest of the row (DSA's indexer key) is not
    read. As GQA with one KV head over the same rows, gathered."""
    torch.manual_seed(3)
    block_size, latent, rope, extra, heads = 4, 24, 8, 16, 5
    cache = torch.randn(30 * block_size + 1, latent + rope + extra)
    block_table = torch.randperm(30)[:18].view(3, 6)
    seq_lens = torch.tensor([21, 1, 0])
    query = torch.randn(3, heads, latent + rope)
    got, _ = torch.ops.updraft.paged_latent_attention(
        query, cache, block_table, seq_lens, block_size, 0.2, latent
    )
    width = latent + rope
    as_gqa = torch.stack([cache[:, :width], F.pad(cache[:, :latent], (0, rope))])[
        :, :, None
    ]  # values padded to the key width: GQA's layout
    want = reference(query, as_gqa, block_table, seq_lens, block_size, 0.2)[..., :latent]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (3, heads, latent) and got[2].eq(0).all()
    # With the log-sum-exp (decode context parallelism over a latent cache).
    out, lse = torch.ops.updraft.paged_latent_attention(
        query, cache, block_table, seq_lens, block_size, 0.2, latent, True
    )
    torch.testing.assert_close(out, got, atol=0, rtol=0)
    positions = torch.arange(21)
    slots = block_table[0, positions // block_size] * block_size + positions % block_size
    scores = query[0] @ cache[slots, :width].T * 0.2  # [heads, 21]
    torch.testing.assert_close(lse[0], scores.logsumexp(dim=-1), atol=1e-5, rtol=1e-5)
    assert (lse[2] == -1e30).all()


@pytest.mark.parametrize("head_dim", [8, 64])
def test_a_missing_block_is_skipped_not_read(head_dim):
    """A block id of -1 inside the context (an inconsistent step) reads nothing: the
    kernel attends to the positions it can address and stays in bounds."""
    kv_cache = torch.randn(2, 8 * 4 + 1, 1, head_dim)
    block_table = torch.tensor([[2, -1, 10**9]])
    query = torch.randn(1, 1, head_dim)
    got, _ = torch.ops.updraft.paged_decode_attention(
        query, kv_cache, block_table, torch.tensor([12]), 4, 1.0
    )
    want = reference(query, kv_cache, block_table[:, :1], torch.tensor([4]), 4, 1.0)
    torch.testing.assert_close(got, want)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="float32 tensors on the CPU"):
        torch.ops.updraft.paged_decode_attention(
            torch.randn(1, 2, 8).double(), torch.randn(2, 9, 2, 8).double(),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 8, 1.0,
        )  # fmt: skip
    with pytest.raises(TypeError, match="whole query-head groups"):
        torch.ops.updraft.paged_decode_attention(
            torch.randn(1, 3, 8), torch.randn(2, 9, 2, 8),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 8, 1.0,
        )  # fmt: skip


def test_engine_decodes_read_the_cache_in_place(tiny_llama, monkeypatch):
    """Decode groups never gather their context; prefill groups of long queries do."""
    gathered = []
    original = PagedKV.gathered

    def spy(self, tokens, group, *args):
        gathered.append(group.query_index.shape[1])  # the group's longest query
        return original(self, tokens, group, *args)

    monkeypatch.setattr(PagedKV, "gathered", spy)
    llm = LLM(tiny_llama, num_kv_blocks=32)
    llm.generate([list(range(1, 21))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert gathered and all(longest > IN_PLACE_MAX_QUERY for longest in gathered)


def test_loading_the_kernels_keeps_subnormal_floats():
    """The kernels are compiled with -ffast-math but must not be linked with it, which
    would switch the whole process to flush-to-zero (hypothesis, numpy and torch all
    notice)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from updraft.kernels.build import load\n"
        "load('paged_attention'); load('linear')\n"
        "tiny = sys.float_info.min\n"
        "assert tiny / 4 > 0, 'subnormals flushed'\n"
        "assert (torch.tensor([torch.finfo(torch.float32).tiny]) / 4).item() > 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.usefixtures("all_cores")
def test_short_queries_read_the_cache_in_place_and_equal_the_gathered_path(monkeypatch):
    """A verify-sized group (queries of 2-4 tokens, one of them a whole short prompt) runs
    the kernel, one causal context per query token, and equals padded attention."""
    torch.manual_seed(5)
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    kv_cache = torch.randn(2, 40 * block_size + 1, kv_heads, head_dim)
    block_table = torch.zeros(3, 6, dtype=torch.long)  # padded as StepInputs pads it
    order = torch.randperm(40)
    used = 0
    for b, length in enumerate(SHORT_SEQ_LENS):
        count = -(-length // block_size)
        block_table[b, :count] = order[used : used + count]
        used += count
    metadata = short_query_metadata(block_table, block_size)
    query = torch.randn(9, heads, head_dim)
    group = metadata.group(0)
    reader = PagedKV(query, kv_cache, 0.25)
    want, _ = reader.gathered(slice(0, 9), group, group.mask, False)

    def gathering(*args, **kwargs):
        raise AssertionError("a short-query group gathered its context")

    monkeypatch.setattr(PagedKV, "gathered", gathering)
    got = attend(reader, metadata)
    torch.testing.assert_close(got, want.flatten(1), atol=1e-5, rtol=1e-5)
