"""Device caches: the paged KV pool (full-attention layers) and the state pool (GDN/KDA layers).

One state *slot* holds, for every linear-attention layer, the conv window (last K-1 pre-conv
inputs, model dtype) and the recurrent state (``state_dtype``: float32, or bfloat16 at half the
bytes, ``--state-dtype``; the kernels compute in float32 either way). Slot 0 is NULL; block 0 is
null.

The recurrent state of a head is stored transposed: ``S^T [Dv, Dk]``, the pool
``[num_slots, H, Dv, Dk]`` (the head axis is axis 1, where tensor parallel splits it). A value
channel's row over the key channels is then contiguous, which is what the GPU decode kernels
stream (16 rows of V a program, both reductions over K inside a warp: BENCHMARKS.md, "Decode in
the transposed state layout"). Every GDN / KDA op, reference and kernel, takes this layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hyjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Caches:
    # per attention layer, its paged arrays [NB, bs, *token_shape]: Qwen3-Next k, v
    # [NB, bs, Hkv, D]; Kimi-Linear's MLA one latent [NB, bs, kv_lora_rank + rope dims]
    kv: tuple[tuple[jax.Array, ...], ...]
    conv: tuple[jax.Array, ...]  # per linear layer: [num_slots, K-1, conv_dim]
    ssm: tuple[jax.Array, ...]  # per linear layer: f32 | bf16[num_slots, H, Dv, Dk]  (S^T)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What one model keeps per token (KV pool) and per slot (state pool), layer by layer.

    Each family's config derives its own (``cfg.cache_spec``); what follows is generic.
    """

    kv_token_shapes: tuple[tuple[int, ...], ...]  # one attention layer's paged arrays, per token
    num_attention_layers: int
    conv_shape: tuple[int, int]  # [K-1, conv channels]
    ssm_shape: tuple[int, int, int]  # [H, Dv, Dk]: the state transposed (module docstring)
    num_linear_layers: int


def cache_spec(cfg: ModelConfig) -> CacheSpec:
    """The model's pools, as its family's config derives them (``cfg.cache_spec``)."""
    return cfg.cache_spec


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one KV block over all attention layers."""
    spec = cache_spec(cfg)
    per_token = sum(int(np.prod(s)) for s in spec.kv_token_shapes) * jnp.dtype(dtype).itemsize
    return per_token * block_size * spec.num_attention_layers


def state_slot_bytes(
    cfg: ModelConfig, dtype: jnp.dtype, state_dtype: jnp.dtype = jnp.float32
) -> int:
    """Bytes of one state slot over all linear-attention layers: conv windows in ``dtype``,
    recurrent states in ``state_dtype``."""
    spec = cache_spec(cfg)
    conv = int(np.prod(spec.conv_shape)) * jnp.dtype(dtype).itemsize
    ssm = int(np.prod(spec.ssm_shape)) * jnp.dtype(state_dtype).itemsize
    return (conv + ssm) * spec.num_linear_layers


# Pool arrays stay below this many elements: the Triton (GPU) kernels address a pool with 32-bit
# offsets, so a larger array would wrap. 2**31 bf16 elements are 4 GiB per array, about 4M tokens
# of one Qwen3-Next-80B attention layer (2 kv heads x 256): only small models on big cards meet it.
MAX_POOL_ELEMENTS = 2**31 - 1


def pool_limits(
    cfg: ModelConfig,
    block_size: int,
    *,
    kv_split: int = 1,
    slot_split: int = 1,
    max_elements: int = MAX_POOL_ELEMENTS,
) -> tuple[int, int]:
    """``(max KV blocks, max state slots)`` keeping every pool array (per device, where the
    pools are split ``kv_split`` / ``slot_split`` ways by head, and stacked over the layer
    groups of the scanned forward) within ``max_elements``."""
    from hyjax.models.hybrid import layer_groups  # here: that module imports this one

    spec = cache_spec(cfg)
    # The scanned forward stacks a group position's pools into one array, G times as long.
    groups = layer_groups(cfg)
    stack = groups.num_groups if groups is not None else 1
    per_block = max(int(np.prod(s)) for s in spec.kv_token_shapes) * block_size // kv_split
    per_slot = max(int(np.prod(spec.conv_shape)), int(np.prod(spec.ssm_shape))) // slot_split
    per_block, per_slot = per_block * stack, per_slot * stack
    return max_elements // max(1, per_block), max_elements // max(1, per_slot)


def init_caches(
    cfg: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    dtype: jnp.dtype,
    state_dtype: jnp.dtype = jnp.float32,
    fill: float = 0.0,
) -> Caches:
    """Allocates the pools: KV pages and conv windows in ``dtype``, recurrent states in
    ``state_dtype``. ``fill=nan`` poisons them so a stray read shows up in tests."""
    spec = cache_spec(cfg)
    kv = tuple(
        tuple(jnp.full((num_blocks, block_size) + s, fill, dtype) for s in spec.kv_token_shapes)
        for _ in range(spec.num_attention_layers)
    )
    conv_shape = (num_slots,) + spec.conv_shape
    ssm_shape = (num_slots,) + spec.ssm_shape
    conv = tuple(jnp.full(conv_shape, fill, dtype) for _ in range(spec.num_linear_layers))
    ssm = tuple(jnp.full(ssm_shape, fill, state_dtype) for _ in range(spec.num_linear_layers))
    return Caches(kv=kv, conv=conv, ssm=ssm)
