"""GGUF files of the dense families as llama.cpp's own converter writes them give what
transformers gives on the checkpoint they came from.

* Llama 3.1's RoPE scaling reaches the file as ``rope_freqs``, one divisor per
  frequency; updraft turns its queries and keys by those very factors.
* Phi-3 and Phi-4-mini: fused q/k/v and gate/up tensors, LongRoPE's factors as tensors
  beside the attention factor in the metadata (both sides of the original context of
  32 positions), partial rotary, a tied head, a sliding window.
* Gemma 3: norms stored as 1 + the checkpoint's weight, its own norm names, llama.cpp's
  fixed pattern of sliding layers (every sixth global) and local RoPE base, a linearly
  scaled global RoPE and a final logit cap.
* Q8_0 files (Llama's, and Phi-4-mini's with its fused tensors and tied head in blocks)
  give transformers' outputs on the weights their blocks stand for.

Each runs eager and from captured graphs, with ``--activations float32``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map, quants

from tests.helpers import generate_logits, greedy
from tests.llama_cpp_tree import convert_checkpoints, llama_cpp_tree
from tests.probes import logits_of, probed, records

# Inside the original LongRoPE context of 32 positions and decoding past it, and past it
# from the start; each longer than the windows of 8.
PROMPTS = [list(range(3, 20)), [200, 17, 9], list(range(40, 80)), [5] * 30 + [6, 7, 8, 9]]
NEW_TOKENS = 24

# Gemma 3 as llama.cpp reads it: seven layers of which the sixth is global (its fixed
# pattern), the local base its fixed 10000, a global base far from it (scaled linearly),
# queries scaled by the head size.
GEMMA3 = dict(
    num_hidden_layers=7,
    layer_types=[*["sliding_attention"] * 5, "full_attention", "sliding_attention"],
    query_pre_attn_scalar=16,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0},
    },
)
# name -> (tiny checkpoint, its changes, the converter's outtype)
FILES = {
    "llama-3.1": ("llama", {}, "f32"),
    "llama-3.1-q8_0": ("llama", {}, "q8_0"),
    "phi4-mini": ("phi4-mini", {}, "f32"),
    "phi4-mini-q8_0": ("phi4-mini", {}, "q8_0"),
    "phi3-window": ("phi3-window", {}, "f32"),
    "gemma3": ("gemma3", GEMMA3, "f32"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, GGUF file), every file converted in one process."""
    llama_cpp_tree()
    root = tmp_path_factory.mktemp("gguf-families")
    return convert_checkpoints(FILES, root)


