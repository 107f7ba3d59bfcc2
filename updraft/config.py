"""How the engine runs: ``EngineConfig``, every field of which is also an ``updraft``
flag with its help text, and the sizes of its parallel groups.

By name only at import: this module is what ``updraft --help`` reads, and must not
import torch. A model's own config is ``model_config``; weight formats are ``weights``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from updraft.checkpoints.local import local_checkpoint
from updraft.demo import DEMO_EAGLE_DIR, DEMO_MODEL_DIR
from updraft.weights import (
    ACTIVATIONS,
    DTYPES,
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    WeightFormat,
    choose_format,
    compute_dtype,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

    from updraft.model_config import ModelConfig

GRAPH_MODES = ("auto", "piecewise", "full")
# --kv-cache-dtype, spelled as vLLM spells it; its fp8 kinds are refused by name (the
# CPU kernels read float or int8 rows).
KV_CACHE_DTYPES = ("auto", "int8")
REFUSED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
# The default of EngineConfig.compile_graphs where it is not given: a test suite that
# starts many engines sets it to 0 to skip inductor's compile time.
COMPILE_GRAPHS_ENV = "UPDRAFT_COMPILE_GRAPHS"
# The default of EngineConfig.capture_tokens: past 256 tokens a prefill step is its
# matrix products and a graph gains nothing (benchmarks/bench_prefill_steps.py). A test
# suite that starts many engines sets the variable to fewer sizes (comma-separated).
CAPTURE_TOKENS = (16, 32, 64, 128, 256)
CAPTURE_TOKENS_ENV = "UPDRAFT_CAPTURE_TOKENS"
# The default of EngineConfig.graphs_in_background: a test of captured steps that wants
# every step replayed from the first sets it to 0.
GRAPHS_IN_BACKGROUND_ENV = "UPDRAFT_GRAPHS_IN_BACKGROUND"
# The batch sizes captured by default, of which those up to max_num_seqs are taken.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ParallelSizes:
    """How many ranks split a model, each way (parallel/topology.py)."""

    tensor: int = 1
    prefill_context: int = 1
    decode_context: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.prefill_context

    def check(self) -> None:
        for name, size in vars(self).items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}_parallel_size must be an int >= 1, got {size!r}")
        if self.tensor % self.decode_context:
            raise ValueError(
                f"decode_context_parallel_size {self.decode_context} must divide "
                f"tensor_parallel_size {self.tensor}: its ranks are tensor-parallel ranks "
                "that keep the same KV heads and split the context"
            )


def setting(default: Any, help: str, **cli: Any) -> Any:
    """An ``EngineConfig`` field with its command-line help (``cli`` adds argparse
    options such as ``choices``); the CLI makes one flag per field from these."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """How the engine runs. Defaults suit the CPU; a GPU wants a larger KV budget.

    Every field is also an ``updraft`` flag (``block_size`` is ``--block-size``), with
    its default, type and help taken from here."""

    model: str = field(metadata={"help": "local Hugging Face checkpoint directory, or a GGUF file"})
    dtype: str = setting(
        "auto",
        "compute dtype; auto is float32 on the CPU with the weights kept in the "
        "checkpoint's dtype (bfloat16 and float16 stay 2 bytes), and the checkpoint's dtype "
        "on a GPU",
        choices=["auto", *DTYPES],
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    quantization: str | None = setting(
        None,
        "weight-only quantization at load, of linear layers and routed experts (CPU only, "
        "float32 activations): int8 (a scale per output row, about a quarter of float32's "
        "bytes) or int4 (a scale and a zero point per --quantization-group-size columns)",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = setting(
        128,
        "int4: weight columns per scale and zero point",
        choices=INT4_GROUP_SIZES,
    )
    activations: str = setting(
        "auto",
        "how quantized linears take their activations: int8 (x rounded to int8 per 32 "
        "values and multiplied by the weights' codes as bytes, as llama.cpp computes, for "
        "every weight type with an integer kernel; about a percent of error on each "
        "product), float32 (exact: float32 x times the weights' own values), or auto: "
        "int8 for a quantized checkpoint all of whose weight types have integer kernels, "
        "float32 for a float one (a bfloat16 one's batches in bfloat16 products where the "
        "CPU has AVX512-BF16; float32 keeps them exact too)",
        choices=ACTIVATIONS,
    )
    adaptive_threads: bool = setting(
        True,
        "on the CPU, leave other processes the cores they keep busy (kernels that wait for "
        "a thread sharing a busy core run several times slower); --no-adaptive-threads "
        "keeps every core",
    )
    keep_freed_memory: bool = setting(
        True,
        "on the CPU, keep the memory a step's temporaries free for the next step (glibc "
        "malloc's mmap and trim thresholds at 1 GiB) instead of returning it to the OS, "
        "which then faults it in again page by page (about a sixth of an eager prefill's "
        "time on two cores); --no-keep-freed-memory returns it",
    )
    mmap: bool = setting(
        True,
        "keep the weights the kernels read as the file stores them in the file's memory "
        "map (the page cache's pages, read as touched); --no-mmap reads them into the "
        "process's own memory at load, as llama.cpp's --no-mmap",
    )
    mlock: bool = setting(
        False,
        "lock the weights' pages in memory so the OS never pages them out, as llama.cpp's "
        "--mlock (RLIMIT_MEMLOCK, ulimit -l, must allow their size)",
    )
    seed: int = setting(0, "seed of the sampling of requests that have no seed of their own")
    overlap_grammar_masks: bool | None = setting(
        None,
        "compute the token masks of requests with structured outputs while the step's "
        "forward runs, rather than after it (default: on a GPU, and on a CPU with a core "
        "the forward's threads leave free: the grammar process runs only on a free core, "
        "so beside a forward on every core its masks are late more often)",
    )
    block_size: int = setting(16, "tokens per KV cache block")
    kv_cache_memory_gib: float = setting(1.0, "KV cache budget in GiB")
    num_kv_blocks: int | None = setting(None, "KV cache blocks; overrides kv_cache_memory_gib")
    kv_cache_dtype: str = setting(
        "auto",
        "what paged keys and values are kept in: auto (the model's dtype) or int8 (each "
        "head's row of a position as int8 codes and one float32 scale: about 0.26x the "
        "bytes of float32, so about 3.8x the tokens in the same budget; attention reads "
        "it in place and computes in float32). Not for MLA (DeepSeek) caches",
        choices=[*KV_CACHE_DTYPES, *REFUSED_KV_CACHE_DTYPES],
    )
    mamba_cache_dtype: str = setting(
        "float32",
        "the dtype of a hybrid model's recurrent state (Qwen3.5's linear-attention layers: "
        "each running request's conv window and state, paid for out of the KV cache budget); "
        "computed in float32 whatever it is kept in",
        choices=["float32", "bfloat16", "float16"],
    )
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int = setting(
        1024, "most tokens per step; longer prompts are prefilled in chunks"
    )
    max_model_len: int | None = setting(
        None, "context length (default: the model's max_position_embeddings)"
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV of prompt blocks seen before")
    prefix_cache_evicts_first: bool = setting(
        False,
        "hand out free KV blocks that hold cached prefixes (evicting them) before blocks "
        "never used: on the CPU the cache's resident memory then stays at the most blocks "
        "requests held at once, rather than growing to the whole budget with cached "
        "prefixes, which fewer prefixes stay cached to pay for",
    )
    kv_pools_per_kind: bool = setting(
        True,
        "in a model that mixes sliding-window and full-attention layers (Gemma 3, gpt-oss), "
        "keep the windowed layers' KV in a pool of its own whose blocks go back once their "
        "window has passed (not with a proposer model, nor a prefill split over ranks)",
    )
    num_prefix_states: int | None = setting(
        None,
        "with prefix caching, a hybrid model's recurrent states kept at cached prompts' "
        "last full block (a hit resumes from one), paid for out of the KV cache budget "
        "(default: as many as the running requests' state slots; 0 for other models)",
    )
    enforce_eager: bool = setting(
        False,
        # Captured steps remove CUDA's launch overhead; on the CPU their compiled runs
        # fuse the small ops between matrix products (benchmarks/RESULTS.md).
        "run every step eagerly instead of replaying captured decode and verify steps",
    )
    compile_graphs: bool | None = setting(
        None,
        "on the CPU, compile each captured step's runs of ops between attention calls into "
        "fused kernels with inductor (seconds per capture size at the first start, cached "
        "on disk after); --no-compile-graphs replays them op by op (default: on, or "
        f"${COMPILE_GRAPHS_ENV} when set to 0 or 1)",
    )
    graph_mode: str = setting(
        "auto",
        "piecewise: attention, whose shapes change every step, runs between captured "
        "segments with that step's shapes; full: decode and verify graphs hold attention "
        "too, shaped by the bucket over every block a request may have (one CUDA graph "
        "per step, but attention over max_model_len wherever it gathers); auto: full where "
        "attention reads the cache in place (float32 on the CPU, queries of up to 8 "
        "tokens, no sparse-attention indexer), else piecewise",
        choices=["auto", "piecewise", "full"],
    )
    graphs_in_background: bool | None = setting(
        None,
        "on the CPU, capture (and compile) the graphs in a thread after the engine starts, "
        "so the first request is answered at once with eager steps, each bucket replayed "
        "from the step after it is ready; --no-graphs-in-background makes them all before "
        f"the first step (default: on, or ${GRAPHS_IN_BACKGROUND_ENV} when set to 0 or 1)",
    )
    capture_sizes: tuple[int, ...] | None = setting(
        None,
        "batch sizes of captured steps, comma-separated (default: those of "
        f"{','.join(map(str, CAPTURE_SIZES))} below the largest batch a step holds, "
        "--max-num-seqs or --max-num-batched-tokens, and that batch)",
    )
    capture_tokens: tuple[int, ...] | None = setting(
        None,
        "token counts of captured mixed steps (prefill chunks, alone or beside decodes), "
        "comma-separated: such a step replays the smallest at least its size, its matrix "
        "products over its own tokens only; larger ones run eagerly (default: "
        f"{','.join(map(str, CAPTURE_TOKENS))}, or ${CAPTURE_TOKENS_ENV} when set)",
    )
    sanitize: bool = setting(
        False,
        "check every graph replay against eager on a copy of the KV cache (copies the "
        "whole cache each step: use a small one)",
    )
    speculative_method: str | None = setting(
        None,
        "draft (a draft model; implied by --speculative-model), ngram (prompt lookup), mtp "
        "(a DeepSeek checkpoint's multi-token prediction layer), eagle (an EAGLE-1 head "
        "reading the target's hidden states), or a registered proposer",
    )
    speculative_model: str | None = setting(
        None,
        "draft model checkpoint directory or GGUF file, with the target's tokenizer; or, with "
        "--speculative-method eagle, the EAGLE head's directory",
    )
    num_speculative_tokens: int = setting(3, "draft tokens verified per step")
    speculative_enforce_eager: bool | None = setting(
        None, "run the draft model's steps eagerly (default: as the target)"
    )
    draft_tensor_parallel_size: int = setting(
        1,
        "ranks the draft model splits over: 1 (whole on rank 0) or --tensor-parallel-size "
        "(split like the target on every tensor rank, replicated across prefill-context "
        "ranks)",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks that split every layer's heads and MLP rows (worker processes this engine "
        "starts, gloo on the CPU); the Llama family and DeepSeek",
    )
    prefill_context_parallel_size: int = setting(
        1,
        "ranks that split each long prefill's tokens, each with a whole tensor-parallel "
        "group (ranks in all: tensor x prefill context)",
    )
    decode_context_parallel_size: int = setting(
        1,
        "tensor-parallel ranks that keep the same KV heads and split every context "
        "between them, position by position (divides --tensor-parallel-size)",
    )
    probe: str | None = setting(
        None,
        "a directory where every rank records each step it runs, each graph replay's "
        "inputs and its KV caches at close (runner/probe.py; for tests and debugging)",
    )

    def __post_init__(self) -> None:
        self.model = local_checkpoint(str(self.model))
        if self.speculative_model is not None:
            self.speculative_model = local_checkpoint(str(self.speculative_model))
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                "quantization_group_size must be one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quantization_group_size!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        if self.capture_sizes is not None and min(self.capture_sizes, default=0) < 1:
            raise ValueError(f"capture_sizes must be sizes >= 1, got {self.capture_sizes}")
        if self.mixed_capture_tokens and min(self.mixed_capture_tokens) < 1:
            raise ValueError(f"capture_tokens must be sizes >= 1, got {self.mixed_capture_tokens}")
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        if self.speculative_method == "eagle" and self.speculative_model is None:
            if Path(self.model).resolve() != DEMO_MODEL_DIR:
                raise ValueError(
                    "speculative_method 'eagle' needs speculative_model (an EAGLE head "
                    "directory); only the demo model has a head shipped with updraft"
                )
            self.speculative_model = str(DEMO_EAGLE_DIR)
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError(
                "speculative_method 'draft' needs speculative_model (a draft checkpoint directory)"
            )
        if self.speculative_method in ("ngram", "mtp") and self.speculative_model is not None:
            raise ValueError(
                f"speculative_method {self.speculative_method!r} takes no speculative_model, "
                f"got {self.speculative_model!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}"
            )
        self.parallel_sizes.check()
        self._check_draft_tensor_parallel()
        if self.parallel_sizes.world > 1 and self.sanitize:
            raise ValueError("sanitize is not supported over several ranks")
        self._check_cache_sizes()
        self._check_kv_cache_dtype()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype in REFUSED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: updraft's attention "
                "kernels read float or int8 K/V rows (no CPU here converts fp8 natively, and "
                "int8 with a scale per head row keeps more precision in the same bytes); use "
                "'int8' or 'auto'"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )

    def _check_cache_sizes(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_prefix_states is not None and self.num_prefix_states < 0:
            raise ValueError(f"num_prefix_states must be >= 0, got {self.num_prefix_states}")

    def _check_draft_tensor_parallel(self) -> None:
        if self.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(
                f"draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                f"({self.tensor_parallel_size}), got {self.draft_tensor_parallel_size!r}"
            )
        if self.draft_tensor_parallel_size > 1 and self.speculative_method != "draft":
            raise ValueError(
                "draft_tensor_parallel_size is the draft model's (speculative_method "
                f"'draft'), got it with {self.speculative_method!r}"
            )

    @property
    def parallel_sizes(self) -> ParallelSizes:
        return ParallelSizes(
            self.tensor_parallel_size,
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
        )

    @property
    def positions_per_block(self) -> int:
        """Positions of a sequence per KV block, as the scheduler counts them: each of
        the C ranks of a decode-context group keeps ``block_size`` of them, so a block
        is ``block_size`` slots of each rank's cache."""
        return self.block_size * self.decode_context_parallel_size

    @property
    def use_graphs(self) -> bool:
        return not self.enforce_eager

    @property
    def mixed_capture_tokens(self) -> tuple[int, ...]:
        """``capture_tokens`` as given, else from the environment, else the default."""
        if self.capture_tokens is not None:
            return self.capture_tokens
        text = os.environ.get(CAPTURE_TOKENS_ENV)
        if text is None:
            return CAPTURE_TOKENS
        try:
            return tuple(int(size) for size in text.split(",") if size.strip())
        except ValueError:
            raise ValueError(
                f"${CAPTURE_TOKENS_ENV} must be comma-separated sizes, got {text!r}"
            ) from None

    @property
    def batch_capture_sizes(self) -> tuple[int, ...]:
        """``capture_sizes`` as given, else the default sizes below the largest batch a
        step can hold (``max_num_seqs`` requests, each a token of ``max_num_batched_tokens``),
        and that batch itself (at most the largest default)."""
        if self.capture_sizes is not None:
            return self.capture_sizes
        batch = min(self.max_num_seqs, self.max_num_batched_tokens, CAPTURE_SIZES[-1])
        return tuple(sorted({*(size for size in CAPTURE_SIZES if size < batch), batch}))

    @property
    def compiles_graphs(self) -> bool:
        if self.compile_graphs is not None:
            return self.compile_graphs
        return os.environ.get(COMPILE_GRAPHS_ENV, "1") != "0"

    @property
    def captures_in_background(self) -> bool:
        """Whether a CPU engine of one rank makes its graphs after it starts."""
        if self.enforce_eager or self.device != "cpu" or self.parallel_sizes.world > 1:
            return False
        if self.graphs_in_background is not None:
            return self.graphs_in_background
        return os.environ.get(GRAPHS_IN_BACKGROUND_ENV, "1") != "0"

    def start_up_steps(self) -> str:
        """What building an engine from this config does, for a progress line: loading
        takes seconds, compiling graphs up to a minute at the first start."""
        what = "loading the model"
        if self.captures_in_background:
            what += " (then stepping eagerly while graphs are captured"
            what += ", and compiled," if self.compiles_graphs else ""
            what += " in the background)"
        elif self.use_graphs:
            what += " and capturing graphs"
            if self.compiles_graphs and self.device == "cpu":
                what += " (compiling them: up to a minute at the first start, seconds after)"
        return what

    def compute_dtype(self, model_config: ModelConfig) -> torch.dtype:
        return compute_dtype(self.dtype, self.device, model_config.checkpoint_dtype)

    def cache_dtypes(self, compute: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """What paged K/V and a hybrid model's recurrent state are kept in, for a model
        computing in ``compute``."""
        import torch

        return (torch.int8 if self.kv_cache_dtype == "int8" else compute), self.state_dtype

    @property
    def state_dtype(self) -> torch.dtype:
        """What a hybrid model's recurrent state is kept in."""
        return torch_dtype(self.mamba_cache_dtype)

    def weight_format(self, model_config: ModelConfig) -> WeightFormat:
        """How the linear and expert weights are kept (``weights.choose_format``)."""
        chosen = choose_format(
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            group_size=self.quantization_group_size,
            checkpoint_dtype=model_config.checkpoint_dtype,
            prequantized=model_config.quantized,
        )
        return replace(chosen, exact=self.activations == "float32")
