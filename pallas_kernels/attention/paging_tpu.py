"""What the two Mosaic paged-attention kernels share: the page DMAs and the online softmax.

Both kernels (:mod:`pallas_kernels.attention.tpu`, GQA; :mod:`pallas_kernels.attention.mla_tpu`,
MLA) attend one tile of queries to the keys ``[0, ctx)`` of one sequence, read from the paged
pools in blocks of ``BK = P * bs`` tokens. A kernel step is :func:`attend_tile`; the kernel
gives it the pools (:class:`PagedBlocks`, which moves the pages) and ``attend_block``, which
reads one block's keys and values from the buffer and calls :func:`softmax_step` per head::

    block kb, page p:  pool[block_tables[seq, kb * P + p]] -> buf[slot, p*bs:(p+1)*bs]
                       for every stream (GQA: k and v; MLA: the latent), a live page only
                       (kb * P + p < cdiv(ctx, bs): pages past the context are never fetched)

    start(0, slot 0)                             if n_kv > 0
    for kb in [0, n_kv):   slot = kb % 2
        start(kb + 1, slot 1 - slot)             if kb + 1 < n_kv: double buffering
        wait(kb, slot)
        attend_block(slot, ...)                  the kernel's math on buf[slot]

Rows of a buffer past ``ctx`` hold whatever was there (NaN under the interpreter): the kernel
masks them out of the scores and zeroes them in the values.

Mosaic: a page DMA moves a whole page ``[bs, W]`` (contiguous in HBM) to a row offset that is
a multiple of ``bs``; the block tables sit in SMEM; the running max and denominator are kept
lane-broadcast, ``[M, 128]``, so they are whole vregs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.tiles import cdiv

MASKED = -1e30  # finite: a row whose keys are all masked gets p = 0, never NaN


class PagedBlocks:
    """One sequence's KV pages, copied from HBM into a two-slot VMEM buffer a block at a time.

    ``streams``: ``(pool, buf)`` pairs, pool HBM ``[NB, bs, W]``, buf VMEM ``[2, P * bs, W]``
    (one per pool the kernel reads); stream ``s`` signals DMA semaphores ``sems[s, slot]``.
    Built at the top of the kernel: it reads nothing but computes the block counts."""

    def __init__(
        self,
        block_tables,  # SMEM i32[S * max_blocks]
        seq: jax.Array,  # i32[]  the sequence whose pages are read
        ctx: jax.Array,  # i32[]  keys [0, ctx)
        streams: tuple,  # ((HBM [NB, bs, W], VMEM [2, BK, W]), ...)
        sems,  # DMA semaphores [len(streams), 2]
        *,
        pages_per_block: int,
        max_blocks: int,
    ):
        self.block_tables, self.seq, self.streams, self.sems = block_tables, seq, streams, sems
        self.ctx = ctx
        self.pages_per_block, self.max_blocks = pages_per_block, max_blocks
        self.block_size = streams[0][0].shape[1]
        self.block_tokens = pages_per_block * self.block_size  # BK
        self.n_pages = cdiv(ctx, self.block_size)
        self.n_kv = cdiv(ctx, self.block_tokens)

    def _copies(self, kb, slot):
        """Block kb's page DMAs into ``slot``: ``(live, [one copy per stream])`` per page."""
        bs, ppb = self.block_size, self.pages_per_block
        out = []
        for p in range(ppb):
            idx = kb * ppb + p
            # past the table's end only for a dead page (never copied): clamp the SMEM read
            page = self.block_tables[
                self.seq * self.max_blocks + jnp.minimum(idx, self.max_blocks - 1)
            ]
            dst = pl.ds(p * bs, bs)
            copies = [
                pltpu.make_async_copy(pool.at[page], buf.at[slot, dst], self.sems.at[s, slot])
                for s, (pool, buf) in enumerate(self.streams)
            ]
            out.append((idx < self.n_pages, copies))
        return out

    def _on_live_pages(self, kb, slot, op: Callable) -> None:
        for live, copies in self._copies(kb, slot):

            @pl.when(live)
            def _(copies=copies):
                for copy in copies:
                    op(copy)

    def start(self, kb, slot) -> None:
        """Starts block kb's page DMAs into ``slot``."""
        self._on_live_pages(kb, slot, lambda copy: copy.start())

    def wait(self, kb, slot) -> None:
        """Waits for block kb's page DMAs into ``slot``."""
        self._on_live_pages(kb, slot, lambda copy: copy.wait())

    def run(self, attend: Callable[[jax.Array, jax.Array], None]) -> None:
        """``attend(kb, slot)`` for every block ``kb`` of keys, its pages in ``buf[slot]``; the
        next block's DMAs run meanwhile."""

        @pl.when(self.n_kv > 0)
        def _():
            self.start(0, 0)

        def body(kb, carry):
            slot = jax.lax.rem(kb, 2)

            @pl.when(kb + 1 < self.n_kv)
            def _():
                self.start(kb + 1, 1 - slot)

            self.wait(kb, slot)
            attend(kb, slot)
            return carry

        jax.lax.fori_loop(0, self.n_kv, body, 0)


