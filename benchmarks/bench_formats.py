"""Weight formats against float32: speed, memory and quality in updraft.

Speed: batch-1 decode and 32 mixed requests (the peer workload), every format
alternating in one run, best of the rounds, with each format's bandwidth floor (its
weight bytes read per token / the measured memory bandwidth). Memory: peak RSS after
load and after the mixed workload, each format in a fresh process. Quality: the demo
model's held-out cross-entropy (the windows scripts/train_demo.py reports) and the mean
KL divergence of each format's next-token distribution from float32's, in transformers
with every linear weight (the LM head included, the embedding not) replaced by the
weight its format stands for (``kernels/panels.py``: exactly what updraft multiplies
by).

    .venv/bin/python -m benchmarks.bench_formats [--rounds 3] [--model demo|100m|both]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer

from benchmarks.bench_peers import prepare_model
from benchmarks.common import markdown_table, stored_in, updraft_weight_bytes
from benchmarks.peers import workload
from benchmarks.peers.workload import best_time
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.kernels.panels import pack, unpack
from updraft.weights import WeightFormat

TRAIN_DEMO = Path(__file__).parents[1] / "scripts" / "train_demo.py"
# name -> (engine settings, the format it keeps); a half-precision name runs on a copy
# of the checkpoint stored in that dtype, with dtype auto.
FORMATS = {
    "float32": ({"dtype": "float32"}, WeightFormat("float32")),
    "bfloat16": ({}, WeightFormat("bfloat16")),
    "int8": ({"quantization": "int8"}, WeightFormat("int8")),
    "int4-g128": (
        {"quantization": "int4", "quantization_group_size": 128},
        WeightFormat("int4", 128, zero_point=True),
    ),
    "int4-g32": (
        {"quantization": "int4", "quantization_group_size": 32},
        WeightFormat("int4", 32, zero_point=True),
    ),
}


def train_demo_module():
    spec = importlib.util.spec_from_file_location("train_demo", TRAIN_DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def checkpoint_for(name: str, model: Path, work: Path) -> Path:
    return stored_in(model, torch.bfloat16, work) if name == "bfloat16" else model


@torch.no_grad()
def quality(windows: int, seq_len: int) -> dict[str, tuple[float, float]]:
    """Per format: (held-out cross-entropy in nats/token, mean KL from float32)."""
    demo = train_demo_module()
    corpus = demo.load_corpus(demo.stdlib_dir())
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    data = demo.encode_files(tokenizer, [text for _, text in corpus.heldout])
    batch = demo.sample_windows(data, windows, seq_len, torch.Generator().manual_seed(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # untie
    originals = {
        m: m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)
    }
    chunks = [(chunk[:, :-1], chunk[:, 1:]) for chunk in batch.split(16)]
    reference = [model(inputs).logits.log_softmax(-1) for inputs, _ in chunks]
    out = {}
    for name, (_, fmt) in FORMATS.items():
        for module, weight in originals.items():
            module.weight.copy_(unpack(pack(weight, fmt)))
        losses, kls, count = 0.0, 0.0, 0
        for (inputs, targets), want in zip(chunks, reference, strict=True):
            got = model(inputs).logits.log_softmax(-1)
            losses += F.nll_loss(got.flatten(0, 1), targets.flatten(), reduction="sum")
            kls += F.kl_div(got, want, log_target=True, reduction="sum")
            count += targets.numel()
        out[name] = (float(losses) / count, float(kls) / count)
    return out


def speeds(model: Path, vocab: int, engine: dict) -> tuple[float, float]:
    """(batch-1 decode tokens/s, 32 mixed requests output tokens/s)."""
    llm = LLM(
        model,
        kv_cache_memory_gib=workload.KV_CACHE_GIB,
        max_num_seqs=workload.MAX_NUM_SEQS,
        max_num_batched_tokens=workload.MAX_NUM_BATCHED_TOKENS,
        **engine,
    )
    prompt = workload.batch1_prompt(vocab)

    def run(prompts, lengths) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        return best_time(lambda: llm.generate(prompts, params))

    new = workload.BATCH1_NEW_TOKENS
    decode = (new - 1) / (run([prompt], [new]) - run([prompt], [1]))
    mixed = workload.mixed_requests(vocab)
    seconds = run([p for p, _ in mixed], [n for _, n in mixed])
    llm.engine.close()
    return decode, sum(n for _, n in mixed) / seconds


# Peaks are VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across exec, so a
# child of a large benchmark process would report its parent's peak.
MEMORY_SCRIPT = """
import json, sys
from benchmarks.peers import workload
from updraft import LLM, SamplingParams
model, vocab, engine = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def rss(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 2**10
llm = LLM(model, kv_cache_memory_gib=workload.KV_CACHE_GIB, **engine)
load = rss("VmHWM")
mixed = workload.mixed_requests(vocab)
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in mixed]
llm.generate([p for p, _ in mixed], params)
print(json.dumps({"load": load, "steady": rss()}))
"""


def memory(model: Path, vocab: int, engine: dict) -> dict[str, float]:
    """Peak RSS after load and RSS after the mixed workload, MiB, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(model), str(vocab), json.dumps(engine)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured_bandwidth() -> float:
    """Bytes per second a large copy moves (read and write), best of five."""
    source = torch.empty(2**28 // 4)
    target = torch.empty_like(source)
    seconds = min(best_time(lambda: target.copy_(source)) for _ in range(5))
    return 2 * source.nbytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["demo", "100m", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=256, help="held-out windows")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    names = ["demo", "100m"] if args.model == "both" else [args.model]
    formats = args.formats.split(",")
    bandwidth = measured_bandwidth()
    for name in names:
        model, vocab = prepare_model(name, args.work_dir)
        results: dict[str, list[tuple[float, float]]] = {f: [] for f in formats}
        for round_index in range(args.rounds):
            order = formats if round_index % 2 == 0 else formats[::-1]
            for fmt in order:
                engine = FORMATS[fmt][0]
                results[fmt].append(
                    speeds(checkpoint_for(fmt, model, args.work_dir), vocab, engine)
                )
        rows = []
        base = max(r[0] for r in results[formats[0]])
        for fmt in formats:
            checkpoint, engine = checkpoint_for(fmt, model, args.work_dir), FORMATS[fmt][0]
            decode = [r[0] for r in results[fmt]]
            mixed = [r[1] for r in results[fmt]]
            floor = bandwidth / updraft_weight_bytes(checkpoint, engine)
            rss = memory(checkpoint, vocab, engine)
            rows.append(
                [
                    fmt,
                    f"{max(decode):.1f} ({min(decode):.1f}-{max(decode):.1f})",
                    f"{max(decode) / base:.2f}x",
                    f"{floor:.0f} ({max(decode) / floor:.0%})",
                    f"{max(mixed):.1f} ({min(mixed):.1f}-{max(mixed):.1f})",
                    f"{rss['load']:.0f}",
                    f"{rss['steady']:.0f}",
                ]
            )
        print(
            markdown_table(
                f"{name}: weight formats, best of {args.rounds} alternating rounds "
                f"(bandwidth {bandwidth / 1e9:.1f} GB/s)",
                [
                    "format",
                    "decode tok/s, batch 1",
                    "vs float32",
                    "floor tok/s (reached)",
                    "32 mixed, output tok/s",
                    "peak RSS at load, MiB",
                    "RSS after the load, MiB",
                ],
                rows,
            )
        )
    if args.windows:
        rows = []
        scores = quality(args.windows, 256)
        for fmt in formats:
            loss, kl = scores[fmt]
            rows.append([fmt, f"{loss:.4f} (ppl {math.exp(loss):.2f})", f"{kl:.5f}"])
        print(
            markdown_table(
                f"demo: quality per format ({args.windows} held-out windows x 256 tokens)",
                ["format", "held-out loss, nats/token", "mean KL from float32, nats"],
                rows,
            )
        )


if __name__ == "__main__":
    main()
