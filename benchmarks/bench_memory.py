"""Resident memory, updraft beside llama.cpp on the same GGUF file and context.

For each model, updraft runs in a fresh process: it measures the interpreter and
torch's import first, starts an engine recording each phase of its start (weights, KV
cache, captures), runs the batch-1 request (32 prompt tokens, 128 new), and reports its
resident set cut into parts (``updraft/engine/memory_report.py``: they add up to the RSS
measured, "other" being the rest) with its peak and the phase the peak came in.
llama.cpp runs the same request through its Python binding
(``peers/engine_llamacpp.py``, ``n_ctx`` 2048) in ``peers/.venv-llamacpp``
(``setup_llamacpp.sh``), and reports its peak RSS. The table checks the issue's two
aims: peak <= torch's import + the file's bytes + the KV in use + 150 MiB, and peak <=
1.5 x llama.cpp's + torch's import.

    .venv/bin/python -m benchmarks.bench_memory                        # 100M files + demo
    .venv/bin/python -m benchmarks.bench_memory --model 500m --gguf-dir /tmp/g2-peers500
    .venv/bin/python -m benchmarks.bench_memory --models /tmp/peers/qwen3-100m-q4_0.gguf --quick

The 100M and 500M files are the peer benchmark's (``bench_peers --model 100m --format
gguf`` writes them into its work folder, ``--gguf-dir``); the demo model runs from its
checkpoint directory, and llama.cpp from an F32 GGUF of it (``peers/make_gguf.py``).
RSS does not depend on timing: this may run on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).parent / "peers"
LLAMACPP_PYTHON = PEERS / ".venv-llamacpp" / "bin" / "python"
GGUF_DIR = Path("/tmp/peers")
GGUF_TYPES = ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "f32")
CONTEXT = 2048  # llama.cpp's n_ctx in engine_llamacpp.py, and updraft's max_model_len
PROMPT_TOKENS, NEW_TOKENS = 32, 128
MIB = 2**20
REPORT = "MEMORY "
# llama.cpp's peer worker runs under its own interpreter; this one runs updraft.
SETTINGS = {
    "dtype": "float32",
    "kv_cache_memory_gib": 1.0,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "max_model_len": CONTEXT,
}


def updraft_worker(model: str, quick: bool, options: dict) -> None:
    """Runs in its own process: the baseline is taken before anything imports torch."""
    from updraft.resident import ImportBaseline

    baseline = ImportBaseline.measure()
    from updraft.memory_doctor import measure_memory

    new = 16 if quick else NEW_TOKENS
    report = measure_memory(model, SETTINGS | options, baseline, PROMPT_TOKENS, new)
    print("\n".join(report.lines()), file=sys.stderr)
    split = report.peak_split()
    line = {
        "rss": report.rss,
        "peak": report.peak,
        "parts": report.parts,
        "kv_in_use": report.kv_in_use,
        "weight_file_bytes": report.weight_file_bytes,
        "torch_import": baseline.torch_import,
        "peak_phase": None if split is None else list(split),
    }
    print(REPORT + json.dumps(line), flush=True)


def run_updraft(model: str, quick: bool, options: list[str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_memory", "--worker", model]
    command += ["--quick"] * quick + [f"--option={o}" for o in options]
    done = subprocess.run(command, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-4000:])
    for line in done.stdout.splitlines():
        if line.startswith(REPORT):
            return json.loads(line.removeprefix(REPORT))
    raise RuntimeError(f"updraft on {model} reported nothing (exit {done.returncode})")


def run_llamacpp(gguf: Path, python: Path, quick: bool) -> float | None:
    """llama.cpp's peak RSS (MiB) on the batch-1 request, or None without its venv."""
    if not python.is_file():
        return None
    command = [str(python), str(PEERS / "engine_llamacpp.py"), "--model", str(gguf)]
    command += ["--workload", "batch1", "--repeats", "1"] + ["--quick"] * quick
    command += ["--vocab", str(vocab_size(gguf))]  # its prompt's ids, as updraft's, in range
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line.removeprefix("REPORT "))["peak_rss_mib"]
    sys.stderr.write(done.stderr[-2000:])
    return None


