"""Structured outputs: what a grammar costs per output token, and what hostile schemas
cost a plain stream.

1. Decode time per output token with a JSON schema against unconstrained, at batch 1
   and 32, with the grammar masks computed while the forward runs (overlap) and after
   it, on the demo model (4k vocabulary) and on a random Qwen3-shaped model (hidden 768,
   12 layers) whose vocabulary is a 128k-token byte-level BPE trained here with
   ``tokenizers`` on 80 MB of Python source (the standard library, then this
   environment's site-packages): the demo's small vocabulary makes masks unrealistically
   cheap. Per token = (t(N tokens) - t(1 token)) / (tokens - batch),
   so prefill is left out, with each free request emitting as many tokens as it did
   under the schema; best of the rounds, the settings alternating.
2. ``--hostile``: ``updraft serve`` on the demo model; a plain stream runs alone, then
   again while another client posts hostile schemas (deep nesting, huge enums,
   pathological regexes, a flood of distinct schemas): the stream's largest gap between
   tokens, and its median one.

    .venv/bin/python -m benchmarks.bench_structured [--rounds 3] [--model demo|large|both]
    .venv/bin/python -m benchmarks.bench_structured --hostile
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import free_port, make_random_qwen3, markdown_table
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.structured_outputs import StructuredOutputsParams

LARGE_VOCAB = 128_000
CORPUS_BYTES = 80_000_000
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
    },
    "required": ["name", "tags", "count", "ratio", "ok", "kind"],
    "additionalProperties": False,
}
PROMPT = "import json\n\nconfig = "
MAX_TOKENS = 128


def train_demo_module():
    spec = importlib.util.spec_from_file_location(
        "train_demo", Path(__file__).parents[1] / "scripts" / "train_demo.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def large_vocab_model(work: Path) -> Path:
    """A random Qwen3-shaped checkpoint with a 128k-token BPE tokenizer of its own."""
    out = work / "qwen3-128k-vocab"
    if (out / "tokenizer.json").is_file():
        return out
    demo = train_demo_module()
    texts = [text for _, text in demo.load_corpus(demo.stdlib_dir()).train]
    size = sum(map(len, texts))
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        if size >= CORPUS_BYTES:
            break
        texts.append(path.read_bytes().decode("utf-8", errors="replace"))
        size += len(texts[-1])
    tokenizer = demo.train_tokenizer(texts, LARGE_VOCAB)
    make_random_qwen3(out, vocab_size=tokenizer.get_vocab_size(), eos_token_id=demo.EOS_ID)
    tokenizer.save(str(out / "tokenizer.json"))
    print(f"trained a {tokenizer.get_vocab_size()}-token tokenizer into {out}", flush=True)
    return out


def per_token_seconds(llm: LLM, batch: int) -> tuple[float, float]:
    """Decode seconds per output token of ``batch`` requests with the schema, and of the
    same requests free, each emitting as many tokens as it did under the schema (so the
    batch shrinks alike in both); best of two runs each."""
    spec = StructuredOutputsParams(json=SCHEMA)

    def run(lengths: list[int], constrained: bool) -> tuple[float, list[int]]:
        params = [
            SamplingParams(
                max_tokens=n,
                temperature=1.0,
                seed=i,
                ignore_eos=True,
                structured_outputs=spec if constrained else None,
            )
            for i, n in enumerate(lengths)
        ]
        start = time.perf_counter()
        outputs = llm.generate([PROMPT] * batch, params)
        return time.perf_counter() - start, [len(o.outputs[0].token_ids) for o in outputs]

    _, lengths = run([MAX_TOKENS] * batch, True)  # warm-up: graphs captured, grammar compiled
    run(lengths, False)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(2):
        for constrained in (True, False):
            first, _ = run([1] * batch, constrained)
            full, emitted = run(lengths if not constrained else [MAX_TOKENS] * batch, constrained)
            assert emitted == lengths, "a seeded constrained run emitted other tokens"
            per_token = (full - first) / max(1, sum(emitted) - batch)
            best[constrained] = min(best[constrained], per_token)
    return best[True], best[False]


def overhead_table(name: str, model: Path, rounds: int) -> str:
    settings = {"overlap": True, "after": False}
    results: dict[tuple[str, int, bool], list[float]] = {}
    for round_index in range(rounds):
        order = list(settings) if round_index % 2 == 0 else list(settings)[::-1]
        for setting in order:
            llm = LLM(model, overlap_grammar_masks=settings[setting])
            for batch in (1, 32):
                schema, free = per_token_seconds(llm, batch)
                for constrained, seconds in ((True, schema), (False, free)):
                    results.setdefault((setting, batch, constrained), []).append(seconds)
                print(
                    f"round {round_index + 1} {name} {setting:8s} batch {batch:2d} "
                    f"free {free * 1e3:7.3f} schema {schema * 1e3:7.3f} ms/token",
                    flush=True,
                )
            llm.engine.close()
    rows = []
    for batch in (1, 32):
        for setting in settings:
            free = min(results[(setting, batch, False)])
            schema = min(results[(setting, batch, True)])
            rows.append(
                [str(batch), setting, f"{free * 1e3:.3f}", f"{schema * 1e3:.3f}",
                 f"{schema / free - 1:+.1%}"]
            )  # fmt: skip
    return markdown_table(
        f"{name}: decode ms per output token, JSON schema against free text, best of {rounds}",
        ["batch", "masks", "free text", "schema", "schema / free"],
        rows,
    )


HOSTILE = [
    {"guided_json": {"enum": [f"value-{i}-" + "x" * 40 for i in range(3000)]}},
    {"guided_regex": "(a|aa|aaa|a*)*" * 40 + "b"},
    {"guided_regex": "[a-z]{1000}{1000}"},
    {"guided_grammar": "start: a\na: a a | " + " | ".join(f'"{i}"' for i in range(2000))},
]


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def stream_gaps(base: str, stop: threading.Event | None = None) -> list[float]:
    """The gaps between the tokens of one plain stream of 256 tokens."""
    body = {
        "model": "updraft-demo",
        "prompt": "def fibonacci(n):",
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    gaps, last = [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    if stop is not None:
        stop.set()
    return gaps


def hostile(rounds: int) -> str:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "updraft.cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        stream_gaps(base)  # warm-up
        alone, attacked, sent = [], [], [0]
        for _ in range(rounds):
            alone += stream_gaps(base)
            stop = threading.Event()

            def attack(stop: threading.Event = stop) -> None:
                index = 0
                with httpx.Client(base_url=base, timeout=120) as client:
                    while not stop.is_set():
                        extra = HOSTILE[index % len(HOSTILE)]
                        if index % 3 == 0:
                            extra = {"guided_json": deep_schema(200 + index)}
                        elif index % 3 == 1:
                            extra = {"guided_json": {"const": f"distinct-{index}"}}
                        body = {"model": "updraft-demo", "prompt": "x", "max_tokens": 8}
                        client.post("/v1/completions", json={**body, **extra})
                        index += 1
                        sent[0] += 1

            attackers = [threading.Thread(target=attack) for _ in range(4)]
            for thread in attackers:
                thread.start()
            attacked += stream_gaps(base, stop)
            for thread in attackers:
                thread.join()
    finally:
        server.terminate()
        server.wait(60)
    rows = [
        ["alone", f"{statistics.median(alone) * 1e3:.1f}", f"{max(alone) * 1e3:.1f}", "-"],
        [
            "beside hostile schemas",
            f"{statistics.median(attacked) * 1e3:.1f}",
            f"{max(attacked) * 1e3:.1f}",
            str(sent[0]),
        ],
    ]
    return markdown_table(
        f"demo: a plain stream's gaps between tokens, {rounds} streams of 256 tokens",
        ["stream", "median gap, ms", "largest gap, ms", "hostile requests sent"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["demo", "large", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hostile", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "structured")
    args = parser.parse_args()
    if args.hostile:
        print(hostile(args.rounds))
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    names = ["demo", "large"] if args.model == "both" else [args.model]
    tables = []
    for name in names:
        model = DEMO_MODEL_DIR if name == "demo" else large_vocab_model(args.work_dir)
        tables.append(overhead_table(name, model, args.rounds))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
