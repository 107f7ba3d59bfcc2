"""How close prefill and batched decoding come to this machine's ceilings.

1. The float32 GEMM peak: torch's matrix product (oneDNN) on large square matrices,
   best of several, in GFLOP/s; and what oneDNN reaches on a prefill's own shapes
   (a 512-token chunk through each linear of the model), the fraction a prefill's
   linears could reach at best.
2. updraft's cold prefill of 32 fresh prompts (the peer benchmark's lengths, 16-256
   tokens, max_tokens 1): prompt tokens/s, and the model's FLOPs per prompt token
   (2 x its matrix parameters, the LM head only for the rows that sample, plus causal
   attention's score and value products) as GFLOP/s and as a fraction of the peak.
3. The int8 dot-product peak: every thread running independent chains of the widest
   u8 x s8 multiply-add instruction a build has (``benchmarks/int8_peak.c``: AVX512-VNNI
   or AVX-VNNI ``vpdpbusd`` where the CPU has them, and AVX2 ``vpmaddubsw`` +
   ``vpmaddwd`` too, built for ``haswell``), as multiply-adds/s and as operations/s (2
   a multiply-add) beside the float32 peak's FLOP/s. Then the 100M model's GGUF Q4_0
   and Q4_K_M files (llama.cpp's quantizer, as bench_peers makes them) with int8
   activations: a cold prefill of a 256-token prompt, the quantized linears' integer
   multiply-adds (every part on the int8 path; the head's for the one row that samples)
   over the prefill's time as a fraction of that peak; and the same linears alone, each
   timed on 256 rows of x.
4. Batched decoding at batch 8, 32 and 64, and 1 for reference (each request 32 prompt
   tokens, 64 greedy new tokens): output tokens/s against both floors, compute (peak /
   FLOPs per token) and bandwidth (stream bandwidth x batch / the weight bytes a step
   reads), and the fraction of whichever binds.

The 100M Qwen3-shape float32 checkpoint of the peer benchmark (hidden 768, 12 layers,
a 32k vocabulary tied to the head).

    .venv/bin/python -m benchmarks.bench_ceiling [--rounds 3]

(The GGUF rows need llama.cpp's quantizer: benchmarks/peers/setup_llamacpp.sh.)
"""

from __future__ import annotations

import argparse
import ctypes
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_peers import PYTHONS, prepare_gguf
from benchmarks.common import make_random_qwen3, markdown_table, stream_bandwidth
from benchmarks.peers.workload import cold_prompts
from updraft import LLM, SamplingParams
from updraft.kernels.gguf_ops import INT8_TYPES
from updraft.model_config import ModelConfig
from updraft.models.gguf_loader import GGUFLinear

PREFILL_CHUNK = 512
BATCHES = (1, 8, 32, 64)
DECODE_PROMPT, DECODE_TOKENS = 32, 64


