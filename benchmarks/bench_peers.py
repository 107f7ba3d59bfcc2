"""updraft against the engines users would run instead, on one checkpoint, in one run.

Each engine runs in its own process (its own virtual environment for the peers), on the
same checkpoint and the same token-id prompts, greedy (benchmarks/peers/workload.py):

* batch-1 decode tokens/s (32-token prompt, 128 new tokens; prefill excluded);
* output tokens/s of 32 mixed requests (prompts 16-256 tokens, outputs 16-128);
* peak resident memory of the engine process, each with a 1 GiB KV cache;
* the same again while a busy loop shares the cores (``--contention``), as a server's
  neighbours would.

The batch-1 floor is weight bytes / this machine's streaming read bandwidth, measured
here first. Engines run in rounds, in a rotating order; the table shows the best round
and the range. Every engine's tokens are compared with updraft's.

    bash benchmarks/peers/setup_vllm.sh; bash benchmarks/peers/setup_llamacpp.sh
    .venv/bin/python -m benchmarks.bench_peers [--model demo|100m] [--rounds 3] \\
        [--contention] [--ngram]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.common import make_random_qwen3, markdown_table, stream_bandwidth
from updraft.demo import DEMO_MODEL_DIR

PEERS = Path(__file__).parent / "peers"
PYTHONS = {
    "updraft": Path(sys.executable),
    "vllm": PEERS / ".venv-vllm" / "bin" / "python",
    "llama.cpp": PEERS / ".venv-llamacpp" / "bin" / "python",
    "transformers": Path(sys.executable),
}
WORKERS = {
    "updraft": "engine_updraft.py",
    "vllm": "engine_vllm.py",
    "llama.cpp": "engine_llamacpp.py",
    "transformers": "engine_transformers.py",
}
BATCH1_ONLY = {"llama.cpp", "transformers"}  # they run one request at a time
# n-gram (prompt lookup) speculation, 3 draft tokens from suffixes of up to 3 tokens, in
# each engine's own terms (--ngram)
NGRAM_OPTIONS = {
    "updraft": ["speculative_method='ngram'", "num_speculative_tokens=3"],
    "vllm": [
        "speculative_config={'method': 'ngram', 'num_speculative_tokens': 3, "
        "'prompt_lookup_max': 3, 'prompt_lookup_min': 1}"
    ],
}


def float32_weight_bytes(model_dir: Path) -> int:
    """Bytes of the weights in float32, as every engine here computes."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = file.get_slice(name).get_shape()
                total += 4 * int(torch.Size(shape).numel())
    return total


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
    return make_random_qwen3(work / "qwen3-100m"), 32000


