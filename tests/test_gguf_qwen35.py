"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next GGUF files as llama.cpp's own converter writes
them give back transformers' checkpoint.

Tiny random checkpoints (three Gated DeltaNet layers, then one full attention layer,
then one multi-token prediction layer as published checkpoints carry; two key heads
each serving three value heads, so Qwen3.5's tiled value heads are neither their own
order nor their order's inverse) are converted to f32 and q8_0 files. The tensors the
loader reads from a file, under transformers' Qwen3.5 names, are the checkpoint's:
exactly in an f32 file, the very values their Q8_0 blocks stand for in a q8_0 one
(gguf-py's own quantizer on the checkpoint's tensor; a value head's 32 values are one
block, so the tiled columns of ``ssm_out`` move as whole blocks). A_log comes back
through log(-(-exp(A_log))), within rounding. Qwen3-Next's fused projections are
compared with what transformers' own ``fix_query_key_value_ordering`` makes of them.
The norms are drawn on a grid of 1/256, so the converter's 1 + w is exact and so is
the loader's way back.

Through ``LLM``, each family's q8_0 file (and the f32 Qwen3.5 one) gives transformers'
greedy tokens and logits on the weights the file stands for; so does a q8_0 file whose
value heads (16 values) are half a block, its ``ssm_out`` left in the file's column
order. A Qwen3-Next file is read as Qwen3.5-MoE (its converter stores Qwen3.5's
projection layout) and gives Qwen3-Next's tokens. The config is the checkpoint's; the
MTP block is counted apart and not loaded; a file missing a layer's tensor, or with
sizes that disagree, is refused naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from tests.helpers import generate_logits, greedy
from tests.llama_cpp_tree import convert_many, llama_cpp_tree
from tests.probes import logits_of, probed, records
from updraft.checkpoints.gguf import metadata
from updraft.checkpoints.gguf_header import read_gguf
from updraft.model_config.parts import LinearAttentionConfig
from updraft.model_config.qwen35_gguf import GGUF_TENSORS, from_gguf
from updraft.model_config.registry import Architecture, for_gguf
from updraft.models.gguf_experts import STACKED
from updraft.models.gguf_linear_attention import LinearAttentionTensors
from updraft.models.gguf_loader import hf_name
from updraft.models.gguf_mla import MadeTensor
from updraft.models.weight_targets import RENAMED_MODULES

HYBRID = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# name -> (transformers' config class, model class, changes over HYBRID)
FAMILIES = {
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {"intermediate_size": 128}),
    "qwen3.5-moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**MOE, "shared_expert_intermediate_size": 48},
    ),
    "qwen3-next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**MOE, "shared_expert_intermediate_size": 48, "intermediate_size": 96},
    ),
}
OUTTYPES = ("f32", "q8_0")
# Value heads of 16, half a Q8_0 block: its q8_0 file's ssm_out stays in the file's
# column order, and the layer's output is gathered into it.
NARROW = {"qwen3.5-narrow": ("qwen3.5", {"linear_value_head_dim": 16})}
F32 = GGMLQuantizationType.F32


def build(family: str, directory: Path, **more: Any) -> Path:
    """A random checkpoint of ``family``: norms on a grid of 1/256 (the converter's
    1 + w exact), sharp routers, A_log and dt_bias drawn away from their constant
    initial values."""
    config_class, model_class, changes = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**HYBRID, **changes, **more})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.round(torch.randn_like(param) * 0.3 * 256) / 256)
            elif name.endswith(("A_log", "dt_bias", "mlp.gate.weight")):
                param.normal_(0, 1.0)
    model.save_pretrained(directory)
    with_a_prediction_layer(directory)
    # The converter's built-in vocabulary is cut to the tokenizer's size.
    vocab = {str(i): i for i in range(HYBRID["vocab_size"])}
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    return directory


