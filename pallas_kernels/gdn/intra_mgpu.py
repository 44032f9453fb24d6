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
* **One warpgroup a (chunk, value head)** (:func:`_body`) reads k's 64-token block by TMA and
  makes with ``wgmma``::

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

Rows and columns outside the chunk (the block's other chunks' tokens, or none) are masked out
of A, so X is the identity there; the chunk's rows of Tm and W are stored (a 64-token chunk in
one TMA store, a shorter one in runs of its length's bits, as the serial launch stores o), the
others left to the chunks that own them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import chunk_scan_mgpu as cs
from pallas_kernels.common.chunking import ChunkPlan
from pallas_kernels.common.delta_rule import softplus

CHUNK = cs.CHUNK
ROWS = 8  # vec's rows (a TMA box's): gdn.gpu.FOLD_VECTORS, then this launch's three
R_ROW, C_ROW, BETA_ROW = 5, 6, 7  # r (A's rows' exponent), c (its columns'), beta
f32, f16 = jnp.float32, jnp.float16


def fold_vectors(q, k, a, b, A_log, dt_bias, plan: ChunkPlan, num_chunks: int):
    """Per token, on inputs padded to ``Tp`` (a multiple of 64) tokens: f32 ``vec [Hv, 8, Tp]``
    (``gdn.gpu.FOLD_VECTORS``: ``q_out``, ``k_state``, ``q_norm``, ``k_norm``, ``gam``; then
    ``r = gam + log n_k``, ``c = gam - log(beta n_k)`` and ``beta``), zero on tokens of no
    chunk, and f32 ``decay [NC, Hv]``: ``e^gam`` at each chunk's last token (1 where empty)."""
    tp, hk, dk = q.shape
    hv = a.shape[1]
    n = plan.token_chunk.shape[0]
    # each token's chunk (padding tokens and those past the batch: none)
    tc = jnp.pad(plan.token_chunk, (0, tp - n), constant_values=num_chunks)
    live = jnp.pad(plan.live, (0, tp - n)) & (tc < num_chunks)
    tci = jnp.minimum(tc, num_chunks - 1)
    g = -jnp.exp(A_log.astype(f32)) * softplus(a.astype(f32) + dt_bias.astype(f32))
    beta = jax.nn.sigmoid(b.astype(f32))
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

    n_q, n_k = inv_norm(q) * float(dk) ** -0.5, inv_norm(k)
    rows = (
        n_q * jnp.exp(gam),  # q_out
        n_k * jnp.exp(gam_last[tci] - gam),  # k_state
        n_q,  # q_norm
        n_k,  # k_norm
        gam,
        gam + jnp.log(n_k),  # r
        gam - jnp.log(beta + 1e-30) - jnp.log(n_k),  # c
        beta,
    )
    vec = jnp.stack([jnp.where(live[:, None], x, 0.0) for x in rows], axis=0)  # [8, Tp, Hv]
    return jnp.transpose(vec, (2, 0, 1)), jnp.exp(gam_last)


