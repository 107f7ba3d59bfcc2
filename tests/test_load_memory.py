"""What loading a GGUF file leaves resident: the file's pages a linear read into its
groups are given back as the linear is built (not once the whole model is), and no
small weight keeps the file's map (and the folios around it) in memory."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.peers import make_gguf
from tests.checkpoints import build_checkpoint
from tests.test_gguf import MIXES, convert_to
from updraft.checkpoints.gguf import checkpoint_dir, linked_files
from updraft.checkpoints.gguf_header import walk
from updraft.kernels.gguf_ops import BLOCK_TYPES, gguf_group, int8_kernel_builds
from updraft.model_config import ModelConfig
from updraft.models import gguf_floats, read_pages
from updraft.models.gguf_loader import load_gguf_model
from updraft.models.layers import FusedLinear
from updraft.models.weight_memory import (
    SMALL_MAPPED_BYTES,
    WeightMemory,
    extent,
    read_into_memory,
    settle_weights,
)
from updraft.resident import PAGE, mappings

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps"),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]


def mapped_pages(path: Path) -> int:
    """This process's resident pages of the file (mincore would say the page cache's)."""
    return sum(m.rss for m in mappings() if m.path == str(path)) // PAGE


def test_a_tensor_read_into_another_layout_gives_its_whole_pages_back(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (16 * PAGE // 256))
    spans = read_pages.MappedSpans()
    whole = np.memmap(path, dtype=np.uint8, mode="c")
    spans.spans.append((whole.ctypes.data, whole.ctypes.data + whole.nbytes))
    mapped = torch.from_numpy(whole)
    assert int(mapped.sum()) > 0 and mapped_pages(path) == 16  # all read
    kept = torch.nn.Module()
    kept.register_buffer("table", mapped[2 * PAGE : 4 * PAGE], persistent=False)
    read = mapped[4 * PAGE + 100 : 10 * PAGE + 100]  # pages 5..9 whole, 4 and 10 in part
    own = torch.ones(4 * PAGE)  # anonymous: its pages are its data, never dropped
    assert spans.drop_unheld([mapped[2 * PAGE : 3 * PAGE], read, own], kept) == 5 * PAGE
    assert mapped_pages(path) == 11 and int(own.sum()) == 4 * PAGE
    on_disk = np.fromfile(path, dtype=np.uint8)[4 * PAGE + 100 : 10 * PAGE + 100]
    assert torch.equal(read, torch.from_numpy(on_disk))  # read back from the file


# Q4_K_M's q, k, gate and up are all Q4_K: each fused pair is joined (v and down are Q6_K)
JOINED = tuple(f"{name}.weight" for name in ("attn_q", "attn_k", "ffn_gate", "ffn_up"))


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-load-memory")
    checkpoint = build_checkpoint(
        "qwen3-plain", root / "hf", hidden_size=256, intermediate_size=512
    )
    path = root / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES["Q4_K_M"], np.random.default_rng(3), {}))
    return path


@pytest.mark.parametrize("int8", [True, False])
def test_each_linear_s_file_pages_go_once_it_is_grouped_and_only_then(
    q4_k_m_file, monkeypatch, int8
):
    """With int8 activations every block tensor is regrouped, so each one's whole pages
    are dropped as its linear is built; with float32 x the K-quants' blocks are what the
    kernels read, kept in the map, and none of theirs may go, but for the neighbouring
    slices of one type a fused linear joins in a copy (q and k, gate and up)."""
    if int8 and not int8_kernel_builds():
        pytest.skip("no int8 kernels build here")
    dropped: list[tuple[int, int]] = []
    drop = read_pages.drop_pages
    monkeypatch.setattr(read_pages, "drop_pages", lambda a, b: dropped.append((a, b)) or drop(a, b))
    directory = checkpoint_dir(str(q4_k_m_file))
    config = ModelConfig.from_dir(directory)
    parts = linked_files(Path(directory))
    model = load_gguf_model(config, parts, torch.float32, int8_activations=int8)
    header = walk(q4_k_m_file)
    maps = [m for m in mappings() if m.path == str(q4_k_m_file.resolve())]
    base = next((m.start for m in maps if dropped and m.start <= dropped[0][0] < m.end), 0)
    gone = {page for a, b in dropped for page in range((a - base) // PAGE, (b - base) // PAGE)}
    for tensor in header.tensors:
        first, last = -(-tensor.start // PAGE), (tensor.start + tensor.n_bytes) // PAGE
        whole = set(range(first, last))
        if tensor.type_code in (0, 1):  # F32, F16: kept (or packed) by the float path
            assert not whole & gone, tensor.name
        elif int8 or tensor.name.endswith(JOINED):  # regrouped, or joined in a copy
            assert whole <= gone, tensor.name
        else:  # read where they lie
            assert not whole & gone, tensor.name
    assert not any(param.is_meta for param in model.parameters())


def load_float_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **changes: object
) -> tuple[Path, torch.nn.Module, list[tuple[int, int]]]:
    """A small Qwen3 as an F32 GGUF file, loaded -> (the file, the model, each range of
    the file's pages dropped while it loaded)."""
    checkpoint = build_checkpoint("qwen3-plain", tmp_path / "hf", hidden_size=256, **changes)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path)
    dropped: list[tuple[int, int]] = []
    drop = read_pages.drop_pages
    monkeypatch.setattr(read_pages, "drop_pages", lambda a, b: dropped.append((a, b)) or drop(a, b))
    directory = checkpoint_dir(str(path))
    model = load_gguf_model(
        ModelConfig.from_dir(directory), linked_files(Path(directory)), torch.float32
    )
    return path, model, dropped