def with_a_prediction_layer(directory: Path) -> None:
    """One multi-token prediction layer added as published Qwen3.5 checkpoints hold it
    (transformers' model leaves it out): ``mtp.*`` tensors, a full-attention layer (the
    last decoder layer's values) with its own norms and ``fc``, and
    ``mtp_num_hidden_layers``; the converter writes it as a block after the decoder's."""
    tensors = load_file(directory / "model.safetensors")
    last = f"model.layers.{HYBRID['num_hidden_layers'] - 1}."
    added = {
        f"mtp.layers.0.{name.removeprefix(last)}": tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(last)
    }
    hidden = HYBRID["hidden_size"]
    added["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        added[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    save_file({**tensors, **added}, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """family -> (checkpoint, outtype -> GGUF file), every file converted in one process."""
    llama_cpp_tree()
    root = tmp_path_factory.mktemp("gguf-qwen35")
    made, jobs = {}, []
    for family in FAMILIES:
        checkpoint = build(family, root / family)
        paths = {outtype: root / f"{family}-{outtype}.gguf" for outtype in OUTTYPES}
        jobs += [(checkpoint, path, outtype) for outtype, path in paths.items()]
        made[family] = (checkpoint, paths)
    for name, (family, changes) in NARROW.items():
        checkpoint = build(family, root / name, **changes)
        jobs.append((checkpoint, root / f"{name}-q8_0.gguf", "q8_0"))
        made[name] = (checkpoint, {"q8_0": jobs[-1][1]})
    convert_many(jobs)
    return made


def file_row(path: Path) -> Architecture:
    """The registry row that names the file's architecture."""
    return for_gguf(metadata([path])[0]["general.architecture"], path.name)


def config_of(path: Path) -> dict[str, Any]:
    """The config.json the file's metadata gives."""
    fields, tensors = metadata([path])
    arch = fields["general.architecture"]
    return file_row(path).from_gguf(
        path.name, file_row(path).name, lambda k, d=None: fields.get(f"{arch}.{k}", d), tensors
    )


def read_back(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """transformers' name -> (GGUF type, float32 values) of every tensor the loader
    reads from ``path``; a layer's stacked experts as ``experts.<proj>``."""
    config = config_of(path)
    linear = LinearAttentionConfig(
        num_key_heads=config["linear_num_key_heads"],
        num_value_heads=config["linear_num_value_heads"],
        key_head_dim=config["linear_key_head_dim"],
        value_head_dim=config["linear_value_head_dim"],
        conv_kernel=config["linear_conv_kernel_dim"],
    )
    tiled = file_row(path).gguf_tiled_value_heads
    # a narrow head's ssm_out widened, as a tensor-parallel rank's is
    stream = LinearAttentionTensors(config["num_hidden_layers"], linear, tiled, False)
    out = {}
    for tensor in stream.tensors(read_gguf(path).tensors, path.name):
        stacked = STACKED.fullmatch(tensor.name)
        if stacked is not None:
            name = f"model.layers.{stacked['layer']}.mlp.experts.{stacked['proj']}_proj"
        else:
            name = hf_name(tensor.name, GGUF_TENSORS)
        assert name is not None and name not in out, tensor.name
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        out[name] = (tensor.tensor_type, np.asarray(values, dtype=np.float32))
    return out


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names the loader gives: Qwen3.5's linear
    attention (Qwen3-Next's fused projections split by transformers' own code), the
    shared expert as the model names it, each layer's experts stacked."""
    tensors = load_file(checkpoint / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith("mtp."):
            continue  # the prediction layer's: the decoder's loader passes them over
        for old, new in RENAMED_MODULES:
            name = name.replace(old, new)
        expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.weight", name)
        if expert is not None:
            experts.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = tensor
        elif not name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            out[name] = tensor
    for name, stack in experts.items():
        out[name] = torch.stack([stack[i] for i in sorted(stack)])
    if any(name.endswith("in_proj_qkvz.weight") for name in tensors):
        out.update(_next_split(checkpoint, tensors))
    return out


def _next_split(checkpoint: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba as Qwen3.5's four projections, by
    running the weights' columns through transformers' ``fix_query_key_value_ordering``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = {}
    for index, layer in enumerate(model.model.layers):
        if not hasattr(layer, "linear_attn"):
            continue
        prefix = f"model.layers.{index}.linear_attn"
        qkvz = tensors[f"{prefix}.in_proj_qkvz.weight"].T[None]  # [1, hidden, rows]
        ba = tensors[f"{prefix}.in_proj_ba.weight"].T[None]
        q, k, v, z, b, a = layer.linear_attn.fix_query_key_value_ordering(qkvz, ba)
        hidden = qkvz.shape[1]
        rows = [part.reshape(hidden, -1).T for part in (q, k, v)]
        out[f"{prefix}.in_proj_qkv.weight"] = torch.cat(rows)
        out[f"{prefix}.in_proj_z.weight"] = z.reshape(hidden, -1).T
        out[f"{prefix}.in_proj_b.weight"] = b[0].T
        out[f"{prefix}.in_proj_a.weight"] = a[0].T
    return out


def stands_for(tensor: torch.Tensor, kind: GGMLQuantizationType) -> np.ndarray:
    """What a file of type ``kind`` holds for ``tensor``, as float32 values."""
    values = tensor.float().numpy()
    if kind == GGMLQuantizationType.F32:
        return values
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16).astype(np.float32)
    return quants.dequantize(quants.quantize(values, kind), kind).astype(np.float32)


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tensor_read_from_the_file_is_the_checkpoint_s(files, family, outtype):
    checkpoint, paths = files[family]
    expected = checkpoint_tensors(checkpoint)
    loaded = read_back(paths[outtype])
    assert sorted(loaded) == sorted(expected)
    kinds = {kind for kind, _ in loaded.values()}
    assert (GGMLQuantizationType.Q8_0 in kinds) == (outtype == "q8_0")
    for name, (kind, values) in loaded.items():
        reference = expected[name]
        assert values.shape == tuple(reference.shape), name
        if name.endswith("A_log"):  # log(-(-exp(A_log)))
            np.testing.assert_allclose(values, reference.numpy(), rtol=1e-6, atol=1e-6)
            continue
        assert np.array_equal(values, stands_for(reference, kind)), (name, kind.name)


# config.json's fields the file's metadata gives back as the checkpoint had them.
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_config_is_the_checkpoint_s(files, family):
    checkpoint, paths = files[family]
    written = json.loads((checkpoint / "config.json").read_text())
    config = config_of(paths["f32"])
    # Qwen3-Next's file is read as Qwen3.5-MoE (the converter stored Qwen3.5's layout)
    read_as = {"Qwen3NextForCausalLM": ["Qwen3_5MoeForCausalLM"]}
    assert config["architectures"] == read_as.get(
        written["architectures"][0], written["architectures"]
    )
    for field in CONFIG_FIELDS:
        assert config.get(field) == written.get(field), field
    assert config["rms_norm_eps"] == pytest.approx(written["rms_norm_eps"])
    rope, written_rope = config["rope_parameters"], written["rope_parameters"]
    for field in ("rope_theta", "partial_rotary_factor", "rope_type"):
        assert rope[field] == written_rope[field], field


def _metadata(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's ``<arch>.`` metadata (without the prefix) and its tensors."""
    fields, tensors = metadata([path])
    arch = fields["general.architecture"]
    own = {key.removeprefix(f"{arch}."): value for key, value in fields.items()}
    return own, tensors


# (what is changed, the refusal's words)
BROKEN = {
    "no ssm_conv1d": ("-blk.1.ssm_conv1d.weight", "layer 1 lacks blk.1.ssm_conv1d.weight"),
    "no ssm_a": ("-blk.2.ssm_a", "layer 2 lacks blk.2.ssm_a"),
    "no ssm_beta": ("-blk.0.ssm_beta.weight", "layer 0 lacks blk.0.ssm_beta.weight"),
    "no attn_q": ("-blk.3.attn_q.weight", "layer 3 lacks blk.3.attn_q.weight"),
    "no conv kernel": ("ssm.conv_kernel=None", "lacks ssm.conv_kernel"),
    "state size": ("ssm.state_size=8", r"blk.0.attn_qkv.weight has shape \[256, 64\]"),
    "conv kernel": ("ssm.conv_kernel=3", r"blk.0.ssm_conv1d.weight has shape \[256, 4\]"),
    "inner size": ("ssm.inner_size=32", "ssm.inner_size 32 does not split into"),
    "value heads": ("ssm.time_step_rank=3", "ssm.time_step_rank 3 .* not a multiple of"),
    "layers": ("attention.recurrent_layers=[True]", "recurrent_layers lists 1 layers"),
    "gate rows": ("attention.head_count=2", r"blk.3.attn_q.weight has shape \[128, 64\]"),
    "experts": ("expert_count=8", "expert_count in a file of dense Qwen3_5ForCausalLM"),
}
BROKEN_MIXTURE = {
    "dense layer": ("-blk.2.ffn_gate_inp.weight", r"layers \[2\] have no router"),
    "no shared expert": ("-blk.0.ffn_down_shexp.weight", "layer 0 has no shared expert"),
    "no expert count": ("expert_count=None", "lacks expert_count"),
}


@pytest.mark.parametrize("case", sorted(BROKEN) + sorted(BROKEN_MIXTURE))
def test_a_file_missing_a_state_tensor_or_with_inconsistent_sizes_is_refused(files, case):
    family = "qwen3.5" if case in BROKEN else "qwen3.5-moe"
    path = files[family][1]["f32"]
    fields, tensors = _metadata(path)
    change, words = {**BROKEN, **BROKEN_MIXTURE}[case]
    if change.startswith("-"):
        del tensors[change[1:]]
    else:
        key, value = change.split("=")
        fields[key] = json.loads(value.replace("True", "true").replace("None", "null"))
    with pytest.raises(ValueError, match=words):
        from_gguf(path.name, file_row(path).name, lambda k, d=None: fields.get(k, d), tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_multi_token_prediction_blocks_are_left_to_their_head(files, family):
    """The file's MTP block comes after the decoder's: the config counts it apart and
    the decoder's loader passes it over."""
    path = files[family][1]["f32"]
    fields, tensors = _metadata(path)
    assert (fields["block_count"], fields["nextn_predict_layers"]) == (5, 1)
    assert "blk.4.nextn.eh_proj.weight" in tensors and "blk.4.attn_q.weight" in tensors
    config = config_of(path)
    assert (config["num_hidden_layers"], config["mtp_num_hidden_layers"]) == (4, 1)
    assert config["layer_types"] == HYBRID["layer_types"]
    assert not [name for name in read_back(path) if name.startswith("model.layers.4.")]


def test_a_value_head_narrower_than_a_block_is_widened_to_the_same_values():
    """Where a head's values do not fill whole blocks (a K-quant's 256 over heads of
    128; here Q4_0's 32 over heads of 16) and a tensor-parallel rank cuts its share of
    the columns, ``ssm_out``'s columns move as the floats its blocks stand for, exactly
    as a float file's would."""
    linear = LinearAttentionConfig(2, 6, 16, 16, 4)
    tiled = np.random.default_rng(0).standard_normal((8, linear.value_dim), dtype=np.float32)
    blocks = quants.quantize(tiled, GGMLQuantizationType.Q4_0)
    as_floats = quants.dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float32)
    stream = LinearAttentionTensors(1, linear, True, keep_blocks=False)
    widened, floats = stream.tensors(
        [
            MadeTensor("blk.0.ssm_out.weight", blocks, GGMLQuantizationType.Q4_0),
            MadeTensor("blk.0.ssm_out.weight", as_floats, F32),
        ],
        "x.gguf",
    )
    assert widened.tensor_type == F32 and np.array_equal(widened.data, floats.data)
    assert not np.array_equal(floats.data, as_floats)  # the columns did move


def test_a_narrow_head_s_ssm_out_stays_in_its_blocks(files):
    """Loaded on one rank, a q8_0 file's ssm_out over heads of 16 keeps the file's
    blocks (its input gathered into their order), where a rank's share is widened."""
    path = files["qwen3.5-narrow"][1]["q8_0"]
    linear = LinearAttentionConfig(2, 6, 16, 16, 4)
    stream = LinearAttentionTensors(4, linear, True)
    read = {t.name: t for t in stream.tensors(read_gguf(path).tensors, path.name)}
    assert read["blk.0.ssm_out.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert sorted(stream.input_orders) == [
        f"model.layers.{i}.linear_attn.out_proj" for i in range(3)
    ]


def test_an_early_qwen3_next_file_s_fused_projection_is_split(files):
    """llama.cpp's first Qwen3-Next files hold transformers' in_proj_qkvz as it is
    (``ssm_in``): it is read as the q/k/v and z rows transformers' own code makes of it,
    and its config is read alike."""
    checkpoint, paths = files["qwen3-next"]
    fields, tensors = _metadata(paths["f32"])
    expected = checkpoint_tensors(checkpoint)
    hf = load_file(checkpoint / "model.safetensors")
    early = []
    for layer in range(3):
        rows = hf[f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"].numpy()
        early.append(MadeTensor(f"blk.{layer}.ssm_in.weight", rows, F32))
        tensors[f"blk.{layer}.ssm_in.weight"] = ("F32", rows.shape)
        del tensors[f"blk.{layer}.attn_qkv.weight"], tensors[f"blk.{layer}.attn_gate.weight"]
    config = from_gguf(
        "early.gguf", "Qwen3NextForCausalLM", lambda k, d=None: fields.get(k, d), tensors
    )
    assert config["layer_types"] == HYBRID["layer_types"]
    linear = LinearAttentionConfig(2, 6, 16, 32, 4)
    split = list(LinearAttentionTensors(4, linear, False).tensors(early, "early.gguf"))
    assert len(split) == 6
    for tensor in split:
        name = hf_name(tensor.name, GGUF_TENSORS)
        assert np.array_equal(tensor.data, expected[name].numpy()), name


def test_a_positive_ssm_a_is_refused():
    """ssm_a is -exp(A_log): a value of 0 or more is no A_log's."""
    stream = LinearAttentionTensors(1, LinearAttentionConfig(2, 6, 16, 16, 4), True)
    bad = MadeTensor("blk.0.ssm_a", np.array([-1.0, 0.5, -2.0, -1.0, -1.0, -1.0], np.float32), F32)
    with pytest.raises(ValueError, match=r"x\.gguf: blk\.0\.ssm_a: holds a value that is not"):
        list(stream.tensors([bad], "x.gguf"))


# Prompts over several blocks of the chunked delta rule and single tokens; new tokens
# decoded one at a time from the state.
PROMPTS = [list(range(3, 80)), [200, 17, 9], [5] * 30 + [6, 7, 8, 9]]
NEW_TOKENS = 12
# float32 summation order (the linear kernels' against torch's matmul, through four
# layers and the delta rule's recurrence over 77 tokens) on logits of magnitude ~3
TOLERANCE = 5e-4


def as_the_file_stands(model: torch.nn.Module, path: Path) -> None:
    """Each of ``model``'s weights replaced by what the file holds for it: the values
    gguf-py's quantizer gives in the file's type (rows are quantized apart, so the
    converter's row moves do not change them); A_log through the file's -exp(A_log);
    ``ssm_out`` as read back in transformers' column order (each value the checkpoint's
    in the tests above; a narrow head's widened from the blocks the file tiles)."""
    loaded = read_back(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "linear_attn.out_proj.weight")):
                param.copy_(torch.from_numpy(loaded[name][1]))
                continue
            kind = loaded[_loaded_name(name)][0]
            param.copy_(torch.from_numpy(stands_for(param, kind)))


def _loaded_name(name: str) -> str:
    """The name ``read_back`` gives the file tensor that holds transformers' ``name``
    (the first, where it holds parts of it in several of one type)."""
    for old, new in RENAMED_MODULES:
        name = name.replace(old, new)
    for fused, first in (
        ("experts.gate_up_proj", "experts.gate_proj"),
        ("in_proj_qkvz.weight", "in_proj_qkv.weight"),
        ("in_proj_ba.weight", "in_proj_b.weight"),
    ):
        name = name.replace(fused, first)
    return name


# Each family's Q8_0 file (its quantized linears), and one f32 file, eager; one from
# captured graphs. Each tensor is compared with the checkpoint's in every file above.
RUNS = [
    ("qwen3.5", "f32", True),
    ("qwen3.5", "q8_0", True),
    ("qwen3.5-moe", "q8_0", True),
    ("qwen3.5-moe", "q8_0", False),
    ("qwen3-next", "q8_0", True),
    ("qwen3.5-narrow", "q8_0", True),
]


@pytest.mark.parametrize(
    ("family", "outtype", "eager"),
    RUNS,
    ids=[f"{f}-{o}-{'eager' if e else 'graphs'}" for f, o, e in RUNS],
)
def test_a_converted_file_gives_transformers_tokens(files, family, outtype, eager):
    checkpoint, paths = files[family]
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    as_the_file_stands(reference, paths[outtype])
    expected = [generate_logits(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    llm = probed(str(paths[outtype]), block_size=8, enforce_eager=eager, activations="float32")
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    seen = records(llm)
    for (tokens, logits), output in zip(expected, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == tokens
        assert (logits_of(seen, output) - logits).abs().max().item() < TOLERANCE
    assert ("graph" in llm.engine.stats().steps) != eager
