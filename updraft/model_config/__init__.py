"""A model's config as the model code reads it: ``ModelConfig``, its parts, one parser
per family, and the registry of the architectures updraft serves."""

from updraft.model_config.config import ModelConfig
from updraft.model_config.parts import IndexerConfig, MLAConfig, MoEConfig, RopeConfig
from updraft.model_config.registry import register_model

__all__ = ["IndexerConfig", "MLAConfig", "MoEConfig", "ModelConfig", "RopeConfig", "register_model"]
