"""What every model family's config shares: the base class, the layer kinds, and helpers for
parsing a Hugging Face ``config.json``.

Each family's frozen config dataclass lives in its folder (``hyjax/models/<family>/config.py``)
and subclasses :class:`ModelConfig`; :func:`hyjax.models.config_from_hf` picks the family by
``model_type``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyjax.cache import CacheSpec

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ModelConfig:
    """The base of every family's config, a frozen dataclass that declares at least these
    fields (the generic loader, cache, sharding, runner and scheduler read them)::

        model_type: str                 vocab_size: int          hidden_size: int
        num_hidden_layers: int          layer_types: tuple[str, ...]  (FULL_ / LINEAR_ATTENTION)
        num_experts: int                moe_intermediate_size: int    (0 experts: no MoE)
        rms_norm_eps: float             max_position_embeddings: int  tie_word_embeddings: bool
        bos_token_id: int | None        eos_token_id: int | tuple[int, ...] | None
        dtype: str                      ("bfloat16" | "float32" | "float16": the checkpoint's)

    and these methods: ``is_moe_layer(i)``, ``cache_spec`` (what the pools keep per token and
    per slot), ``from_hf(dict)`` and ``to_hf()``.
    """

    model_type: str
    layer_types: tuple[str, ...]
    eos_token_id: int | tuple[int, ...] | None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def is_moe_layer(self, i: int) -> bool:
        raise NotImplementedError

    @property
    def cache_spec(self) -> CacheSpec:
        raise NotImplementedError

    def to_hf(self) -> dict[str, Any]:
        raise NotImplementedError


def hf_dtype(d: dict[str, Any]) -> str:
    """The checkpoint's dtype from a ``config.json`` dict (``dtype`` or ``torch_dtype``)."""
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}")
    return dtype


def check_layer_types(layer_types: tuple[str, ...], n: int) -> None:
    if len(layer_types) != n:
        raise ValueError(f"{len(layer_types)=} does not match num_hidden_layers={n}")
    bad = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if bad:
        raise ValueError(f"unknown layer types {bad}")
