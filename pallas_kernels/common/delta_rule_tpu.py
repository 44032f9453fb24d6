"""What the GDN and KDA Mosaic TPU kernels share: launches, slot loads and stores, VMEM tricks.

The chunk step itself is :mod:`pallas_kernels.common.delta_rule`; the families
(:mod:`pallas_kernels.gdn.tpu`, :mod:`pallas_kernels.kda.tpu`) lay out their inputs, build the
gate-specific operands and call the helpers below.

The pool stores each state transposed, ``S^T``: ``[num_slots, H, Dv, Dk]`` (DESIGN.md §3; the
GPU decode's layout). A DMA copies bytes, so the VMEM state keeps the pool's layout too, and the
chunk and decode math (written on ``S [Dk, Dv]``) transposes a head's ``[Dv, Dk]`` tile where
it takes it and back where it leaves it (2-D f32 transposes, on the XLU): per chunk in the
prefill (:func:`for_each_head`), per row in the decode (:func:`decode_grid_step`).

Prefill: right-aligned chunks, the state in VMEM
------------------------------------------------
The wrapper cuts the ragged batch into chunks (:mod:`pallas_kernels.common.chunking`: a chunk
never straddles a sequence or a checkpoint offset) and gathers each into a right-aligned block
of ``C`` rows, head-major (``[H, NC, C, D]``), so every kernel block is a plain ``(C, D)``
tile. :func:`launch_prefill`::

    grid = (H // HB "parallel", NC "arbitrary")     state of HB heads: VMEM scratch f32

    chunk c of sequence s:   first[c]?  state <- pool[src[s]]  (DMA; zeros when src == 0)
                             state, o   <- chunk step, per head of the block
                             end[c] == ckpt_offsets[s, m]?  pool[ckpt_slots[s, m]] <- state
                             last[c]?   pool[dst[s]] <- state  (slot 0: nothing written)

Empty chunks (capacity padding) map their blocks to the last real chunk, so they cost one grid
step and no DMA.

A bfloat16 pool (``--state-dtype bfloat16``): a DMA copies bytes and converts nothing, so the
slot moves through a second VMEM block in the pool's dtype (:class:`StateScratch`'s ``stage``)
and is widened to the f32 state after the load and rounded into it before the stores; the
state in VMEM is rounded too after every ``ROUND_EVERY`` tokens of a row (as every op does,
:mod:`pallas_kernels.common.slots`). The math stays f32; an f32 pool has no stage and DMAs
straight to and from the state.

Decode: one token per row, one pass over the state
--------------------------------------------------
:func:`launch_decode`: grid = (H // HB "parallel", S "arbitrary"); the state block
``pool[src[s], heads]`` comes in through the pipeline (a data-dependent index map over
scalar-prefetched slots, so the next row's state streams in while this row computes); the new
state goes out by DMA to ``dst[s]`` and to every checkpoint slot whose offset is 1 (from the
stage, rounded, for a bf16 pool; the pipelined block is widened where it is read). All math is
on the VPU: with q, k (and KDA's gate) as columns ``[Dk, HB]`` (the wrapper transposes them;
they are 1/Dv of the traffic) ``S^T k`` is a sublane reduction and the rank-1 update a
broadcast product.

Assumptions (what Mosaic accepts, and what the scheduler guarantees)
--------------------------------------------------------------------
- Block shapes: every block's last two dims equal the array's (``(C, Dk)``, ``(1, C)``,
  ``(Dk, HB)``, ``(HB, Dv)``), so any head dims work; ``Dk, Dv`` multiples of 128 give
  unpadded tiles. f32 matmuls run at ``Precision.HIGHEST``.
- The prefill keeps ``HB * Dk * Dv * 4`` bytes of state in VMEM (default ``HB = H``: 2 MiB at
  Qwen3-Next-80B shapes; a bf16 pool's stage adds half of that) plus double-buffered input
  and output blocks.
- Slot hazards: a slot written in a launch (dst or checkpoint) is not the source of another
  row of the same launch (DESIGN.md §4, same-step rule). A row may read and write the same
  slot. All DMAs are waited inside their grid step.
- The chunk gather/scatter costs one extra pass over the inputs and o in XLA; a ragged DMA
  straight from ``[T, H, D]`` would remove it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common.chunking import ChunkPlan
from pallas_kernels.common.delta_rule import group_refs
from pallas_kernels.common.slots import ROUND_EVERY, StateSlots

# ----------------------------------------------------------------------------- in-kernel math


def iotas(n):
    """Row and column indices of an ``[n, n]`` tile."""
    return (
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 0),
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 1),
    )


def row_to_col(x):
    """``[1, n] -> [n, 1]`` with a masked lane reduction (no vector transpose needed)."""
    n = x.shape[1]
    i, j = iotas(n)
    return jnp.sum(jnp.where(i == j, jnp.broadcast_to(x, (n, n)), 0.0), axis=1, keepdims=True)


def decode_update(s, qc, kc, v, beta):
    """One token on a decayed state ``s [Dk, Dv]``: ``qc, kc [Dk, 1]`` columns, ``v [1, Dv]``,
    ``beta [1, 1]``. Returns ``(o [1, Dv], s)``."""
    pred = jnp.sum(s * kc, axis=0, keepdims=True)  # [1, Dv] = S^T k
    s = s + kc * (beta * (v - pred))
    return jnp.sum(s * qc, axis=0, keepdims=True), s


# ----------------------------------------------------------------------------- slots


def sync_copy(src_ref, dst_ref, sem, when=None):
    """A DMA started and waited in the same grid step (optionally under a condition)."""

    def copy():
        cp = pltpu.make_async_copy(src_ref, dst_ref, sem)
        cp.start()
        cp.wait()

    if when is None:
        copy()
    else:
        pl.when(when)(copy)


class PrefillPrefetch(NamedTuple):
    """The prefill kernels' scalar prefetch (SMEM): the chunk plan, then the slots."""

    c_seq: jax.Array  # i32[NC]  ChunkPlan.seq
    c_len: jax.Array  # i32[NC]
    c_end: jax.Array  # i32[NC]
    c_first: jax.Array  # i32[NC]
    c_last: jax.Array  # i32[NC]
    n_chunks: jax.Array  # i32[1]
    src: jax.Array  # i32[S]
    dst: jax.Array  # i32[S]
    ck_off: jax.Array  # i32[S * M]  StateSlots.flat()
    ck_slot: jax.Array  # i32[S * M]


