"""Model families, one table: ``model_type`` -> :class:`~hyjax.models.family.ModelFamily`.

A family is one folder here (its config and presets, model and family-only layers, checkpoint
names, partition rules, kernel shape rules) and one entry of :data:`FAMILIES`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flax import nnx

from hyjax.config import ModelConfig
from hyjax.models import kimi_linear, qwen3_next
from hyjax.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family for family in (qwen3_next.FAMILY, kimi_linear.FAMILY)
}


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of a config."""
    return _family(cfg.model_type)


def _family(model_type: str | None) -> ModelFamily:
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
    return FAMILIES[model_type]


def model_class(cfg: ModelConfig) -> type[nnx.Module]:
    return family_of(cfg).model_class


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Parses a Hugging Face config dict into the frozen config of its architecture."""
    return _family(d.get("model_type")).config_class.from_hf(d)


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Reads ``<model_dir>/config.json``."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {os.fspath(model_dir)!r}")
    with open(path) as f:
        return config_from_hf(json.load(f))


__all__ = ["FAMILIES", "ModelFamily", "config_from_hf", "family_of", "load_config", "model_class"]
