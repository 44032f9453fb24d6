"""What the Triton paged-attention kernels share: the split loop over the pages and the launches.

Both kernels (:mod:`pallas_kernels.attention.gpu`, GQA; :mod:`pallas_kernels.attention.mla_gpu`,
MLA's absorbed latent attention) run the same flash-decoding scheme over the paged cache; they
differ only in how a block of keys is read and scored. The kernel side::

    program (tile i, group g, split j):   M rows (BQ tokens x the group's heads), keys [0, ctx)
      blocks of BK keys, split j takes blocks [j * per, min(n_kv, (j + 1) * per)),
               per = cdiv(n_kv, splits)
      key p -> cache row block_tables[seq, p // bs] * bs + p % bs   (masked past ctx: pages
               past the context are never read)
      read_block(rows, k_ok) -> (scaled scores [M, BK], values [BK, W])    the kernel's part
      online softmax -> the unnormalised float32 partial (o [M, W], m [M], l [M])

and the wrapper side (:func:`split_launches`): a short launch (decode rows, a few speculative
tokens) and a long one (prefill chunks), each over its own work list
(:mod:`pallas_kernels.attention.tiles`) with as many splits as fill about
``target_programs`` programs; the partials merge by log-sum-exp and scatter back to tokens.
The engine's GQA decode buckets take a path of their own (``gpu._decode_attention``) that
uses :func:`attend_split` too; the decompressed MLA prefill
(:mod:`pallas_kernels.attention.mla_decompress_gpu`) uses :func:`softmax_step`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.attention.tiles import (
    cdiv,
    merge_splits,
    normalise_split,
    split_count,
    token_rows,
    work_list,
)

MASKED = -1e30  # finite: a row whose keys are all masked gives p = 0, never NaN


def mm(x, y, contract, precision=None):
    """``x @ y`` over the given dims, accumulated in float32 (``pl.dot`` is gone in JAX 0.12).
    ``precision=None`` is ``jax_default_matmul_precision``'s: f32 products are TF32 unless the
    step is traced at ``highest`` (float32 serving without ``--allow-tf32``: IEEE)."""
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def softmax_init(rows: int, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An empty online softmax: ``(o f32[M, W] = 0, m f32[M] = MASKED, l f32[M] = 0)``."""
    return (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows,), MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_step(
    carry: tuple,  # (o f32[M, W], m f32[M], l f32[M])
    s: jax.Array,  # f32[M, BK]  scaled scores
    ok: jax.Array,  # bool[M, BK]  pairs that attend
    v: jax.Array,  # [BK, W]  values (rows of masked keys 0)
    precision=None,
) -> tuple:
    """Adds one key block to the online softmax; returns the new ``(o, m, l)``."""
    o, m, l = carry
    s = jnp.where(ok, s, MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    o = o * alpha[:, None] + mm(p.astype(v.dtype), v, ((1,), (0,)), precision)
    return o, m_new, l


def attend_split(
    q_pos: jax.Array,  # i32[M]  position of each query row
    ctx: jax.Array,  # i32[]  keys [0, ctx)
    j: jax.Array,  # i32[]  this program's split
    seq: jax.Array,  # i32[]  the row whose block table is read
    bt_ref,  # i32[S * max_blocks]  block tables, flattened
    read_block: Callable,  # (cache rows i32[BK], k_ok bool[BK]) -> (f32[M, BK], [BK, W])
    *,
    width: int,
    block_k: int,
    block_size: int,
    max_blocks: int,
    splits: int,
    precision=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online softmax of the query rows over split ``j`` of the keys ``[0, ctx)`` of row
    ``seq``, read through the block tables in ``block_k``-key blocks. ``read_block`` gets each
    key's cache row (``page * bs + offset``; 0 past the context, where ``k_ok`` is False and the
    load must be masked) and returns the block's scaled scores and values. Returns the
    unnormalised float32 partial ``(o [M, W], m [M], l [M])``."""
    n_kv = cdiv(ctx, block_k)
    per = cdiv(n_kv, splits)
    start = j * per
    end = jnp.minimum(n_kv, start + per)

    def body(kb, carry):
        k_pos = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        k_ok = k_pos < ctx
        page = pltr.load(
            bt_ref.at[seq * max_blocks + k_pos // block_size], mask=k_ok, other=0
        )  # [BK]
        s, v = read_block(page * block_size + k_pos % block_size, k_ok)
        ok = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        return softmax_step(carry, s, ok, v, precision)

    return jax.lax.fori_loop(start, end, body, softmax_init(q_pos.shape[0], width))


def store_partial(
    o_ref, m_ref, l_ref,  # f32[splits, G, NT * M, W], f32[splits, G, NT * M] twice
    j, g, i,  # split, group, tile
    partial: tuple,  # (o f32[M, W], m f32[M], l f32[M])
    row_ok: jax.Array,  # bool[M]
) -> None:  # fmt: skip
    """Writes a program's partial to rows ``[i * M, (i + 1) * M)`` of its split and group."""
    o, m, l = partial
    rows = row_ok.shape[0]
    out = pl.ds(i * rows, rows)
    pltr.store(o_ref.at[j, g, out, :], o, mask=row_ok[:, None])
    pltr.store(m_ref.at[j, g, out], m, mask=row_ok)
    pltr.store(l_ref.at[j, g, out], l, mask=row_ok)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch's tiles: ``bq`` tokens against ``block_k``-key blocks; Triton settings."""

    bq: int
    block_k: int
    num_warps: int
    num_stages: int


def split_launches(
    kernel: Callable,  # the kernel body, all but bq, block_k and splits bound
    inputs: Sequence[jax.Array],  # its arrays after the work list and the block tables
    query_start_loc: jax.Array,  # i32[S + 1]
    seq_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    short: Launch,
    long: Launch | None,
    num_tokens: int,
    num_heads: int,
    groups: int,
    group_rows: int,
    group_heads: int,
    width: int,
    groups_fastest: bool,
    block_size: int,
    target_programs: int,
    max_splits_long: int,
    skip_rows: jax.Array | None = None,
    interpret: bool,
    name: str,
) -> jax.Array:
    """Both launches of a split kernel over a ragged batch. Returns f32[T, num_heads, W]
    (padding tokens and ``skip_rows``' tokens 0).

    Rows with ``q_len <= short.bq`` take the short launch, the others the long one (``long``
    None: the caller knows there are none). A launch's grid is ``(NT, groups, splits)``, or
    ``(groups, NT, splits)`` when ``groups_fastest``; program ``(i, g, j)`` runs
    ``kernel(*work_list, block_tables, *inputs, o, m, l, bq=, block_k=, splits=)`` and stores
    (:func:`store_partial`) the partial of tile ``i``'s ``group_rows`` rows per token (of
    which the first ``group_heads`` are heads ``g * group_heads ..``)."""
    num_rows, max_blocks = block_tables.shape
    bt = block_tables.astype(jnp.int32).reshape(-1)
    qsl = query_start_loc.astype(jnp.int32)
    lens = seq_lens.astype(jnp.int32)
    n = jnp.asarray(num_seqs, jnp.int32)
    q_len = qsl[1:] - qsl[:-1]  # [S]
    live_row = (jnp.arange(num_rows) < n) & (q_len > 0)
    if skip_rows is not None:
        live_row = live_row & ~skip_rows
    is_short = q_len <= short.bq  # [S]
    seq_id, local, live = token_rows(qsl, n, num_tokens)  # [T] each
    h_in = jnp.arange(group_heads, dtype=jnp.int32)

    # a short row is one tile; long tiles: T // BQ full ones plus a partial one per long row
    # (a long row has more than short.bq tokens)
    launches = [(True, short, num_rows)]
    if long is not None:
        cap_long = min(num_rows, num_tokens // (short.bq + 1)) + num_tokens // long.bq
        if cap_long > 0:
            launches.append((False, long, cap_long))
    max_ctx = max_blocks * block_size
    o = jnp.zeros((groups, num_tokens, group_heads, width), jnp.float32)
    for short_rows, launch, cap in launches:
        bq = launch.bq
        rows = bq * group_rows
        splits = split_count(cap * groups, cdiv(max_ctx, launch.block_k), target_programs)
        if not short_rows:  # prefill tiles bring their own parallelism; partials cost cap*rows*W
            splits = min(splits, max_splits_long)
        kind = live_row & (is_short if short_rows else ~is_short)
        tiles, first_tile = work_list(q_len, lens, qsl, kind, bq=bq, capacity=cap)
        part = pl.pallas_call(
            functools.partial(kernel, bq=bq, block_k=launch.block_k, splits=splits),
            grid=(groups, cap, splits) if groups_fastest else (cap, groups, splits),
            out_shape=[
                jax.ShapeDtypeStruct((splits, groups, cap * rows, width), jnp.float32),
                jax.ShapeDtypeStruct((splits, groups, cap * rows), jnp.float32),
                jax.ShapeDtypeStruct((splits, groups, cap * rows), jnp.float32),
            ],
            compiler_params=pltr.CompilerParams(
                num_warps=launch.num_warps, num_stages=launch.num_stages
            ),
            interpret=interpret,
            name=name + ("_short" if short_rows else "_long"),
        )(*tiles, bt, *inputs)
        merged = merge_splits(*part) if splits > 1 else normalise_split(part[0][0], part[2][0])
        # token t, head h of the group -> row (tile, token in tile, h) of this launch's output
        tile = first_tile[seq_id] + local // bq  # [T]
        row = (tile * rows + (local % bq) * group_rows)[:, None] + h_in[None, :]  # [T, HG]
        mine = kind[seq_id][None, :, None, None]
        o = jnp.where(mine, merged[:, jnp.clip(row, 0, cap * rows - 1)], o)

    o = o.transpose(1, 0, 2, 3).reshape(num_tokens, groups * group_heads, width)[:, :num_heads]
    return jnp.where(live[:, None, None], o, 0.0)
