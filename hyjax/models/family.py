"""What a model family gives the generic code: one :class:`ModelFamily` per folder of
``hyjax/models/``, listed once in :mod:`hyjax.models`.

The loader, the saver, the sharding plan and the op selection ask a family object for what
differs between architectures; none of them tests ``model_type``. (The cache asks the config:
``cfg.cache_spec`` is a value derived from it.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flax import nnx

if TYPE_CHECKING:
    from hyjax.config import ModelConfig
    from hyjax.partition import FamilySharding


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter path, its layout change, an expert index."""

    path: tuple
    transform: str  # "copy" | "t" (transpose) | "conv" ([C,1,K] -> [C,K]) | "flat"
    expert: int | None = None  # per-expert tensors stack into [E, ...]
    part: slice | None = None  # fused expert tensors: rows taken from the checkpoint
    # "flat": the shape the checkpoint stores (the saver writes it back so); -1 is the rest.
    stored_shape: tuple[int, ...] | None = None


# A GPU kernel rule: the op fields it covers, and why the Triton kernel cannot take this
# model's shapes (None: it can).
KernelRule = tuple[tuple[str, ...], str | None]


def _same_name(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True, eq=False)  # one object per family: compared by identity
class ModelFamily:
    """One architecture: its config, model, checkpoint names, partition rules, kernel rules
    and presets."""

    config_class: type[ModelConfig]  # a frozen dataclass with ``from_hf`` / ``to_hf``
    model_class: type[nnx.Module]  # ``(cfg, *, dtype, rngs)``; parameter paths are the contract
    # Checkpoint name -> parameter, for every tensor a checkpoint of this config must hold.
    targets: Callable[[ModelConfig], dict[str, Target]]
    sharding: FamilySharding
    # The GPU (Triton) kernels of this family's layers: which cannot take the config's shapes
    # (the MoE experts' rule is shared, in hyjax.ops). The TPU kernels take every shape.
    gpu_kernel_rules: Callable[[ModelConfig], list[KernelRule]]
    presets: Mapping[str, Callable[..., Any]]  # name -> named constructor of a config
    # Parameters kept in float32 whatever the model's dtype (the checkpoint keeps them so).
    float32_params: tuple[str, ...] = ()
    # Another spelling of a checkpoint name -> the one ``targets`` uses.
    checkpoint_name: Callable[[str], str] = _same_name

    @property
    def model_type(self) -> str:
        return self.config_class.model_type
