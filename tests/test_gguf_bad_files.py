"""Broken and hostile GGUF files: each is refused in one line that names the file and
the field, through ``LLM`` and through ``updraft generate``, before anything of the size
its header claims is allocated.

A good file (a tiny Llama with a byte-level vocabulary, written by gguf-py's writer)
is corrupted one field at a time, at the offsets gguf-py's own reader finds for it; read
whole, it gives what gguf-py's reader gives. Its matrices in Q8_0 blocks, a block
tensor cut short, with rows that are not whole blocks, or of another shape than the
weight it fills is refused by the tensor's name before a kernel could read past it.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from benchmarks.peers import make_gguf
from tests.checkpoints import build_checkpoint
from tests.conftest import add_byte_tokenizer
from updraft import LLM
from updraft.checkpoints.gguf_header import read_gguf
from updraft.cli import main

HUGE = 2**60


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-bad-files")
    checkpoint = add_byte_tokenizer(build_checkpoint("llama-plain", root / "hf"))
    make_gguf.main(checkpoint, root / "good.gguf")
    return root / "good.gguf"


def _value_offset(reader: GGUFReader, key: str) -> int:
    """Where a metadata value starts: after the key's length, the key and the type."""
    return reader.fields[key].offset + 8 + len(key.encode()) + 4


def _tensor_dims_field(reader: GGUFReader) -> int:
    """Where the last tensor's first dimension is written in its description."""
    tensor = reader.tensors[-1]
    return tensor.field.offset + 8 + len(tensor.name.encode()) + 4


def _tensor_offset_field(reader: GGUFReader) -> int:
    """Where the last tensor's data offset is written in its description."""
    return _tensor_dims_field(reader) + 8 * len(reader.tensors[-1].shape) + 4


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def corrupt(good_path, kind: str) -> bytes:
    data = good_path.read_bytes()
    reader = GGUFReader(str(good_path))
    if kind == "truncated data":
        return data[: len(data) - 100]
    if kind == "truncated header":
        return data[: reader.tensors[-1].field.offset + 5]
    if kind == "magic":
        return b"GGUG" + data[4:]
    if kind == "tensor count":
        return _patched(data, 8, "<Q", HUGE)
    if kind == "key count":
        return _patched(data, 16, "<Q", HUGE)
    if kind == "string length":
        return _patched(data, _value_offset(reader, "general.architecture"), "<Q", HUGE)
    if kind == "array length":  # after the array's item type
        return _patched(data, _value_offset(reader, "tokenizer.ggml.tokens") + 4, "<Q", HUGE)
    if kind == "tensor size":
        return _patched(data, _tensor_dims_field(reader), "<Q", HUGE)
    if kind == "tensor offset":
        return _patched(data, _tensor_offset_field(reader), "<Q", 2**40)
    raise AssertionError(kind)


# What the line says about each: the field, and what is wrong with it.
CASES = {
    "truncated data": r"tensor 'output_norm\.weight''s data .* runs past the end of the file",
    "truncated header": r"tensor \d+'s name's length runs past the end of the file",
    "magic": r"not a GGUF file: its magic is b'GGUG'",
    "tensor count": rf"the tensor count {HUGE} cannot fit in the file",
    "key count": rf"the metadata key count {HUGE} cannot fit in the file",
    "string length": rf"metadata 'general\.architecture' \(a string of {HUGE} bytes\) runs past",
    "array length": rf"metadata 'tokenizer\.ggml\.tokens''s item count {HUGE} cannot fit",
    "tensor offset": r"tensor 'output_norm\.weight''s data \(offset 1099511627776, .* runs past",
    "tensor size": rf"tensor 'output_norm\.weight''s data \(offset \d+, {4 * HUGE} bytes\) runs",
}


def _as_q8_0(name: str, array: np.ndarray):
    if array.ndim != 2:
        return array.astype(np.float32), None
    return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def good_q8_0(good):
    """The good file's checkpoint with its matrices in Q8_0 blocks."""
    make_gguf.main(good.parent / "hf", good.parent / "q8_0.gguf", _as_q8_0)
    return good.parent / "q8_0.gguf"


