"""The weight absorption around the MLA kernels, shared by the TPU and GPU ones.

Both kernels compute *latent* attention: multi-query attention with one shared "kv head" whose
key is a token's whole latent row ``[c_kv | k_rope]`` (L + R) and whose value is its first L
values, over the paged latent cache (layout: :mod:`pallas_kernels.attention.mla_reference`).
The per-head ``kv_b_proj`` weights are applied outside, on this step's tokens only, so the
context is read once in latent form and nothing of size ``ctx x H`` is ever built::

    q_abs[t, h] = [ w_kv_b[:, h, :Dn] @ q_nope[t, h] | q_rope[t, h] ]     (L + R)   absorb_query
    o_lat[t, h] = softmax_c(scale * q_abs[t, h] . latent[c]) @ c_kv[c]   (L)       the kernel
    o[t, h]     = o_lat[t, h] @ w_kv_b[:, h, Dn:]                        (Dv)      absorb_output

The same absorption serves decode rows and prefill chunks, so one launch covers a mixed batch
(what FlashMLA and vLLM do for decode). Its cost for long prefill chunks: per (query, key) pair
``H * (2L + R)`` multiply-adds against ``H * (Dn + R + Dv)`` decompressed (3.4x more at
Kimi-Linear-48B shapes), traded for never materialising decompressed keys and values.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.attention.mla_reference import check_mla_args


def _precision(dtype) -> jax.lax.Precision:
    """IEEE f32 products for f32 operands (no TF32 on GPU); the MXU / tensor-core default for
    16-bit ones (exact products, f32 accumulation)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def absorb_query(
    q: jax.Array,  # [T, H, Dn + R]  per head: q_nope | q_rope
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    *,
    nope_dim: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """``[W_uk q_nope | q_rope]`` per head, in the cache's dtype (the kernel's dot inputs).

    Returns [T, H, L + R]."""
    prec = _precision(jnp.promote_types(q.dtype, w_kv_b.dtype))
    # [T, H, Dn] x [L, H, Dn] -> [T, H, L]
    q_lat = jnp.einsum(
        "THN,LHN->THL", q[..., :nope_dim], w_kv_b[..., :nope_dim],
        precision=prec, preferred_element_type=jnp.float32,
    )  # fmt: skip
    return jnp.concatenate([q_lat.astype(dtype), q[..., nope_dim:].astype(dtype)], axis=-1)


def absorb_output(
    o_lat: jax.Array,  # [T, H, L]
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    *,
    nope_dim: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """``o_lat @ W_uv`` per head. Returns [T, H, Dv] in ``dtype``."""
    prec = _precision(jnp.promote_types(o_lat.dtype, w_kv_b.dtype))
    out = jnp.einsum(
        "THL,LHV->THV", o_lat, w_kv_b[..., nope_dim:],
        precision=prec, preferred_element_type=jnp.float32,
    )  # fmt: skip
    return out.astype(dtype)


# The signature every latent-attention kernel has:
#   core(q_abs [T, H, L+R], latent_cache [NB, bs, L+R], query_start_loc i32[S+1],
#        seq_lens i32[S], block_tables i32[S, max_blocks], num_seqs i32[], *, lora, scale)
#   -> o_lat [T, H, L] (padding tokens 0)
LatentKernel = Callable[..., jax.Array]


def absorbed_prefill(core: LatentKernel, **tuning) -> Callable:
    """``mla_prefill`` (the reference's signature) on a latent-attention kernel."""

    def mla_prefill(
        q: jax.Array,  # [T, H, Dn + R]
        latent_cache: jax.Array,  # [num_blocks, block_size, L + R]  new tokens already written
        w_kv_b: jax.Array,  # [L, H, Dn + Dv]
        query_start_loc: jax.Array,  # i32[S+1]
        seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
        block_tables: jax.Array,  # i32[S, max_blocks]
        num_seqs: jax.Array,  # i32[]
        *,
        nope_dim: int,
        scale: float,
    ) -> jax.Array:
        """Causal MLA of a ragged batch (decode rows and prefill chunks). Returns [T, H, Dv]."""
        _, lora, _, _ = check_mla_args(
            q, latent_cache, w_kv_b, nope_dim, query_start_loc, seq_lens, block_tables
        )
        q_abs = absorb_query(q, w_kv_b, nope_dim=nope_dim, dtype=latent_cache.dtype)
        o_lat = core(
            q_abs, latent_cache, query_start_loc, seq_lens, block_tables, num_seqs,
            lora=lora, scale=scale, **tuning,
        )  # fmt: skip
        # o_lat in the cache's dtype: a bf16 model's output projection runs on tensor cores
        o_lat = o_lat.astype(latent_cache.dtype)
        return absorb_output(o_lat, w_kv_b, nope_dim=nope_dim, dtype=q.dtype)

    return mla_prefill


def absorbed_decode(core: LatentKernel, **tuning) -> Callable:
    """``mla_decode`` (the reference's signature): one token per row, as a ragged batch."""
    prefill = absorbed_prefill(core, **{"max_q_len": 1, **tuning})  # no prefill launch

    def mla_decode(
        q: jax.Array,  # [S, H, Dn + R]  one new token per sequence
        latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
        w_kv_b: jax.Array,  # [L, H, Dn + Dv]
        seq_lens: jax.Array,  # i32[S]  context incl. the new token
        block_tables: jax.Array,  # i32[S, max_blocks]
        num_seqs: jax.Array,  # i32[]
        *,
        nope_dim: int,
        scale: float,
    ) -> jax.Array:
        """MLA decode. Returns [S, H, Dv] (rows past ``num_seqs`` 0)."""
        rows = q.shape[0]
        if block_tables.shape[0] != rows:
            raise ValueError(
                f"block_tables {block_tables.shape} must have one row per query {q.shape}"
            )
        # row i is token i; rows past num_seqs get no tokens
        qsl = jnp.minimum(jnp.arange(rows + 1, dtype=jnp.int32), num_seqs)
        return prefill(
            q, latent_cache, w_kv_b, qsl, seq_lens, block_tables, num_seqs,
            nope_dim=nope_dim, scale=scale,
        )  # fmt: skip

    return mla_decode
