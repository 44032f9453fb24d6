"""Ragged paged attention for TPU (Mosaic), decode and prefill mixed, on hyjax's KV layout.

Same signature and semantics as :mod:`pallas_kernels.attention.reference`; ``interpret`` is
passed to ``pallas_call`` (``pltpu.InterpretParams()`` runs the kernel on CPU, which is how CI
tests it).

Why not the kernel JAX ships: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` wants
K and V interleaved in one ``[pages, page_size, 2 * Hkv, D]`` array (hyjax keeps ``k`` and ``v``
pools ``[NB, bs, Hkv, D]``, one spec for every attention kind in :mod:`hyjax.cache`), it takes
no ``interpret`` argument, and under the TPU interpreter (JAX 0.10.2) it fails on a ref reshape
(``'ReshapeTransform' object has no attribute 'indices'``), so CI could never check it.

Layout and grid
---------------
The wrapper cuts every sequence's new tokens into tiles of ``BQ`` tokens (a work list in SMEM:
sequence, tokens in tile, position of its first token) and gathers the query tile head-major,
``[NT, Hkv, G * BQ, D]``, row ``g * BQ + t`` = token ``t``, query head ``h * G + g``::

    grid = (NT,)        one tile per step, all kv heads (a page DMA brings every head at once)

    tile i of sequence s:   keys [0, pos0 + nq) in blocks of BK = P * bs tokens
      block kb:  P page DMAs  k_cache[block_tables[s, kb*P + p]] -> kbuf[slot, p*bs:(p+1)*bs]
                 (the next block's DMAs start before this block's math: double buffering)
      per kv head h (static):  k = kbuf[slot, :, h*D:(h+1)*D]       [BK, D], a lane slice
                 online softmax of q[h] k^T (causal, keys past the context masked), acc += p v
    o[i] = acc / l   ->  the wrapper scatters tile rows back to [T, Hq, D]

Pages past a sequence's context are not fetched; whatever the buffer holds there (NaN under
the interpreter) is masked out of the scores and zeroed in ``v`` before ``p @ v``.

The page DMAs, the double-buffered block loop and the online-softmax step are
:mod:`pallas_kernels.attention.paging_tpu`'s, shared with the MLA kernel
(:mod:`pallas_kernels.attention.mla_tpu`); this module holds the GQA layout around them.

Assumptions (what Mosaic accepts)
---------------------------------
- Every block's last two dims equal the array's (``[G*BQ, D]`` for q/o), page DMAs move whole
  pages ``[bs, Hkv*D]`` (contiguous in HBM) into row offsets that are multiples of ``bs``
  (``bs`` a multiple of 16 keeps them on bf16 tiles). Per-head slices of a page are lane
  slices at multiples of ``D``: free when ``D % 128 == 0`` (Qwen3-Next: 256).
- ``BQ`` is a power of two (a row's token is ``row & (BQ - 1)``: no vector division).
- The block tables sit in SMEM (``S * max_blocks`` int32), as in JAX's shipped kernel.
- Nothing here is tuned or has run on a TPU yet; a lowering test checks that it lowers for
  ``tpu`` (Pallas -> Mosaic MLIR) from this CPU machine.
- Known costs: a decode tile uses 1 of its ``BQ`` token rows (the MXU has room: decode is
  bandwidth bound); the next tile's first KV block is not prefetched during this tile (one DMA
  latency per tile); padding tiles (``nq = 0``) still move their q/o blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.paging_tpu import (
    PagedBlocks,
    attend_tile,
    softmax_step,
)
from pallas_kernels.attention.reference import check_attention_args
from pallas_kernels.attention.tiles import token_rows, work_list


def _kernel(
    tseq_ref, tnq_ref, tpos_ref,  # SMEM i32[NT]: the work list (nq = 0: an empty tile)
    bt_ref,  # SMEM i32[S * max_blocks]
    q_ref,  # [Hkv, G * BQ, D]  this tile's queries
    k_hbm, v_hbm,  # HBM [NB, bs, Hkv * D]
    o_ref,  # [Hkv, G * BQ, D]
    kbuf, vbuf,  # VMEM [2, BK, Hkv * D]
    sems,  # DMA semaphores [2, 2]  (k/v, slot)
    m_ref, l_ref,  # VMEM f32[Hkv, G * BQ, 128]  (lane-broadcast running max / denominator)
    acc_ref,  # VMEM f32[Hkv, G * BQ, D]
    *, bq: int, pages_per_block: int, max_blocks: int, scale: float,
):  # fmt: skip
    i = pl.program_id(0)
    seq, nq, pos0 = tseq_ref[i], tnq_ref[i], tpos_ref[i]
    num_kv_heads, _, d = q_ref.shape
    ctx = pos0 + nq  # keys [0, ctx)
    pages = PagedBlocks(
        bt_ref, seq, ctx, ((k_hbm, kbuf), (v_hbm, vbuf)), sems,
        pages_per_block=pages_per_block, max_blocks=max_blocks,
    )  # fmt: skip

    def attend_block(slot, ok, key_live):
        for h in range(num_kv_heads):
            k = kbuf[slot, :, pl.ds(h * d, d)]  # [BK, D]
            v = jnp.where(key_live, vbuf[slot, :, pl.ds(h * d, d)], 0)
            softmax_step(q_ref[h], k, v, ok, m_ref, l_ref, acc_ref, at=h, scale=scale)

    attend_tile(pages, nq, pos0, o_ref, m_ref, l_ref, acc_ref, bq=bq,
                heads=tuple(range(num_kv_heads)), attend_block=attend_block)  # fmt: skip


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
    block_q: int = 8,
    kv_block_tokens: int = 256,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Causal GQA attention of every query token over its sequence's paged KV. [T, Hq, D]."""
    check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_tokens, num_q_heads, d = q.shape
    num_blocks, bs, num_kv_heads, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    if block_q <= 0 or block_q & (block_q - 1):
        raise ValueError(f"{block_q=} must be a power of two")
    group = num_q_heads // num_kv_heads
    bq = block_q
    ppb = max(1, min(kv_block_tokens // bs, max_blocks))
    # tiles: T // BQ full ones plus at most one partial per sequence, and never more than T
    capacity = min(num_tokens, num_rows + num_tokens // bq)
    qsl = query_start_loc.astype(jnp.int32)
    n = jnp.asarray(num_seqs, jnp.int32)
    q_len = qsl[1:] - qsl[:-1]  # [S]
    live_row = jnp.arange(num_rows) < n
    (tseq, tfirst, tnq, tpos), first_tile = work_list(
        q_len, seq_lens.astype(jnp.int32), qsl, live_row, bq=bq, capacity=capacity
    )

    # gather query tiles: [NT, BQ] tokens -> [NT, Hkv, G * BQ, D], row g * BQ + t
    t_idx = tfirst[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]
    t_ok = jnp.arange(bq)[None, :] < tnq[:, None]
    qt = jnp.where(t_ok[..., None, None], q[jnp.clip(t_idx, 0, num_tokens - 1)], 0)
    qt = qt.reshape(capacity, bq, num_kv_heads, group, d).transpose(0, 2, 3, 1, 4)
    qt = qt.reshape(capacity, num_kv_heads, group * bq, d)

    kernel = functools.partial(
        _kernel, bq=bq, pages_per_block=ppb, max_blocks=max_blocks, scale=scale
    )
    tile_spec = pl.BlockSpec((None, num_kv_heads, group * bq, d), lambda i, *_: (i, 0, 0, 0))
    kv_flat = (num_blocks, bs, num_kv_heads * d)
    ot = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(capacity,),
            in_specs=[
                tile_spec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb * bs, num_kv_heads * d), k_cache.dtype),
                pltpu.VMEM((2, ppb * bs, num_kv_heads * d), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((num_kv_heads, group * bq, 128), jnp.float32),
                pltpu.VMEM((num_kv_heads, group * bq, 128), jnp.float32),
                pltpu.VMEM((num_kv_heads, group * bq, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        tseq, tnq, tpos, block_tables.astype(jnp.int32).reshape(-1),
        qt, k_cache.reshape(kv_flat), v_cache.reshape(kv_flat),
    )  # fmt: skip

    # scatter back: token t -> tile first_tile[seq] + local // BQ, row g * BQ + local % BQ
    seq_id, local, live = token_rows(qsl, n, num_tokens)
    tile = jnp.clip(first_tile[seq_id] + local // bq, 0, capacity - 1)
    o = ot.reshape(capacity, num_kv_heads, group, bq, d)[tile, :, :, local % bq]  # [T,Hkv,G,D]
    o = o.reshape(num_tokens, num_q_heads, d)
    return jnp.where(live[:, None, None], o, 0).astype(q.dtype)