def softmax_init(m_ref, l_ref, acc_ref) -> None:
    """Empties the running softmax: max ``MASKED``, denominator and accumulator 0."""
    m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def softmax_step(
    q: jax.Array,  # [M, K]  queries
    k: jax.Array,  # [BK, K]  this block's keys
    v: jax.Array,  # [BK, W]  its values, rows past the context zeroed
    ok: jax.Array,  # bool[M, BK]  which (query, key) pairs attend
    m_ref,
    l_ref,  # VMEM f32[..., M, 128]  running max / denominator, lane-broadcast
    acc_ref,  # VMEM f32[..., M, W]  unnormalised output
    *,
    at,  # the refs' index of these rows (a kv head; ``...`` for all)
    scale: float,
    precision=None,
) -> None:
    """Adds one key block to the online softmax of rows ``at``; updates the three refs."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [M, BK]
    s = jnp.where(ok, s * scale, MASKED)
    m_prev = m_ref[at]  # [M, 128]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
    l_ref[at] = l_ref[at] * alpha + jnp.sum(p, axis=1, keepdims=True)
    m_ref[at] = m_new
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )  # [M, W]
    acc_ref[at] = acc_ref[at] * alpha[:, :1] + pv


def softmax_finish(o_ref, l_ref, acc_ref, *, at) -> None:
    """``o[at] = acc / l`` (rows that saw no key, l = 0, stay 0)."""
    l = l_ref[at][:, :1]
    o_ref[at] = (acc_ref[at] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def attend_tile(
    pages: PagedBlocks,  # the tile's sequence, keys [0, pages.ctx)
    nq: jax.Array,  # i32[]  query tokens in the tile (0: a padding tile)
    pos0: jax.Array,  # i32[]  position of its first token
    o_ref,  # [..., M, W]  out
    m_ref,
    l_ref,  # VMEM f32[..., M, 128]
    acc_ref,  # VMEM f32[..., M, W]
    *,
    bq: int,
    heads: tuple,  # the refs' index of each group of rows: kv heads, or (...,)
    attend_block: Callable,  # (slot, ok bool[M, BK], key_live bool[BK, W]) -> None
) -> None:
    """The body of a kernel step: causal attention of one query tile (rows ``g * BQ + t``:
    token ``t`` of the tile, ``g`` a head of the group) to its sequence's pages.

    ``attend_block`` reads block ``slot``'s keys and values and calls :func:`softmax_step` for
    each of ``heads``; ``ok`` masks pairs past the causal bound or of padding tokens,
    ``key_live`` the buffer rows past the context (NaN possible: zero the values)."""
    rows, width = acc_ref.shape[-2:]
    bk = pages.block_tokens

    @pl.when(nq == 0)  # capacity padding: nothing to attend (the wrapper drops these rows)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(nq > 0)
    def _():
        softmax_init(m_ref, l_ref, acc_ref)
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        tok = jnp.bitwise_and(row, bq - 1)  # rows are g * BQ + t (BQ a power of two)
        q_pos = pos0 + tok

        def attend(kb, slot):
            k_pos = kb * bk + col  # [M, BK]
            ok = (k_pos <= q_pos) & (tok < nq)
            key_live = (kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, width), 0)) < pages.ctx
            attend_block(slot, ok, key_live)

        pages.run(attend)
        for at in heads:
            softmax_finish(o_ref, l_ref, acc_ref, at=at)
