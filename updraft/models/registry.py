"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from updraft.config import SUPPORTED_ARCHITECTURES, ModelConfig
from updraft.models.deepseek import DeepseekForCausalLM
from updraft.models.gemma import Gemma3ForCausalLM
from updraft.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES[config.architecture]
