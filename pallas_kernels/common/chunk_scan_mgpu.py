"""An experiment: the delta-rule prefill's serial launch in Mosaic GPU (``plgpu.kernel``).

The Triton serial launch (:mod:`pallas_kernels.common.chunk_scan_gpu`) is latency-bound on
an H200 (ncu at 8x4096, BENCHMARKS.md: one 4-warp program an SM, a warp issuing about one
cycle in five, a third of the gaps on global loads). Hopper's own answer is asynchronous: TMA
copies bring the next chunk's operands into shared memory while ``wgmma`` products of this
chunk run. This module measures what that buys on the same chunk recurrence before the
engine's ragged path is built on it: rows of equal length (a multiple of the 64-token
chunk), the state's final value only (no checkpoints), GDN's scalar decay.

Everything is transposed so that the state is the ``wgmma`` accumulator and the products'
left operands come from registers (the layout FlashAttention 3 uses for ``P V``)::

    S^T [BV, Dk] f32, in registers                      (the pool's [Dv, Dk] layout)
    V'^T = U^T - S^T W^T          A = bf16(S^T) (regs), B = W^T (shared memory, transposed)
    o^T  = S^T q_dec^T + V'^T Aqk^T                     B = q_dec^T, Aqk^T
    S^T  = e^gam_last S^T + V'^T k_dec                  A = bf16(V'^T), B = k_dec

so the inputs it reads are the intra launch's ``w, q_dec, k_dec, a_qk`` ([H, T, D]) as they
are, and ``U^T`` ([H, Dv, T], the intra launch would write it so); ``o`` leaves as
``o^T [H, Dv, T]``. One program per (row, head, Dv block of 64), one warpgroup; each chunk's
five tiles come by TMA, two chunks in flight. Not in the engine: ``benchmarks.gdn_kernels
--mgpu-scan`` times it against the Triton serial launch on the same scratch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

CHUNK = 64
BV = 64
STAGES = 2


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def serial_scan_mgpu(
    w: jax.Array,  # [H, T, Dk]  bf16: W = Tm (beta k e^gam)
    u_t: jax.Array,  # [H, Dv, T]  bf16: U^T
    q_dec: jax.Array,  # [H, T, Dk]  bf16
    k_dec: jax.Array,  # [H, T, Dk]  bf16
    a_qk: jax.Array,  # [H, T, C]  bf16
    decay: jax.Array,  # f32[H, NC]  e^gam_last per chunk (all rows' chunks in token order)
    state: jax.Array,  # f32[B, H, Dv, Dk]  each row's starting state (pool layout)
    *,
    rows: int,
) -> tuple[jax.Array, jax.Array]:
    """``rows`` rows of ``T / rows`` tokens each: ``(o^T [H, Dv, T] bf16, final states
    [B, H, Dv, Dk] f32)``."""
    plgpu = _plgpu()
    h, t, dk = w.shape
    dv = u_t.shape[1]
    if t % rows or (t // rows) % CHUNK or dv % BV or dk % 64:
        raise ValueError(f"{rows} rows of {t} tokens: each row must be a multiple of {CHUNK}")
    per_row = t // rows
    nc = per_row // CHUNK
    op = w.dtype
    swizzle = 128  # bytes: 64 bf16 a row of a tile
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def body(w_ref, ut_ref, qd_ref, kd_ref, aqk_ref, dec_ref, s0_ref, o_ref, s_ref, scratch):
        w_s, ut_s, qd_s, kd_s, aqk_s, o_s, st_s, dec_s, bars, one_bar = scratch
        r, head, vb = jax.lax.axis_index("r"), jax.lax.axis_index("h"), jax.lax.axis_index("v")
        vs = pl.ds(vb * BV, BV)
        t0 = r * per_row

        def issue(c, slot):
            tok = pl.ds(t0 + c * CHUNK, CHUNK)
            bar = bars.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[head, tok], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ut_ref.at[head, vs, tok], ut_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(qd_ref.at[head, tok], qd_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(kd_ref.at[head, tok], kd_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(aqk_ref.at[head, tok], aqk_s.at[slot], bar)

        # the row's starting state and its chunks' decays
        plgpu.copy_gmem_to_smem(s0_ref.at[r, head, vs], st_s, one_bar.at[0])
        plgpu.copy_gmem_to_smem(dec_ref.at[head, pl.ds(r * nc, nc)], dec_s, one_bar.at[0])
        issue(0, 0)
        plgpu.barrier_wait(one_bar.at[0])
        s0 = plgpu.load(st_s, (), layout=plgpu.Layout.WGMMA, optimized=False)

        def zeros():
            return plgpu.layout_cast(jnp.zeros((BV, CHUNK), jnp.float32), plgpu.Layout.WGMMA)

        def step(c, s):
            slot = c % STAGES

            @pl.when(c + 1 < nc)
            def _():
                issue(c + 1, (c + 1) % STAGES)

            plgpu.barrier_wait(bars.at[slot])
            sb = s.astype(op)

            def v_new(acc):  # S^T W^T
                plgpu.wgmma(acc, sb, plgpu.transpose_ref(w_s.at[slot], (1, 0)))

            sw = pl.run_state(v_new)(plgpu.ACC.init(zeros()))
            ut = plgpu.load(ut_s.at[slot], (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            vb16 = (ut - sw).astype(op)  # V'^T

            def out(acc):  # S^T q_dec^T + V'^T Aqk^T
                plgpu.wgmma(acc, sb, plgpu.transpose_ref(qd_s.at[slot], (1, 0)))
                plgpu.wgmma(acc, vb16, plgpu.transpose_ref(aqk_s.at[slot], (1, 0)))

            o_t = pl.run_state(out)(plgpu.ACC.init(zeros()))

            def update(acc):  # e^gam_last S^T + V'^T k_dec
                plgpu.wgmma(acc, vb16, kd_s.at[slot])

            s = pl.run_state(update)(plgpu.ACC.init(s * dec_s[c]))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's o^T has left
            o_s[...] = o_t.astype(op)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[head, vs, pl.ds(t0 + c * CHUNK, CHUNK)])
            return s

        s = jax.lax.fori_loop(0, nc, step, s0)
        plgpu.wait_smem_to_gmem(0)
        st_s[...] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, s_ref.at[r, head, vs])
        plgpu.wait_smem_to_gmem(0)

    def tile(shape):
        return plgpu.SMEM((STAGES, *shape), op, transforms=transforms)

    scratch = (
        tile((CHUNK, dk)),  # w
        tile((BV, CHUNK)),  # U^T
        tile((CHUNK, dk)),  # q_dec
        tile((CHUNK, dk)),  # k_dec
        tile((CHUNK, CHUNK)),  # Aqk
        plgpu.SMEM((BV, CHUNK), op, transforms=transforms),  # o^T
        plgpu.SMEM((BV, dk), jnp.float32),  # the state in and out
        plgpu.SMEM((nc,), jnp.float32),  # the decays
        plgpu.Barrier(num_arrivals=5, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    )
    return plgpu.kernel(
        lambda *refs: body(*refs[:9], refs[9:]),
        out_type=(
            jax.ShapeDtypeStruct((h, dv, t), op),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ),
        scratch_types=scratch,
        grid=(rows, h, dv // BV),
        grid_names=("r", "h", "v"),
    )(w, u_t, q_dec, k_dec, a_qk, decay, state)


def serial_scan_reference(w, u_t, q_dec, k_dec, a_qk, decay, state, *, rows: int):
    """:func:`serial_scan_mgpu`'s arithmetic in plain JAX, chunk by chunk (its products and
    bf16 roundings, f32 accumulation): the transposed recurrence checked on a CPU host."""
    h, t, dk = w.shape
    per_row = t // rows
    nc = per_row // CHUNK
    op = w.dtype
    f32 = jnp.float32

    def mm(a, b):
        return jnp.einsum("hij,hjk->hik", a.astype(op), b.astype(op), preferred_element_type=f32)

    outs, finals = [], []
    for r in range(rows):
        s = state[r]  # [H, Dv, Dk]
        for c in range(nc):
            tok = slice(r * per_row + c * CHUNK, r * per_row + (c + 1) * CHUNK)
            sb = s.astype(op)
            vb = (u_t[:, :, tok].astype(f32) - mm(sb, jnp.swapaxes(w[:, tok], 1, 2))).astype(op)
            o_t = mm(sb, jnp.swapaxes(q_dec[:, tok], 1, 2)) + mm(
                vb, jnp.swapaxes(a_qk[:, tok], 1, 2)
            )
            outs.append(o_t.astype(op))
            s = s * decay[:, r * nc + c][:, None, None] + mm(vb, k_dec[:, tok])
        finals.append(s)
    return jnp.concatenate(outs, axis=2), jnp.stack(finals)
