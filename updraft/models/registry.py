"""The model class of a config: the one its architecture's registry row names
(``model_config/registry.py``), imported when first asked for."""

from __future__ import annotations

import importlib

from torch import nn

from updraft.model_config import ModelConfig
from updraft.model_config.registry import ARCHITECTURES


def model_class(config: ModelConfig) -> type[nn.Module]:
    row = ARCHITECTURES[config.architecture]
    if row.proposer is not None:
        raise ValueError(
            f"{config.architecture} is a drafter that runs beside its target: give it as "
            "--speculative-model, not as the model"
        )
    model = row.model
    if isinstance(model, str):
        module, _, name = model.partition(":")
        model = getattr(importlib.import_module(module), name)
    return model