class DecodePrefetch(NamedTuple):
    """The decode kernels' scalar prefetch (SMEM): ``StateSlots.flat()``."""

    src: jax.Array  # i32[S]
    dst: jax.Array  # i32[S]
    ck_off: jax.Array  # i32[S * M]
    ck_slot: jax.Array  # i32[S * M]
    num_seqs: jax.Array  # i32[1]


class StateScratch(NamedTuple):
    """A delta-rule kernel's scratch (``_launch`` groups the refs): the head block's state in
    VMEM, the DMA semaphore and, for a pool that is not f32, the stage every slot DMA goes
    through (a DMA converts nothing)."""

    state: Any  # VMEM f32[HB, Dv, Dk]  (S^T, the pool's layout)
    sem: Any  # DMA semaphore
    stage: Any | None  # VMEM [HB, Dv, Dk] in the pool's dtype; None for an f32 pool


def _load_state(src_ref, scr: StateScratch):
    """``scr.state <- src_ref`` (one slot's head block of the pool), widened to f32."""
    if scr.stage is None:
        sync_copy(src_ref, scr.state, scr.sem)
    else:
        sync_copy(src_ref, scr.stage, scr.sem)
        scr.state[...] = scr.stage[...].astype(jnp.float32)


def _store_state(p, scr: StateScratch, pool_out, heads, *, row, offset, write_dst):
    """``pool[ckpt_slots[row, m]] <- state`` where ``ckpt_offsets[row, m] == offset``, and
    ``pool[dst[row]] <- state`` where ``write_dst`` (``None``: always), rounded to the pool's
    dtype; slot 0 is never written."""
    max_ckpt = p.ck_off.shape[0] // p.src.shape[0]
    writes = []
    for m in range(max_ckpt):
        slot = p.ck_slot[row * max_ckpt + m]
        writes.append((slot, (slot > 0) & (p.ck_off[row * max_ckpt + m] == offset)))
    slot = p.dst[row]
    writes.append((slot, slot > 0 if write_dst is None else write_dst & (slot > 0)))
    src = scr.state
    if scr.stage is not None:
        src = scr.stage
        any_write = functools.reduce(jnp.logical_or, [ok for _, ok in writes])

        @pl.when(any_write)
        def _round():
            scr.stage[...] = scr.state[...].astype(scr.stage.dtype)

    for slot, ok in writes:
        sync_copy(src, pool_out.at[slot, heads], scr.sem, when=ok)


