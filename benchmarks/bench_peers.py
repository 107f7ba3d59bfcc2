"""updraft against the engines users would run instead, on one checkpoint, in one run.

Each engine runs in its own process (its own virtual environment for the peers), on the
same checkpoint and the same token-id prompts, greedy (benchmarks/peers/workload.py):

* batch-1 decode tokens/s (32-token prompt, 128 new tokens; prefill excluded);
* cold prefill: prompt tokens/s of the mixed load's 32 prompt lengths (16-256 tokens),
  with fresh tokens in every run so that no prefix cache can help, one output token
  each (llama.cpp and transformers take them one at a time, as they serve);
* cold prefill of whole 256-token prompts, one at a time (``prefill256``, the default
  for ``--format gguf`` in place of the mixed lengths);
* output tokens/s of 32 mixed requests (prompts 16-256 tokens, outputs 16-128);
* peak resident memory of the engine process, each with a 1 GiB KV cache;
* the same again while a busy loop shares the cores (``--contention``), as a server's
  neighbours would.

The batch-1 floor is weight bytes / this machine's streaming read bandwidth, measured
here first. Engines run in rounds, in a rotating order; the table shows the best round
and the range. Every engine's tokens are compared with updraft's.

    bash benchmarks/peers/setup_vllm.sh; bash benchmarks/peers/setup_llamacpp.sh
    bash benchmarks/peers/setup_ik_llamacpp.sh [SOURCE]   # for --format gguf
    .venv/bin/python -m benchmarks.bench_peers [--model demo|100m|500m|moe|qwen3.5|gpt-oss] \\
        [--rounds 3] [--format float32|bfloat16|float16|int4|gguf|mxfp4] [--contention] [--ngram]

``--format`` runs each engine on the weights users would download or make in that
format (FORMATS below); every run's floor is its own weight bytes per token. ``gguf``
runs updraft (its defaults), llama.cpp and ik_llama.cpp on the same Q8_0, Q4_0, Q4_K_M,
Q5_K_M and Q6_K files, and adds a table of each file's rates and updraft's ratios.
ik_llama.cpp, which has no Python binding, is its own ``llama-bench``
(``peers/engine_ik_llamacpp.py``), with and without ``-rtr 1``: batch 1 and the
256-token prefill only, no tokens to compare.

``--model qwen3.5`` is a hybrid of Gated DeltaNet and gated full-attention layers, 3 to
1 (``make_random_qwen35``). llama.cpp reads it from the F32 file that llama.cpp's own
converter writes (the tree of the pinned ``llama-cpp-python`` sdist, as the tests use
it), since the GGUF layout of its linear-attention tensors is the converter's to define.
vLLM's CPU build runs its linear-attention layers in bfloat16 only (``--format
bfloat16``); in the other formats it is left out.

``--model gpt-oss --format mxfp4`` is a gpt-oss-shaped mixture (32 experts, 4 active,
attention sinks, alternating 128-token windows) whose experts are in MXFP4, as OpenAI
ships gpt-oss (``make_random_gpt_oss``); llama.cpp reads the GGUF file its own converter
writes from that checkpoint, experts still in MXFP4.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.common import (
    active_expert_fraction,
    make_random_gpt_oss,
    make_random_qwen3,
    make_random_qwen3_moe,
    make_random_qwen35,
    markdown_table,
    stored_in,
    stream_bandwidth,
    updraft_weight_bytes,
)
from updraft.demo import DEMO_MODEL_DIR

PEERS = Path(__file__).parent / "peers"
LLAMA_BENCH = PEERS / "ik_llama.cpp-build" / "bin" / "llama-bench"  # setup_ik_llamacpp.sh
PYTHONS = {
    "updraft": Path(sys.executable),
    "vllm": PEERS / ".venv-vllm" / "bin" / "python",
    "llama.cpp": PEERS / ".venv-llamacpp" / "bin" / "python",
    "transformers": Path(sys.executable),
    "ik_llama.cpp": Path(sys.executable),  # its worker only runs the program
}
WORKERS = {
    "updraft": "engine_updraft.py",
    "vllm": "engine_vllm.py",
    "llama.cpp": "engine_llamacpp.py",
    "transformers": "engine_transformers.py",
    "ik_llama.cpp": "engine_ik_llamacpp.py",
}
# What must exist before an engine runs (setup_*.sh makes it)
INSTALLED = PYTHONS | {"ik_llama.cpp": LLAMA_BENCH}
BATCH1_ONLY = {"llama.cpp", "transformers", "ik_llama.cpp"}  # one request at a time
# Workloads an engine cannot run (ik's llama-bench takes sizes, not prompts)
ONLY_WORKLOADS = {"ik_llama.cpp": {"batch1", "prefill256"}}
GGUF_FILE_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# n-gram (prompt lookup) speculation, 3 draft tokens from suffixes of up to 3 tokens, in
# each engine's own terms (--ngram)
NGRAM_OPTIONS = {
    "updraft": ["speculative_method='ngram'", "num_speculative_tokens=3"],
    "vllm": [
        "speculative_config={'method': 'ngram', 'num_speculative_tokens': 3, "
        "'prompt_lookup_max': 3, 'prompt_lookup_min': 1}"
    ],
}


# What each engine runs in each --format: (label, engine, its checkpoint, its settings).
# A checkpoint is the float32 directory, a copy stored in bfloat16 or float16, or a GGUF
# file of that type, written from the float32 file by llama.cpp's own quantizer.
FORMATS: dict[str, list[tuple[str, str, str, list[str]]]] = {
    "float32": [
        ("updraft", "updraft", "float32", []),
        ("vllm", "vllm", "float32", []),
        ("llama.cpp", "llama.cpp", "F32", []),
        ("transformers", "transformers", "float32", []),
    ],
    "bfloat16": [
        ("updraft bf16", "updraft", "bfloat16", ["dtype='auto'"]),
        ("vllm bf16", "vllm", "bfloat16", ["dtype='bfloat16'"]),
        ("llama.cpp BF16", "llama.cpp", "BF16", []),
    ],
    "float16": [
        ("updraft fp16", "updraft", "float16", ["dtype='auto'"]),
        ("llama.cpp F16", "llama.cpp", "F16", []),
    ],
    "int4": [
        (
            "updraft int4-g32",
            "updraft",
            "float32",
            ["quantization='int4'", "quantization_group_size=32"],
        ),
        (
            "updraft int4-g128",
            "updraft",
            "float32",
            ["quantization='int4'", "quantization_group_size=128"],
        ),
        ("llama.cpp Q4_0", "llama.cpp", "Q4_0", []),
    ],
    # gpt-oss as OpenAI ships it, experts in MXFP4: updraft and vLLM on the checkpoint
    # (vLLM's CPU build computes in bfloat16), updraft and llama.cpp on the GGUF file
    # llama.cpp's own converter writes from it (experts kept in MXFP4, the rest F32).
    "mxfp4": [
        ("updraft", "updraft", "float32", []),
        ("updraft GGUF", "updraft", "gguf:MXFP4", []),
        ("llama.cpp MXFP4", "llama.cpp", "MXFP4", []),
        ("vllm bf16", "vllm", "float32", ["dtype='bfloat16'"]),
    ],
    # The same GGUF files for every engine, each quantized by llama.cpp's own quantizer;
    # updraft with its defaults, ik_llama.cpp without and with its load-time repacking.
    # (``--float32-activations`` adds updraft's exact path, ``x32``.)
    "gguf": [
        entry
        for file_type in GGUF_FILE_TYPES
        for entry in (
            (f"updraft {file_type}", "updraft", f"gguf:{file_type}", []),
            (f"llama.cpp {file_type}", "llama.cpp", file_type, []),
            (f"ik_llama.cpp {file_type} rtr0", "ik_llama.cpp", file_type, ["rtr=0"]),
            (f"ik_llama.cpp {file_type} rtr1", "ik_llama.cpp", file_type, ["rtr=1"]),
        )
    ],
}
FLOAT32_X = ["activations='float32'"]


@dataclass(frozen=True)
class Contender:
    label: str
    engine: str
    checkpoint: Path
    options: list[str]


def contenders(
    fmt: str, engines: list[str], model: Path, work: Path, float32_x: bool = False
) -> list[Contender]:
    """The runs of ``fmt`` by the engines asked for, their checkpoints made
    (``float32_x``: with updraft's float32-activation run on each GGUF file too)."""
    out = []
    entries = FORMATS[fmt]
    if float32_x:
        entries = [
            more
            for label, engine, kind, options in entries
            for more in [(label, engine, kind, options)]
            + ([(f"{label} x32", engine, kind, FLOAT32_X)] if kind.startswith("gguf:") else [])
        ]
    for label, engine, kind, options in entries:
        if engine not in engines:
            continue
        if engine == "vllm" and kind != "bfloat16" and is_hybrid(model):
            print(f"skipping {label}: vLLM's CPU Gated DeltaNet runs in bfloat16 only")
            continue
        if engine == "vllm" and fmt == "mxfp4" and "amx_tile" not in cpu_flags():
            print(f"skipping {label}: vLLM's CPU MXFP4 experts need AMX, which this CPU lacks")
            continue
        if engine in ("llama.cpp", "ik_llama.cpp"):
            checkpoint = prepare_gguf(model, work, kind)
        elif kind.startswith("gguf:"):  # updraft on llama.cpp's own file
            checkpoint = prepare_gguf(model, work, kind.removeprefix("gguf:"))
        elif kind == "float32":
            checkpoint = model
        else:
            checkpoint = stored_in(model, getattr(torch, kind), work)
        out.append(Contender(label, engine, checkpoint, options))
    return out


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def decode_bytes(contender: Contender) -> int:
    """Weight bytes one batch-1 decode step of ``contender`` reads."""
    if contender.checkpoint.suffix == ".gguf":
        done = subprocess.run(
            [PYTHONS["llama.cpp"], PEERS / "gguf_file.py", "bytes", contender.checkpoint],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stdout.split()[-1])
    settings = workload_options(contender.options)
    if contender.engine == "updraft":
        return updraft_weight_bytes(contender.checkpoint, {"dtype": "float32"} | settings)
    # vLLM and transformers: the checkpoint's tensors in the compute dtype, experts' by
    # the share a token reads.
    total = 0.0
    itemsize = torch.empty(0, dtype=getattr(torch, settings.get("dtype", "float32"))).itemsize
    fraction = active_expert_fraction(contender.checkpoint)
    for path in contender.checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                size = itemsize * int(torch.Size(file.get_slice(name).get_shape()).numel())
                total += size * (fraction if ".experts." in name else 1.0)
    return int(total)


def workload_options(options: list[str]) -> dict[str, object]:
    return {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in options)}