def _body(refs, scratch, *, ops, hk_ratio: int):
    """One program: chunk ``c``, value head ``h`` (module docstring)."""
    plgpu = cs._plgpu()
    meta_ref, k_ref, vec_ref, w_ref, tm_ref = refs
    k_s, vec_s, meta_s, tx, tp, tm_t, w_t, tm_p, w_p, plan_bar, bar = scratch
    ci, h = jax.lax.axis_index("c"), jax.lax.axis_index("h")
    dk = k_s.shape[1]
    hi, lo = ci // cs.META_COLS, ci % cs.META_COLS
    plgpu.copy_gmem_to_smem(meta_ref.at[:, hi], meta_s, plan_bar.at[0])
    plgpu.barrier_wait(plan_bar.at[0])
    start, length = meta_s[0, lo], meta_s[1, lo]

    @pl.when(length > 0)
    def _():
        win = start - start % CHUNK
        lead = start - win
        tok = pl.ds(win, CHUNK)
        plgpu.copy_gmem_to_smem(k_ref.at[tok, pl.ds(h // hk_ratio * dk, dk)], k_s, bar.at[0])
        plgpu.copy_gmem_to_smem(vec_ref.at[h, :, tok], vec_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        sq = (CHUNK, CHUNK)
        ri, cj = ops.iota(sq, 0), ops.iota(sq, 1)

        def over_rows(i):  # vec row i along A's rows / columns
            return jax.lax.broadcast_in_dim(ops.load_col_vector(vec_s.at[i]), sq, (0,))

        def over_cols(i):
            return jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[i]), sq, (1,))

        (kk,) = ops.mma((ops.zeros(sq), [(k_s, k_s, True)]))  # k k^T, raw k
        keep = (ri > cj) & (cj >= lead) & (ri < lead + length)
        expo = jnp.where(keep, over_rows(R_ROW) - over_cols(C_ROW), -1e30)
        a = jnp.where(keep, kk * jnp.exp(expo), 0.0)
        eye = jnp.where(ri == cj, 1.0, 0.0)
        x = eye - jnp.where((ri // 2 == cj // 2), a, 0.0)  # X_2 = I - L_1
        for n in (2, 4, 8, 16, 32):  # X_2n = X_n - X_n L_n X_n
            low = jnp.where((ri // (2 * n) == cj // (2 * n)) & (ri // n != cj // n), a, 0.0)
            tx[...] = x.astype(f16)
            plgpu.commit_smem()
            (p,) = ops.mma((ops.zeros(sq), [(low.astype(f16), tx, False)]))  # L_n X_n
            tp[...] = p.astype(f16)
            plgpu.commit_smem()
            (xlx,) = ops.mma((ops.zeros(sq), [(x.astype(f16), tp, False)]))  # X_n L_n X_n
            x = x - xlx
        tm = over_rows(BETA_ROW) * x  # diag(beta) X
        wscale = over_cols(3) * jnp.exp(over_cols(4))  # n_k e^gam, along Tm's columns
        op = k_s.dtype
        (w,) = ops.mma((ops.zeros((CHUNK, dk)), [((tm * wscale).astype(op), k_s, False)]))

        @pl.when(length == CHUNK)
        def _():  # one store each from the swizzled tiles
            tm_t[...] = tm.astype(tm_t.dtype)
            w_t[...] = w.astype(w_t.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tm_t, tm_ref.at[h, tok])
            plgpu.copy_smem_to_gmem(w_t, w_ref.at[h, tok])

        @pl.when(length < CHUNK)
        def _():  # the chunk's rows only, in runs of its length's bits, from plain rows
            tm_p[...] = tm.astype(tm_p.dtype)
            w_p[...] = w.astype(w_p.dtype)
            plgpu.commit_smem()
            for bit in (32, 16, 8, 4, 2, 1):
                off = length & (CHUNK - 2 * bit)

                @pl.when(length & bit != 0)
                def _(off=off, bit=bit):
                    src, dst = pl.ds(lead + off, bit), pl.ds(start + off, bit)
                    plgpu.copy_smem_to_gmem(tm_p.at[src], tm_ref.at[h, dst])
                    plgpu.copy_smem_to_gmem(w_p.at[src], w_ref.at[h, dst])

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
    interpret: bool = False,
) -> cs.FoldRefs:  # fmt: skip
    """The fold's scratch (module docstring) on inputs padded to a multiple of 64 tokens."""
    if why := unsupported_reason(q.shape[2], operand_dtype):
        raise ValueError(f"the Mosaic GPU fold launch cannot take this prefill: {why}")
    plgpu = cs._plgpu()
    tp, hk, dk = q.shape
    hv = v.shape[1]
    op = operand_dtype
    vec, decay = fold_vectors(q, k, a, b, A_log, dt_bias, plan, num_chunks)
    ncp = -(-num_chunks // cs.META_COLS) * cs.META_COLS
    meta = jnp.stack([plan.start, plan.length]).astype(jnp.int32)
    meta = jnp.pad(meta, [(0, 0), (0, ncp - num_chunks)])
    meta = meta.reshape(2, ncp // cs.META_COLS, cs.META_COLS)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def tile(shape, dtype=op):
        return plgpu.SMEM(shape, dtype, transforms=transforms)

    scratch = (
        tile((CHUNK, dk)),  # k's block
        plgpu.SMEM((ROWS, CHUNK), f32),  # its vectors
        plgpu.SMEM((2, cs.META_COLS), jnp.int32),  # the chunks' starts and lengths
        tile((CHUNK, CHUNK), f16),  # X_n (a product's B)
        tile((CHUNK, CHUNK), f16),  # L_n X_n
        tile((CHUNK, CHUNK)),  # Tm and W of a 64-token chunk (swizzled)
        tile((CHUNK, dk)),
        plgpu.SMEM((CHUNK, CHUNK), op),  # of a shorter one: plain rows, stored by runs
        plgpu.SMEM((CHUNK, dk), op),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),  # the chunk plan's copy
        plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the block's two
    )
    body = functools.partial(
        _body, ops=cs.InterpretOps if interpret else cs.GpuOps, hk_ratio=hv // hk
    )

    def kernel(*refs):
        pl.run_scoped(lambda *s: body(refs, s), *scratch)

    mesh = plgpu.Mesh(grid=(num_chunks, hv), grid_names=("c", "h"))
    out_type = (
        jax.ShapeDtypeStruct((hv, tp, dk), op),  # W
        jax.ShapeDtypeStruct((hv, tp, CHUNK), op),  # Tm diag(beta)
    )
    run = cs.mgpu_kernel(kernel, out_type, mesh, name="gdn_prefill_fold_mgpu", interpret=interpret)
    w, tm = run(meta, k.reshape(tp, hk * dk), vec)
    return cs.FoldRefs(w, tm, v, q, k, vec, decay)
