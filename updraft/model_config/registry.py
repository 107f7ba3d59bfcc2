"""Which architectures updraft serves: one row each, naming the family's config parser,
its model class and what else is known of it (its GGUF name, whether it can be an EAGLE
head's layer, whether it reads checkpoints quantized elsewhere).

A family is one parser (``model_config/<family>.py``), one model file
(``models/<family>.py``) and its rows here; ``tests/test_architecture.py`` checks that
no other module names an architecture. ``register_model`` adds a row from outside the
package. Model classes are named as ``module:Class`` and imported when a model is built,
so that reading a config imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from updraft.model_config import (
    deepseek,
    gemma3,
    gemma4,
    gemma4_assistant,
    gemma4_gguf,
    gpt_oss,
    gpt_oss_gguf,
    llama,
    qwen35,
    qwen35_gguf,
)

# config.json (as a dict) and the architecture named in it -> ModelConfig's fields.
Parser = Callable[[dict[str, Any], str], dict[str, Any]]
# (file name, architecture, metadata getter, tensors) -> the config.json of a GGUF file.
GGUFParser = Callable[[str, str, Any, dict[str, tuple[str, tuple[int, ...]]]], dict[str, Any]]

LLAMA = "updraft.models.llama:LlamaForCausalLM"
GEMMA3 = "updraft.models.gemma:Gemma3ForCausalLM"
GEMMA4 = "updraft.models.gemma4:Gemma4ForCausalLM"
DEEPSEEK = "updraft.models.deepseek:DeepseekForCausalLM"
QWEN35 = "updraft.models.qwen35:Qwen35ForCausalLM"
GPT_OSS = "updraft.models.gpt_oss:GptOssForCausalLM"
GEMMA4_ASSISTANT = "updraft.models.gemma4_assistant:Gemma4Assistant"


@dataclass(frozen=True)
class Architecture:
    name: str  # as config.json's ``architectures`` lists it
    parse: Parser
    model: str | type  # the model class, or ``module:Class``
    gguf_name: str | None = None  # llama.cpp's ``general.architecture`` for its files
    from_gguf: GGUFParser | None = None
    # llama.cpp's converter permutes the q and k rows of this architecture's files.
    gguf_permuted_qk: bool = False
    # (pattern, replacement) of its GGUF tensor names tried before the shared ones, and
    # what its converter added to every norm weight (Gemma's 1).
    gguf_tensor_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_shift: float = 0.0
    # Its converter stores linear attention's value heads tiled over the key heads
    # (Qwen3.5's: ``models/gguf_linear_attention.py`` puts them back).
    gguf_tiled_value_heads: bool = False
    eagle_head: bool = False  # an EAGLE head may be one layer of it
    prequantized: bool = False  # AWQ, GPTQ and compressed-tensors checkpoints are read
    mxfp4_experts: bool = False  # checkpoints with MXFP4 experts (gpt-oss's) are read
    # A drafter that runs only beside its target: the proposer (speculative_method) that
    # a --speculative-model checkpoint of it is served by.
    proposer: str | None = None


def _hybrid(name: str, gguf_name: str, tiled_value_heads: bool = False) -> Architecture:
    """A Qwen3.5-family row that reads GGUF files too."""
    return Architecture(
        name,
        qwen35.parse,
        QWEN35,
        gguf_name=gguf_name,
        from_gguf=qwen35_gguf.from_gguf,
        gguf_tensor_names=qwen35_gguf.GGUF_TENSORS,
        gguf_tiled_value_heads=tiled_value_heads,
    )


ARCHITECTURES: dict[str, Architecture] = {
    row.name: row
    for row in (
        Architecture(
            "LlamaForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="llama",  # Mistral's files say llama too
            from_gguf=llama.from_gguf,
            gguf_permuted_qk=True,
            eagle_head=True,
            prequantized=True,
        ),
        Architecture(
            "Qwen2ForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="qwen2",
            from_gguf=llama.from_gguf,
            eagle_head=True,
            prequantized=True,
        ),
        Architecture(
            "Qwen3ForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="qwen3",
            from_gguf=llama.from_gguf,
            eagle_head=True,
            prequantized=True,
        ),
        # Fused qkv and gate/up in its checkpoints, LongRoPE.
        Architecture(
            "Phi3ForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="phi3",
            from_gguf=llama.phi3_from_gguf,
            gguf_tensor_names=llama.PHI3_GGUF_TENSORS,
            eagle_head=True,
            prequantized=True,
        ),
        Architecture("MistralForCausalLM", llama.parse, LLAMA, eagle_head=True, prequantized=True),
        Architecture(
            "Qwen3MoeForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="qwen3moe",
            from_gguf=llama.from_gguf,
        ),
        Architecture(
            "Qwen2MoeForCausalLM",
            llama.parse,
            LLAMA,
            gguf_name="qwen2moe",
            from_gguf=llama.from_gguf,
        ),
        # Its GGUF files say llama: llama.from_gguf tells them by their experts.
        Architecture("MixtralForCausalLM", llama.parse, LLAMA, gguf_permuted_qk=True),
        Architecture(
            "Gemma3ForCausalLM",
            gemma3.parse,
            GEMMA3,
            gguf_name="gemma3",
            from_gguf=gemma3.from_gguf,
            gguf_tensor_names=gemma3.GGUF_TENSORS,
            gguf_norm_shift=gemma3.GGUF_NORM_SHIFT,
            prequantized=True,
        ),
        Architecture("Gemma3ForConditionalGeneration", gemma3.parse, GEMMA3, prequantized=True),
        # Per-layer head shapes, KV-shared layers and per-layer inputs; the multimodal
        # checkpoints' text tower.
        Architecture(
            "Gemma4ForCausalLM",
            gemma4.parse,
            GEMMA4,
            gguf_name="gemma4",
            from_gguf=gemma4_gguf.from_gguf,
            gguf_tensor_names=gemma4_gguf.GGUF_TENSORS,
        ),
        Architecture("Gemma4ForConditionalGeneration", gemma4.parse, GEMMA4),
        Architecture("DeepseekV2ForCausalLM", deepseek.parse, DEEPSEEK),
        # V2's GGUF files say deepseek2 too: the parser tells the two apart by their router.
        Architecture(
            "DeepseekV3ForCausalLM",
            deepseek.parse,
            DEEPSEEK,
            gguf_name="deepseek2",
            from_gguf=deepseek.from_gguf,
        ),
        Architecture("DeepseekV32ForCausalLM", deepseek.parse, DEEPSEEK),
        # Gated DeltaNet layers between gated full-attention ones; the multimodal
        # checkpoints' text tower.
        # Their GGUF files (qwen3next's read as Qwen3.5-MoE: model_config/qwen35_gguf.py);
        # llama.cpp's converter tiles Qwen3.5's value heads.
        _hybrid("Qwen3_5ForCausalLM", "qwen35", tiled_value_heads=True),
        _hybrid("Qwen3_5MoeForCausalLM", "qwen35moe", tiled_value_heads=True),
        _hybrid("Qwen3NextForCausalLM", "qwen3next"),
        Architecture("Qwen3_5ForConditionalGeneration", qwen35.parse, QWEN35),
        Architecture("Qwen3_5MoeForConditionalGeneration", qwen35.parse, QWEN35),
        # Attention sinks, alternating windows, YaRN, biased clamped-SwiGLU experts.
        Architecture(
            "GptOssForCausalLM",
            gpt_oss.parse,
            GPT_OSS,
            gguf_name="gpt-oss",
            from_gguf=gpt_oss_gguf.from_gguf,
            gguf_tensor_names=gpt_oss_gguf.GGUF_TENSORS,
            mxfp4_experts=True,
        ),
        # Gemma 4's assistant drafter: it reads the Gemma 4 target's hidden states and K/V.
        Architecture(
            "Gemma4AssistantForCausalLM",
            gemma4_assistant.parse,
            GEMMA4_ASSISTANT,
            proposer="gemma4-assistant",
        ),
    )
}


def register_model(
    name: str, model: str | type, parse: Parser = llama.parse, **known: Any
) -> Architecture:
    """Serve the architecture ``name`` (as config.json lists it) with ``model``, a model
    class or ``module:Class`` built as updraft's own are (``Class(config,
    max_positions=...)``), its config read by ``parse`` (default: as a Llama-family
    config). ``known`` sets the row's other fields. A name already served is replaced."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_model: the architecture name must be a string, got {name!r}")
    row = Architecture(name, parse, model, **known)
    ARCHITECTURES[name] = row
    return row


def find(names: list[str]) -> Architecture:
    """The row of the first architecture of ``names`` that is served."""
    if not isinstance(names, list):
        raise ValueError(f"config.json: architectures must be a list of names, not {names!r}")
    for name in names:
        if isinstance(name, str) and name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported architecture {names or '(none given)'}; "
        f"updraft supports {', '.join(ARCHITECTURES)}"
    )


def for_gguf(gguf_name: Any, file_name: str) -> Architecture:
    """The row whose GGUF files say ``general.architecture = gguf_name``."""
    rows = {row.gguf_name: row for row in ARCHITECTURES.values() if row.from_gguf}
    if gguf_name not in rows:
        raise ValueError(
            f"{file_name}: GGUF architecture {gguf_name!r} is not supported "
            f"({', '.join(map(str, rows))} are)"
        )
    return rows[gguf_name]
