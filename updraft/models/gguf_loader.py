"""A model's weights read from a GGUF file (``checkpoints/gguf.py``), in the file's own
layout.

Float tensors (F32, F16, BF16) fill the model's parameters and are packed like a
safetensors checkpoint's. Tensors in quantized blocks stay in the file's memory map, as
the file lays them out: a linear layer becomes a ``GGUFLinear`` over its blocks (a fused
q/k/v or gate/up keeps one block tensor per part, each of its own type, as a Q4_K_M file
mixes them; neighbouring slices of one type are joined) and a quantized embedding a
``GGUFEmbedding``, which widens only the rows it looks up. Neither ever holds a float32
copy of its weight. A layer's stacked experts are placed by ``gguf_experts``.

With ``int8_activations`` (``--activations int8``), the linears in the block types
``kernels/gguf_int8.c`` multiplies as bytes (``INT8_TYPES``) keep their rows
regrouped eight at a time, the same bytes in another order, and round x to int8, as
llama.cpp does, and multiply the codes as bytes: a decode step of up to 8 rows in one
pass over the groups, a prefill or a larger batch in integer tiles that reuse each
group across all its rows (``gguf_gemm_int8``). A tied embedding looks its rows up in
the LM head's groups.

Under int8 activations a linear in a block type without an integer kernel is refused,
by its tensor's name (``_with_int8_kernels``), rather than left to take float x; which
activations a checkpoint takes by default is ``models/activations.py``'s to say. A
tensor in blocks of another shape than the weight it fills is refused, by its name,
before a kernel could read past its rows.

Q8_0 and Q4_0 blocks are one scale and 32 codes each, exactly the int8 and int4 panels'
groups of 32 (``kernels/panels.py``), whose kernel streams them at the memory's speed
and runs batches on a widened panel: a linear all of whose parts are in one of those
two types has its codes and scales moved into panels at load, value for value (Q4_0's
codes 0..15 stand for -8..7, as the int4 panels' own do). A tied LM head stays on the
embedding's blocks rather than keep a second copy.

llama.cpp stores a Llama model's q and k rows permuted for its RoPE, which turns
interleaved pairs where transformers turns the two halves of each head: they are put
back in transformers' order here. Its Qwen2 and Qwen3 RoPE is transformers'.
The Gated DeltaNet layers of Qwen3.5's and Qwen3-Next's files pass through
``gguf_linear_attention``, which undoes what the converter changed in them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from updraft.checkpoints.gguf import CONFIG_TENSORS, linked_files
from updraft.checkpoints.gguf_header import read_gguf, walk
from updraft.config import ParallelSizes
from updraft.kernels.gguf_ops import (
    BLOCK_PASSES_UP_TO,
    BLOCK_TYPES,
    BLOCKS,
    GGUF_MAX_ROWS,
    INT8_MAX_ROWS,
    INT8_TYPES,
    gguf_group,
    int8_kernel_builds,
)
from updraft.model_config import ModelConfig
from updraft.model_config.registry import ARCHITECTURES, for_gguf
from updraft.models.gguf_experts import NAMES as EXPERT_NAMES
from updraft.models.gguf_experts import ExpertTensors, down_target
from updraft.models.gguf_floats import fill_and_pack_floats
from updraft.models.gguf_linear_attention import LinearAttentionTensors
from updraft.models.gguf_mla import LatentKV
from updraft.models.gguf_panels import PANEL_FORMATS, block_panels
from updraft.models.gguf_shards import RankShare, block_columns, embedding_over, kept_part
from updraft.models.gguf_tables import GGUFTables
from updraft.models.gguf_tensors import FLOAT_DTYPES, block_rows, float_tensor
from updraft.models.packed_linear import PackedLinear
from updraft.models.read_pages import MappedSpans
from updraft.models.registry import model_class
from updraft.models.tensor_parallel import VocabParallelHead, shard_model
from updraft.models.weight_targets import (
    FUSED,
    Slice,
    building,
    is_split,
    part_of,
    target_of,
)
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat

# llama.cpp's tensor names -> transformers' (the loader's fused slices take it from there)
NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    # DeepSeek's latent attention (gguf_mla.py joins attn_k_b and attn_v_b into attn_kv_b)
    (r"blk\.(\d+)\.attn_q_a\.weight", r"model.layers.\1.self_attn.q_a_proj.weight"),
    (r"blk\.(\d+)\.attn_q_a_norm\.weight", r"model.layers.\1.self_attn.q_a_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q_b\.weight", r"model.layers.\1.self_attn.q_b_proj.weight"),
    (
        r"blk\.(\d+)\.attn_kv_a_mqa\.weight",
        r"model.layers.\1.self_attn.kv_a_proj_with_mqa.weight",
    ),
    (r"blk\.(\d+)\.attn_kv_a_norm\.weight", r"model.layers.\1.self_attn.kv_a_layernorm.weight"),
    (r"blk\.(\d+)\.attn_kv_b\.weight", r"model.layers.\1.self_attn.kv_b_proj.weight"),
    # DeepSeek's shared experts and its router's score bias
    (
        r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight",
        r"model.layers.\1.mlp.shared_experts.\2_proj.weight",
    ),
    (r"blk\.(\d+)\.exp_probs_b\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
)


def hf_name(gguf_name: str, family_names: tuple[tuple[str, str], ...] = ()) -> str | None:
    """transformers' name of a GGUF tensor: the family's own names first (its registry
    row's ``gguf_tensor_names``), then the shared ones."""
    for pattern, replacement in (*family_names, *NAMES, *EXPERT_NAMES):
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    return None


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rows as interleaved rotary pairs) ->
    transformers' (the first halves of the pairs, then the second halves)."""
    n = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


