"""``--activations``: auto takes int8 x for a quantized file whose types all have integer
kernels and float32 x for a float checkpoint; int8 is refused on a float checkpoint and,
by the tensor's name, on a linear in a type without a kernel; speculation over a target
that rounds x gives the tokens it gives alone."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

from benchmarks.peers import make_gguf
from tests.helpers import greedy, token_ids
from tests.test_gguf import MIXES, convert_to, plain
from updraft import LLM
from updraft.checkpoints.local import local_checkpoint
from updraft.config import EngineConfig
from updraft.kernels.gguf_ops import int8_kernel_builds
from updraft.model_config import ModelConfig
from updraft.models import activations, gguf_loader
from updraft.models.activations import int8_activations
from updraft.models.loader import load_model
from updraft.models.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny untied Qwen3 checkpoint (float32), and its files in Q8_0 and in F32."""
    root = tmp_path_factory.mktemp("activations")
    checkpoint = plain("qwen3", root / "hf")
    make_gguf.main(checkpoint, root / "q8_0.gguf", convert_to(MIXES["Q8_0"], None, {}))
    make_gguf.main(checkpoint, root / "f32.gguf")
    return checkpoint, root / "q8_0.gguf", root / "f32.gguf"


def resolve(setting: str, model, quantization: str | None = None, draft: bool = False) -> bool:
    config = EngineConfig(model=str(model), activations=setting, quantization=quantization)
    return int8_activations(config, ModelConfig.from_dir(config.model), draft)


def test_auto_is_int8_for_a_quantized_file_and_float32_for_a_float_checkpoint(tiny):
    checkpoint, quantized, floats = tiny
    assert resolve("auto", quantized) and resolve("int8", quantized)
    assert not resolve("float32", quantized)
    for model in (checkpoint, floats):
        assert not resolve("auto", model) and not resolve("float32", model)
        with pytest.raises(ValueError, match=rf"{model.name}: --activations int8 is for quantized"):
            resolve("int8", model)
        assert not resolve("int8", model, draft=True)  # a draft model's: asked of the target
    with pytest.raises(ValueError, match="activations int8 is for quantized weights"):
        LLM(str(checkpoint), activations="int8")
    with pytest.raises(ValueError, match="activations must be one of auto, int8, float32"):
        LLM(str(quantized), activations="int4")


def test_auto_is_float32_where_a_type_or_format_has_no_kernel(tiny, monkeypatch):
    """A file with a block type the integer kernels do not take, and a format (here
    ``--quantization int4``) before its kernels join ``INT8_FORMATS``: auto keeps float32
    x, and int8 is refused for the format by name."""
    checkpoint, quantized, _ = tiny
    monkeypatch.setattr(activations, "INT8_TYPES", frozenset())
    assert not resolve("auto", quantized)
    monkeypatch.setattr(activations, "INT8_FORMATS", frozenset())
    assert not resolve("auto", checkpoint, "int4")
    with pytest.raises(ValueError, match="int4 weights have no integer kernel"):
        resolve("int8", checkpoint, "int4")
    monkeypatch.setattr(activations, "INT8_FORMATS", frozenset({"int4"}))
    assert resolve("auto", checkpoint, "int4") and not resolve("auto", checkpoint, "int8")


def test_int8_refuses_a_linear_in_a_type_without_a_kernel_by_name(tiny, monkeypatch):
    """Not widened unnoticed: the first linear in such a type is named, with its type.
    The untied embedding, only looked up (row by row widened), is placed before it and
    passes in any type."""
    _, quantized, _ = tiny
    directory = local_checkpoint(str(quantized))
    config = ModelConfig.from_dir(directory)
    monkeypatch.setattr(gguf_loader, "INT8_TYPES", frozenset())
    with pytest.raises(ValueError) as refused:
        load_model(config, directory, torch.float32, int8_activations=True)
    message = str(refused.value)
    # a linear, not the embedding (token_embd, in Q8_0 too), which is placed first
    assert re.match(r"q8_0\.gguf: (output|blk\.\d+\.\w+)\.weight is in Q8_0, which has no", message)
    assert "--activations float32 reads it exactly" in message
    load_model(config, directory, torch.float32)  # float32 x reads it


@pytest.fixture(scope="module")
def demo_q8_0(tmp_path_factory):
    """The demo model (tied, byte-level BPE) in Q8_0: its LM head is the embedding's
    blocks."""
    from updraft.demo import DEMO_MODEL_DIR

    root = tmp_path_factory.mktemp("activations-demo")
    checkpoint = root / "hf"
    shutil.copytree(DEMO_MODEL_DIR, checkpoint)
    path = root / "demo-q8_0.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES["Q8_0"], np.random.default_rng(0), {}))
    return path


def test_speculation_over_an_int8_target_changes_no_token(demo_q8_0):
    """By default a quantized file's every linear rounds x (its parts regrouped, none in
    float panels); n-gram drafts verified by that target give the tokens it gives
    alone, greedily."""
    prompts, params = ["class ", "def fib(n):"], greedy(24)
    engine = dict(num_kv_blocks=32, enforce_eager=True)
    alone = LLM(str(demo_q8_0), **engine)
    modules = list(alone.engine._runner.model.modules())  # noqa: SLF001
    linears = [m for m in modules if isinstance(m, gguf_loader.GGUFLinear)]
    assert linears and all(all(m.grouped) for m in linears)
    assert not [m for m in modules if isinstance(m, PackedLinear) and m.format.quantized]
    plain_tokens = token_ids(alone.generate(prompts, params))
    alone.engine.close()
    ngram = LLM(str(demo_q8_0), speculative_method="ngram", num_speculative_tokens=3, **engine)
    assert token_ids(ngram.generate(prompts, params)) == plain_tokens
    assert ngram.engine.stats().speculative.num_accepted_tokens > 0
    ngram.engine.close()
