"""DeepSeek's GGUF files (``deepseek2``: V2 and V3, latent attention) written by llama.cpp's
own converter from tiny checkpoints, loaded in updraft, give transformers' tokens and
logits, eager and captured.

* Files in the converter's layout (``attn_kv_b`` split into ``attn_k_b`` and the
  transposed ``attn_v_b``), and in the layout older files have (``attn_kv_b`` whole,
  the head sizes in ``key_length``/``value_length``: the V3 file rewritten with gguf-py).
* V3 with a query LoRA, V3 without, and V2 (V2-Lite's shape, a softmax router, YaRN with
  ``mscale_all_dim``) in Q8_0 blocks, whose reference is transformers on the values its
  blocks stand for (llama.cpp's own quantizer, in gguf-py).
* V3's and V2's files route their later layers through experts (stacked ``ffn_*_exps``,
  a shared expert ``ffn_*_shexp``, V3's ``exp_probs_b``), in groups; the V3 file without
  a query LoRA is dense throughout.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from safetensors.torch import load_file, save_file

from tests.checkpoints import DEEPSEEK_TINY, build_checkpoint
from tests.helpers import greedy, token_ids
from tests.llama_cpp_tree import convert_many
from tests.probes import logits_of, probed, records
from tests.test_reference_models import PROMPTS
from updraft import LLM
from updraft.model_config import ModelConfig

LAYERS = DEEPSEEK_TINY["num_hidden_layers"]
# A routed expert's weight, which the file holds in its layer's stack of them.
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
DENSE = dict(first_k_dense_replace=LAYERS)
# What published configs say (transformers' tiny ones leave it out); the converter
# writes it as expert_gating_func, which tells V3's files from V2's.
SIGMOID = dict(scoring_func="sigmoid")
# V2's YaRN as released: mscale equal to mscale_all_dim. Prompts and decodes run past
# the original context of 16 positions.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# kv_lora_rank 32 puts attn_v_b (rows of kv_lora_rank values) in Q8_0 blocks, and experts
# 32 wide put every expert projection in them.
FILES = {
    "v3": ("deepseek-v3", "f32", SIGMOID),
    "v3-no-q-lora": ("deepseek-v3-no-q-lora", "f32", {**DENSE, **SIGMOID}),
    "v2-q8_0": (
        "deepseek-v2",
        "q8_0",
        {"kv_lora_rank": 32, "moe_intermediate_size": 32, "rope_parameters": YARN},
    ),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (its transformers reference checkpoint, its GGUF file); the V3 file
    also in the fused layout."""
    root = tmp_path_factory.mktemp("gguf-deepseek")
    jobs, checkpoints = [], {}
    for name, (kind, outtype, changes) in FILES.items():
        checkpoints[name] = build_checkpoint(kind, root / name, **changes)
        jobs.append((checkpoints[name], root / f"{name}.gguf", outtype))
    convert_many(jobs)
    made = {name: (checkpoints[name], root / f"{name}.gguf") for name in FILES}
    reference = stands_for(checkpoints["v2-q8_0"], root / "v2-q8_0.gguf", root / "v2-ref")
    made["v2-q8_0"] = (reference, root / "v2-q8_0.gguf")
    fused = fused_layout(root / "v3.gguf", checkpoints["v3"], root / "v3-fused.gguf")
    made["v3-fused"] = (checkpoints["v3"], fused)
    return made