def prefill_grid_step(
    p: PrefillPrefetch,
    pool_in,  # ANY f32 | bf16[num_slots, H, Dv, Dk]
    pool_out,  # ANY, aliased to pool_in
    scr: StateScratch,
    compute: Callable,  # compute(h0, length): the chunk step of every head of the block
):
    """Grid step (head block, chunk ``c``) of a prefill kernel: the state in, the family's
    chunk step, the state out (see the module docstring)."""
    hb_idx, c = pl.program_id(0), pl.program_id(1)
    num_heads_blk = scr.state.shape[0]
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = c < p.n_chunks[0]
    seq = p.c_seq[c]

    @pl.when(live & (p.c_first[c] == 1))
    def _load_initial_state():
        slot = p.src[seq]

        @pl.when(slot > 0)
        def _():
            _load_state(pool_in.at[slot, heads], scr)

        @pl.when(slot == 0)
        def _():
            scr.state[...] = jnp.zeros_like(scr.state)

    @pl.when(live)
    def _compute():
        compute(h0, p.c_len[c])

    if scr.stage is not None:  # a bf16 pool: the carried state rounds every ROUND_EVERY tokens

        @pl.when(live & (p.c_end[c] % ROUND_EVERY == 0))
        def _round():
            scr.state[...] = scr.state[...].astype(scr.stage.dtype).astype(jnp.float32)

    @pl.when(live)
    def _write_states():
        _store_state(
            p, scr, pool_out, heads, row=seq, offset=p.c_end[c], write_dst=p.c_last[c] == 1
        )


def for_each_head(s_scr, o_ref, head: Callable):
    """``o, state = head(jh, state)`` for each head ``jh`` of the block (a loop, not unrolled:
    one chunk step's code), ``state [Dk, Dv]``; it stays in ``s_scr[jh]`` as ``S^T [Dv, Dk]``
    (the pool's layout), ``o`` goes to ``o_ref[jh, 0]``."""

    def body(jh, carry):
        o, s_new = head(jh, s_scr[jh].T)
        s_scr[jh] = s_new.T
        o_ref[jh, 0] = o.astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, s_scr.shape[0], body, 0)


def decode_grid_step(
    p: DecodePrefetch,
    s_in,  # [1, HB, Dv, Dk]  pool[src[r], heads], pipelined (the pool's dtype)
    o_ref,  # [1, 1, HB, Dv]
    pool_out,  # ANY, aliased to the pool that s_in is read from
    scr: StateScratch,
    head: Callable,  # head(h, j) -> (qc, kc [Dk, 1], v [1, Dv], beta [1, 1], decay)
):
    """Grid step (head block, row ``r``) of a decode kernel: for each head ``j`` of the block
    (``h`` in the layer), ``S = decay * S`` (``decay``: the family's ``exp(g)``, ``[1, 1]`` or
    a ``[Dk, 1]`` column), the delta-rule update, then the state to ``dst`` and to the
    checkpoints at offset 1. Padding rows write zeros to ``o`` and nothing else."""
    hb_idx, r = pl.program_id(0), pl.program_id(1)
    num_heads_blk = scr.state.shape[0]
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = r < p.num_seqs[0]
    has_src = p.src[r] > 0

    @pl.when(live)
    def _compute():
        for j in range(num_heads_blk):
            qc, kc, v, beta, decay = head(h0 + j, j)
            s_t = jnp.where(has_src, s_in[0, j].astype(jnp.float32), 0.0)  # [Dv, Dk]
            o, s = decode_update(s_t.T * decay, qc, kc, v, beta)  # on S [Dk, Dv]
            o_ref[0, 0, j : j + 1, :] = o.astype(o_ref.dtype)
            scr.state[j] = s.T
        _store_state(p, scr, pool_out, heads, row=r, offset=1, write_dst=None)

    @pl.when(~live)
    def _padding_row():
        o_ref[...] = jnp.zeros_like(o_ref)


# ----------------------------------------------------------------------------- launches


