"""MLA on the paged latent cache for TPU (Mosaic), decode rows and prefill chunks in one call.

``mla_prefill`` / ``mla_decode`` have the reference ops' signatures
(:mod:`pallas_kernels.attention.mla_reference`); both absorb ``kv_b_proj`` around one latent
attention kernel (:mod:`pallas_kernels.attention.mla_absorb`): MQA with a single kv head whose
key is the whole latent row (L + R) and whose value is its first L values. ``interpret`` goes
to ``pallas_call`` (``pltpu.InterpretParams()`` runs the kernel on CPU: how CI tests it).

Layout and grid (as :mod:`pallas_kernels.attention.tpu`, with all H query heads in the role of
a GQA group): the wrapper cuts every sequence's new tokens into tiles of ``BQ`` tokens and
gathers each tile head-major, ``[NT, H * BQ, L + R]``, row ``h * BQ + t``::

    grid = (NT,)     one tile per step: its H * BQ rows against every latent page, read once
      keys [0, pos0 + nq) in blocks of BK = P * bs tokens
      block kb:  P page DMAs  latent[block_tables[s, kb*P + p]] -> buf[slot, p*bs:(p+1)*bs]
                 (the next block's DMAs start before this block's math: double buffering)
                 s = scale * q buf^T  [M, BK] (one dot over L + R);  acc += p @ buf[:, :L]
    o[i] = acc / l   [H * BQ, L]  ->  the wrapper scatters tile rows back to [T, H, L]

Two launches of the kernel, as for GQA on GPU: rows with ``q_len <= block_q_decode`` (decode,
a few speculative tokens) in tiles of ``block_q_decode`` tokens, so a decode row does not
carry ``block_q - 1`` empty tokens through the MXU (at L + R = 576 and H = 32 that waste
would make decode compute-bound), and the rest in tiles of ``block_q``.

Pages past a sequence's context are not fetched; whatever the buffer holds there (NaN under
the interpreter) is masked out of the scores and zeroed before ``p @ c``.

The page DMAs (one stream: the latent pool), the double-buffered block loop and the
online-softmax step are :mod:`pallas_kernels.attention.paging_tpu`'s, shared with GQA.

Assumptions (what Mosaic accepts): block shapes equal the arrays' last two dims (``[H*BQ,
L+R]`` for q, ``[H*BQ, L]`` for o); page DMAs move whole pages ``[bs, L+R]`` into row offsets
that are multiples of ``bs``; the value is the lane slice ``[:, :L]`` (aligned when ``L % 128
== 0``: Kimi-Linear's 512); ``BQ`` powers of two; block tables in SMEM. Lowering for v5e and
v6e is checked on CPU (``tests/pallas_kernels/test_tpu_lowering.py``); nothing here has run on
a TPU or been tuned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.mla_absorb import _precision, absorbed_decode, absorbed_prefill
from pallas_kernels.attention.paging_tpu import (
    PagedBlocks,
    attend_tile,
    softmax_step,
)
from pallas_kernels.attention.tiles import token_rows, work_list


def _kernel(
    tseq_ref, tnq_ref, tpos_ref,  # SMEM i32[NT]: the work list (nq = 0: an empty tile)
    bt_ref,  # SMEM i32[S * max_blocks]
    q_ref,  # [H * BQ, L + R]  this tile's absorbed queries
    lat_hbm,  # HBM [NB, bs, L + R]
    o_ref,  # [H * BQ, L]
    buf,  # VMEM [2, BK, L + R]
    sems,  # DMA semaphores [1, 2]  (the one stream, slot)
    m_ref, l_ref,  # VMEM f32[H * BQ, 128]  (lane-broadcast running max / denominator)
    acc_ref,  # VMEM f32[H * BQ, L]
    *, bq: int, lora: int, pages_per_block: int, max_blocks: int, scale: float, precision,
):  # fmt: skip
    i = pl.program_id(0)
    seq, nq, pos0 = tseq_ref[i], tnq_ref[i], tpos_ref[i]
    ctx = pos0 + nq  # keys [0, ctx)
    pages = PagedBlocks(
        bt_ref, seq, ctx, ((lat_hbm, buf),), sems, pages_per_block=pages_per_block,
        max_blocks=max_blocks,
    )  # fmt: skip

    def attend_block(slot, ok, key_live):
        k = buf[slot]  # [BK, L + R]
        c = jnp.where(key_live, buf[slot, :, pl.ds(0, lora)], 0)  # [BK, L]
        softmax_step(q_ref[...], k, c, ok, m_ref, l_ref, acc_ref, at=..., scale=scale,
                     precision=precision)  # fmt: skip

    attend_tile(pages, nq, pos0, o_ref, m_ref, l_ref, acc_ref, bq=bq, heads=(...,),
                attend_block=attend_block)  # fmt: skip


def latent_attention(
    q_abs: jax.Array,  # [T, H, L + R]  absorbed queries, the cache's dtype
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    lora: int,
    scale: float,
    block_q: int = 8,
    block_q_decode: int = 1,
    kv_block_tokens: int = 256,
    max_q_len: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Causal latent attention of a ragged batch. Returns o_lat [T, H, L] (padding 0).

    ``max_q_len``: a static bound on every row's new tokens (``mla_decode`` passes 1); when
    the short tiles hold that many, the long launch is left out."""
    num_tokens, num_heads, width = q_abs.shape
    _, bs, _ = latent_cache.shape
    num_rows, max_blocks = block_tables.shape
    for name, v in (("block_q", block_q), ("block_q_decode", block_q_decode)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    if block_q_decode > block_q:
        raise ValueError(f"{block_q_decode=} must be at most {block_q=}")
    ppb = max(1, min(kv_block_tokens // bs, max_blocks))
    qsl = query_start_loc.astype(jnp.int32)
    lens = seq_lens.astype(jnp.int32)
    n = jnp.asarray(num_seqs, jnp.int32)
    q_len = qsl[1:] - qsl[:-1]  # [S]
    live_row = (jnp.arange(num_rows) < n) & (q_len > 0)
    is_short = q_len <= block_q_decode
    seq_id, local, live = token_rows(qsl, n, num_tokens)
    precision = _precision(latent_cache.dtype)

    launches = [(True, block_q_decode, min(num_rows, num_tokens))]
    cap_long = min(num_rows, num_tokens // (block_q_decode + 1)) + num_tokens // block_q
    if max_q_len is not None and max_q_len <= block_q_decode:
        cap_long = 0  # every row fits a short tile
    if cap_long > 0:
        launches.append((False, block_q, cap_long))
    o = jnp.zeros((num_tokens, num_heads, lora), jnp.float32)
    for short, bq, cap in launches:
        kind = live_row & (is_short if short else ~is_short)
        (tseq, tfirst, tnq, tpos), first_tile = work_list(q_len, lens, qsl, kind, bq=bq,
                                                          capacity=cap)  # fmt: skip
        # gather query tiles: [NT, BQ] tokens -> [NT, H * BQ, L + R], row h * BQ + t
        t_idx = tfirst[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]
        t_ok = jnp.arange(bq)[None, :] < tnq[:, None]
        qt = jnp.where(t_ok[..., None, None], q_abs[jnp.clip(t_idx, 0, num_tokens - 1)], 0)
        qt = qt.transpose(0, 2, 1, 3).reshape(cap, num_heads * bq, width)
        kernel = functools.partial(
            _kernel, bq=bq, lora=lora, pages_per_block=ppb, max_blocks=max_blocks, scale=scale,
            precision=precision,
        )  # fmt: skip
        rows = num_heads * bq
        ot = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4,
                grid=(cap,),
                in_specs=[
                    pl.BlockSpec((None, rows, width), lambda i, *_: (i, 0, 0)),
                    pl.BlockSpec(memory_space=pl.ANY),
                ],
                out_specs=pl.BlockSpec((None, rows, lora), lambda i, *_: (i, 0, 0)),
                scratch_shapes=[
                    pltpu.VMEM((2, ppb * bs, width), latent_cache.dtype),
                    pltpu.SemaphoreType.DMA((1, 2)),
                    pltpu.VMEM((rows, 128), jnp.float32),
                    pltpu.VMEM((rows, 128), jnp.float32),
                    pltpu.VMEM((rows, lora), jnp.float32),
                ],
            ),
            out_shape=jax.ShapeDtypeStruct((cap, rows, lora), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
            interpret=interpret,
            name="mla_latent_attention_tpu_" + ("short" if short else "long"),
        )(tseq, tnq, tpos, block_tables.astype(jnp.int32).reshape(-1), qt, latent_cache)
        # scatter back: token t -> tile first_tile[seq] + local // BQ, rows h * BQ + local % BQ
        tile = jnp.clip(first_tile[seq_id] + local // bq, 0, cap - 1)
        mine = (is_short[seq_id] if short else ~is_short[seq_id])[:, None, None]
        o = jnp.where(mine, ot.reshape(cap, num_heads, bq, lora)[tile, :, local % bq], o)
    return jnp.where(live[:, None, None], o, 0.0)


def mla_prefill(*args, interpret: bool | pltpu.InterpretParams = False, **kwargs) -> jax.Array:
    """``mla_prefill_reference``'s signature and result ([T, H, Dv]) on the Mosaic kernel.
    Tuning keywords (``block_q``, ``kv_block_tokens`` ...) go to :func:`latent_attention`."""
    tuning = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("nope_dim", "scale")}
    return absorbed_prefill(latent_attention, interpret=interpret, **tuning)(*args, **kwargs)


def mla_decode(*args, interpret: bool | pltpu.InterpretParams = False, **kwargs) -> jax.Array:
    """``mla_decode_reference``'s signature and result ([S, H, Dv]) on the Mosaic kernel."""
    tuning = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("nope_dim", "scale")}
    return absorbed_decode(latent_attention, interpret=interpret, **tuning)(*args, **kwargs)
