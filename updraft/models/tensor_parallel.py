"""Tensor parallelism for the Llama family, DeepSeek, gpt-oss and the hybrid Qwen3.5
family: one rank's shard of a model.

``shard_model`` splits a model built on the meta device (models/loader.py) and says, for
each parameter, what the rank keeps of the checkpoint tensors that fill it (``Kept``), so
that each rank reads only its own rows and columns; on a loaded model it keeps the shard
of the weights it holds. The split, before the linears are packed:

* q/k/v and gate/up are column-parallel: rank r keeps its heads (and its slice of the
  MLP's intermediate rows) of every fused part. KV heads split like the query heads;
  where there are fewer KV heads than ranks, each rank keeps the one its query heads
  read (replicated). Under decode context parallelism the C ranks of a group keep the
  same KV heads (each stores every C-th position) and the heads split T / C ways. A
  gated attention's query rows (per head its query, then its gate) split by heads too.
* o_proj and down_proj are row-parallel: each rank multiplies its slice of the inputs,
  and one all-reduce sums the partial outputs: one per attention, one per MLP.
* The embedding and the LM head are vocabulary-parallel: each rank holds a contiguous
  slice of rows (the last one padded with zeros); an embedding lookup is a masked
  lookup and an all-reduce, and the logits are every rank's slice gathered in order.
* DeepSeek: the query and key/value up-projections split by heads and o_proj is
  row-parallel; the latent down-projections, the latent cache and DSA's indexer stay
  whole on every rank. Every expert's intermediate rows split like an MLP's (the router
  whole), and the routed and shared experts' parts are summed in one all-reduce.
* Gated DeltaNet (linear attention): the key heads split, each with the value heads it
  serves, so a rank's state holds whole heads (``local_config`` says their counts).
  Every projection keeps its rows of those heads: the q, k and v sections of the q/k/v
  channels and of the convolution (three ranges of one tensor, kept end to end), z, b,
  a, the per-value-head decay and its bias; Qwen3-Next's projections, interleaved per
  key head, keep one range. The gated norm (per head) is whole; out_proj is
  row-parallel, one all-reduce.
* gpt-oss: attention as Llama's, each rank with its heads' sinks; its experts are
  whole on every rank (each computes the same mixture), with no all-reduce.

The residual stream is whole on every rank, so everything else (norms, RoPE, sampling,
hidden states for a proposer) is as in one process. Collectives are the ops of
``parallel/collectives.py``, so captured steps record and replay them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from updraft.model_config import ModelConfig
from updraft.model_config.parts import LinearAttentionConfig
from updraft.models.deepseek import LatentAttention
from updraft.models.gated_delta_net import GatedDeltaNet
from updraft.models.gpt_oss import GptOssMoE
from updraft.models.layers import MLP, CausalLM, DecoderLayer, FusedLinear
from updraft.models.llama import Attention
from updraft.models.moe import SparseMoE
from updraft.parallel import collectives  # noqa: F401 (registers the collective ops)
from updraft.parallel.topology import GroupRank, ParallelSizes, RankPlace
from updraft.weights import INT4_GROUP_SIZES, WeightFormat

# An index range of a checkpoint tensor, or several ranges kept end to end.
Rows = slice | tuple[slice, ...]


@dataclass(frozen=True)
class Kept:
    """What a rank keeps of the checkpoint tensors of one parameter: its own parameter
    ``param``, and of each part (a fused projection's parts; an expert's gate and up) the
    index range along ``dim`` (``dim`` None: all of it), or ranges (``Rows``). A range
    may run past the tensor's end (the last vocabulary shard), its rows left zero.
    ``zeros``: the rank holds zeros (a row-parallel bias, which rank 0 alone adds)."""

    param: nn.Parameter
    dim: int | None = None
    parts: tuple[Rows, ...] = ()
    zeros: bool = False


def pieces(rows: Rows) -> tuple[slice, ...]:
    """The ranges of ``rows``, in the order the rank keeps them."""
    return rows if isinstance(rows, tuple) else (rows,)


def kept_count(rows: Rows) -> int:
    return sum(piece.stop - piece.start for piece in pieces(rows))


Shards = dict[nn.Parameter, Kept]  # an unsplit parameter -> what one rank keeps of it


def check_parallel(
    config: ModelConfig, sizes: ParallelSizes, weights: WeightFormat | None = None
) -> None:
    """Refuse, by name, a model that cannot be split as ``sizes`` says, or whose
    quantization groups (``weights``) a row-parallel split would cut."""
    sizes.check()
    if sizes.world == 1:
        return
    if config.quantized is not None and sizes.tensor > 1:
        raise ValueError(
            f"a {config.quantized.method} checkpoint is not split over tensor-parallel ranks "
            "yet: run it with tensor_parallel_size 1"
        )
    if (
        config.full_head_dim is not None
        or config.num_kv_shared_layers
        or config.per_layer_input_size
    ):
        raise ValueError(
            "Gemma 4 is not split over ranks yet (its full-attention layers' own heads, "
            "KV-shared layers and per-layer inputs have no shard): run it with "
            "tensor_parallel_size, prefill_context_parallel_size and "
            "decode_context_parallel_size 1"
        )
    if config.linear_layers and (sizes.prefill_context > 1 or sizes.decode_context > 1):
        raise ValueError(
            "context parallelism (prefill_context_parallel_size, "
            "decode_context_parallel_size) is not supported for a model with linear-attention "
            "layers: their recurrent state is one per request, not split by position "
            "(ARCHITECTURE.md, Hybrid models); use tensor_parallel_size"
        )
    size, kv_ranks = sizes.tensor, sizes.tensor // sizes.decode_context
    kv = config.num_kv_heads
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    if config.mla is None and kv % kv_ranks and kv_ranks % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of {kv_ranks})")
    if config.intermediate_size % size:
        problems.append(f"an MLP of {config.intermediate_size} rows")
    if config.moe is not None and config.moe.moe_intermediate_size % size:
        problems.append(f"experts of {config.moe.moe_intermediate_size} rows")
    if config.moe is not None and config.moe.shared_size % size:
        problems.append(f"shared experts of {config.moe.shared_size} rows")
    linear = config.linear_attention
    if linear is not None and (linear.num_key_heads % size or linear.num_value_heads % size):
        problems.append(
            f"{linear.num_key_heads} linear-attention key heads and "
            f"{linear.num_value_heads} value heads"
        )
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide this model's {', '.join(problems)}"
        )
    if weights is not None and weights.quantized and weights.group_size:
        _check_groups(config, size, weights)


def _check_groups(config: ModelConfig, size: int, weights: WeightFormat) -> None:
    """A rank quantizes the columns it keeps of a row-parallel layer (o_proj, down_proj,
    the experts' down projections, a Gated DeltaNet's out_proj): its groups are one
    process's only where each rank's share is a whole number of groups."""
    v_dim = config.mla.v_head_dim if config.mla is not None else config.head_dim
    widths = {"o_proj": config.num_heads * v_dim, "down_proj": config.intermediate_size}
    if config.linear_attention is not None:
        widths["the linear-attention out_proj"] = config.linear_attention.value_dim
    if config.moe is not None:
        widths["the experts' down_proj"] = config.moe.moe_intermediate_size
        if config.moe.shared_size:
            widths["the shared experts' down_proj"] = config.moe.shared_size
    group = weights.group_size
    cut = [
        f"{name} ({width // size} columns per rank)"
        for name, width in widths.items()
        if (width // size) % group
    ]
    if cut:
        raise ValueError(
            f"{weights.name} groups of {group} columns would straddle the tensor-parallel "
            f"shards of {', '.join(cut)}: use --quantization-group-size "
            f"{min(INT4_GROUP_SIZES)} or fewer ranks"
        )


def local_config(config: ModelConfig, sizes: ParallelSizes) -> ModelConfig:
    """What one rank's layers hold: its query and KV heads (KV cache shape included)."""
    kv_ranks = sizes.tensor // sizes.decode_context
    return replace(
        config,
        num_heads=config.num_heads // sizes.tensor,
        num_kv_heads=max(1, config.num_kv_heads // kv_ranks),
        linear_attention=local_linear_attention(config.linear_attention, sizes.tensor),
    )


def local_linear_attention(
    linear: LinearAttentionConfig | None, ranks: int
) -> LinearAttentionConfig | None:
    """One rank's Gated DeltaNet heads: its share of the key heads and of the value
    heads they serve (``check_parallel`` makes sure both divide)."""
    if linear is None:
        return None
    return replace(
        linear,
        num_key_heads=linear.num_key_heads // ranks,
        num_value_heads=linear.num_value_heads // ranks,
    )


class SummedOverRanks(nn.Module):
    """A module whose output each rank holds a part of, summed over the ranks: a
    row-parallel linear (its slice of the inputs), or a DeepSeekMoE (its slice of every
    expert's rows: the routed and shared experts summed in one all-reduce)."""

    def __init__(self, module: nn.Module, group: str) -> None:
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.updraft.all_reduce(self.module(x), self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the embedding; other ids look up zeros here and
    their rows come from the rank that holds them."""

    def __init__(self, weight: torch.Tensor, first: int, group: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first = first
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return torch.ops.updraft.all_reduce(rows * mine[:, None].to(rows.dtype), self.group)


class VocabParallelHead(nn.Module):
    """This rank's rows of the LM head; the logits are every rank's, in order."""

    def __init__(self, linear: nn.Linear, vocab_size: int, rank: GroupRank) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.rank = rank

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.ops.updraft.all_gather_last(
            self.linear(hidden), self.rank.group, self.rank.size
        )
        return logits[..., : self.vocab_size]


def _take(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The rows (dim 0) of ``tensor`` that ``rows`` says, end to end."""
    return torch.cat([tensor[piece] for piece in pieces(rows)]).contiguous()


def _rows(weight: torch.Tensor, parts: list[int], keep: list[Rows]) -> torch.Tensor:
    """Of each part of a fused weight (stacked on dim 0), the rows ``keep`` says."""
    return torch.cat(
        [_take(part, rows) for part, rows in zip(weight.split(parts), keep, strict=True)]
    ).contiguous()


def _keep(
    kept: Shards, old: nn.Parameter, new: torch.Tensor, dim: int | None = None, *parts: slice
) -> nn.Parameter:
    """``new`` as the rank's parameter in place of ``old``, recorded in ``kept``."""
    param = nn.Parameter(new, requires_grad=False)
    kept[old] = Kept(param, dim, parts)
    return param


def _shard_fused(linear: FusedLinear, keep: list[Rows], kept: Shards) -> FusedLinear:
    weight = _rows(linear.weight.detach(), linear.split_sizes, keep)
    sizes = [kept_count(rows) for rows in keep]
    with torch.device("meta"):  # its parameters are replaced right away
        sharded = FusedLinear(linear.in_features, sizes, bias=linear.bias is not None)
    sharded.weight = _keep(kept, linear.weight, weight, 0, *keep)
    if linear.bias is not None:
        bias = _rows(linear.bias.detach(), linear.split_sizes, keep)
        sharded.bias = _keep(kept, linear.bias, bias, 0, *keep)
    return sharded


def _row_slice(linear: nn.Linear, columns: slice, rank: GroupRank, kept: Shards) -> nn.Linear:
    """This rank's input columns of ``linear``; the caller sums the outputs."""
    sharded = nn.Linear(
        columns.stop - columns.start, linear.out_features, bias=False, device="meta"
    )
    weight = linear.weight.detach()[:, columns].contiguous()
    sharded.weight = _keep(kept, linear.weight, weight, 1, columns)
    if linear.bias is not None:  # added once, by rank 0
        if rank.rank == 0:
            sharded.bias = _keep(kept, linear.bias, linear.bias.detach())
        else:
            sharded.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
            kept[linear.bias] = Kept(sharded.bias, zeros=True)
    return sharded


def _row_parallel(
    linear: nn.Linear, columns: slice, rank: GroupRank, kept: Shards
) -> SummedOverRanks:
    return SummedOverRanks(_row_slice(linear, columns, rank, kept), rank.group)


def _share(count: int, rank: GroupRank) -> slice:
    per_rank = count // rank.size
    return slice(rank.rank * per_rank, (rank.rank + 1) * per_rank)


def _shard_attention(attention: Attention, place: RankPlace, kept: Shards) -> None:
    dim, rank, kv_rank = attention.head_dim, place.tensor, place.kv_heads
    heads = _share(attention.num_heads, rank)
    if attention.num_kv_heads >= kv_rank.size:
        kv_heads = _share(attention.num_kv_heads, kv_rank)
    else:  # the KV head the query heads of this rank's KV group read
        group_heads = _share(attention.num_heads, kv_rank)
        kv_head = group_heads.start // (attention.num_heads // attention.num_kv_heads)
        kv_heads = slice(kv_head, kv_head + 1)
    # A gated attention's query rows hold per head its query, then its gate.
    q_width = 2 * dim if attention.output_gate else dim
    q_rows = slice(heads.start * q_width, heads.stop * q_width)
    kv_rows = slice(kv_heads.start * dim, kv_heads.stop * dim)
    attention.qkv_proj = _shard_fused(attention.qkv_proj, [q_rows, kv_rows, kv_rows], kept)
    o_columns = slice(heads.start * dim, heads.stop * dim)
    attention.o_proj = _row_parallel(attention.o_proj, o_columns, rank, kept)
    attention.num_heads = heads.stop - heads.start
    attention.num_kv_heads = kv_heads.stop - kv_heads.start
    if attention.sinks is not None:  # gpt-oss's: one per query head
        old = attention.sinks
        attention.sinks = _keep(kept, old, old.detach()[heads].contiguous(), 0, heads)


def _shard_mlp(mlp: MLP, rank: GroupRank, kept: Shards, reduce: bool = True) -> None:
    """``reduce``: the down projection's all-reduce; without it, the caller sums."""
    rows = _share(mlp.down_proj.in_features, rank)
    mlp.gate_up_proj = _shard_fused(mlp.gate_up_proj, [rows, rows], kept)
    down = _row_slice(mlp.down_proj, rows, rank, kept)
    mlp.down_proj = SummedOverRanks(down, rank.group) if reduce else down


def _column(linear: nn.Linear, rows: slice, kept: Shards) -> nn.Linear:
    """A linear keeping output rows ``rows``."""
    sharded = nn.Linear(linear.in_features, rows.stop - rows.start, bias=False, device="meta")
    sharded.weight = _keep(kept, linear.weight, linear.weight.detach()[rows].contiguous(), 0, rows)
    return sharded


def _times(heads: slice, width: int, offset: int = 0) -> slice:
    """The rows of ``heads`` heads of ``width`` rows each, from row ``offset`` on."""
    return slice(offset + heads.start * width, offset + heads.stop * width)


def _shard_linear_attention(layer: GatedDeltaNet, rank: GroupRank, kept: Shards) -> None:
    """The rank's key heads and the value heads they serve, in every projection."""
    linear = layer.linear
    key_heads = _share(linear.num_key_heads, rank)
    per_key = linear.num_value_heads // linear.num_key_heads
    value_heads = _times(key_heads, per_key)
    key_dim, value_dim = linear.key_head_dim, linear.value_head_dim
    values = _times(value_heads, value_dim)
    channels = (  # of q, of k, of v: the convolution's channels and in_proj_qkv's rows
        _times(key_heads, key_dim),
        _times(key_heads, key_dim, linear.key_dim),
        _times(value_heads, value_dim, 2 * linear.key_dim),
    )
    if layer.interleaved:  # per key head: q, k, v, z; and b, a
        per_head = 2 * key_dim + 2 * per_key * value_dim
        layer.in_proj_qkvz = _column(layer.in_proj_qkvz, _times(key_heads, per_head), kept)
        layer.in_proj_ba = _column(layer.in_proj_ba, _times(key_heads, 2 * per_key), kept)
    else:
        keep = [channels, values, value_heads, value_heads]
        layer.in_proj = _shard_fused(layer.in_proj, keep, kept)
        layer.projection_sizes = layer.in_proj.split_sizes
    conv = layer.conv1d.weight
    layer.conv1d.weight = _keep(kept, conv, _take(conv.detach(), channels), 0, channels)
    for name in ("dt_bias", "A_log"):
        old = getattr(layer, name)
        setattr(layer, name, _keep(kept, old, _take(old.detach(), value_heads), 0, value_heads))
    layer.out_proj = _row_parallel(layer.out_proj, values, rank, kept)
    layer.linear = local_linear_attention(linear, rank.size)


def _shard_latent_attention(attention: LatentAttention, place: RankPlace, kept: Shards) -> None:
    """Heads split; the latent down-projections, the latent cache and DSA's indexer are
    whole on every rank (each writes the same rows and selects the same context), or,
    under decode context parallelism, the cache keeps the rank's positions."""
    rank = place.tensor
    mla, heads = attention.mla, _share(attention.num_heads, rank)
    qk, per_head = attention.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    q_rows = slice(heads.start * qk, heads.stop * qk)
    if mla.q_lora_rank is not None:
        attention.q_b_proj = _column(attention.q_b_proj, q_rows, kept)
    else:  # the query is the first part of the fused down-projection
        latent = attention.down_sizes[1]
        keep = [q_rows, slice(0, latent)]
        attention.qkv_a_proj = _shard_fused(attention.qkv_a_proj, keep, kept)
        attention.down_sizes = [q_rows.stop - q_rows.start, latent]
    up_rows = slice(heads.start * per_head, heads.stop * per_head)
    up = attention.kv_b_proj.weight
    attention.kv_b_proj.weight = _keep(kept, up, up.detach()[up_rows].contiguous(), 0, up_rows)
    v_rows = slice(heads.start * mla.v_head_dim, heads.stop * mla.v_head_dim)
    attention.o_proj = _row_parallel(attention.o_proj, v_rows, rank, kept)
    attention.num_heads = heads.stop - heads.start


def _shard_moe(moe: SparseMoE, rank: GroupRank, kept: Shards) -> SummedOverRanks:
    """Every expert's intermediate rows split (the router whole on every rank, so each
    routes alike); each rank's partial output is summed once. An expert's checkpoint
    tensors are its gate and up [I, H] (rows kept) and down [H, I] (columns kept)."""
    experts = moe.experts
    size = experts.down_proj.shape[2]
    rows = _share(size, rank)
    old_gate_up, old_down = experts.gate_up_proj, experts.down_proj
    gate, up = old_gate_up.detach().split(size, dim=1)
    gate_up = torch.cat([gate[:, rows], up[:, rows]], dim=1).contiguous()
    experts.gate_up_proj = _keep(kept, old_gate_up, gate_up, 0, rows, rows)
    down = old_down.detach()[:, :, rows].contiguous()
    experts.down_proj = _keep(kept, old_down, down, 1, rows)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, kept, reduce=False)
    return SummedOverRanks(moe, rank.group)


def _vocab_rows(vocab_size: int, rank: GroupRank) -> tuple[int, int]:
    """(first row, rows per rank): every rank holds the same count, the last padded."""
    per_rank = -(-vocab_size // rank.size)
    return rank.rank * per_rank, per_rank


def _padded_rows(weight: torch.Tensor, first: int, count: int) -> torch.Tensor:
    rows = weight[first : first + count]
    if rows.shape[0] == count:
        return rows.clone()
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], *rows.shape[1:])])


