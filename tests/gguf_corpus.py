"""Hand-made corruptions of a good GGUF file, each with what its one-line error must say.

The good file is a tiny Llama (two layers, hidden size 64, a byte-level vocabulary of
256 tokens, float32 tensors) written by ``benchmarks/peers/make_gguf.py``. Each case
breaks one thing: the header's counts, lengths, type codes, dimensions and offsets
(overwritten where ``GGUFParts`` wrote them), or a metadata value or tensor written as
no converter would (a size of 2^31, a count of 0, a value of the wrong type, a key or a
tensor name twice, a merge list the vocabulary cannot hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gguf import GGUFValueType

from tests.gguf_bytes import GGUFParts, number, patched

Make = Callable[[GGUFParts], bytes]
LOADS = None  # the case is a file that loads and generates
BIG = 2**40
U32 = GGUFValueType.UINT32


def _at(label: str, value: int) -> Make:
    def make(parts: GGUFParts) -> bytes:
        data = parts.to_bytes()
        return patched(data, number(parts, label), value)

    return make


def _value(key: str, value, kind: GGUFValueType | None = None, item=None) -> Make:
    def make(parts: GGUFParts) -> bytes:
        changed = parts.with_value(key, value, kind)
        if item is not None:
            index = next(i for i, (name, _) in enumerate(changed.metadata) if name == key)
            changed.metadata[index] = (key, replace(changed.metadata[index][1], item=item))
        return changed.to_bytes()

    return make


def _cut(where: Callable[[GGUFParts], int]) -> Make:
    def make(parts: GGUFParts) -> bytes:
        return parts.to_bytes()[: where(parts)]

    return make


def _tensor(index: int, **changes) -> Make:
    def make(parts: GGUFParts) -> bytes:
        tensors = list(parts.tensors)
        tensors[index] = replace(tensors[index], **changes)
        return replace(parts, tensors=tensors).to_bytes()

    return make


def _offsets(change: Callable[[list[int]], None]) -> Make:
    def make(parts: GGUFParts) -> bytes:
        parts.to_bytes()
        offsets = [0]
        for tensor in parts.tensors[:-1]:
            offsets.append(offsets[-1] + -(-len(tensor.data) // 32) * 32)
        change(offsets)
        return parts.to_bytes(offsets)

    return make


def _repeated_key(parts: GGUFParts) -> bytes:
    return replace(parts, metadata=[*parts.metadata, parts.metadata[3]]).to_bytes()


def _without_tensor(name: str) -> Make:
    def make(parts: GGUFParts) -> bytes:
        return replace(parts, tensors=[t for t in parts.tensors if t.name != name]).to_bytes()

    return make


def _shift(offsets: list[int], index: int, by: int) -> None:
    offsets[index] += by


def _overlap(offsets: list[int]) -> None:
    offsets[5] = offsets[4]


# name -> (how the bytes are made, a regex the one line must match, or LOADS)
CASES: dict[str, tuple[Make, str | None]] = {
    # -- the header's structure
    "empty file": (lambda parts: b"", r"the magic runs past the end of the file"),
    "magic only": (lambda parts: b"GGUF", r"the version runs past the end of the file"),
    "wrong magic": (lambda parts: b"GGUG" + parts.to_bytes()[4:], r"not a GGUF file"),
    "version 99": (_at("version", 99), r"GGUF version 99 is not read"),
    "truncated in the metadata": (
        _cut(lambda p: number(p, "tokenizer.ggml.tokens item 100 length").offset + 3),
        r"'tokenizer\.ggml\.tokens''s item count 256 cannot fit in the file",
    ),
    "truncated header": (
        _cut(lambda p: number(p, "tensor 5 name length").offset + 12),
        r"tensor 5's name \(a string of \d+ bytes\) runs past the end of the file",
    ),
    "tensor count 2^32": (_at("tensor count", 2**32), r"the tensor count 4294967296 cannot fit"),
    "tensor count 2^63": (_at("tensor count", 2**63), rf"the tensor count {2**63} cannot fit"),
    "key count 0": (_at("metadata key count", 0), r"tensor 'general\.architecture' has 8 dim"),
    "key count 2^40": (_at("metadata key count", BIG), rf"the metadata key count {BIG} cannot"),
    "key length": (
        _at("key general.architecture length", BIG),
        rf"metadata key 0 \(a string of {BIG} bytes\) runs past the end",
    ),
    "string length": (
        _at("general.architecture length", BIG),
        rf"'general\.architecture' \(a string of {BIG} bytes\) runs past the end",
    ),
    "token array of 2^40": (
        _at("tokenizer.ggml.tokens item count", BIG),
        rf"'tokenizer\.ggml\.tokens''s item count {BIG} cannot fit in the file",
    ),
    "value type 99": (_at("llama.block_count type", 99), r"'llama\.block_count': unknown value"),
    "array item type 99": (
        _at("tokenizer.ggml.token_type item type", 99),
        r"'tokenizer\.ggml\.token_type': unknown array item type 99",
    ),
    "a key twice": (_repeated_key, r"metadata 'llama\.block_count' appears twice"),
    "a tensor name twice": (
        _tensor(3, name="blk.0.attn_norm.weight"),
        r"tensor 'blk\.0\.attn_norm\.weight' appears twice",
    ),
    "seven dimensions": (
        _at("tensor output_norm.weight dimension count", 7),
        r"tensor 'output_norm\.weight' has 7 dimensions \(at most 4\)",
    ),
    "tensor type 99": (_at("tensor output.weight type", 99), r"'output\.weight': unknown ggml"),
    "offset past the end": (
        _at("tensor output_norm.weight offset", BIG),
        r"'output_norm\.weight''s data \(offset 1099511627776, 256 bytes\) runs past the end",
    ),
    "misaligned offset": (
        _offsets(lambda offsets: _shift(offsets, 5, 4)),
        r"'blk\.0\.ffn_up\.weight''s data offset \d+ is not a multiple of the alignment 32",
    ),
    "overlapping offsets": (
        _offsets(_overlap),
        r"tensor 'blk\.0\.ffn_up\.weight''s data \(offset \d+, 32768 bytes\) overlaps "
        r"tensor 'blk\.0\.ffn_gate\.weight''s",
    ),
    "dimensions whose product overflows": (
        _tensor(-1, dims=(2**32, 2**32)),
        r"'output_norm\.weight''s data \(offset \d+, \d+ bytes\) runs past the end",
    ),
    "alignment 0": (
        _value("general.alignment", 0, U32),
        r"general\.alignment must be a uint32 power of two, not 0",
    ),
    # -- the tensors' shapes against the metadata
    "a norm of 62 values": (
        _tensor(2, dims=(62,), data=bytes(248)),
        r"blk\.0\.attn_norm\.weight: a F32 tensor of shape \(62,\) cannot fill "
        r"model\.layers\.0\.input_layernorm\.weight, which takes \(64,\)",
    ),
    "a vocabulary of no rows": (
        _tensor(1, dims=(64, 0), data=b""),
        r"'token_embd\.weight'.*\(0, 64\)",
    ),
    "a missing tensor": (
        _without_tensor("blk.1.attn_q.weight"),
        r"no tensor for part 0 \(of 3\) of model\.layers\.1\.self_attn\.qkv_proj\.weight",
    ),
    # -- metadata values that size the model
    "head_count 0": (
        _value("llama.attention.head_count", 0),
        r"llama\.attention\.head_count is 0; the model needs at least 1",
    ),
    "head_count 3": (
        _value("llama.attention.head_count", 3),
        r"blk\.0\.attn_output\.weight: a F32 tensor of shape \(64, 64\) cannot fill",
    ),
    "head_count_kv 0": (
        _value("llama.attention.head_count_kv", 0),
        r"llama\.attention\.head_count_kv is 0",
    ),
    "block_count 2^31": (
        _value("llama.block_count", 2**31),
        r"llama\.block_count is 2147483648, but the file's tensors hold 2 layers",
    ),
    "block_count 0": (_value("llama.block_count", 0), r"llama\.block_count is 0"),
    "block_count 3": (
        _value("llama.block_count", 3),
        r"llama\.block_count is 3, but the file's tensors hold 2 layers",
    ),
    "context_length 2^31": (_value("llama.context_length", 2**31), LOADS),
    "context_length 0": (_value("llama.context_length", 0), r"llama\.context_length is 0"),
    "embedding_length 2^20": (
        _value("llama.embedding_length", 2**20),
        r"llama\.embedding_length is 1048576, wider than any tensor of the file \(the widest "
        r"dimension is 256\)",
    ),
    "feed_forward_length 2^30": (
        _value("llama.feed_forward_length", 2**30),
        r"llama\.feed_forward_length is 1073741824, wider than any tensor",
    ),
    "key_length 2^20": (
        _value("llama.attention.key_length", 2**20),
        r"llama\.attention\.key_length is 1048576, wider than any tensor",
    ),
    "expert_count 2^31": (
        _value("llama.expert_count", 2**31),
        r"llama\.expert_count is 2147483648, wider than any tensor",
    ),
    "block_count as a string": (
        _value("llama.block_count", "2", GGUFValueType.STRING),
        r"llama\.block_count must be a non-negative integer, not '2'",
    ),
    "head_count as a float": (
        _value("llama.attention.head_count", 4.5, GGUFValueType.FLOAT32),
        r"llama\.attention\.head_count must be a non-negative integer, not 4\.5",
    ),
    "rms epsilon NaN": (
        _value("llama.attention.layer_norm_rms_epsilon", float("nan")),
        r"llama\.attention\.layer_norm_rms_epsilon must be a positive finite number, not nan",
    ),
    # -- the vocabulary
    "garbage merges": (
        _value(
            "tokenizer.ggml.merges",
            ["\u0100 \u0101", "zz qq", ""],
            GGUFValueType.ARRAY,
            item=GGUFValueType.STRING,
        ),
        r"tokenizer\.ggml\.merges item 0 \('Ā ā'\) does not join two tokens into a token",
    ),
    "tokens as numbers": (
        _value("tokenizer.ggml.tokens", list(range(256)), item=GGUFValueType.INT32),
        r"tokenizer\.ggml\.tokens must be a list of strings; it holds 0",
    ),
    "token types cut short": (
        _value("tokenizer.ggml.token_type", [1] * 10),
        r"tokenizer\.ggml\.token_type has 10 entries for 256 tokens",
    ),
    "bos id past the vocabulary": (
        _value("tokenizer.ggml.bos_token_id", 2**32 - 1),
        LOADS,  # llama.cpp, too, leaves a special id outside the vocabulary unused
    ),
    "unknown architecture": (
        _value("general.architecture", "llama9"),
        r"llama9",
    ),
}