def test_a_float_file_s_linears_give_their_pages_back_as_each_is_packed(tmp_path, monkeypatch):
    """A float linear is packed into panels (a fused one first joined in a copy): the
    pages it was read from go then, not once the whole model is in (a 500M F32 file's
    load peaked at 6970 MiB for 2.5 GB of weights). The embedding stays in the map."""
    path, model, dropped = load_float_file(tmp_path, monkeypatch)
    mapped = next(m for m in mappings() if m.start <= dropped[0][0] < m.end)
    assert Path(mapped.path).name == path.name
    base = mapped.start
    gone = {page for a, b in dropped for page in range((a - base) // PAGE, (b - base) // PAGE)}
    for tensor in walk(path).tensors:
        whole = set(range(-(-tensor.start // PAGE), (tensor.start + tensor.n_bytes) // PAGE))
        linear = len(tensor.dims) == 2 and tensor.name != "token_embd.weight"
        assert whole <= gone if linear else not whole & gone, tensor.name
    assert not any(param.is_meta for param in model.parameters())


def test_a_float_file_is_packed_a_layer_at_a_time(tmp_path, monkeypatch):
    """Each decoder layer's float linears are packed before the next layer is read, and
    a fused weight's joined copy is freed once its layer is packed: joining every
    layer first kept them all at once (a 500M F32 file's load peaked at 4482 MiB for
    2.5 GB of weights, 2824 now)."""
    checkpoint = build_checkpoint("qwen3-plain", tmp_path / "hf", hidden_size=256)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path)
    joined: list[weakref.ref] = []  # each layer's fused weights, once it is packed
    whole: list[torch.nn.Module] = []  # the model: packed first, for its parts outside layers
    pack = gguf_floats.pack_model

    def unpacked(module: torch.nn.Module) -> list[torch.Tensor]:
        return [
            m.weight
            for m in module.modules()
            if isinstance(m, FusedLinear) and not m.weight.is_meta
        ]

    def packing(module, *args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in joined), "a packed layer's joined copy lives on"
        whole.append(whole[0] if whole else module)
        fused = unpacked(module)
        if module is not whole[0]:  # a decoder layer: its qkv and gate/up, and no other's
            assert len(fused) == 2 and len(unpacked(whole[0])) == 2
        joined.extend(weakref.ref(w) for w in fused)
        return pack(module, *args, **kwargs)

    monkeypatch.setattr(gguf_floats, "pack_model", packing)
    directory = checkpoint_dir(str(path))
    config = ModelConfig.from_dir(directory)
    load_gguf_model(config, linked_files(Path(directory)), torch.float32)
    assert len(joined) == 2 * len(whole[0].model.layers) > 0


def test_a_tied_head_s_embedding_gives_its_pages_back_once_the_head_is_packed(
    tmp_path, monkeypatch
):
    """A tied LM head reads the whole embedding into its panels; the embedding is read
    by row after that, so its pages go (a step's lookups map its rows back in)."""
    path, model, dropped = load_float_file(tmp_path, monkeypatch, tie_word_embeddings=True)
    assert model.lm_head.__class__.__name__ == "PackedLinear"
    table = model.model.embed_tokens.weight
    first, last = extent(table)
    whole = set(range(-(-first // PAGE), last // PAGE))
    gone = {page for a, b in dropped for page in range(a // PAGE, b // PAGE)}
    assert whole and whole <= gone
    info = next(t for t in walk(path).tensors if t.name == "token_embd.weight")
    assert info.type_code == 0  # F32
    rows = np.fromfile(path, np.float32, info.n_bytes // 4, offset=info.start)
    expected = torch.from_numpy(rows.reshape(info.dims[::-1]))
    ids = torch.tensor([[0, 5, table.shape[0] - 1]])
    assert torch.equal(model.model.embed_tokens(ids)[0], expected[ids[0]])


def test_a_small_mapped_weight_is_copied_out_and_a_large_one_stays_in_the_map(tmp_path):
    """A read maps the page cache's folio around it (up to 2 MiB): a norm of a few KiB
    left in the map held that much of the file resident."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (2 * SMALL_MAPPED_BYTES // 256))
    whole = np.memmap(path, dtype=np.uint8, mode="c")
    module = torch.nn.Module()
    small = torch.from_numpy(whole[PAGE : 2 * PAGE + 24])  # a tensor of its own, as a file's
    large = torch.from_numpy(whole[SMALL_MAPPED_BYTES // 2 : SMALL_MAPPED_BYTES * 3 // 2])
    module.register_buffer("norm", small, persistent=False)
    module.register_buffer("table", large, persistent=False)
    values = module.norm.clone()
    settle_weights(module, WeightMemory())
    in_file = [(m.start, m.end) for m in mappings() if m.path == str(path)]
    assert not any(a <= module.norm.data_ptr() < b for a, b in in_file)
    assert any(a <= module.table.data_ptr() < b for a, b in in_file)
    assert torch.equal(module.norm, values)


def test_copying_small_weights_out_leaves_none_of_their_folios_mapped(tmp_path):
    """Each copy reads the folio around its weight into the map (up to 2 MiB on ext4 or
    xfs): a 500M model's few dozen norms held 113 MiB of its file at once. Each is
    dropped as its copy is made, but for the pages of a weight that stays in the map."""
    mib = 2**20
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (8 * mib // 256))
    whole = np.memmap(path, dtype=np.uint8, mode="c")
    module = torch.nn.Module()
    for index in range(4):
        start = index * mib + mib // 2
        module.register_buffer(f"norm{index}", torch.from_numpy(whole[start : start + 4096]))
    table = torch.from_numpy(whole[6 * mib : 8 * mib])
    module.register_buffer("table", table, persistent=False)
    assert int(table.sum()) > 0  # every page of the table read, so mapped
    values = [module.get_buffer(f"norm{index}").clone() for index in range(4)]
    read_into_memory(module, below=SMALL_MAPPED_BYTES)
    table_pages = 2 * mib // PAGE
    assert table_pages <= mapped_pages(path) <= table_pages + 16
    assert module.table.data_ptr() == table.data_ptr()  # still the file's
    for index, value in enumerate(values):
        assert torch.equal(module.get_buffer(f"norm{index}"), value)


@pytest.mark.skipif(not int8_kernel_builds(), reason="no int8 kernels build here")
@pytest.mark.parametrize("rows", [(16, 8, 24), (16, 12, 8)])
def test_a_fused_weight_s_parts_regroup_as_their_joined_rows_do(rows):
    """A fused q/k/v or gate/up is regrouped part by part into one weight's groups, with
    no joined copy (parts of whole groups), or joined first where a group would span
    two parts (12 rows): the groups are the joined rows' either way."""
    k, row_bytes = 64, 2 * 34  # Q8_0: 34 bytes per 32 values
    generator = torch.Generator().manual_seed(0)
    parts = [
        torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=generator) for n in rows
    ]
    q8_0 = BLOCK_TYPES["Q8_0"]
    assert torch.equal(gguf_group(parts, q8_0, k), gguf_group(torch.cat(parts), q8_0, k))
