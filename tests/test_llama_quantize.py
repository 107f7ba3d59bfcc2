"""Files quantized by llama.cpp's own ``llama-quantize`` give transformers' tokens and
logits on the values their blocks stand for.

The other GGUF tests read K-quant and IQ4 blocks of random bytes (every bit pattern,
bit for bit against gguf-py's dequantizer) or blocks gguf-py's quantizer writes; here
the blocks and the mix of types per tensor are the quantizer's: a tiny Llama and a tiny
Qwen3-MoE, written as float32 GGUF by llama.cpp's converter, are quantized to the
usual downloads (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL). The reference
is transformers on the checkpoint with each weight replaced by the file's dequantized
tensor (gguf-py's dequantizer and name map; a row order the converter changed, as
Llama's q/k permutation, found by matching the float32 file's rows to the
checkpoint's).

``llama-quantize`` is built from the same sdist by ``scripts/build_llama_quantize.py``
(minutes of compiling, so not in CI's set-up); without it these tests skip and say so.
``$UPDRAFT_LLAMA_QUANTIZE`` names another build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map, quants
from safetensors.torch import load_file, save_file

from tests.checkpoints import build_checkpoint
from tests.helpers import generate_logits, greedy
from tests.llama_cpp_tree import VERSION, cache_root, convert_many
from tests.probes import logits_of, probed, records

QUANTIZED = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ4_NL")
# Rows of 256 values: the K-quants' blocks, so the quantizer keeps the types it names.
CHECKPOINTS = {
    "llama": ("llama-plain", {"hidden_size": 256, "intermediate_size": 512}),
    "qwen3-moe": (
        "qwen3-moe",
        {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "moe_intermediate_size": 256,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}
PROMPTS = [list(range(3, 20)), [200, 17, 9], [5] * 30 + [6, 7, 8, 9]]
NEW_TOKENS = 8
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def quantize_binary() -> Path:
    named = os.environ.get("UPDRAFT_LLAMA_QUANTIZE")
    binary = (
        Path(named) if named else cache_root() / f"llama.cpp-build-{VERSION}/bin/llama-quantize"
    )
    if not binary.is_file():
        pytest.skip(
            f"llama.cpp's llama-quantize is not built ({binary}): "
            "python scripts/build_llama_quantize.py builds it"
        )
    return binary


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """(model, type) -> (checkpoint, float32 file, quantized file)."""
    binary = quantize_binary()
    root = tmp_path_factory.mktemp("llama-quantize")
    checkpoints = {
        name: build_checkpoint(kind, root / name, **changes)
        for name, (kind, changes) in CHECKPOINTS.items()
    }
    convert_many([(path, root / f"{name}-f32.gguf", "f32") for name, path in checkpoints.items()])
    made = {}
    for name, checkpoint in checkpoints.items():
        whole = root / f"{name}-f32.gguf"
        for kind in QUANTIZED:
            out = root / f"{name}-{kind}.gguf"
            done = subprocess.run([binary, whole, out, kind], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-2000:]
            made[name, kind] = (checkpoint, whole, out)
    return made


def stands_for(checkpoint: Path, whole: Path, quantized: Path, directory: Path) -> Path:
    """``checkpoint`` with every weight the quantized file holds replaced by its
    dequantized values, rows in the checkpoint's order."""
    shutil.copytree(checkpoint, directory)
    tensors = load_file(directory / "model.safetensors")
    floats = {t.name: np.asarray(t.data) for t in GGUFReader(str(whole)).tensors}
    reader = GGUFReader(str(quantized))
    arch = str(reader.fields["general.architecture"].contents())
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    layers = transformers.AutoConfig.from_pretrained(checkpoint).num_hidden_layers
    names = get_tensor_name_map(arch, layers)
    for tensor in reader.tensors:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        for name, (rows, order) in _targets(tensor.name, tensors, names, floats).items():
            tensors[name] = torch.from_numpy(np.array(values[rows][order]))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _targets(gguf_name, tensors, names, floats):
    """checkpoint name -> (the file tensor's index for it, the row order that puts its
    rows in the checkpoint's): experts are slices of a stacked tensor; a float32 row
    that matches each checkpoint row gives the order."""
    found = {}
    for name, weight in tensors.items():
        expert = EXPERT.fullmatch(name)
        if expert is not None:
            layer, index, projection = expert.groups()
            if gguf_name != f"blk.{layer}.ffn_{projection}_exps.weight":
                continue
            rows = int(index)
        elif names.get_name(name, try_suffixes=(".weight", ".bias")) == gguf_name:
            rows = slice(None)
        else:
            continue
        float_rows = floats[gguf_name][rows]
        if float_rows.ndim == 1:
            found[name] = (rows, slice(None))
            continue
        position = {row.tobytes(): i for i, row in enumerate(float_rows)}
        order = [position[row.tobytes()] for row in weight.numpy()]
        found[name] = (rows, np.array(order))
    return found


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("model", sorted(CHECKPOINTS))
def test_a_file_quantized_by_llama_cpp_gives_transformers_on_its_values(
    files, tmp_path, model, kind
):
    checkpoint, whole, quantized = files[model, kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        stands_for(checkpoint, whole, quantized, tmp_path / "reference"), dtype=torch.float32
    )
    expected = [generate_logits(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    llm = probed(str(quantized), block_size=4, num_kv_blocks=64, activations="float32")
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    seen = records(llm)
    for (tokens, logits), output in zip(expected, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == tokens
        # float32's rounding, summed in another order (blocks of 256 against torch's
        # matmul) over rows 256 and 512 wide, through every decode step; a wrong value
        # in a block moves logits by its quantization step, 1e-2 and more
        torch.testing.assert_close(logits_of(seen, output), logits, atol=5e-4, rtol=1e-4)
