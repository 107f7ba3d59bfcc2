"""A cold prefill with the memory steps free kept (the default) and returned to the OS
(``--no-keep-freed-memory``): prompt tokens/s, the page faults the prefill takes, and
the process's peak RSS. malloc's settings are a process's, so each round starts one
process per setting, alternating which goes first; each process warms up with one cold
prefill, then times ``--prefills`` more (fresh prompts each: no prefix-cache hit) and
reports its best.

The 100M Qwen3-shape float32 checkpoint of the peer benchmark, 32 prompts of 16-256
tokens (4,218 in all), 2,048-token steps, as ``bench_ceiling``'s cold prefill.

    .venv/bin/python -m benchmarks.bench_freed_memory [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_ceiling import cold_prefill
from benchmarks.common import make_random_qwen3, markdown_table

SETTINGS = ("keep", "return")


def one_process(model: str, setting: str, prefills: int) -> dict[str, float]:
    """In the child: the best cold prefill's tokens/s and its page faults."""
    from updraft import LLM

    llm = LLM(
        model,
        dtype="float32",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        keep_freed_memory=setting == "keep",
    )
    vocab = llm.engine.model_config.vocab_size
    cold_prefill(llm, vocab, run=999)  # warm-up
    best = {"tok_s": 0.0, "faults": 0.0}
    for run in range(prefills):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds, lengths = cold_prefill(llm, vocab, run)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if sum(lengths) / seconds > best["tok_s"]:
            best = {"tok_s": sum(lengths) / seconds, "faults": faults}
    best["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefills", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = str(make_random_qwen3(args.work_dir / "qwen3-100m"))
    if args.child:
        print(json.dumps(one_process(model, args.child, args.prefills)))
        return
    results: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    for round_index in range(args.rounds):
        order = SETTINGS if round_index % 2 == 0 else SETTINGS[::-1]
        for setting in order:
            command = [sys.executable, "-m", "benchmarks.bench_freed_memory"]
            command += ["--child", setting, "--prefills", str(args.prefills)]
            command += ["--work-dir", str(args.work_dir)]
            output = subprocess.run(command, capture_output=True, text=True, check=True)
            results[setting].append(json.loads(output.stdout.splitlines()[-1]))
            print(f"round {round_index + 1}, {setting}: {results[setting][-1]}", file=sys.stderr)
    rows = []
    for setting in SETTINGS:
        rates = [r["tok_s"] for r in results[setting]]
        best = max(results[setting], key=lambda r: r["tok_s"])
        rows.append(
            [
                {"keep": "kept (default)", "return": "returned (--no-keep-freed-memory)"}[setting],
                f"{best['tok_s']:.0f} ({min(rates):.0f}-{max(rates):.0f})",
                f"{best['faults']:.0f}",
                f"{min(r['peak_mib'] for r in results[setting]):.0f}"
                f"-{max(r['peak_mib'] for r in results[setting]):.0f}",
            ]
        )
    keep, back = (max(r["tok_s"] for r in results[s]) for s in SETTINGS)
    print(
        markdown_table(
            f"cold prefill, 100M float32, freed memory kept or returned, best of "
            f"{args.rounds} alternating rounds ({keep / back:.2f}x kept)",
            ["freed memory", "prompt tok/s (spread)", "page faults, best prefill", "peak RSS, MiB"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
