"""GDN's fold scratch (:class:`~pallas_kernels.common.chunk_scan_mgpu.FoldRefs`) by XLA and
one Mosaic GPU launch, in place of the Triton intra launch (``gdn.gpu._intra_kernel_fold``).

The Triton launch sits at the register cap with two 4-warp programs an SM and issues on a
quarter of its cycles (ncu, BENCHMARKS.md): its inverse is ~30 products of ``[16, 16]`` blocks
and a forward substitution, small work with long latencies. Here:

* **XLA** makes every per-token figure (:func:`fold_vectors`): the gates, ``gam`` (``g``'s
  cumulative sum from the chunk's first token: chunks lie inside 64-token blocks, so a sum of
  at most 64 terms), q's and k's l2norm factors, the serial launch's row scalings
  (``gdn.gpu.FOLD_VECTORS``) and the chunk decays. A few elementwise and reduction fusions
  over q, k, a, b.
* **One warpgroup a 64-token block** (:func:`_body`) reads k's block by TMA and makes with
  ``wgmma``::

      A   = strict_lower(k_i . k_j n_i n_j beta_j e^(gam_i - gam_j))  in the chunk
            = k k^T (raw bf16 k) times e^(r_i - c_j), r = gam + log n, c = gam - log(beta n)
      X   = (I + A)^-1   by doubling: X_1 = I; X_2n = X_n - X_n L_n X_n, L_n A's blocks
            of n rows below the diagonal blocks of X_n inside each 2n-block (n = 1, ..., 32)
      Tm  = diag(beta) X          (= Tm diag(beta) of the fold: the push-through identity)
      W   = (Tm diag(n e^gam)) k  (raw k)

  ``n`` is k's l2norm factor. ``X_2n`` is exact: ``L_n X_n L_n = 0`` for that block structure.
  The doubling's operands are f16 (f32 accumulation), as FlashInfer's Hopper kernel makes its
  inverse; a step's product is ~128 tensor-core cycles, five steps of two. The first step
  (``n = 1``) is ``X_2 = I - L_1``, no product.

A program owns a 64-token block of the batch (every chunk in it: chunks lie inside blocks)
and one value head (two of one key head, their chains interleaved, was slower: the prefill
1.355 against 1.262 ms at 8x4096, a doubling step ~3,700 cycles against ~1,050).
On an H200 at 8x4096 the two-head launch traced 0.50 ms where the Triton one took 1.05, and
the one-head form took the prefill 0.09 ms less (BENCHMARKS.md, session 35). A is masked to
pairs of tokens of one chunk (the token's chunk is a row of vec), so
X is block diagonal by chunk and the identity on tokens of no chunk; the block's Tm and W are
one TMA store each (rows of no chunk: zeros). With ``with_aqk`` (``gdn.gpu.FOLD_AQK``, opt-in,
not yet timed) it reads q's block too and makes each chunk's ``Aqk`` (``q k^T`` scaled by the
norms and decays, inclusive lower in its chunk), which the serial launch then reads instead of
issuing ``q k^T`` and making Aqk itself.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import chunk_scan_mgpu as cs
from pallas_kernels.common.chunking import ChunkPlan
from pallas_kernels.common.delta_rule_gpu import resident_programs
from pallas_kernels.gdn.reference import gdn_gates

CHUNK = cs.CHUNK
# vec's rows: gdn.gpu.FOLD_VECTORS (the serial launch's, its first FOLD_ROWS), then this
# launch's: r (A's rows' exponent), c (its columns'), beta, W's column scale n_k e^gam, and the
# token's chunk (-1: none), padded to a TMA box's rows
QNORM_ROW, KNORM_ROW, GAM_ROW = 2, 3, 4  # (of FOLD_VECTORS)
R_ROW, C_ROW, BETA_ROW, WSCALE_ROW, CHUNK_ROW = 5, 6, 7, 8, 9
ROWS = 10
# The launch as a persistent one (_body_persistent; one head a program): PERSIST programs (0:
# not persistent; None, the default: four an SM), each taking items a stride apart with the
# next one's copies in flight. Its shared memory, 53 KB a program (W stored from its own
# stage's k tile), lets four run an SM as the plain launch's 50.5 KB does. Measured on an H200
# (session 36, 528 programs): the launch 336 against 379 us at 8x4096 (traced), the prefill
# 1.198 against 1.235 ms there and 0.339 against 0.343 at 1x4096; three an SM (396) slower
# (1.342). Checked on the GPU against the reference as the plain launch (error ratios 3.70e-3 /
# 2.32e-3). HYJAX_GDN_FOLD_MGPU_PERSIST=N for N programs (0: the plain launch).
_PERSIST_ENV = os.environ.get("HYJAX_GDN_FOLD_MGPU_PERSIST")
PERSIST = None if _PERSIST_ENV is None else int(_PERSIST_ENV)


def persist_programs(persist: int | None = None) -> int:
    """The persistent launch's programs: ``persist``, else :data:`PERSIST`, else four an SM
    (``delta_rule_gpu.resident_programs``); 0: the plain launch."""
    n = PERSIST if persist is None else persist
    return 4 * resident_programs() if n is None else n


f32, f16 = jnp.float32, jnp.float16


def fold_vectors(q, k, a, b, A_log, dt_bias, plan: ChunkPlan, num_chunks: int):
    """Per token, on inputs padded to ``Tp`` (a multiple of 64) tokens: f32 ``vec [Hv, 10, Tp]``
    (``gdn.gpu.FOLD_VECTORS``: ``q_out``, ``k_state``, ``q_norm``, ``k_norm``, ``gam``; then
    ``r = gam + log n_k``, ``c = gam - log(beta n_k)``, ``beta``, ``n_k e^gam`` and the
    token's chunk), zero on tokens of no chunk (their chunk -1), and f32 ``decay [NC, Hv]``:
    ``e^gam`` at each chunk's last token (1 where empty)."""
    tp, hk, dk = q.shape
    hv = a.shape[1]
    n = plan.token_chunk.shape[0]
    # each token's chunk (padding tokens and those past the batch: none)
    tc = jnp.pad(plan.token_chunk, (0, tp - n), constant_values=num_chunks)
    live = jnp.pad(plan.live, (0, tp - n)) & (tc < num_chunks)
    tci = jnp.minimum(tc, num_chunks - 1)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    g = jnp.where(live[:, None], g, 0.0)
    beta = jnp.where(live[:, None], beta, 0.0)
    # gam: g summed from the chunk's first token; a chunk lies inside its 64-token block, so the
    # block's running sum less its value before the chunk
    run = jnp.cumsum(g.reshape(tp // CHUNK, CHUNK, hv), axis=1).reshape(tp, hv)
    first = plan.start[tci]
    before = jnp.where((first % CHUNK > 0)[:, None], run[jnp.maximum(first - 1, 0)], 0.0)
    gam = jnp.where(live[:, None], run - before, 0.0)
    last = jnp.maximum(plan.start + plan.length - 1, 0)  # each chunk's last token
    gam_last = jnp.where((plan.length > 0)[:, None], gam[last], 0.0)  # [NC, Hv]

    def inv_norm(x):  # l2norm's factor, per token and key head, then per value head
        xf = x.astype(f32)
        inv = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1) + 1e-6)  # [Tp, Hk]
        return jnp.repeat(inv, hv // hk, axis=1)  # [Tp, Hv]

    # (materialised: fused into vec's rows, XLA recomputed the norms' sums for each of them)
    n_q, n_k, gam, gam_last, beta = jax.lax.optimization_barrier(
        (inv_norm(q) * float(dk) ** -0.5, inv_norm(k), gam, gam_last, beta)
    )
    rows = [
        n_q * jnp.exp(gam),  # q_out
        n_k * jnp.exp(gam_last[tci] - gam),  # k_state
        n_q,  # q_norm
        n_k,  # k_norm
        gam,
        gam + jnp.log(n_k),  # r
        gam - jnp.log(beta + 1e-30) - jnp.log(n_k),  # c
        beta,
        n_k * jnp.exp(gam),  # W's column scale
    ]
    rows = [jnp.where(live[:, None], x, 0.0) for x in rows]
    rows.append(jnp.broadcast_to(jnp.where(live, tc, -1).astype(f32)[:, None], (tp, hv)))
    vec = jnp.stack(rows, axis=0)  # [10, Tp, Hv]
    return jnp.transpose(vec, (2, 0, 1)), jnp.exp(gam_last)


def _products(ops, k_s, q_s, vec_s, tx, after_scores=None):
    """A block's ``Tm diag(beta)``, W and (with ``q_s``) Aqk from its tiles in shared memory
    (k's and q's blocks, the head's vectors; ``tx`` the f16 tile a doubling step's operands
    pass through). ``after_scores()`` runs once ``k k^T`` is made (the persistent launch's
    next copies)."""
    plgpu = cs._plgpu()
    sq = (CHUNK, CHUNK)
    ri, cj = ops.iota(sq, 0), ops.iota(sq, 1)
    near = ri ^ cj  # i and j in one aligned block of m rows (m a power of two): near < m

    def over_rows(row):  # vec row ``row`` along A's rows / columns
        return jax.lax.broadcast_in_dim(ops.load_col_vector(vec_s.at[row]), sq, (0,))

    def over_cols(row):
        return jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[row]), sq, (1,))

    def in_chunk(keep):  # pairs of one chunk (tokens of none: -1)
        chunk = over_cols(CHUNK_ROW)
        return keep & (over_rows(CHUNK_ROW) == chunk) & (chunk >= 0)

    with jax.named_scope("scores"):
        (kk,) = ops.mma((ops.zeros(sq), [(k_s, k_s, True)]))  # k k^T, raw k
        if after_scores is not None:
            after_scores()
        keep = in_chunk(ri > cj)
        a = jnp.where(keep, kk * jnp.exp(jnp.where(keep, over_rows(R_ROW) - over_cols(C_ROW),
                                                   -1e30)), 0.0)  # fmt: skip
        x = jnp.where(ri == cj, 1.0, 0.0) - jnp.where(near < 2, a, 0.0)  # X_2 = I - L_1

    def double(x, n):  # X_2n = X_n - X_n L_n X_n
        tx[...] = x.astype(f16)
        plgpu.commit_smem()
        low = jnp.where((near < 2 * n) & (near >= n), a, 0.0).astype(f16)
        (p,) = ops.mma((ops.zeros(sq), [(low, tx, False)]))  # L_n X_n
        tx[...] = p.astype(f16)  # (X_n's tile read: it takes L_n X_n)
        plgpu.commit_smem()
        (xlx,) = ops.mma((ops.zeros(sq), [(x.astype(f16), tx, False)]))
        return x - xlx

    for n in (2, 4, 8, 16, 32):
        with jax.named_scope(f"double{n}"):
            x = double(x, n)
    with jax.named_scope("w"):
        tm = over_rows(BETA_ROW) * x  # diag(beta) X
        wa = (tm * over_cols(WSCALE_ROW)).astype(k_s.dtype)
        (w,) = ops.mma((ops.zeros((CHUNK, k_s.shape[1])), [(wa, k_s, False)]))
    aqk = None
    if q_s is not None:  # Aqk = incl_lower(q k^T n_q n_k e^(gam_i - gam_j)) in the chunk
        with jax.named_scope("aqk"):
            (qk,) = ops.mma((ops.zeros(sq), [(q_s, k_s, True)]))  # raw q, k
            keep = in_chunk(ri >= cj)
            e = jnp.exp(jnp.where(keep, over_rows(GAM_ROW) - over_cols(GAM_ROW), -1e30))
            aqk = jnp.where(keep, qk * over_rows(QNORM_ROW) * over_cols(KNORM_ROW) * e, 0.0)
    return tm, w, aqk