def prepare_gguf(model: Path, work: Path) -> Path:
    out = work / f"{model.name}-f32.gguf"
    if not out.is_file():
        subprocess.run(
            [str(PYTHONS["llama.cpp"]), str(PEERS / "make_gguf.py"), str(model), str(out)],
            check=True,
        )
    return out


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    best, worst = max(values), min(values)
    return f"**{best:.1f}**" + (f" ({worst:.1f}-{best:.1f})" if len(values) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["demo", "100m"], default="100m")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--engines", default="updraft,vllm,llama.cpp,transformers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contention", action="store_true", help="also run beside a busy loop")
    parser.add_argument("--quick", action="store_true", help="short workloads, one round")
    parser.add_argument("--ngram", action="store_true", help="also with n-gram speculation")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    engines = [e for e in args.engines.split(",") if PYTHONS[e].exists()]
    missing = set(args.engines.split(",")) - set(engines)
    if missing:
        print(f"skipping {sorted(missing)}: run benchmarks/peers/setup_*.sh first")
    model, vocab = prepare_model(args.model, args.work_dir)
    models = {e: model for e in engines}
    if "llama.cpp" in engines:
        models["llama.cpp"] = prepare_gguf(model, args.work_dir)

    bandwidth = stream_bandwidth()
    weight_bytes = float32_weight_bytes(model)
    floor = bandwidth / weight_bytes
    print(f"stream read {bandwidth / 1e9:.1f} GB/s; float32 weights {weight_bytes / 1e6:.0f} MB")

    conditions = [False, True] if args.contention else [False]
    results: dict[tuple[str, str, bool], list[dict]] = {}
    rounds = 1 if args.quick else args.rounds
    for round_index in range(rounds):
        order = engines[round_index % len(engines) :] + engines[: round_index % len(engines)]
        for engine in order:
            variants = [("batch1", []), ("mixed", [])]
            if args.ngram and engine in NGRAM_OPTIONS:
                variants += [(f"{w} ngram", NGRAM_OPTIONS[engine]) for w in ("batch1", "mixed")]
            for workload, options in variants:
                if workload.startswith("mixed") and engine in BATCH1_ONLY:
                    continue
                for contended in conditions if not options else [False]:
                    report = run_worker(
                        engine, models[engine], workload, vocab, args.quick, contended, options
                    )
                    results.setdefault((engine, workload, contended), []).append(report)
                    print(
                        f"round {round_index + 1} {engine:12s} {workload:12s} "
                        f"{'busy ' if contended else ''}{report['tokens_per_second']:8.1f} tok/s "
                        f"rss {report['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )

    def rates(engine: str, workload: str, contended: bool = False) -> list[float]:
        return [r["tokens_per_second"] for r in results.get((engine, workload, contended), [])]

    def best(engine: str, workload: str, contended: bool = False) -> float:
        return max(rates(engine, workload, contended), default=float("nan"))

    def row(measure: str, cell, floor_cell: str = "") -> list[str]:
        return [measure, *[cell(e) for e in engines], floor_cell]

    def slowdown(engine: str, workload: str) -> str:
        if not rates(engine, workload, True):
            return "-"
        busy = best(engine, workload, True)
        return f"{busy:.1f} ({best(engine, workload) / busy:.2f}x slower)"

    def peak_rss(engine: str) -> str:
        return (
            f"{max(r['peak_rss_mib'] for k, v in results.items() if k[0] == engine for r in v):.0f}"
        )

    reference = {k[1]: v[0]["tokens"] for k, v in results.items() if k[0] == "updraft"}

    def same_tokens(engine: str, workloads: tuple[str, ...] = ("batch1", "mixed")) -> str:
        """Requests whose tokens equal plain (unspeculated) updraft's."""
        verdicts = []
        for workload in workloads:
            plain = reference.get(workload.split()[0])
            if (engine, workload, False) in results and plain is not None:
                theirs = results[(engine, workload, False)][0]["tokens"]
                equal = sum(a == b for a, b in zip(theirs, plain, strict=True))
                verdicts.append(f"{equal}/{len(theirs)}")
        return " + ".join(verdicts) or "-"

    def versus_vllm(engine: str) -> str:
        if engine == "vllm" or "vllm" not in engines:
            return ""
        ratios = [best(engine, w) / best("vllm", w) for w in ["batch1", "mixed"]]
        return " / ".join("-" if r != r else f"{r:.2f}x" for r in ratios)

    rows = [
        row("decode tokens/s, batch 1", lambda e: summary(rates(e, "batch1")), f"{floor:.1f}"),
        row("  fraction of the floor", lambda e: f"{best(e, 'batch1') / floor:.2f}", "1"),
        row("output tokens/s, 32 mixed requests", lambda e: summary(rates(e, "mixed"))),
        row("vs vLLM, batch 1 / mixed", versus_vllm),
        row("peak RSS MiB (1 GiB KV cache)", peak_rss),
        row("requests with updraft's tokens, batch 1 + mixed", same_tokens),
    ]
    if args.ngram:
        rows += [
            row(
                "decode tokens/s, batch 1, n-gram k=3", lambda e: summary(rates(e, "batch1 ngram"))
            ),
            row("32 mixed requests, n-gram k=3", lambda e: summary(rates(e, "mixed ngram"))),
            row(
                "n-gram requests with plain updraft's tokens",
                lambda e: same_tokens(e, ("batch1 ngram", "mixed ngram")),
            ),
        ]
    if args.contention:
        rows += [
            row("batch 1 beside a busy loop, tokens/s", lambda e: slowdown(e, "batch1")),
            row("mixed beside a busy loop, tokens/s", lambda e: slowdown(e, "mixed")),
        ]
    title = f"peers, {args.model} model ({weight_bytes / 1e6:.0f} MB float32), best of {rounds}"
    print()
    print(markdown_table(title, ["measure", *engines, "floor"], rows))
    print(
        f"\nfloor: {bandwidth / 1e9:.1f} GB/s stream read / {weight_bytes / 1e6:.0f} MB of weights"
    )


if __name__ == "__main__":
    main()