def gemm_peak(sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 5) -> float:
    """Best float32 FLOP/s of torch.mm on square matrices."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def int8_peak_library(march: str) -> ctypes.CDLL:
    """``int8_peak.c`` built for ``march`` (native: the machine's widest instructions)."""
    source = Path(__file__).with_name("int8_peak.c")
    compiler = shutil.which("gcc") or shutil.which("cc") or "cc"
    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder) / f"int8_peak_{march}.so"
        command = [compiler, "-O2", f"-march={march}", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run([*command, str(source), "-o", str(library)], check=True)
        lib = ctypes.CDLL(str(library))  # loaded, the file may go
    lib.int8_peak_kind.restype = ctypes.c_char_p
    lib.int8_peak_per_iteration.restype = ctypes.c_int64
    lib.int8_peak_run.restype = ctypes.c_int64
    lib.int8_peak_run.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def int8_peak(march: str, repeats: int = 5) -> tuple[str, float] | None:
    """(the instructions, int8 multiply-adds/s on every torch thread), best of
    ``repeats``; None where the build has no SIMD path."""
    lib = int8_peak_library(march)
    per_iteration = lib.int8_peak_per_iteration()
    if per_iteration == 0:
        return None
    threads, iterations = torch.get_num_threads(), 4_000_000
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        total = lib.int8_peak_run(iterations, threads, 3, -2)
        best = min(best, time.perf_counter() - start)
        done = iterations * threads * per_iteration
        if total != -6 * done:  # each multiply-add adds 3 x -2
            raise RuntimeError(f"int8_peak.c ({march}) summed {total}, expected {-6 * done}")
    return lib.int8_peak_kind().decode(), done / best


def int8_peaks() -> list[tuple[str, float]]:
    """The native build's peak, and the AVX2 one where the native build has VNNI."""
    native = int8_peak("native")
    peaks = [] if native is None else [native]
    if native is not None and "VNNI" in native[0]:
        peaks.append(int8_peak("haswell"))
    return peaks


def gguf_prefill(model: Path, work: Path, file_type: str, rounds: int) -> dict[str, float]:
    """A cold 256-token prefill of ``model``'s ``file_type`` file with int8 activations:
    its best seconds, its int8 multiply-adds, and its int8-path linears' seconds alone
    on 256 rows (best of ``rounds`` each)."""
    tokens = 256
    llm = LLM(str(prepare_gguf(model, work, file_type)), activations="int8", enforce_eager=True)
    model_module = llm.engine._runner.model  # noqa: SLF001 - a benchmark's look inside
    linears = [(name, m) for name, m in model_module.named_modules() if isinstance(m, GGUFLinear)]

    def int8_macs(linear: GGUFLinear) -> int:
        """Multiply-adds a row of x takes in the parts on the int8 path."""
        on_int8 = [
            n for n, code in zip(linear.rows, linear.codes, strict=True) if code in INT8_TYPES
        ]
        return sum(on_int8) * linear.in_features if linear.int8 else 0

    macs = sum((1 if "lm_head" in name else tokens) * int8_macs(m) for name, m in linears)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(4000)
    prefill = float("inf")
    for _ in range(rounds + 1):  # the first one warms up
        prompt = [rng.randrange(vocab) for _ in range(tokens)]
        start = time.perf_counter()
        llm.generate([prompt], [params])
        prefill = min(prefill, time.perf_counter() - start)
    alone = 0.0
    with torch.inference_mode():
        for name, linear in linears:
            if "lm_head" in name or int8_macs(linear) == 0:
                continue
            x = torch.randn(tokens, linear.in_features)
            best = float("inf")
            for _ in range(rounds + 1):
                start = time.perf_counter()
                linear(x)
                best = min(best, time.perf_counter() - start)
            alone += best
    llm.engine.close()
    layer_macs = macs - sum(int8_macs(m) for name, m in linears if "lm_head" in name)
    return {"seconds": prefill, "macs": macs, "alone": alone, "layer_macs": layer_macs}


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matrix products, as updraft fuses them."""
    hidden, heads, kv_heads = config.hidden_size, config.num_heads, config.num_kv_heads
    head_dim = config.head_dim
    inter = config.intermediate_size
    return [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]


def shapes_peak(config: ModelConfig, tokens: int = PREFILL_CHUNK, repeats: int = 5) -> float:
    """FLOP/s of oneDNN through one layer's linears on a chunk of ``tokens`` rows."""
    shapes = linear_shapes(config)
    weights = [torch.randn(n, k) for n, k in shapes]
    inputs = [torch.randn(tokens, k) for _, k in shapes]
    flops = sum(2 * tokens * n * k for n, k in shapes)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for x, w in zip(inputs, weights, strict=True):
            torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return flops / best


def layer_params(config: ModelConfig) -> int:
    return sum(n * k for n, k in linear_shapes(config))


def prefill_flops(config: ModelConfig, lengths: list[int]) -> float:
    """FLOPs of prefilling prompts of ``lengths``: every token through every layer's
    linears, causal attention (scores and values: 2 x 2 x head_dim per head and pair of
    positions attended), and the LM head for each prompt's last token only."""
    tokens = sum(lengths)
    attention_pairs = sum(n * (n + 1) // 2 for n in lengths)
    per_layer = 2 * layer_params(config) * tokens
    per_layer += 4 * config.num_heads * config.head_dim * attention_pairs
    head = 2 * config.vocab_size * config.hidden_size * len(lengths)
    return config.num_layers * per_layer + head


def decode_flops_per_token(config: ModelConfig, context: int) -> float:
    attention = 4 * config.num_heads * config.head_dim * context
    per_layer = 2 * layer_params(config) + attention
    return config.num_layers * per_layer + 2 * config.vocab_size * config.hidden_size


def weight_bytes(config: ModelConfig) -> int:
    """float32 bytes a decode step reads: every layer's linears and the head."""
    return 4 * (config.num_layers * layer_params(config) + config.vocab_size * config.hidden_size)


def cold_prefill(llm: LLM, vocab: int, run: int) -> tuple[float, list[int]]:
    """Seconds to prefill 32 fresh prompts (one new token each), and their lengths."""
    prompts = cold_prompts(vocab, run)
    lengths = [len(prompt) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, [params] * len(prompts))
    return time.perf_counter() - start, lengths


def batched_decode(llm: LLM, vocab: int, batch: int, run: int) -> float:
    """Output tokens/s of decoding ``batch`` requests together (after their prefill)."""
    rng = random.Random(2000 + run)
    prompts = [[rng.randrange(vocab) for _ in range(DECODE_PROMPT)] for _ in range(batch)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, [first] * batch)  # the prompts are now cached
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, [params] * batch)  # a prefix-cache hit, then decode steps
    return batch * DECODE_TOKENS / (time.perf_counter() - start)


def int8_rows(model: Path, work: Path, rounds: int, float32_peak: float) -> list[list[str]]:
    """The int8 peak's rows, and the GGUF prefills' against it."""
    peaks = int8_peaks()
    threads = torch.get_num_threads()
    rows = [
        [
            f"int8 dot-product peak ({kind}, {threads} threads), G multiply-adds/s",
            f"{rate / 1e9:.1f} ({2 * rate / 1e9:.0f} GOP/s)",
            f"{2 * rate / float32_peak:.2f}x the float32 FLOP/s",
        ]
        for kind, rate in peaks
    ]
    if not peaks:
        print("no int8 peak: this CPU has no AVX2")
        return rows
    if not PYTHONS["llama.cpp"].exists():
        print("skipping the GGUF prefills: run benchmarks/peers/setup_llamacpp.sh first")
        return rows
    top = peaks[0][1]
    for file_type in ("Q4_0", "Q4_K_M"):
        run = gguf_prefill(model, work, file_type, rounds)
        whole, alone = run["macs"] / run["seconds"], run["layer_macs"] / run["alone"]
        rows += [
            [
                f"{file_type} cold prefill of 256 tokens, int8 x "
                f"({256 / run['seconds']:.0f} tok/s): its int8 G multiply-adds/s",
                f"{whole / 1e9:.1f}",
                f"{whole / top:.2f} of the int8 peak",
            ],
            [
                f"  {file_type}'s int8-path linears alone, 256 rows each, G multiply-adds/s",
                f"{alone / 1e9:.1f}",
                f"{alone / top:.2f}",
            ],
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    args = parser.parse_args()
    model = make_random_qwen3(args.work_dir / "qwen3-100m")
    config = ModelConfig.from_dir(model)
    peak = gemm_peak()
    on_shapes = shapes_peak(config)
    bandwidth = stream_bandwidth()
    llm = LLM(str(model), dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048)
    prefills: list[float] = []
    decodes: dict[int, list[float]] = {batch: [] for batch in BATCHES}
    lengths: list[int] = []
    cold_prefill(llm, config.vocab_size, run=999)  # warm-up: captures, compiles
    # A busy neighbour moves the peak by a third within minutes: each round measures it
    # again just before its prefill, and the prefill is also judged against its round's.
    round_peaks: list[float] = []
    for round_index in range(args.rounds):
        round_peaks.append(gemm_peak())
        seconds, lengths = cold_prefill(llm, config.vocab_size, round_index)
        prefills.append(seconds)
        for batch in BATCHES:
            decodes[batch].append(batched_decode(llm, config.vocab_size, batch, round_index))
    peak = max(peak, *round_peaks)
    best_prefill = min(prefills)
    flops = prefill_flops(config, lengths)
    prefill_rate = flops / best_prefill
    of_round = [flops / (t * p) for t, p in zip(prefills, round_peaks, strict=True)]
    rows = [
        [
            "float32 GEMM peak (torch.mm, square 1-3k), GFLOP/s, best of the run (each round's)",
            f"{peak / 1e9:.1f} ({', '.join(f'{p / 1e9:.0f}' for p in round_peaks)})",
            "1.00",
        ],
        [
            f"oneDNN on a {PREFILL_CHUNK}-token chunk through one layer's linears, GFLOP/s",
            f"{on_shapes / 1e9:.1f}",
            f"{on_shapes / peak:.2f}",
        ],
        [
            f"updraft cold prefill, 32 prompts ({sum(lengths)} tokens): "
            f"{sum(lengths) / best_prefill:.0f} prompt tok/s, GFLOP/s",
            f"{prefill_rate / 1e9:.1f} ({flops / max(prefills) / 1e9:.1f}"
            f"-{prefill_rate / 1e9:.1f})",
            f"{prefill_rate / peak:.2f} ({min(of_round):.2f}-{max(of_round):.2f} of "
            "each round's own)",
        ],
    ]
    rows += int8_rows(model, args.work_dir, args.rounds, peak)
    context = DECODE_PROMPT + DECODE_TOKENS // 2
    for batch in BATCHES:
        best = max(decodes[batch])
        compute_floor = peak / decode_flops_per_token(config, context)
        bandwidth_floor = bandwidth * batch / weight_bytes(config)
        binding = min(compute_floor, bandwidth_floor)
        which = "compute" if compute_floor < bandwidth_floor else "bandwidth"
        rows.append(
            [
                f"batch {batch} decode, output tok/s (floors: compute {compute_floor:.0f}, "
                f"bandwidth {bandwidth_floor:.0f})",
                f"{best:.1f} ({min(decodes[batch]):.1f}-{best:.1f})",
                f"{best / binding:.2f} of {which}",
            ]
        )
    print(
        markdown_table(
            f"ceilings, 100M float32, best of {args.rounds} "
            f"(stream read {bandwidth / 1e9:.1f} GB/s)",
            ["measure", "value", "fraction of the ceiling"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