def _copies(k_ref, q_ref, vec_ref, tok, h, hk_ratio, k_s, q_s, vec_s, bar):
    """An item's tiles (block ``tok``, head ``h``) into shared memory, on barrier ``bar``: k's
    block (and q's, with ``q_ref``) and the head's vectors."""
    plgpu = cs._plgpu()
    keys = pl.ds(h // hk_ratio * k_s.shape[-1], k_s.shape[-1])
    plgpu.copy_gmem_to_smem(k_ref.at[tok, keys], k_s, bar)
    if q_ref is not None:
        plgpu.copy_gmem_to_smem(q_ref.at[tok, keys], q_s, bar)
    plgpu.copy_gmem_to_smem(vec_ref.at[h, :, tok], vec_s, bar)


def _stores(outs, tiles, refs, tok, h):
    """An item's outputs (``None`` skipped) through their tiles to ``refs[h, tok]``: the
    block's rows (those of no chunk: zeros), one TMA store each."""
    plgpu = cs._plgpu()
    kept = [(o, t, r) for o, t, r in zip(outs, tiles, refs, strict=True) if o is not None]
    for o, t, _ in kept:
        t[...] = o.astype(t.dtype)
    plgpu.commit_smem()
    for _, t, r in kept:
        plgpu.copy_smem_to_gmem(t, r.at[h, tok])


def _split(refs, scratch, with_aqk: bool, stored: int):
    """``(k, q, vec, w, tm, aqk)`` refs and the scratch's tiles with ``None`` where there is no
    Aqk (q's tile and Aqk's output); ``stored`` tiles after the vectors' and X's."""
    if with_aqk:
        k_ref, q_ref, vec_ref, w_ref, tm_ref, aqk_ref = refs
        k_s, q_s, vec_s, tx, *rest = scratch
    else:
        (k_ref, vec_ref, w_ref, tm_ref), q_ref, aqk_ref = refs, None, None
        (k_s, vec_s, tx, *rest), q_s = scratch, None
    outs = rest[:stored] + ([rest[stored]] if with_aqk else [None])
    return (k_ref, q_ref, vec_ref, w_ref, tm_ref, aqk_ref), (k_s, q_s, vec_s, tx, outs, rest[-1])


def _body(refs, scratch, *, ops, hk_ratio: int, with_aqk: bool = False):
    """One program: 64-token block ``t``, value head ``h`` (module docstring)."""
    plgpu = cs._plgpu()
    (k_ref, q_ref, vec_ref, w_ref, tm_ref, aqk_ref), (k_s, q_s, vec_s, tx, outs, bar) = _split(
        refs, scratch, with_aqk, stored=2
    )
    t, h = jax.lax.axis_index("t"), jax.lax.axis_index("h")
    tok = pl.ds(t * CHUNK, CHUNK)
    with jax.named_scope("load"):  # (named regions: benchmarks/mgpu_regions.py)
        _copies(k_ref, q_ref, vec_ref, tok, h, hk_ratio, k_s, q_s, vec_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
    tm, w, aqk = _products(ops, k_s, q_s, vec_s, tx)
    with jax.named_scope("store"):
        tm_t, w_t, aqk_t = outs
        _stores((tm, w, aqk), (tm_t, w_t, aqk_t), (tm_ref, w_ref, aqk_ref), tok, h)
        plgpu.wait_smem_to_gmem(0)


def _body_persistent(
    refs, scratch, *, ops, hk_ratio: int, hv: int, items: int, programs: int, with_aqk: bool
):  # fmt: skip
    """:func:`_body` as a persistent launch (:data:`PERSIST`): program ``p`` of ``P`` takes
    items ``p, p + P, ...`` (item = block * Hv + head), the next item's copies in flight in
    the other of two stages while this one's products run (issued once its ``k k^T`` is made,
    by when the last item's stores have left the stage), W stored from its own stage's k tile
    (k read for the last time by W's product) and the stores waited for only before the tiles
    are written again."""
    plgpu = cs._plgpu()
    (k_ref, q_ref, vec_ref, w_ref, tm_ref, aqk_ref), (k_s, q_s, vec_s, tx, outs, bars) = _split(
        refs, scratch, with_aqk, stored=1
    )
    tm_t, aqk_t = outs
    p = jax.lax.axis_index("p")
    mine = (items - p + programs - 1) // programs

    def item(m):  # (its 64-token block's rows, its head)
        it = p + m * programs
        return pl.ds(it // hv * CHUNK, CHUNK), it % hv

    def stage(slot):  # (q's tile: None without Aqk)
        return k_s.at[slot], None if q_s is None else q_s.at[slot], vec_s.at[slot]

    def issue(m, slot):
        _copies(k_ref, q_ref, vec_ref, *item(m), hk_ratio, *stage(slot), bars.at[slot])

    def step(m, carry):
        slot = m % 2

        def next_copies():  # (the other stage's k tile held the last item's W: read by now)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(m + 1 < mine)
            def _():
                issue(m + 1, 1 - slot)

        with jax.named_scope("load"):
            plgpu.barrier_wait(bars.at[slot])
        k_t, q_t, vec_t = stage(slot)
        tm, w, aqk = _products(ops, k_t, q_t, vec_t, tx, after_scores=next_copies)
        with jax.named_scope("store"):  # (W's product has read k: W leaves from k's tile)
            _stores((tm, w, aqk), (tm_t, k_t, aqk_t), (tm_ref, w_ref, aqk_ref), *item(m))
        return carry

    @pl.when(mine > 0)
    def _():
        issue(0, 0)
        jax.lax.fori_loop(0, mine, step, 0)
        plgpu.wait_smem_to_gmem(0)


def unsupported_reason(dk: int, op_dtype) -> str | None:
    """Why this launch cannot make a fold's scratch (the Triton launch then does), or None."""
    if jnp.dtype(op_dtype) != jnp.dtype(jnp.bfloat16):
        return f"operand dtype {jnp.dtype(op_dtype).name} (bf16 here)"
    if dk not in (64, 128):
        return f"Dk={dk} (64 or 128)"
    return None


def fold_scratch(
    q, k, v, a, b, A_log, dt_bias, plan: ChunkPlan, *, num_chunks: int, operand_dtype,
    with_aqk: bool = False, persist: int | None = None, interpret: bool = False,
) -> cs.FoldRefs:  # fmt: skip
    """The fold's scratch (module docstring) on inputs padded to a multiple of 64 tokens;
    ``with_aqk``: and each chunk's ``Aqk`` (``FoldRefs.aqk``: ``q k^T`` on q's block, one
    more product, so that the serial launch makes neither); ``persist`` (None:
    :func:`persist_programs`, four an SM) programs of the persistent launch (0: the plain
    one)."""
    if why := unsupported_reason(q.shape[2], operand_dtype):
        raise ValueError(f"the Mosaic GPU fold launch cannot take this prefill: {why}")
    plgpu = cs._plgpu()
    tp, hk, dk = q.shape
    hv = v.shape[1]
    ratio = hv // hk
    op = operand_dtype
    vec, decay = fold_vectors(q, k, a, b, A_log, dt_bias, plan, num_chunks)

    def tile(shape, dtype=op):
        return cs.swizzled(shape, dtype)

    items = tp // CHUNK * hv
    programs = min(persist_programs(persist), items)
    if programs:
        scratch = (
            tile((2, CHUNK, dk)),  # k's blocks, two stages (W stored from them)
            *((tile((2, CHUNK, dk)),) if with_aqk else ()),  # q's
            plgpu.SMEM((2, ROWS, CHUNK), f32),  # the vectors
            tile((CHUNK, CHUNK), f16),  # X_n, then L_n X_n (a product's B)
            tile((CHUNK, CHUNK)),  # Tm diag(beta)
            *((tile((CHUNK, CHUNK)),) if with_aqk else ()),  # Aqk
            plgpu.Barrier(num_arrivals=2 + with_aqk, num_barriers=2),
        )
        body = functools.partial(
            _body_persistent, ops=cs.InterpretOps if interpret else cs.GpuOps, hk_ratio=ratio,
            hv=hv, items=items, programs=programs, with_aqk=with_aqk,
        )  # fmt: skip
        mesh = plgpu.Mesh(grid=(programs,), grid_names=("p",))
    else:
        scratch = (
            tile((CHUNK, dk)),  # k's block
            *((tile((CHUNK, dk)),) if with_aqk else ()),  # q's
            plgpu.SMEM((ROWS, CHUNK), f32),  # the head's vectors
            tile((CHUNK, CHUNK), f16),  # X_n, then L_n X_n (a product's B)
            tile((CHUNK, CHUNK)),  # Tm diag(beta)
            tile((CHUNK, dk)),  # W
            *((tile((CHUNK, CHUNK)),) if with_aqk else ()),  # Aqk
            plgpu.Barrier(num_arrivals=2 + with_aqk, num_barriers=1),
        )
        body = functools.partial(
            _body, ops=cs.InterpretOps if interpret else cs.GpuOps, hk_ratio=ratio,
            with_aqk=with_aqk,
        )  # fmt: skip
        mesh = plgpu.Mesh(grid=(tp // CHUNK, hv), grid_names=("t", "h"))

    def kernel(*refs):
        pl.run_scoped(lambda *s: body(refs, s), *scratch)

    out_type = (
        jax.ShapeDtypeStruct((hv, tp, dk), op),  # W
        jax.ShapeDtypeStruct((hv, tp, CHUNK), op),  # Tm diag(beta)
        *((jax.ShapeDtypeStruct((hv, tp, CHUNK), op),) if with_aqk else ()),  # Aqk
    )
    run = cs.mgpu_kernel(
        kernel, out_type, mesh, name="gdn_prefill_fold_mgpu", interpret=interpret,
        approx_math=True,  # (exps into A's f16 operands: ex2.approx's 2^-22 far below)
    )  # fmt: skip
    if with_aqk:
        w, tm, aqk = run(k.reshape(tp, hk * dk), q.reshape(tp, hk * dk), vec)
        return cs.FoldRefs(w, tm, v, q, k, vec, decay, aqk)
    w, tm = run(k.reshape(tp, hk * dk), vec)
    return cs.FoldRefs(w, tm, v, q, k, vec, decay)
