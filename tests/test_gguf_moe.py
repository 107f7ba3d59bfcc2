"""GGUF files with experts, as llama.cpp's own converter writes them: Qwen3-MoE
(``qwen3moe``), Mixtral (``llama`` with experts) and Qwen2-MoE (``qwen2moe``, a gated
shared expert).

* A float32 file gives the tokens and logits transformers gives on the checkpoint it was
  converted from, eager and captured.
* A Q8_0 file and one in Q4_0 (their experts' codes moved into int8 and int4 panels),
  and a file whose experts are in K-quant blocks (Q4_K gate and up, Q6_K down, as
  Q4_K_M keeps them; read through the block kernels) beside Q8_0 matrices, give
  transformers' tokens and logits on the weights their blocks stand for (dequantized by
  the ``gguf`` package), eager and captured.
* The loaded model holds about the file's tensor bytes: no float copy of an expert.
* Experts whose down projections' blocks tensor-parallel ranks would cut are refused,
  with the numbers (their split is tested in test_tensor_parallel).
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.torch import load_file, save_file

from tests.checkpoints import build_checkpoint
from tests.llama_cpp_tree import convert_all
from tests.test_gguf import assert_same, random_blocks, run
from updraft import LLM
from updraft.models import gguf_loader
from updraft.models.gguf_experts import BlockExperts
from updraft.models.moe import PackedExperts

# Every layer routed: llama.cpp's qwen3moe and qwen2moe read no dense layers.
ALL_ROUTED = {"decoder_sparse_step": 1, "mlp_only_layers": []}
CHECKPOINTS = {
    "qwen3-moe": ("qwen3-moe", {"num_hidden_layers": 2, **ALL_ROUTED}),
    "mixtral": ("mixtral", {}),
    # rows of 256 values for the K-quants' blocks
    "qwen2-moe": (
        "qwen2-moe",
        {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_experts": 4,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 64,
            **ALL_ROUTED,
        },
    ),
}
# (file, checkpoint, outtype, converter arguments)
FILES = (
    ("qwen3-moe-f32", "qwen3-moe", "f32", ()),
    ("qwen3-moe-q8_0", "qwen3-moe", "q8_0", ()),
    ("mixtral-f32", "mixtral", "f32", ()),
    ("qwen2-moe-f32", "qwen2-moe", "f32", ()),
)
# One transformers expert tensor per GGUF projection: (projection, expert) -> name
PER_EXPERT = {
    "mixtral": "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight",
    "qwen": "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight",
}
MIXTRAL_W = {"gate": "w1", "up": "w3", "down": "w2"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-moe")
    checkpoints = {
        name: build_checkpoint(kind, root / name, **changes)
        for name, (kind, changes) in CHECKPOINTS.items()
    }
    convert_all([(checkpoints[c], root / f"{f}.gguf", t, x) for f, c, t, x in FILES])
    paths = {name: root / f"{name}.gguf" for name, *_ in FILES}
    # Q4_K_M's pattern for experts: gate and up in Q4_K, down in Q6_K
    k_quants = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    paths["qwen2-moe-q4_k_m"] = _requantized(
        paths["qwen2-moe-f32"], root / "qwen2-moe-q4_k_m.gguf", k_quants, "Q8_0"
    )
    q4_0 = dict.fromkeys(("gate", "up", "down"), "Q4_0")
    paths["qwen3-moe-q4_0"] = _requantized(
        paths["qwen3-moe-f32"], root / "qwen3-moe-q4_0.gguf", q4_0, "Q4_0"
    )
    return root, checkpoints, paths


def _requantized(path, out, experts_in: dict[str, str], others_in: str):
    """``path`` written again with its experts' projections in the types
    ``experts_in`` names (K-quants as random blocks of about the model's scale: the
    ``gguf`` package cannot write them) and its other matrices in ``others_in`` (the
    routers and the shared expert's gate stay float32, as llama.cpp keeps them)."""
    rng = np.random.default_rng(4)
    changed = {}
    for tensor in GGUFReader(str(path)).tensors:
        data = np.asarray(tensor.data)
        match = re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", tensor.name)
        if match:
            kind = GGMLQuantizationType[experts_in[match[1]]]
            if kind.name.endswith("_K"):
                experts, rows, k = data.shape
                blocks = random_blocks(kind.name, experts * rows, k, rng, scale=2e-4)
                changed[tensor.name] = (blocks.reshape(experts, rows, -1), kind)
            else:
                changed[tensor.name] = (quants.quantize(data, kind), kind)
        elif data.ndim == 2 and "norm" not in tensor.name and "gate_inp" not in tensor.name:
            kind = GGMLQuantizationType[others_in]
            changed[tensor.name] = (quants.quantize(data, kind), kind)
    return _with_tensors(path, out, changed)


def _with_tensors(path, out, replaced, fields=None):
    """``path`` written again by the ``gguf`` package's writer, the tensors named in
    ``replaced`` as (blocks, type) and the metadata named in ``fields`` as given."""
    from gguf import GGUFWriter

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        value = (fields or {}).get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name in replaced:
            blocks, qtype = replaced[tensor.name]
            writer.add_tensor(tensor.name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _reference(checkpoint, path, directory, family: str):
    """``checkpoint`` with every tensor the file keeps in blocks replaced by what the
    blocks stand for (q/k rows back in transformers' order for llama files)."""
    shutil.copytree(checkpoint, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type.name == "F32":
            continue
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        stacked = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", tensor.name)
        if stacked:
            layer, proj = stacked[1], stacked[2]
            for expert, rows in enumerate(values):
                name = PER_EXPERT[family].format(
                    layer=layer, expert=expert, proj=proj, w=MIXTRAL_W[proj]
                )
                tensors[name] = _tensor(rows)
            continue
        hf = gguf_loader.hf_name(tensor.name).replace(".shared_experts.", ".shared_expert.")
        if family == "mixtral" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            values = gguf_loader.unpermute(values, heads)
        assert hf in tensors, hf
        tensors[hf] = _tensor(values)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _tensor(values: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _both_modes(path, reference):
    """The file run eagerly and through captured graphs, each against ``reference``."""
    for eager in (True, False):
        ours = run(path, enforce_eager=eager)
        assert_same(ours, reference)
        if not eager:
            assert "graph" in ours[2].engine.stats().steps


def _routed_experts(llm):
    model = llm.engine._runner.model  # noqa: SLF001
    return [m for m in model.modules() if isinstance(m, PackedExperts | BlockExperts)], model


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_a_float_file_gives_the_checkpoint_s_tokens_and_logits(files, name):
    _, checkpoints, paths = files
    _both_modes(paths[f"{name}-f32"], run(checkpoints[name]))


@pytest.mark.parametrize(
    ("file", "checkpoint", "held"),
    [
        ("qwen3-moe-q8_0", "qwen3-moe", PackedExperts),
        ("qwen3-moe-q4_0", "qwen3-moe", PackedExperts),
        ("qwen2-moe-q4_k_m", "qwen2-moe", BlockExperts),
    ],
)
def test_experts_in_blocks_give_transformers_logits_on_what_the_blocks_stand_for(
    files, tmp_path, file, checkpoint, held
):
    _, checkpoints, paths = files
    reference = _reference(checkpoints[checkpoint], paths[file], tmp_path / "reference", "qwen")
    _both_modes(paths[file], run(reference))
    llm = LLM(str(paths[file]), enforce_eager=True, num_kv_blocks=8)
    experts, model = _routed_experts(llm)
    assert len(experts) == 2 and all(isinstance(e, held) for e in experts)
    if held is PackedExperts:  # Q8_0's codes in int8 panels, Q4_0's in int4
        assert all(e.format.name == ("int8" if "q8_0" in file else "int4") for e in experts)
    # no float copy of an expert: the model holds about the file's tensor bytes
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(paths[file])).tensors)
    held_bytes = {
        tensor.data_ptr(): tensor.numel() * tensor.element_size()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if "rotary" not in name
    }
    loaded = sum(held_bytes.values())
    assert abs(loaded - file_bytes) <= 0.1 * file_bytes, (loaded, file_bytes)


@pytest.mark.usefixtures("all_cores")
def test_the_grouped_op_over_blocks_computes_each_expert_s_mlp_fused_or_not():
    """Experts in three block types, an idle one, one of a few rows (block passes) and
    one of many (widened chunks), against float64 on the dequantized blocks; gate and up
    fused in one tensor give what they give apart."""
    import torch
    import torch.nn.functional as F

    from updraft.kernels.gguf_ops import BLOCK_TYPES

    rng = np.random.default_rng(5)
    experts, inter, hidden = 3, 32, 64

    def stacked(kind, rows, k):
        blocks = random_blocks(kind, experts * rows, k, rng, scale=0.05).reshape(experts, rows, -1)
        values = quants.dequantize(blocks, GGMLQuantizationType[kind])
        return torch.from_numpy(blocks), torch.from_numpy(values).double()

    (gate, gate_w), (up, _) = stacked("Q4_1", inter, hidden), stacked("Q4_1", inter, hidden)
    (up5, up5_w), (down, down_w) = stacked("Q5_0", inter, hidden), stacked("Q8_0", hidden, inter)
    x = torch.randn(75, hidden, generator=torch.Generator().manual_seed(5))
    offsets = torch.tensor([0, 0, 5, 75])
    q41, q50, q80 = (BLOCK_TYPES[k] for k in ("Q4_1", "Q5_0", "Q8_0"))
    got = torch.ops.updraft.gguf_grouped_mlp(x, offsets, [gate, up5], [q41, q50], down, q80, inter)
    want = torch.zeros(75, hidden, dtype=torch.float64)
    for expert, (start, end) in enumerate([(0, 0), (0, 5), (5, 75)]):
        rows = x[start:end].double()
        hidden_rows = F.silu(rows @ gate_w[expert].T) * (rows @ up5_w[expert].T)
        want[start:end] = hidden_rows @ down_w[expert].T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    fused = torch.cat([gate, up], dim=1).contiguous()
    apart = torch.ops.updraft.gguf_grouped_mlp(x, offsets, [gate, up], [q41, q41], down, q80, inter)
    together = torch.ops.updraft.gguf_grouped_mlp(x, offsets, [fused], [q41], down, q80, inter)
    torch.testing.assert_close(together, apart, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"qwen3moe.expert_feed_forward_length": 48}, "expert_feed_forward_length is 48"),
        ({"qwen3moe.expert_used_count": 9}, "expert_used_count 9 is not between 1 and the 8"),
        ({"qwen3moe.expert_count": 4}, r"ffn_down_exps has shape \(8, 64, 32\)"),
    ],
)
def test_expert_metadata_that_disagrees_with_the_tensors_is_refused_by_name(
    files, tmp_path, fields, message
):
    from updraft.checkpoints.gguf import describe

    _, _, paths = files
    bad = _with_tensors(paths["qwen3-moe-f32"], tmp_path / "bad.gguf", {}, fields)
    with pytest.raises(ValueError, match=message):
        describe([bad])


