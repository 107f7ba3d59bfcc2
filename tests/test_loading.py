"""Loading: the model is built on the meta device and filled tensor by tensor from the
memory-mapped checkpoint, each tensor-parallel rank reading only the rows and columns it
keeps, each decoder layer packed as soon as its weights are in."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from benchmarks.common import stored_in
from updraft.kernels.build import kernel_builds
from updraft.model_config import ModelConfig
from updraft.models import loader
from updraft.models.loader import layer_of, load_model
from updraft.models.moe import Experts
from updraft.models.packing import Packer
from updraft.models.tensor_parallel import shard_model
from updraft.parallel.topology import ParallelSizes, RankPlace
from updraft.weights import WeightFormat

from .checkpoints import build_checkpoint

TWO_RANKS = [RankPlace(rank, ParallelSizes(tensor=2), "unconnected") for rank in (0, 1)]


def checkpoint(kind: str, directory: Path) -> Path:
    if kind == "llama-257":  # a vocabulary that does not split evenly over 2 ranks
        return build_checkpoint("llama-plain", directory, vocab_size=257)
    return build_checkpoint(kind, directory)


KINDS = ["llama-257", "qwen2", "deepseek-v3", "deepseek-v3-no-q-lora"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_loads_what_shard_model_keeps_of_the_whole_model(kind, tmp_path):
    """bfloat16 compute, so that nothing is packed and the parameters compare as they
    are: q/k/v and gate/up rows, o_proj and down columns, the replicated KV head (Qwen2's
    one), a padded vocabulary shard, the experts' rows and columns, DeepSeek's fused
    down-projection."""
    model_dir = checkpoint(kind, tmp_path / kind)
    config = ModelConfig.from_dir(model_dir)
    for place in TWO_RANKS:
        whole = load_model(config, model_dir, torch.bfloat16)
        shard_model(whole, place)
        expected = dict(whole.named_parameters())
        got = dict(load_model(config, model_dir, torch.bfloat16, place=place).named_parameters())
        assert got.keys() == expected.keys()
        for name, param in got.items():
            assert torch.equal(param, expected[name]), (place.rank, name)


class CountingReads:
    """``safe_open`` that counts the elements read of each tensor."""

    def __init__(self, read: Counter) -> None:
        self.read = read

    def __call__(self, path: str, framework: str, device: str):
        reads = self.read

        class Reader:
            def __enter__(self):
                self.inner = safe_open(path, framework=framework, device=device)
                self.file = self.inner.__enter__()
                return self

            def __exit__(self, *error):
                return self.inner.__exit__(*error)

            def keys(self):
                return self.file.keys()

            def get_slice(self, name):
                whole = self.file.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return whole.get_shape()

                    def __getitem__(self, index):
                        tensor = whole[index]
                        reads[name] += tensor.numel()
                        return tensor

                return Slice()

        return Reader()


@pytest.mark.parametrize("kind", ["llama-257", "deepseek-v3"])
def test_each_rank_reads_only_what_it_keeps(kind, tmp_path, monkeypatch):
    model_dir = checkpoint(kind, tmp_path / kind)
    config = ModelConfig.from_dir(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as file:
        sizes = {name: file.get_slice(name).get_shape() for name in file.keys()}  # noqa: SIM118
    numel = {name: torch.Size(shape).numel() for name, shape in sizes.items()}
    per_rank = []
    for place in TWO_RANKS:
        read = Counter()
        monkeypatch.setattr(loader, "safe_open", CountingReads(read))
        load_model(config, model_dir, torch.bfloat16, place=place)
        per_rank.append(read)
    whole = {  # what every rank keeps whole: norms, the router, the latent down-projections
        name
        for name in numel
        if "norm" in name
        or name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        or any(part in name for part in ("q_a_proj", "kv_a_proj_with_mqa"))
    }
    assert any("experts.3.down_proj" in name for name in numel) == (kind == "deepseek-v3")
    for name, count in numel.items():
        if layer_of(name) is not None and layer_of(name) >= config.num_layers:
            continue  # a multi-token prediction layer: not the model's
        if name in whole:
            assert [read[name] for read in per_rank] == [count, count], name
        else:  # split: the ranks' reads are disjoint and cover the tensor once
            assert all(0 < read[name] < count for read in per_rank), name
            assert sum(read[name] for read in per_rank) == count, name


@pytest.mark.skipif(not kernel_builds("linear"), reason="needs a C compiler for the kernels")
def test_a_layer_in_the_checkpoint_s_dtype_lives_only_until_it_is_packed(tmp_path, monkeypatch):
    """int4 from a bfloat16 checkpoint: whenever the packer runs, the unpacked linear
    and expert weights the model holds are at most one layer's (with everything loaded
    first and packed after, they would be all of them)."""
    model_dir = stored_in(
        build_checkpoint("deepseek-v3", tmp_path / "v3"), torch.bfloat16, tmp_path
    )
    config = ModelConfig.from_dir(model_dir)
    unpacked = []
    pack = Packer.__call__

    def spy(self, model: nn.Module) -> None:
        weights = [
            param
            for module in model.modules()
            if isinstance(module, (nn.Linear, Experts))
            for param in module.parameters(recurse=False)
            if not param.is_meta
        ]
        unpacked.append(sum(param.nbytes for param in {id(p): p for p in weights}.values()))
        pack(self, model)

    monkeypatch.setattr(Packer, "__call__", spy)
    model = load_model(config, model_dir, torch.float32, weights=WeightFormat("int4", 32))
    assert not any(isinstance(m, (nn.Linear, Experts)) for m in model.modules())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as file:
        per_layer = Counter()
        for name in file.keys():  # noqa: SIM118
            if "proj" in name or "lm_head" in name:
                per_layer[layer_of(name)] += file.get_slice(name)[:].nbytes
    del per_layer[config.num_layers]  # the MTP layer, which the model does not load
    assert len(unpacked) == config.num_layers + 1  # after each layer, then the rest
    assert max(unpacked) <= max(per_layer.values())
    assert sum(per_layer.values()) > 2 * max(per_layer.values())  # the test could fail
