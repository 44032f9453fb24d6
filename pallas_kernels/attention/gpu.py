"""Ragged paged attention for NVIDIA GPUs in Pallas (Triton lowering), decode and prefill mixed.

Same signature and semantics as the reference (:mod:`pallas_kernels.attention.reference`)
(plus tuning keywords). One call covers the whole ragged batch; inside it two launches of one
kernel body, each over its own work list of query tiles (:mod:`pallas_kernels.attention.tiles`):

- *short* rows (``q_len <= BQs``: decode, a few speculative tokens): ``BQs * Gp = 16`` query
  rows per program, the smallest tile ``tl.dot`` takes, so a decode row costs one K/V pass;
- *long* rows (prefill chunks): ``BQl * Gp = 128`` query rows per program (``rows_prefill``).

Query layout: the wrapper regroups ``q [T, Hq, D]`` kv-head-major, ``[Hkv, T, Gp, D]`` (``Gp`` =
the GQA group padded to a power of two), so a tile of ``BQ`` tokens of one kv head is ``BQ * Gp``
contiguous rows and a program reads each K/V row once for its whole group::

    work item (tile i, kv head h, split j):
      tokens  q0 .. q0+nq-1 of one sequence, positions pos0 .. pos0+nq-1
      keys    [0, pos0+nq) cut in BK-token blocks; split j takes its share of the blocks
      key p -> block_tables[seq, p // bs], offset p % bs -> row (page*bs + off)*Hkv + h of
               k_cache viewed as [NB*bs*Hkv, D] (a gathered load; masked past the context, so
               unused pages are never read)
      out     rows [i*M, (i+1)*M) of this launch's partials; the wrapper gathers them back
              to [T, Hq, D]

``decode_only=True`` (the engine's decode buckets) skips all of this: one tile per row, q
gathered and the output scattered in the kernel, splits merged by a second small kernel.

Flash-decoding: each split writes an unnormalised partial ``(o, m, l)`` in float32; the wrapper
merges the splits with their log-sum-exp weights. Splits are chosen so that a launch has about
``target_programs`` programs (occupancy for a few long decode rows), at most
``max_splits_prefill`` for prefill tiles (their partials cost ``capacity * rows * D``);
programs whose share is empty exit at once. Everything around the kernels is loop-free (an
XLA ``while`` on GPU costs a host round trip per trip; a test checks the lowered module).

The split loop over the pages, the two launches and the merge are
:mod:`pallas_kernels.attention.paging_gpu`'s, shared with MLA
(:mod:`pallas_kernels.attention.mla_gpu`); this module holds how GQA reads K and V, its query
layout and the decode-only path.

Requirements: ``D`` a power of two (Triton ``arange``; :func:`unsupported_reason`); element
offsets of one layer's cache below 2**31 (Triton's 32-bit pointer arithmetic). Tuning
defaults: the H200 sweep in BENCHMARKS.md (D = 256).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.attention.paging_gpu import (
    MASKED,
    Launch,
    attend_split,
    mm,
    split_launches,
    store_partial,
)
from pallas_kernels.attention.reference import check_attention_args
from pallas_kernels.attention.tiles import (
    cdiv,
    merge_splits,
    next_pow2,
    normalise_split,
    split_count,
)

# The narrowest head dim the kernel takes (one Triton tile holds a head; narrower ones would
# run as FMA loops never compiled on a GPU).
MIN_HEAD_DIM = 8


def unsupported_reason(head_dim: int) -> str | None:
    """Why the kernel cannot take this head dim, or None (``hyjax.ops`` then uses the
    reference op for the model)."""
    if head_dim & (head_dim - 1) or head_dim < MIN_HEAD_DIM:
        return f"head dim {head_dim} is not a power of two >= {MIN_HEAD_DIM} (a Triton tile)"
    return None


# ----------------------------------------------------------------------------- kernel


def _attend_split(
    q, q_pos, ctx, j, seq, h, bt_ref, k_ref, v_ref,
    *, block_k: int, block_size: int, max_blocks: int, num_kv_heads: int, splits: int,
    scale: float,
):  # fmt: skip
    """Online softmax of ``q`` [M, D] (positions ``q_pos`` [M]) over split ``j`` of the keys
    ``[0, ctx)`` of sequence ``seq``, kv head ``h``
    (:func:`pallas_kernels.attention.paging_gpu.attend_split`; K and V rows are gathered
    [BK, D] loads, masked past the context). Returns the unnormalised float32 partial
    ``(o [M, D], m [M], l [M])``."""
    d = q.shape[1]
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]

    def read_block(slot, k_ok):
        kv_row = slot * num_kv_heads + h  # [BK]  rows of the cache as [NB * bs * Hkv, D]
        k_mask = k_ok[:, None] & (cols >= 0)  # [BK, D]
        k = pltr.load(k_ref.at[kv_row[:, None], cols], mask=k_mask, other=0.0)  # [BK, D]
        v = pltr.load(v_ref.at[kv_row[:, None], cols], mask=k_mask, other=0.0)
        return mm(q, k, ((1,), (1,))) * scale, v  # [M, BK], [BK, D]

    return attend_split(
        q_pos, ctx, j, seq, bt_ref, read_block, width=d, block_k=block_k, block_size=block_size,
        max_blocks=max_blocks, splits=splits,
    )  # fmt: skip


def _kernel(
    tseq_ref, tq0_ref, tnq_ref, tpos_ref,  # i32[NT] each: the work list (nq = 0: empty tile)
    bt_ref,  # i32[S * max_blocks]  block tables, flattened
    q_ref,  # [Hkv, Tp * Gp, D]
    k_ref, v_ref,  # [NB * bs * Hkv, D]
    o_ref,  # f32[splits, Hkv, NT * M, D]  rows of tile i: [i * M, (i + 1) * M)
    m_ref, l_ref,  # f32[splits, Hkv, NT * M]
    *, bq: int, gp: int, group: int, block_k: int, block_size: int, max_blocks: int,
    num_kv_heads: int, splits: int, scale: float,
):  # fmt: skip
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = bq * gp
    seq, q0, nq, pos0 = tseq_ref[i], tq0_ref[i], tnq_ref[i], tpos_ref[i]

    r = jnp.arange(rows, dtype=jnp.int32)
    tok = r // gp
    row_ok = (tok < nq) & (r % gp < group)  # [M]
    q_pos = pos0 + tok  # [M]
    q = pltr.load(q_ref.at[h, pl.ds(q0 * gp, rows), :], mask=row_ok[:, None], other=0.0)

    ctx = pos0 + nq  # keys [0, ctx)
    partial = _attend_split(
        q, q_pos, ctx, j, seq, h, bt_ref, k_ref, v_ref, block_k=block_k, block_size=block_size,
        max_blocks=max_blocks, num_kv_heads=num_kv_heads, splits=splits, scale=scale,
    )  # fmt: skip
    store_partial(o_ref, m_ref, l_ref, j, h, i, partial, row_ok)


# ----------------------------------------------------------------------------- decode-only


def _token_rows(t0, count, h, *, bq: int, gp: int, group: int, num_q_heads: int, spare):
    """Rows of ``[T * Hq, D]`` of tokens ``t0 .. t0 + count - 1`` (at most ``bq``), head group
    ``h``, in tile order (row ``r``: token ``r // gp``, head ``h * group + r % gp``).

    Returns ``(index [M], ok [M])``. Masked rows point at ``spare + r``: on a GPU they are never
    touched, but the interpreter turns a masked scatter into "write back what was read", and a
    masked lane aliasing a real one would race with it (the interpreted output has ``M`` spare
    rows past the end; on a GPU ``spare`` is 0)."""
    r = jnp.arange(bq * gp, dtype=jnp.int32)
    tok, g = r // gp, r % gp
    ok = (tok < count) & (g < group)
    return jnp.where(ok, (t0 + tok) * num_q_heads + h * group + g, spare + r), ok


def _decode_row(qsl_ref, lens_ref, n_ref, i, bq: int):
    """Row ``i`` as a tile: ``(first token, tokens, first position, q_len, live)``; ``tokens``
    is 0 unless the row is live (``i < num_seqs``, ``0 < q_len <= bq``)."""
    q0, q_len = qsl_ref[i], qsl_ref[i + 1] - qsl_ref[i]
    live = (i < n_ref[0]) & (q_len > 0)
    fits = live & (q_len <= bq)
    nq = jnp.where(fits, q_len, 0)
    pos0 = jnp.where(fits, lens_ref[i] - q_len, 0)
    return q0, nq, pos0, q_len, live


def _decode_kernel(
    qsl_ref,  # i32[S + 1]
    lens_ref,  # i32[S]
    n_ref,  # i32[1]  num_seqs
    bt_ref,  # i32[S * max_blocks]  block tables, flattened
    q_ref,  # [T * Hq, D]
    k_ref, v_ref,  # [NB * bs * Hkv, D]
    out_ref,  # [T * Hq (+ M interpreted), D]  splits == 1: the output; else zeros only
    *part_refs,  # splits > 1: f32[splits * Hkv * S * M, D], f32[...M] twice: (o, m, l)
    bq: int, gp: int, group: int, block_k: int, block_size: int, max_blocks: int,
    num_kv_heads: int, num_tokens: int, splits: int, scale: float, spare: int,
):  # fmt: skip
    """Program ``(i, h, j)``: row ``i`` of the batch (one tile), kv head ``h``, KV split ``j``.

    Split 0 also writes the zeros the reference's contract asks for: padding tokens (past
    ``query_start_loc[num_seqs]``, dealt out over the rows' programs) and the tokens of a row
    too long for one tile."""
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = lens_ref.shape[0]
    rows, d = bq * gp, q_ref.shape[-1]
    num_q_heads = num_kv_heads * group
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]
    q0, nq, pos0, q_len, live = _decode_row(qsl_ref, lens_ref, n_ref, i, bq)
    rows_of = functools.partial(
        _token_rows, h=h, bq=bq, gp=gp, group=group, num_q_heads=num_q_heads, spare=spare
    )
    zeros = jnp.zeros((rows, d), out_ref.dtype)

    def zero_chunk(t0, count):
        idx, ok = rows_of(t0, count)
        pltr.store(out_ref.at[idx[:, None], cols], zeros, mask=ok[:, None] & (cols >= 0))

    # padding tokens [qsl[num_seqs], T) in chunks of bq tokens: chunk c goes to row c % S
    pad0 = qsl_ref[jnp.minimum(n_ref[0], num_rows)]
    pad_chunks = cdiv(jnp.maximum(num_tokens - pad0, 0), bq)
    mine = jnp.where(j == 0, cdiv(jnp.maximum(pad_chunks - i, 0), num_rows), 0)

    def zero_pad(c, carry):
        t0 = pad0 + (i + c * num_rows) * bq
        zero_chunk(t0, jnp.minimum(bq, num_tokens - t0))
        return carry

    jax.lax.fori_loop(0, mine, zero_pad, 0)
    too_long = jnp.where((j == 0) & live & (q_len > bq), cdiv(q_len, bq), 0)

    def zero_row(c, carry):
        zero_chunk(q0 + c * bq, jnp.minimum(bq, q_len - c * bq))
        return carry

    jax.lax.fori_loop(0, too_long, zero_row, 0)

    idx, row_ok = rows_of(q0, nq)  # [M] each
    tok = jnp.arange(rows, dtype=jnp.int32) // gp
    q_pos = pos0 + tok  # [M]
    mask = row_ok[:, None] & (cols >= 0)  # [M, D]
    q = pltr.load(q_ref.at[jnp.where(row_ok, idx, 0)[:, None], cols], mask=mask, other=0.0)

    ctx = pos0 + nq  # keys [0, ctx)
    o, m, l = _attend_split(
        q, q_pos, ctx, j, i, h, bt_ref, k_ref, v_ref, block_k=block_k, block_size=block_size,
        max_blocks=max_blocks, num_kv_heads=num_kv_heads, splits=splits, scale=scale,
    )  # fmt: skip
    if splits == 1:  # normalise and write the output rows: no partials, no merge
        out = normalise_split(o, l).astype(out_ref.dtype)
        pltr.store(out_ref.at[idx[:, None], cols], out, mask=mask)
    else:  # partial rows ((j * Hkv + h) * S + i) * M + r
        po_ref, pm_ref, pl_ref = part_refs
        at = pl.ds(((j * num_kv_heads + h) * num_rows + i) * rows, rows)
        pltr.store(po_ref.at[at, :], o, mask=mask)
        pltr.store(pm_ref.at[at], m, mask=row_ok)
        pltr.store(pl_ref.at[at], l, mask=row_ok)


def _decode_merge_kernel(
    qsl_ref,  # i32[S + 1]
    lens_ref,  # i32[S]
    n_ref,  # i32[1]
    po_ref,  # f32[splits * Hkv * S * M, D]
    pm_ref, pl_ref,  # f32[splits * Hkv * S * M]
    _out_in,  # [T * Hq (+ 1 interpreted), D]  aliased with out_ref
    out_ref,
    *, bq: int, gp: int, group: int, num_kv_heads: int, splits: int, cols: int, spare: int,
):  # fmt: skip
    """Program ``(i, x, c)``: row ``i``, kv head ``x // (bq * group)``, query row
    ``x % (bq * group)`` of its tile, output columns ``[c * cols, (c + 1) * cols)``: the
    log-sum-exp merge of its ``splits`` partials, written to ``[T * Hq, D]``."""
    i, x, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = lens_ref.shape[0]
    rows = bq * gp
    h, rr = x // (bq * group), x % (bq * group)
    tok, g = rr // group, rr % group
    q0, nq, _, _, _ = _decode_row(qsl_ref, lens_ref, n_ref, i, bq)
    ok = tok < nq
    s = jnp.arange(splits, dtype=jnp.int32)
    prow = ((s * num_kv_heads + h) * num_rows + i) * rows + tok * gp + g  # [splits]
    prow = jnp.where(ok, prow, 0)
    cc = c * cols + jnp.arange(cols, dtype=jnp.int32)
    m = pltr.load(pm_ref.at[prow], mask=ok & (s >= 0), other=MASKED)
    l = pltr.load(pl_ref.at[prow], mask=ok & (s >= 0), other=0.0)
    mask = ok & (s[:, None] >= 0) & (cc[None, :] >= 0)  # [splits, cols]
    o = pltr.load(po_ref.at[prow[:, None], cc[None, :]], mask=mask, other=0.0)
    out = merge_splits(o, m, l).astype(out_ref.dtype)  # [cols]
    row = jnp.where(ok, (q0 + tok) * num_kv_heads * group + h * group + g, spare)
    pltr.store(out_ref.at[row, pl.ds(c * cols, cols)], out, mask=ok & (cc >= 0))


def _decode_attention(
    q, k_cache, v_cache, qsl, lens, block_tables, num_seqs, *, scale, block_k, target_programs,
    num_warps, num_stages, interpret,
) -> jax.Array:  # fmt: skip
    """``decode_only``: row i is tile i, everything computed in one or two Pallas kernels.

    No XLA op runs around them but free reshapes: the tiles come from ``query_start_loc`` and
    ``seq_lens`` inside the kernel, q is gathered from ``[T, Hq, D]`` and the output scattered
    back into it (the general path's dozen small XLA kernels around its launch cost ~5 us a call
    on an H100). One split: the kernel writes normalised rows. Several: float32 partials and a
    small merge kernel, one program per (row, head, query row, column chunk)."""
    num_tokens, num_q_heads, d = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    gp = next_pow2(group)
    bq = max(1, 16 // gp)
    rows = bq * gp
    splits = split_count(num_rows * num_kv_heads, cdiv(max_blocks * block_size, block_k),
                         target_programs)  # fmt: skip
    spare = num_tokens * num_q_heads if interpret else 0
    out_rows = num_tokens * num_q_heads + (rows if interpret else 0)
    ints = (
        qsl.astype(jnp.int32),
        lens.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
    )
    kernel = functools.partial(
        _decode_kernel, bq=bq, gp=gp, group=group, block_k=block_k, block_size=block_size,
        max_blocks=max_blocks, num_kv_heads=num_kv_heads, num_tokens=num_tokens,
        splits=splits, scale=scale, spare=spare,
    )  # fmt: skip
    part = splits * num_kv_heads * num_rows * rows
    out_shape = [jax.ShapeDtypeStruct((out_rows, d), q.dtype)]
    if splits > 1:
        out_shape += [
            jax.ShapeDtypeStruct((part, d), jnp.float32),
            jax.ShapeDtypeStruct((part,), jnp.float32),
            jax.ShapeDtypeStruct((part,), jnp.float32),
        ]
    res = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(
        *ints,
        block_tables.astype(jnp.int32).reshape(-1),
        q.reshape(num_tokens * num_q_heads, d),
        k_cache.reshape(num_blocks * block_size * num_kv_heads, d),
        v_cache.reshape(num_blocks * block_size * num_kv_heads, d),
    )
    out = res[0]
    if splits > 1:
        cols = min(d, max(16, 4096 // splits))  # a program reads [splits, cols] floats at once
        merge = functools.partial(
            _decode_merge_kernel, bq=bq, gp=gp, group=group, num_kv_heads=num_kv_heads,
            splits=splits, cols=cols, spare=spare,
        )  # fmt: skip
        out = pl.pallas_call(
            merge,
            grid=(num_rows, num_kv_heads * bq * group, d // cols),
            out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
            input_output_aliases={6: 0},
            compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret,
            name="ragged_paged_attention_decode_merge",
        )(*ints, *res[1:], out)
    if interpret:
        out = out[: num_tokens * num_q_heads]
    return out.reshape(num_tokens, num_q_heads, d)


# ----------------------------------------------------------------------------- work lists


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
    block_k_decode: int = 64,
    block_k_prefill: int = 64,
    rows_prefill: int = 128,
    target_programs: int = 256,
    max_splits_prefill: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    num_warps_prefill: int = 8,
    num_stages_prefill: int = 3,
    decode_only: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Causal GQA attention of every query token over its sequence's paged KV. [T, Hq, D].

    ``decode_only`` (static): the caller knows every row has at most ``16 // Gp`` tokens (a
    decode step, or one draft token with Gp = 8), so row i is tile i and the call is one kernel
    (two when KV is split) with no XLA op around it (:func:`_decode_attention`; over 64 keys
    12.6 us a call on an H100 against 17.4 us with the general path's regroup, work list, merge
    and scatter, BENCHMARKS.md). A longer row comes back as zeros.
    """
    check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_tokens, num_q_heads, d = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    if d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two for the Triton kernel")
    if k_cache.size >= 2**31:
        raise ValueError(
            f"k_cache {k_cache.shape} has {k_cache.size} >= 2**31 elements: the Triton kernel's "
            "32-bit offsets would wrap; use fewer blocks per layer (or shard the kv heads)"
        )
    if decode_only:
        return _decode_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
            scale=scale, block_k=block_k_decode, target_programs=target_programs,
            num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )  # fmt: skip
    group = num_q_heads // num_kv_heads
    gp = next_pow2(group)
    bq_short = max(1, 16 // gp)
    bq_long = max(bq_short, rows_prefill // gp)
    t_pad = num_tokens + bq_long  # a tile's row window never runs past the array

    # [T, Hq, D] -> [Hkv, Tp * Gp, D]: the rows of one kv head's group are contiguous.
    qg = q.reshape(num_tokens, num_kv_heads, group, d)
    qg = jnp.pad(qg, ((0, t_pad - num_tokens), (0, 0), (0, gp - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, t_pad * gp, d)
    kf = k_cache.reshape(num_blocks * block_size * num_kv_heads, d)
    vf = v_cache.reshape(num_blocks * block_size * num_kv_heads, d)
    kernel = functools.partial(
        _kernel, gp=gp, group=group, block_size=block_size, max_blocks=max_blocks,
        num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    o = split_launches(
        kernel, (qg, kf, vf), query_start_loc, seq_lens, block_tables, num_seqs,
        short=Launch(bq_short, block_k_decode, num_warps, num_stages),
        long=Launch(bq_long, block_k_prefill, num_warps_prefill, num_stages_prefill),
        num_tokens=num_tokens, num_heads=num_q_heads, groups=num_kv_heads, group_rows=gp,
        group_heads=group, width=d, groups_fastest=False, block_size=block_size,
        target_programs=target_programs, max_splits_long=max_splits_prefill,
        interpret=interpret, name="ragged_paged_attention",
    )  # fmt: skip
    return o.astype(q.dtype)