def test_a_router_in_blocks_is_refused_by_name(files, tmp_path):
    """llama.cpp keeps routers float32; one in blocks would have to be guessed at."""
    _, _, paths = files
    reader = GGUFReader(str(paths["qwen3-moe-f32"]))
    router = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_inp.weight")
    q8 = GGMLQuantizationType.Q8_0
    blocks = quants.quantize(np.asarray(router.data), q8)
    bad = _with_tensors(paths["qwen3-moe-f32"], tmp_path / "bad.gguf", {router.name: (blocks, q8)})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_gate_inp\.weight is in Q8_0 blocks"):
        LLM(str(bad))


def test_experts_whose_down_blocks_a_rank_would_cut_are_refused_with_the_numbers(files):
    """down_exps's 256 inputs in Q6_K blocks of 256: 128 per rank would cut every block.
    The engine refuses before any rank starts, and a rank's loader refuses alike."""
    import torch

    from updraft.checkpoints.local import local_checkpoint
    from updraft.config import ParallelSizes
    from updraft.model_config import ModelConfig
    from updraft.models.gguf_loader import check_gguf_split
    from updraft.models.loader import load_model
    from updraft.parallel.topology import RankPlace

    _, _, paths = files
    message = (
        r"blk\.0\.ffn_down_exps\.weight: 256 inputs in Q6_K blocks of 256 cannot be split "
        "over 2 ranks: 128 each is not a whole number of blocks"
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(paths["qwen2-moe-q4_k_m"]), tensor_parallel_size=2)
    directory = local_checkpoint(str(paths["qwen2-moe-q4_k_m"]))
    config, sizes = ModelConfig.from_dir(directory), ParallelSizes(tensor=2)
    with pytest.raises(ValueError, match=message):  # from the headers, before any rank
        check_gguf_split(config, directory, sizes)
    place = RankPlace(1, sizes, "unconnected")
    with pytest.raises(ValueError, match=message):
        load_model(config, directory, torch.float32, place=place)