def run_worker(
    engine: str,
    model: Path,
    workload: str,
    vocab: int,
    quick: bool,
    contention: bool,
    options: list[str] | None = None,
) -> dict:
    """Run ``workload`` ("batch1" or "mixed", then any words naming the variant) in
    ``engine``'s worker process; ``options`` are its engine settings, ``k=v``."""
    command = [str(PYTHONS[engine]), str(PEERS / WORKERS[engine])]
    command += ["--model", str(model), "--workload", workload.split()[0]]
    command += ["--vocab", str(vocab)]
    command += [f"--option={option}" for option in options or []]
    if quick:
        command += ["--quick", "--repeats", "1"]
    busy = None
    if contention:  # one single-threaded CPU-bound neighbour
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    for line in done.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line.removeprefix("REPORT "))
    raise RuntimeError(f"{engine} {workload} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def prepare_model(name: str, work: Path) -> tuple[Path, int]:
    if name == "demo":
        return DEMO_MODEL_DIR, 4096
    if name == "moe":
        return make_random_qwen3_moe(work / "qwen3-moe"), 16000
    if name == "500m":
        return make_random_qwen3(work / "qwen3-500m", scale=2), 32000
    if name == "qwen3.5":
        return make_random_qwen35(work / "qwen3.5-100m"), 32000
    if name == "gpt-oss":
        return make_random_gpt_oss(work / "gpt-oss-mxfp4"), 32000
    return make_random_qwen3(work / "qwen3-100m"), 32000


def prepare_gguf(model: Path, work: Path, file_type: str = "F32") -> Path:
    """``model`` as a GGUF file of ``file_type``: F32 written by make_gguf.py (by
    llama.cpp's converter for a hybrid), the others quantized from it by llama.cpp."""
    out = work / f"{model.name}-{file_type.lower()}.gguf"
    if out.is_file():
        return out
    python = str(PYTHONS["llama.cpp"])
    if file_type == "MXFP4":  # converted from the checkpoint's own MXFP4 experts
        from tests.llama_cpp_tree import convert

        convert(model, out, "f32")
    elif file_type == "F32" and is_hybrid(model):
        from tests.llama_cpp_tree import convert

        # the checkpoint carries no MTP head, which the converter would otherwise expect
        convert(model, out, "f32", "--no-mtp")
    elif file_type == "F32":
        subprocess.run([python, str(PEERS / "make_gguf.py"), str(model), str(out)], check=True)
    else:
        source = str(prepare_gguf(model, work))
        subprocess.run(
            [python, str(PEERS / "gguf_file.py"), "quantize", source, str(out), file_type],
            check=True,
        )
    return out


def is_hybrid(model: Path) -> bool:
    """Whether ``model`` has linear-attention layers (a Qwen3.5 or Qwen3-Next)."""
    config = json.loads((model / "config.json").read_text())
    return "linear_attention" in (config.get("layer_types") or [])


def gguf_table(title: str, rates: Callable[[str, str], list[float]]) -> str:
    """Per GGUF file and workload (batch-1 decode, cold 256-token prefill): updraft's
    best rate, llama.cpp's, ik_llama.cpp's best of ``-rtr 0/1`` (naming which), and
    updraft's ratio to each; ``rates(label, workload)``: a run's rates, one a round."""

    def best(label: str, workload: str) -> float:
        return max(rates(label, workload), default=float("nan"))

    def cell(value: float) -> str:
        return "-" if value != value else f"{value:.1f}"

    def ratio(ours: float, theirs: float) -> str:
        return "-" if ours != ours or theirs != theirs else f"{ours / theirs:.2f}x"

    rows = []
    for file_type in GGUF_FILE_TYPES:
        for workload, name in (("batch1", "decode, batch 1"), ("prefill256", "prefill 256")):
            ours = best(f"updraft {file_type}", workload)
            exact = best(f"updraft {file_type} x32", workload)
            theirs = best(f"llama.cpp {file_type}", workload)
            ik = {rtr: best(f"ik_llama.cpp {file_type} rtr{rtr}", workload) for rtr in (0, 1)}
            rtr = max(ik, key=lambda r: -1.0 if ik[r] != ik[r] else ik[r])
            rows.append(
                [
                    f"{file_type} {name}",
                    cell(ours),
                    cell(exact),
                    cell(theirs),
                    "-" if ik[rtr] != ik[rtr] else f"{ik[rtr]:.1f} (rtr {rtr})",
                    ratio(ours, theirs),
                    ratio(ours, ik[rtr]),
                ]
            )
    rows = [row for row in rows if any(c != "-" for c in row[1:])]
    header = ["file, tokens/s", "updraft", "updraft x32", "llama.cpp", "ik_llama.cpp"]
    header += ["updraft / llama.cpp", "updraft / ik_llama.cpp"]
    kept = [0] + [i for i in range(1, len(header)) if any(row[i] != "-" for row in rows)]
    header, rows = [header[i] for i in kept], [[row[i] for i in kept] for row in rows]
    return markdown_table(f"updraft against llama.cpp and ik_llama.cpp, {title}", header, rows)


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    best, worst = max(values), min(values)
    return f"**{best:.1f}**" + (f" ({worst:.1f}-{best:.1f})" if len(values) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", choices=["demo", "100m", "500m", "moe", "qwen3.5", "gpt-oss"], default="100m"
    )
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--engines", default="updraft,vllm,llama.cpp,transformers,ik_llama.cpp")
    parser.add_argument("--format", choices=list(FORMATS), default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contention", action="store_true", help="also run beside a busy loop")
    parser.add_argument("--quick", action="store_true", help="short workloads, one round")
    parser.add_argument("--ngram", action="store_true", help="also with n-gram speculation")
    parser.add_argument(
        "--float32-activations",
        action="store_true",
        help="gguf: also updraft with --activations float32 on each file",
    )
    parser.add_argument(
        "--workloads",
        help="which workloads, comma-separated (default: batch1,prefill,mixed; for gguf "
        "batch1,prefill256,mixed)",
    )
    args = parser.parse_args()
    if args.workloads is None:
        middle = "prefill256" if args.format == "gguf" else "prefill"
        args.workloads = f"batch1,{middle},mixed"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    engines = [e for e in args.engines.split(",") if INSTALLED[e].exists()]
    missing = set(args.engines.split(",")) - set(engines)
    if missing:
        print(f"skipping {sorted(missing)}: run benchmarks/peers/setup_*.sh first")
    model, vocab = prepare_model(args.model, args.work_dir)
    runs = contenders(args.format, engines, model, args.work_dir, args.float32_activations)
    labels = [run.label for run in runs]

    bandwidth = stream_bandwidth()
    floors = {run.label: bandwidth / decode_bytes(run) for run in runs}
    print(f"stream read {bandwidth / 1e9:.1f} GB/s")

    conditions = [False, True] if args.contention else [False]
    results: dict[tuple[str, str, bool], list[dict]] = {}
    rounds = 1 if args.quick else args.rounds
    for round_index in range(rounds):
        order = runs[round_index % len(runs) :] + runs[: round_index % len(runs)]
        for run in order:
            variants = [(workload, []) for workload in args.workloads.split(",")]
            if args.ngram and run.engine in NGRAM_OPTIONS:
                variants += [(f"{w} ngram", NGRAM_OPTIONS[run.engine]) for w in ("batch1", "mixed")]
            for workload, options in variants:
                if workload.startswith("mixed") and run.engine in BATCH1_ONLY:
                    continue
                if workload not in ONLY_WORKLOADS.get(run.engine, {workload}):
                    continue
                for contended in conditions if not options else [False]:
                    report = run_worker(
                        run.engine,
                        run.checkpoint,
                        workload,
                        vocab,
                        args.quick,
                        contended,
                        run.options + options,
                    )
                    results.setdefault((run.label, workload, contended), []).append(report)
                    print(
                        f"round {round_index + 1} {run.label:18s} {workload:12s} "
                        f"{'busy ' if contended else ''}{report['tokens_per_second']:8.1f} tok/s "
                        f"rss {report['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )

    def rates(label: str, workload: str, contended: bool = False) -> list[float]:
        return [r["tokens_per_second"] for r in results.get((label, workload, contended), [])]

    def best(label: str, workload: str, contended: bool = False) -> float:
        return max(rates(label, workload, contended), default=float("nan"))

    def row(measure: str, cell) -> list[str]:
        return [measure, *[cell(label) for label in labels]]

    def slowdown(label: str, workload: str) -> str:
        if not rates(label, workload, True):
            return "-"
        busy = best(label, workload, True)
        return f"{busy:.1f} ({best(label, workload) / busy:.2f}x slower)"

    def peak_rss(label: str) -> str:
        return (
            f"{max(r['peak_rss_mib'] for k, v in results.items() if k[0] == label for r in v):.0f}"
        )

    # every run's tokens against the first run's (updraft's, in this format)
    reference = {k[1]: v[0]["tokens"] for k, v in results.items() if k[0] == labels[0]}

    def same_tokens(label: str, workloads: tuple[str, ...] = ("batch1", "mixed")) -> str:
        """Requests whose tokens equal the first run's plain (unspeculated) ones."""
        verdicts = []
        for workload in workloads:
            plain = reference.get(workload.split()[0])
            theirs = results.get((label, workload, False), [{"tokens": []}])[0]["tokens"]
            if theirs and plain is not None:  # ik_llama.cpp's program returns none
                equal = sum(a == b for a, b in zip(theirs, plain, strict=True))
                verdicts.append(f"{equal}/{len(theirs)}")
        return " + ".join(verdicts) or "-"

    vllm = next((run.label for run in runs if run.engine == "vllm"), None)

    def versus_vllm(label: str) -> str:
        if vllm is None or label == vllm:
            return ""
        ratios = [best(label, w) / best(vllm, w) for w in ["batch1", "mixed"]]
        return " / ".join("-" if r != r else f"{r:.2f}x" for r in ratios)

    rows = [
        row("decode tokens/s, batch 1", lambda label: summary(rates(label, "batch1"))),
        row("  bandwidth floor, tokens/s", lambda label: f"{floors[label]:.1f}"),
        row(
            "  fraction of the floor", lambda label: f"{best(label, 'batch1') / floors[label]:.2f}"
        ),
        row(
            "cold prefill, prompt tokens/s (32 fresh prompts, max_tokens 1)",
            lambda label: summary(rates(label, "prefill")),
        ),
        row(
            "cold prefill, 256-token prompts one at a time, prompt tokens/s",
            lambda label: summary(rates(label, "prefill256")),
        ),
        row("output tokens/s, 32 mixed requests", lambda label: summary(rates(label, "mixed"))),
        row("vs vLLM, batch 1 / mixed", versus_vllm),
        row("peak RSS MiB (1 GiB KV cache)", peak_rss),
        row(f"requests with {labels[0]}'s tokens, batch 1 + mixed", same_tokens),
    ]
    if args.ngram:
        rows += [
            row(
                "decode tokens/s, batch 1, n-gram k=3", lambda e: summary(rates(e, "batch1 ngram"))
            ),
            row("32 mixed requests, n-gram k=3", lambda e: summary(rates(e, "mixed ngram"))),
            row(
                f"n-gram requests with plain {labels[0]}'s tokens",
                lambda e: same_tokens(e, ("batch1 ngram", "mixed ngram")),
            ),
        ]
    if args.contention:
        rows += [
            row("batch 1 beside a busy loop, tokens/s", lambda e: slowdown(e, "batch1")),
            row("mixed beside a busy loop, tokens/s", lambda e: slowdown(e, "mixed")),
        ]
    rows = [r for r in rows if any(cell not in ("-", "", "nan") for cell in r[1:])]
    title = f"peers, {args.model} model, {args.format} weights, best of {rounds}"
    print()
    print(markdown_table(title, ["measure", *labels], rows))
    if args.format == "gguf":
        print()
        print(gguf_table(f"{args.model} model, best of {rounds}", rates))
    print(
        f"\nfloor: {bandwidth / 1e9:.1f} GB/s stream read / the weight bytes each run reads "
        "per token"
    )


if __name__ == "__main__":
    main()