def vocab_size(gguf: Path) -> int:
    """Rows of a GGUF file's token embedding (ggml lists a tensor's row width first)."""
    from updraft.checkpoints.gguf_header import walk

    embedding = next(t for t in walk(gguf).tensors if t.name == "token_embd.weight")
    return embedding.dims[1]


def demo_gguf(python: Path, work: Path) -> Path | None:
    """The demo model as an F32 GGUF file for llama.cpp (make_gguf.py), or None."""
    from updraft.demo import DEMO_MODEL_DIR

    out = work / "updraft-demo-f32.gguf"
    if not out.is_file() and python.is_file():
        subprocess.run([str(python), str(PEERS / "make_gguf.py"), str(DEMO_MODEL_DIR), str(out)])
    return out if out.is_file() else None


def row(name: str, result: dict, llamacpp: float | None) -> list[str]:
    """A table row: peak and steady RSS, the parts, llama.cpp's peak and both aims."""
    parts = result["parts"]
    torch_import = result["torch_import"] / MIB
    aim_bytes = torch_import + (result["weight_file_bytes"] + result["kv_in_use"]) / MIB + 150
    peak = result["peak"] / MIB
    phase = result["peak_phase"]
    cells = [name, f"{peak:.0f}", f"{result['rss'] / MIB:.0f}"]
    cells.append(f"{phase[0]} (+{phase[2] / MIB:.0f})" if phase else "-")
    cells += [f"{size / MIB:.0f}" for size in parts.values()]
    cells.append("-" if llamacpp is None else f"{llamacpp:.0f}")
    cells.append(f"{aim_bytes:.0f} ({'met' if peak <= aim_bytes else 'not met'})")
    if llamacpp is None:
        cells.append("-")
    else:
        aim_peer = 1.5 * llamacpp + torch_import
        cells.append(f"{aim_peer:.0f} ({'met' if peak <= aim_peer else 'not met'})")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", help="comma-separated GGUF files or checkpoint dirs")
    parser.add_argument("--gguf-dir", type=Path, default=GGUF_DIR)
    parser.add_argument(
        "--model", default="100m", choices=("100m", "500m"), help="whose files in --gguf-dir"
    )
    parser.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON)
    parser.add_argument("--option", action="append", default=[], help="engine option k=v")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, not 128")
    args = parser.parse_args()
    if args.worker:
        options = {}
        for item in args.option:
            key, _, value = item.partition("=")
            options[key] = json.loads(value) if value[:1] in "0123456789-tf[" else value
        updraft_worker(args.worker, args.quick, options)
        return
    from benchmarks.common import markdown_table
    from updraft.demo import DEMO_MODEL_DIR

    if args.models:
        models = [(Path(m).name, Path(m), Path(m)) for m in args.models.split(",")]
    else:
        files = [args.gguf_dir / f"qwen3-{args.model}-{kind}.gguf" for kind in GGUF_TYPES]
        models = [(f.name, f, f) for f in files if f.is_file()]
        demo = demo_gguf(args.llamacpp_python, args.gguf_dir)
        models.append(("demo", DEMO_MODEL_DIR, demo))
    rows, names = [], None
    for name, model, gguf in models:
        result = run_updraft(str(model), args.quick, args.option)
        names = names or list(result["parts"])
        peer = None if gguf is None or gguf.is_dir() else gguf
        llamacpp = None if peer is None else run_llamacpp(peer, args.llamacpp_python, args.quick)
        rows.append(row(name, result, llamacpp))
        print(" | ".join(rows[-1]), flush=True)
    header = ["model", "peak", "steady", "peak's phase (+MiB)", *(names or [])]
    header += ["llama.cpp peak", "aim: torch + file + KV + 150", "aim: 1.5x llama.cpp + torch"]
    print(markdown_table("Resident memory, MiB", header, rows))


if __name__ == "__main__":
    main()