class Part:
    """One checkpoint tensor of a linear: in blocks of ggml type ``code`` (uint8 rows),
    or a float32 weight (``code`` None); ``where``: the file and tensor it came from."""

    def __init__(self, weight: torch.Tensor, code: int | None, where: str = "") -> None:
        self.weight = weight
        self.code = code
        self.where = where


class GGUFLinear(nn.Module):
    """y = x W^T (+ bias), W the rows of each part in turn, each read in its own type.
    With ``int8``, the parts in ``INT8_TYPES`` are kept regrouped eight rows at a time
    (``gguf_ops.gguf_group``), and x is rounded to int8 for them, as llama.cpp does."""

    def __init__(
        self,
        in_features: int,
        parts: list[Part],
        bias: torch.Tensor | None,
        int8: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.int8 = int8 and int8_kernel_builds()
        runs = _runs(parts)
        self.codes = [run[0].code for run in runs]
        self.rows = [sum(part.weight.shape[0] for part in run) for run in runs]
        self.grouped = [self.int8 and code in INT8_TYPES for code in self.codes]
        for index, run in enumerate(runs):
            weights = [part.weight for part in run]
            if self.grouped[index]:  # each part regrouped in place, never joined first
                weight = gguf_group(weights, self.codes[index], in_features)
            else:  # rows of blocks are read as they lie: joined once, at load
                weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.register_buffer(f"part{index}", weight, persistent=False)
        self.out_features = sum(self.rows)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        outs = [self._part(flat, index) for index in range(len(self.codes))]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _part(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        weight = getattr(self, f"part{index}")
        code, k = self.codes[index], self.in_features
        if code is None:
            return F.linear(flat, weight)
        rows = flat.shape[0]
        if self.grouped[index]:
            n = self.rows[index]
            if rows <= INT8_MAX_ROWS:  # a decode step: one pass over the groups
                return torch.ops.updraft.gguf_linear_int8(flat, weight, None, code, k, n)
            # a prefill or a batched step: integer tiles, each group reused by all of x
            return torch.ops.updraft.gguf_gemm_int8(flat, weight, None, code, k, n)
        if rows <= BLOCK_PASSES_UP_TO:  # a decode step: a pass over the blocks per 8 rows
            return _in_passes(
                lambda group: torch.ops.updraft.gguf_linear(group, weight, None, code, k),
                flat,
                GGUF_MAX_ROWS,
            )
        # A prefill: a chunk of weight rows at a time widened and multiplied, in one op.
        return torch.ops.updraft.gguf_widened_linear(flat, weight, code, k, weight.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _in_passes(
    linear: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor, rows: int
) -> torch.Tensor:
    """``linear`` over ``flat`` ``rows`` rows at a time (what its kernel takes at once)."""
    if flat.shape[0] <= rows:
        return linear(flat)
    return torch.cat([linear(group) for group in flat.split(rows)])


def _runs(parts: list[Part]) -> list[list[Part]]:
    """Neighbouring parts in one block type, as runs that become one weight each (a
    fused q/k/v or gate/up whose slices share a type): a kernel call per type, not per
    slice."""
    runs: list[list[Part]] = []
    for part in parts:
        if runs and part.code is not None and runs[-1][-1].code == part.code:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


class GGUFEmbedding(nn.Module):
    """An embedding table in blocks: the looked-up rows are widened, the table never.
    ``grouped_rows`` (if not 0): the table is a tied LM head's that many rows,
    regrouped eight at a time."""

    def __init__(self, blocks: torch.Tensor, code: int, dim: int, grouped_rows: int = 0) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.code = code
        self.dim = dim
        self.grouped_rows = grouped_rows
        self.num_embeddings = grouped_rows or blocks.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.flatten()
        if self.grouped_rows:
            out = torch.ops.updraft.gguf_dequantize_groups(
                self.blocks, self.code, self.dim, self.grouped_rows, ids
            )
        else:
            rows = self.blocks.index_select(0, ids)
            out = torch.ops.updraft.gguf_dequantize(rows, self.code, self.dim)
        return out.view(*input_ids.shape, self.dim)


def load_gguf_model(
    config: ModelConfig,
    parts: list[Path],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    int8_activations: bool = False,
    place: RankPlace | None = None,
    exact: bool = False,
) -> nn.Module:
    """The model ``config`` describes, its weights read from the GGUF ``parts`` (with
    ``int8_activations``, its quantized linears round x to int8; ``exact``: a bfloat16
    file's weights multiply x unrounded; with ``place``, the rank's shard)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        raise ValueError("a GGUF file runs on the CPU in float32")
    with building(torch.float32, "meta"):
        model = model_class(config)(config, max_positions=max_positions)
    share = RankShare(model, place)
    params, modules = share.params, share.modules  # the unsplit model's
    row = ARCHITECTURES[config.architecture]
    gathered = Gathered(row.gguf_norm_shift)
    spans = MappedSpans()  # what each linear has read is dropped once it is built
    experts = ExpertTensors(modules, parts[0].name, share, spans)
    tables = GGUFTables(model, parts[0].name)  # mapped, not loaded: read by row
    latent = LatentKV()
    linear = _linear_attention(config, parts[0], share)
    for path in parts:
        stream = latent.tensors(spans.tensors(read_gguf(path)), path.name)
        if linear is not None:  # the converter's changes to Gated DeltaNet layers undone
            stream = linear.tensors(stream, path.name)
        for tensor in stream:
            if tensor.name in CONFIG_TENSORS:  # read into the config, not a weight
                continue
            if experts.take(tensor.name, tensor.tensor_type.name, tensor.data):
                continue  # a layer's stacked experts (the rank's share), placed below
            name = hf_name(tensor.name, row.gguf_tensor_names)
            kind = tensor.tensor_type.name
            if tables.take(tensor.name, name, kind, tensor.data):
                continue
            target = None if name is None else target_of(name, params, modules)
            if target is None:
                raise ValueError(f"{path.name}: GGUF tensor {tensor.name} fits no parameter")
            _check_shape(f"{path.name}: {tensor.name}", kind, tensor.data, share, *target)
            data = share(tensor.name, kind, tensor.data, *target)
            if row.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                data = unpermute(np.asarray(data), data.shape[0] // config.head_dim)
            gathered.add(f"{path.name}: {tensor.name}", name, kind, data, *target)
    latent.finish(parts[0].name)
    tables.finish()
    floats, blocks = share.renamed(gathered.floats), share.renamed(gathered.blocks)
    _place_blocks(model, blocks, floats, config, int8_activations, spans)
    if linear is not None:
        linear.order_inputs(model)
    fmt = replace(gathered.float_format(), exact=exact)
    fill_and_pack_floats(model, floats, fmt, spans, parts[0].name, experts.place)
    return model.to(device).eval().requires_grad_(False)


def _check_shape(
    where: str, kind: str, data: np.ndarray, share: RankShare, param: str, index: Slice
) -> None:
    """Refuse a tensor that is not the matrix of the part of ``param`` it fills, as it
    is read: before any parameter is made, so a size the metadata made up is never
    allocated, and no kernel told the parameter's sizes reads past the tensor."""
    check = _check_float_shape if kind in FLOAT_DTYPES else _check_block_shape
    check(where, kind, data, share, param, index)


def _check_block_shape(
    where: str, kind: str, data: np.ndarray, share: RankShare, param: str, index: Slice
) -> None:
    """Refuse a tensor in blocks that is not the matrix of the part of ``param`` it fills
    (rows, and values per row), with both shapes: a kernel told the parameter's sizes
    would read past its rows."""
    values, block_bytes = BLOCKS[BLOCK_TYPES[kind]]
    module = share.modules[param.rpartition(".")[0]]
    whole = share.params[param]
    want = tuple((whole if index == FUSED else part_of(whole, module, param, index)).shape)
    got = (*data.shape[:-1], data.shape[-1] // block_bytes * values)
    if len(want) != 2:  # blocks are read by the linears' and embeddings' kernels only
        raise ValueError(f"{where}: a {kind} tensor cannot fill {param} of shape {want}")
    if got != want:
        raise ValueError(
            f"{where}: a {kind} tensor of shape {got} (rows, values per row) cannot fill "
            f"{param}, which takes {want}"
        )


def _check_float_shape(
    where: str, kind: str, data: np.ndarray, share: RankShare, param: str, index: Slice
) -> None:
    """Refuse a float tensor of another shape than the part of ``param`` it fills, as it
    is read: before any parameter is made, so a size the metadata made up is never
    allocated."""
    module = share.modules[param.rpartition(".")[0]]
    whole = share.params[param]
    want = tuple((whole if index == FUSED else part_of(whole, module, param, index)).shape)
    got = tuple(data.shape)
    if kind == "BF16":  # gguf-py's view of it is its bytes
        got = (*got[:-1], got[-1] // 2)
    if got != want:
        raise ValueError(
            f"{where}: a {kind} tensor of shape {got} cannot fill {param}, which takes {want}"
        )


def _linear_attention(
    config: ModelConfig, first: Path, share: RankShare
) -> LinearAttentionTensors | None:
    """What undoes the converter's changes to the Gated DeltaNet layers, if any."""
    if config.linear_attention is None:
        return None
    # the file's own converter tiled the value heads or not (a qwen3next file is read as
    # another row's architecture)
    arch = read_gguf(first).fields.get("general.architecture")
    tiled = for_gguf(arch, first.name).gguf_tiled_value_heads
    # a rank's share of ssm_out's columns is cut from the file: those it widens
    keep = share.ranks == 1
    return LinearAttentionTensors(config.num_layers, config.linear_attention, tiled, keep)


class Gathered:
    """A file's tensors by the parameter (and slice of it) each fills: float values, or
    parts in blocks; and the float type most of its float matrices came in."""

    def __init__(self, norm_shift: float) -> None:
        self.norm_shift = norm_shift  # what the converter added to every norm weight
        self.floats: dict[str, dict[int, torch.Tensor]] = {}
        self.blocks: dict[str, dict[int, Part]] = {}
        self.float_kinds: Counter[str] = Counter()

    def add(self, where: str, name: str, kind: str, data, param: str, index: int) -> None:
        if kind in FLOAT_DTYPES:
            values = float_tensor(data, kind)
            if self.norm_shift and name.endswith("norm.weight"):
                # back to the checkpoint's weight: exact while 1 + w lies in [0.5, 2]
                values = values.float() - self.norm_shift
            self.floats.setdefault(param, {})[index] = values
            if name.endswith(".weight") and np.asarray(data).ndim == 2:
                self.float_kinds[kind] += 1
        elif where.endswith("token_embd.weight") or param.endswith(".weight"):
            rows = block_rows(data)
            self.blocks.setdefault(param, {})[index] = Part(rows, BLOCK_TYPES[kind], where)
        else:
            raise ValueError(f"{where}: a quantized tensor of this kind is not supported")

    def float_format(self) -> WeightFormat:
        """The format the model's float weights are packed in: the file's own."""
        kind = self.float_kinds.most_common(1)[0][0] if self.float_kinds else "F32"
        return WeightFormat(str(FLOAT_DTYPES[kind]).removeprefix("torch."))


def _place_blocks(
    model, blocks, floats, config: ModelConfig, int8: bool, spans: MappedSpans
) -> None:
    """Put a ``GGUFLinear`` (and a ``GGUFEmbedding``) where tensors came in blocks; the
    file's pages a module read into another layout are dropped as it is built."""
    modules = dict(model.named_modules())
    embedding = blocks.pop("model.embed_tokens.weight", None)
    if embedding is not None:
        part = embedding[0]
        dim = config.hidden_size
        if config.tie_word_embeddings:  # the embedding reads the LM head's blocks
            head = GGUFLinear(dim, _with_int8_kernels([part], int8), None, int8)
            if isinstance(model.lm_head, VocabParallelHead):
                model.lm_head.linear = head
            else:
                model.lm_head = head
            grouped = head.rows[0] if head.grouped[0] else 0
            table = GGUFEmbedding(head.part0, part.code, dim, grouped)
        else:
            table = GGUFEmbedding(part.weight, part.code, dim)
        model.model.embed_tokens = embedding_over(model.model.embed_tokens, table)
        spans.drop_unheld([part.weight], model)
    for param, slices in blocks.items():
        module_name = param.removesuffix(".weight")
        module = modules[module_name]
        count = len(module.split_sizes) if is_split(module) else 1
        indices = [FUSED] if FUSED in slices else list(range(count))
        mixed = floats.pop(param, {})
        parts = []
        for index in indices:
            if index in slices:
                parts.append(slices[index])
            elif index in mixed:  # a part of the fused layer stored as floats
                parts.append(Part(mixed[index].float(), None))
            else:
                raise ValueError(f"no GGUF tensor for part {index} of {module_name}")
        bias_name = f"{module_name}.bias"
        bias = None
        if module.bias is not None:
            bias_parts = floats.pop(bias_name, {})
            bias = torch.cat([bias_parts[i] for i in sorted(bias_parts)]).float()
        parent, _, child = module_name.rpartition(".")
        built = _linear(module.in_features, parts, bias, int8)
        setattr(modules[parent], child, built)
        spans.drop_unheld([part.weight for part in parts], built)


def _linear(
    in_features: int, parts: list[Part], bias: torch.Tensor | None, int8: bool
) -> nn.Module:
    """A ``PackedLinear`` over panels where every part is Q8_0, or every part Q4_0 (and x
    stays float32); else a ``GGUFLinear`` over the blocks."""
    kinds = {part.code for part in parts}
    parts = _with_int8_kernels(parts, int8)
    if int8 or len(kinds) != 1 or next(iter(kinds)) not in PANEL_FORMATS:
        return GGUFLinear(in_features, parts, bias, int8)
    fmt = PANEL_FORMATS[next(iter(kinds))]
    panels = block_panels([part.weight for part in parts], fmt, in_features)
    return PackedLinear.over(panels, bias, WeightFormat(fmt, 32))


def _with_int8_kernels(parts: list[Part], int8: bool) -> list[Part]:
    """``parts``, each in a block type ``gguf_int8.c`` multiplies where x is rounded to
    int8: a part in another is refused by name, not left to take float x unnoticed."""
    for part in parts:
        if int8 and part.code is not None and part.code not in INT8_TYPES:
            kind = next(name for name, code in BLOCK_TYPES.items() if code == part.code)
            covered = [name for name, code in BLOCK_TYPES.items() if code in INT8_TYPES]
            raise ValueError(
                f"{part.where} is in {kind}, which has no integer kernel for --activations "
                f"int8 (the types with one: {', '.join(covered) or 'none'}); --activations "
                "float32 reads it exactly"
            )
    return parts


def check_gguf_split(config: ModelConfig, model_dir: str | Path, sizes: ParallelSizes) -> None:
    """Refuse, with the numbers, a GGUF file (the one ``model_dir`` stands for, if any)
    whose row-parallel tensors in blocks (o_proj, down_proj, the experts' down
    projections) ``sizes``' tensor-parallel ranks would cut mid-block: read from the
    headers alone, before any rank loads."""
    parts = linked_files(Path(model_dir))
    if parts is None or sizes.tensor == 1:
        return
    with building(torch.float32, "meta"):
        model = model_class(config)(config)
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    kept = shard_model(model, RankPlace(0, sizes, "unconnected"))
    kinds = {code: kind for kind, code in BLOCK_TYPES.items()}
    family_names = ARCHITECTURES[config.architecture].gguf_tensor_names
    for part in parts:
        for info in walk(part).tensors:
            name = hf_name(info.name, family_names)
            target = None if name is None else target_of(name, params, modules)
            target = target or down_target(info.name)
            keep = None if target is None else kept.get(params.get(target[0]))
            if keep is None or keep.dim != 1 or keep.zeros or info.type_code not in kinds:
                continue
            columns = kept_part(keep, target[1])
            block_columns(info.name, kinds[info.type_code], info.dims[0], columns, sizes.tensor)