def _launch(
    kernel, prefetch, smem, blocks, state, out, *,
    grid, spec, state_spec, heads_per_block, name, interpret, params,
):  # fmt: skip
    """The ``pallas_call`` of both launches: the prefetch, the gate parameters in SMEM, the
    blocked inputs (``spec``), the pool (``state_spec``, aliased to the second output, which
    the kernel writes by DMA), and ``HB`` heads of state in VMEM (:class:`StateScratch`, the
    kernel's last argument)."""
    _, _, dv, dk = state.shape
    scratch = [
        pltpu.VMEM((heads_per_block, dv, dk), jnp.float32),
        pltpu.SemaphoreType.DMA(()),
    ]
    staged = state.dtype != jnp.float32
    if staged:
        scratch.append(pltpu.VMEM((heads_per_block, dv, dk), state.dtype))
    grouped = group_refs(kernel, type(prefetch), **params)

    def body(*refs):
        n = len(scratch)
        scr = StateScratch(*refs[-n:]) if staged else StateScratch(*refs[-n:], stage=None)
        return grouped(*refs[:-n], scr)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), *map(spec, blocks), state_spec],
        out_specs=[spec(out), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=scratch,
    )
    return pl.pallas_call(
        body,
        grid_spec=grid_spec,
        out_shape=[out, jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={len(prefetch) + 1 + len(blocks): 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(*prefetch, smem, *blocks, state)


def launch_prefill(
    kernel: Callable,  # kernel(PrefillPrefetch, smem, *blocks, pool_in, o, pool_out, scr)
    *,
    name: str,
    plan: ChunkPlan,
    slots: StateSlots,
    smem: jax.Array,  # f32[...]  the gate parameters, whole in SMEM
    blocks: Sequence[jax.Array],  # [H', NC, R, D] chunked inputs, H' a multiple of the blocks
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    out: jax.ShapeDtypeStruct,  # [H, NC, C, Dv]
    heads_per_block: int,
    interpret,
    **params,
) -> tuple[jax.Array, jax.Array]:
    """One ``pallas_call`` over grid ``(H // HB, NC)``; returns ``(o [H, NC, C, Dv], state)``.

    Grid step ``(h, c)`` sees block ``[H' // (H // HB), 1, R, D]`` of every input at
    ``(h, c)``, so a GVA key head block is ``HB / ratio`` heads."""
    num_blocks = state.shape[1] // heads_per_block

    def block_map(h, c, cs, cl, ce, cf, cla, nch, *_):
        return (h, jnp.minimum(c, jnp.maximum(nch[0] - 1, 0)), 0, 0)  # empty chunks: no DMA

    def spec(x):
        return pl.BlockSpec((x.shape[0] // num_blocks, 1, *x.shape[2:]), block_map)

    src, dst, ck_off, ck_slot, _ = slots.flat()
    prefetch = PrefillPrefetch(
        plan.seq, plan.length, plan.end, plan.first, plan.last, plan.num_chunks,
        src, dst, ck_off, ck_slot,
    )  # fmt: skip
    return _launch(
        kernel, prefetch, smem, blocks, state, out,
        grid=(num_blocks, out.shape[1]), spec=spec,
        state_spec=pl.BlockSpec(memory_space=pl.ANY),
        heads_per_block=heads_per_block, name=name, interpret=interpret, params=params,
    )  # fmt: skip


def launch_decode(
    kernel: Callable,  # kernel(DecodePrefetch, smem, *blocks, s_in, o, pool_out, scr)
    *,
    name: str,
    slots: StateSlots,
    smem: jax.Array,  # f32[...]  the gate parameters, whole in SMEM
    blocks: Sequence[jax.Array],  # [S, H // HB, R, D]  row r, head block h: block [R, D]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    out: jax.ShapeDtypeStruct,  # [S, H // HB, HB, Dv]
    interpret,
    **params,
) -> tuple[jax.Array, jax.Array]:
    """One ``pallas_call`` over grid ``(H // HB, S)``; returns ``(o [S, H // HB, HB, Dv],
    state)``. The kernel's ``s_in`` is ``pool[src[r], heads]`` through the pipeline."""
    rows, num_blocks, heads_per_block, _ = out.shape
    _, _, dv, dk = state.shape

    def row_map(h, r, *_):
        return (r, h, 0, 0)

    def state_map(h, r, src, dst, ck_off, ck_slot, n):
        # Padding rows and src 0 fetch slot 0 (never used): consecutive repeats are not refetched.
        return (jnp.where(r < n[0], src[r], 0), h, 0, 0)

    def spec(x):
        return pl.BlockSpec((1, 1, *x.shape[2:]), row_map)

    return _launch(
        kernel, DecodePrefetch(*slots.flat()), smem, blocks, state, out,
        grid=(num_blocks, rows), spec=spec,
        state_spec=pl.BlockSpec((1, heads_per_block, dv, dk), state_map),
        heads_per_block=heads_per_block, name=name, interpret=interpret, params=params,
    )  # fmt: skip


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` up to ``cap`` (the decode kernels' default head block)."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
