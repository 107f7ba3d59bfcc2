"""A GGUF file in another type through llama.cpp's own quantizer, and the bytes of a GGUF
file a decode step reads. Runs in benchmarks/peers/.venv-llamacpp (setup_llamacpp.sh).

    python gguf_file.py quantize IN.gguf OUT.gguf TYPE    TYPE: one of FILE_TYPES
    python gguf_file.py bytes FILE.gguf                   prints the bytes, one number
"""

from __future__ import annotations

import ctypes
import sys

# llama-quantize's file types (LLAMA_FTYPE_MOSTLY_<name>); one ending in _M mixes block
# types by tensor, and every K or IQ type falls back to another for rows that are not
# whole 256-value blocks.
FILE_TYPES = (
    *("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"),
)


def quantize(source: str, target: str, file_type: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    if file_type not in FILE_TYPES:
        raise SystemExit(f"gguf_file.py quantize: {file_type} is not one of {FILE_TYPES}")
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = 0  # every core
    failed = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if failed:
        raise SystemExit(f"llama.cpp could not quantize {source} to {file_type}")


def decode_bytes(path: str) -> int:
    """Bytes of every tensor a decode step reads whole: all of them but the token
    embedding (one row a token), which is read whole only as a tied output head."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    untied = "output.weight" in tensors
    fraction = 1.0  # of a mixture's experts, the top k a token reads
    fields = {name.rsplit(".", 1)[-1]: field for name, field in reader.fields.items()}
    if "expert_count" in fields:
        count, used = (int(fields[k].parts[-1][0]) for k in ("expert_count", "expert_used_count"))
        fraction = used / count
    return int(
        sum(
            n * (fraction if "_exps." in name else 1.0)
            for name, n in tensors.items()
            if not (untied and name == "token_embd.weight")
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "quantize":
        quantize(*sys.argv[2:5])
    else:
        print(decode_bytes(sys.argv[2]))