@pytest.fixture(scope="module")
def references(files) -> Callable[[str], list[tuple[list[int], torch.Tensor]]]:
    """name -> transformers' greedy tokens and logits for each prompt, computed once."""
    cache: dict[str, list] = {}

    def of(name: str) -> list[tuple[list[int], torch.Tensor]]:
        if name not in cache:
            checkpoint, path = files[name]
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32
            )
            if FILES[name][2] != "f32":
                as_its_blocks_stand_for(model, path)
            cache[name] = [generate_logits(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
        return cache[name]

    return of


def as_its_blocks_stand_for(model, path: Path) -> None:
    """Each of ``model``'s weights that the file holds in blocks replaced by what its
    blocks stand for. The converter quantizes each row apart (its q/k row permutation
    moves whole rows), so llama.cpp's own quantizer and dequantizer, applied to the
    checkpoint's weight, give them; gguf-py's name map says which tensor is which."""
    reader = GGUFReader(str(path))
    kinds = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    in_file = {tensor.name: tensor for tensor in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    replaced = set()
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
            kind = kinds.get(gguf_name)
            if kind is None or kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                continue
            stands_for = quants.dequantize(quants.quantize(param.numpy(), kind), kind)
            # the file's own values, rows in its order: the same rows
            file_values = quants.dequantize(np.asarray(in_file[gguf_name].data), kind)
            assert np.array_equal(np.sort(file_values, 0), np.sort(stands_for, 0)), gguf_name
            param.copy_(torch.from_numpy(stands_for))
            replaced.add(gguf_name)
    in_blocks = {n for n, k in kinds.items() if k == GGMLQuantizationType.Q8_0}
    assert replaced == in_blocks and in_blocks, (replaced, in_blocks)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", sorted(FILES))
def test_a_converted_file_gives_transformers_tokens_and_logits(files, references, name, eager):
    _, path = files[name]
    llm = probed(
        str(path), block_size=4, num_kv_blocks=128, enforce_eager=eager, activations="float32"
    )
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    seen = records(llm)
    for (tokens, expected), output in zip(references(name), outputs, strict=True):
        assert list(output.outputs[0].token_ids) == tokens
        assert (logits_of(seen, output) - expected).abs().max().item() < 1e-4
    assert ("graph" in llm.engine.stats().steps) != eager


def test_the_config_is_read_from_the_file_s_own_metadata(files):
    from updraft.checkpoints.local import local_checkpoint
    from updraft.model_config import ModelConfig

    llama = ModelConfig.from_dir(local_checkpoint(str(files["llama-3.1"][1])))
    assert llama.rope.kind == "default" and len(llama.rope.frequency_factors) == 8
    phi4 = ModelConfig.from_dir(local_checkpoint(str(files["phi4-mini"][1])))
    assert (phi4.rotary_dim, phi4.rope.kind, phi4.tie_word_embeddings) == (12, "longrope", True)
    phi3 = ModelConfig.from_dir(local_checkpoint(str(files["phi3-window"][1])))
    assert phi3.layer_windows == (8, 8) and phi3.rope.kind == "default"
    gemma = ModelConfig.from_dir(local_checkpoint(str(files["gemma3"][1])))
    assert gemma.layer_windows == (8, 8, 8, 8, 8, None, 8)
    assert (gemma.rope.theta, gemma.rope.kind, gemma.local_rope.theta) == (100.0, "linear", 1e4)
    assert gemma.final_logit_softcapping == 30.0


@pytest.mark.parametrize(
    ("pattern", "sliding"),
    [
        (None, [True] * 5 + [False, True]),  # llama.cpp's fixed period of 6
        (3, [True, True, False] * 2 + [True]),
        (0, [True] * 7),  # every layer slides
        ([False, True] * 3 + [True], [False, True] * 3 + [True]),  # listed per layer
    ],
)
def test_gemma3_s_sliding_layers_follow_the_file_s_pattern_as_llama_cpp_counts_it(pattern, sliding):
    from updraft.model_config import gemma3

    metadata = {
        "attention.head_count": 4,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "block_count": 7,
        "attention.sliding_window": 8,
        "attention.sliding_window_pattern": pattern,
    }
    tensors = {"token_embd.weight": ("F32", (256, 64))}
    config = gemma3.from_gguf("x.gguf", "Gemma3ForCausalLM", metadata.get, tensors)
    assert [kind == "sliding_attention" for kind in config["layer_types"]] == sliding
    metadata["attention.sliding_window_pattern"] = [True] * 3
    with pytest.raises(ValueError, match="lists 3 layers, the file has 7"):
        gemma3.from_gguf("x.gguf", "Gemma3ForCausalLM", metadata.get, tensors)


def test_a_chat_template_that_writes_its_bos_gets_no_second_one(files, tmp_path):
    """The file's SentencePiece tokenizer adds a BOS (``add_bos_token``); a template that
    spells ``{{ bos_token }}`` itself must not get another, as transformers' and vLLM's
    chat tokenization give; updraft's own template, which writes none, keeps the
    tokenizer's."""
    from updraft import LLM, SamplingParams
    from updraft.chat_template import ChatTemplate
    from updraft.engine.input_processor import InputProcessor

    _, path = files["llama-3.1"]
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, enforce_eager=True)
    bos = llm.tokenizer.backend.token_to_id("<s>")
    messages = [{"role": "user", "content": "hi"}]
    simple = llm.chat(messages, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert simple[0] == bos and simple[1] != bos
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
        {"bos_token": "<s>"},
    )
    processor = InputProcessor(llm.tokenizer, llm.input_processor.limits, template)
    request = processor.process(
        processor.render_chat(messages), SamplingParams(), processor.chat_adds_special_tokens
    )
    own = list(request.prompt_token_ids)
    assert own.count(bos) == 1 and own[0] == bos