@torch.no_grad()
def shard_model(model: CausalLM, place: RankPlace) -> Shards:
    """Keep, in place, the shard of every layer of ``model`` (loaded, or on the meta
    device) that the rank at ``place`` holds; what it keeps of each parameter."""
    rank, kept = place.tensor, {}
    vocab_size = model.model.embed_tokens.num_embeddings
    first, count = _vocab_rows(vocab_size, rank)
    rows = slice(first, first + count)
    old_embedding, old_head = model.model.embed_tokens.weight, model.lm_head.weight
    embedding = _padded_rows(old_embedding, first, count)
    head = nn.Linear(model.lm_head.in_features, count, bias=False, device="meta")
    model.model.embed_tokens = VocabParallelEmbedding(embedding, first, rank.group)
    kept[old_embedding] = Kept(model.model.embed_tokens.weight, 0, (rows,))
    if old_head is old_embedding:  # tied
        head.weight = model.model.embed_tokens.weight
    else:
        head.weight = _keep(kept, old_head, _padded_rows(old_head, first, count), 0, rows)
    model.lm_head = VocabParallelHead(head, vocab_size, rank)
    kept.update(shard_layers(model.model.layers, place))
    return kept


def shard_layers(layers: Iterable[DecoderLayer], place: RankPlace) -> Shards:
    """``shard_layer`` of each of ``layers``; what the rank keeps of their parameters."""
    kept: Shards = {}
    for layer in layers:
        kept.update(shard_layer(layer, place))
    return kept


def splits_tensors(place: RankPlace | None) -> bool:
    """Whether the rank at ``place`` holds a shard of each layer, not the whole."""
    return place is not None and place.sizes.tensor > 1


@torch.no_grad()
def shard_layer(layer: DecoderLayer, place: RankPlace) -> Shards:
    """Keep, in place, the rank's shard of one decoder layer (a target's, or a draft
    head's, which splits like a target layer of its kind); what it keeps of each
    parameter."""
    kept: Shards = {}
    if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
        _shard_linear_attention(layer.linear_attn, place.tensor, kept)
    elif isinstance(layer.self_attn, LatentAttention):
        _shard_latent_attention(layer.self_attn, place, kept)
    else:
        _shard_attention(layer.self_attn, place, kept)
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp = _shard_moe(layer.mlp, place.tensor, kept)
    elif isinstance(layer.mlp, GptOssMoE):
        pass  # whole on every rank: each computes the same mixture, no all-reduce
    else:
        _shard_mlp(layer.mlp, place.tensor, kept)
    return kept