def stands_for(checkpoint, path, directory):
    """``checkpoint`` with each weight replaced by what the file's tensor for it stands
    for: the name from gguf-py's own map, the values through gguf-py's quantizer in the
    file's type (kv_b_proj's in attn_k_b's and attn_v_b's: the key rows of each head,
    then its value rows)."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    shutil.copytree(checkpoint, directory)
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    names = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, LAYERS)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    nope, heads = config["qk_nope_head_dim"], config["num_attention_heads"]
    for name, tensor in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        values = tensor.numpy()
        if name.endswith("kv_b_proj.weight"):
            rows = values.reshape(heads, -1, values.shape[-1])
            keys = rounded(rows[:, :nope], types[gguf_name.replace("kv_b", "k_b")])
            vals = rounded(rows[:, nope:], types[gguf_name.replace("kv_b", "v_b")])
            values = np.concatenate([keys, vals], axis=1).reshape(tensor.shape)
        elif (expert := EXPERT.fullmatch(name)) is not None:  # a row block of its stack
            layer, projection = expert.groups()
            values = rounded(values, types[f"blk.{layer}.ffn_{projection}_exps.weight"])
        else:
            values = rounded(values, types[gguf_name])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def rounded(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """``values`` (rows along the last axis) as a tensor of ``kind`` holds them."""
    if kind == GGMLQuantizationType.F32:
        return values
    return quants.dequantize(quants.quantize(values, kind), kind)


def fused_layout(path, checkpoint, out):
    """``path`` as llama.cpp's converter wrote DeepSeek files before it split kv_b:
    ``attn_kv_b`` (the checkpoint's kv_b_proj) in place of ``attn_k_b``/``attn_v_b``,
    the head sizes in key_length/value_length, no _mla sizes, a head count for keys."""
    hf = load_file(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())

    def kv_b(tensor):
        if ".attn_v_b." in tensor.name:
            return []
        if ".attn_k_b." in tensor.name:
            layer = tensor.name.split(".")[1]
            kv_b = hf[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].numpy()
            return [(f"blk.{layer}.attn_kv_b.weight", kv_b, GGMLQuantizationType.F32)]
        return None

    changed = {
        "attention.key_length": config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
        "attention.value_length": config["v_head_dim"],
        "attention.head_count_kv": config["num_attention_heads"],
        "attention.key_length_mla": None,
        "attention.value_length_mla": None,
    }
    return rewritten(path, out, changed, kv_b)


def rewritten(path, out, changed, tensors=lambda tensor: None):
    """``path`` written again with gguf-py: ``<architecture>.<key>`` metadata set to
    ``changed[key]`` (None: left out), and each tensor as ``tensors(tensor)`` gives it
    ((name, values, type) each; None: as it was)."""
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    changed = {f"{arch}.{key}": value for key, value in changed.items()}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changed.pop(key, field.contents())
        sub_type = field.types[-1] if len(field.types) > 1 else None
        if value is not None:
            writer.add_key_value(key, value, field.types[0], sub_type)
    assert not any(changed.values()), f"not in the file: {changed}"
    for tensor in reader.tensors:
        made = tensors(tensor)
        if made is None:
            made = [(tensor.name, np.array(tensor.data), tensor.tensor_type)]
        for name, values, kind in made:
            writer.add_tensor(name, values, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def run(path, **engine):
    llm = probed(str(path), block_size=4, num_kv_blocks=64, activations="float32", **engine)
    outputs = llm.generate(PROMPTS, greedy(8))
    steps = set(llm.engine.stats().steps)
    seen = records(llm)
    return outputs, [logits_of(seen, output) for output in outputs], steps


def assert_transformers_logits(reference, outputs, logits):
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    for prompt, output, got in zip(PROMPTS, outputs, logits, strict=True):
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            expected = model.eval()(torch.tensor([sequence])).logits[0]
        expected = expected[len(prompt) - 1 : len(sequence) - 1]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["v3", "v3-fused", "v3-no-q-lora", "v2-q8_0"])
def test_a_deepseek_gguf_gives_transformers_tokens_and_logits_eager_and_captured(files, name):
    reference, path = files[name]
    eager = run(path, enforce_eager=True)
    captured = run(path, capture_tokens=(128,))
    assert "graph" in captured[2] and "graph" not in eager[2]
    assert token_ids(eager[0]) == token_ids(captured[0])
    assert_transformers_logits(reference, *eager[:2])
    assert_transformers_logits(reference, *captured[:2])


def test_the_file_s_metadata_becomes_the_checkpoint_s_config(files):
    """The architecture (V3 by its sigmoid router, V2 by its softmax one), MLA's sizes in
    either layout and the YaRN scaling are those of the checkpoint converted."""
    from updraft.checkpoints.local import local_checkpoint

    for name, (reference, path) in files.items():
        ours = ModelConfig.from_dir(local_checkpoint(str(path)))
        theirs = ModelConfig.from_dir(reference)
        assert ours.architecture == theirs.architecture, name
        assert ours.mla == theirs.mla, name
        assert ours.first_k_dense_replace == theirs.first_k_dense_replace, name
        assert ours.num_heads == theirs.num_heads, name
        assert ours.moe.scoring == theirs.moe.scoring, name
        assert ours.rope.kind == theirs.rope.kind, name
        if ours.rope.kind == "yarn":
            assert ours.rope.mscale_all_dim == pytest.approx(theirs.rope.mscale_all_dim)
            assert ours.rope.factor == theirs.rope.factor


def without_v_b_of_layer_1(tensor):
    return [] if tensor.name == "blk.1.attn_v_b.weight" else None


@pytest.mark.parametrize(
    "changed, tensors, message",
    [
        ({}, without_v_b_of_layer_1, "blk.1.attn_k_b has no attn_v_b"),
        ({"expert_gating_func": 4}, None, r"expert_gating_func 4 \(sqrtsoftplus\)"),
        # a softmax router, V2's, has no score biases (nor renormalises its top k) in
        # transformers
        ({"expert_gating_func": None}, None, "softmax router .* with exp_probs_b"),
        ({"attention.q_lora_rank": None}, None, "q_lora_rank is None but blk.0.attn_q_a"),
        ({"rope.dimension_count": 20}, None, "key length 20 leaves no room beside its 20"),
    ],
    ids=["a-lone-half", "sqrtsoftplus", "softmax-renormalised", "q-lora", "rope-dims"],
)
def test_what_cannot_be_read_is_refused_by_name(files, tmp_path, changed, tensors, message):
    _, path = files["v3"]
    bad = rewritten(path, tmp_path / "bad.gguf", changed, tensors or (lambda tensor: None))
    with pytest.raises(ValueError, match=f"bad.gguf: .*{message}"):
        LLM(str(bad), enforce_eager=True)