def test_the_good_file_loads(good, good_q8_0):
    LLM(str(good), num_kv_blocks=8, enforce_eager=True)
    LLM(str(good_q8_0), num_kv_blocks=8, enforce_eager=True)


BLOCKS = "blk.0.attn_q.weight"  # the Q8_0 tensor the block cases break


def corrupt_blocks(path, kind: str) -> tuple[bytes, str]:
    """The Q8_0 file broken in one block tensor, and what the line must say of it."""
    data = path.read_bytes()
    reader = GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == BLOCKS)
    dims = tensor.field.offset + 8 + len(BLOCKS.encode()) + 4  # its first dimension
    width, rows = (int(d) for d in tensor.shape)
    name = BLOCKS.replace(".", r"\.")
    if kind == "row width":  # not a whole number of blocks of 32
        said = rf"tensor '{name}': rows of {width + 16} values are not whole Q8_0 blocks of 32"
        return _patched(data, dims, "<Q", width + 16), said
    if kind == "row count":  # its bytes past the end of the file
        return _patched(data, dims + 8, "<Q", HUGE), rf"tensor '{name}''s data .* runs past the end"
    if kind == "truncated":  # the file cut inside its blocks (later tensors' data follows)
        last = max(reader.tensors, key=lambda t: t.data_offset)
        cut = int(tensor.data_offset) + int(tensor.n_bytes) // 2
        assert last.data_offset > tensor.data_offset
        return data[:cut], rf"tensor '{name}''s data .* runs past the end of the file"
    shape = {"rows": (rows // 2, width), "values": (rows, width // 2)}[kind]
    patched = _patched(data, dims + 8, "<Q", shape[0])
    patched = _patched(patched, dims, "<Q", shape[1])
    said = rf"{name}: a Q8_0 tensor of shape \({shape[0]}, {shape[1]}\) \(rows, values per row\)"
    said += rf" cannot fill \S+, which takes \({rows}, {width}\)"
    return patched, said


@pytest.mark.parametrize("kind", ["row width", "row count", "truncated", "rows", "values"])
def test_a_broken_block_tensor_is_refused_by_its_name(good_q8_0, tmp_path, kind):
    bad = tmp_path / "bad.gguf"
    data, said = corrupt_blocks(good_q8_0, kind)
    bad.write_bytes(data)
    with pytest.raises(ValueError, match=said) as refused:
        LLM(str(bad), num_kv_blocks=8, enforce_eager=True)
    line = str(refused.value)
    assert "\n" not in line and bad.name in line, line


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_broken_field_is_one_line_naming_the_file_and_the_field(good, tmp_path, kind, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(corrupt(good, kind))
    with pytest.raises(ValueError, match=CASES[kind]) as refused:
        LLM(str(bad))
    line = str(refused.value)
    assert "\n" not in line and str(bad) in line, line
    assert main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {line}\n"


@pytest.mark.parametrize("kind", ["string length", "array length", "tensor count"])
def test_a_claimed_length_allocates_nothing_of_its_size(good, tmp_path, kind):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(corrupt(good, kind))
    with pytest.raises(ValueError):
        LLM(str(bad))  # imports and caches warmed
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=str(HUGE)):
            LLM(str(bad))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def test_a_good_file_reads_as_gguf_py_reads_it(good, tmp_path):
    """The checked reader gives gguf-py's ``GGUFReader``'s metadata values and tensors
    (names, types, shapes, bytes), on a model file and on llama.cpp's SentencePiece
    vocabulary (32,000 tokens with scores and types)."""
    import numpy as np

    from tests.llama_cpp_tree import llama_cpp_tree, vocab_files

    for path in (good, vocab_files(llama_cpp_tree())["llama-spm"]):
        theirs = GGUFReader(str(path))
        ours = read_gguf(path)
        fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.fields == fields
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
            assert mine.tensor_type == reference.tensor_type
            assert mine.shape == tuple(reference.shape.tolist())
            assert mine.data.dtype == reference.data.dtype
            assert np.array_equal(mine.data, reference.data)
