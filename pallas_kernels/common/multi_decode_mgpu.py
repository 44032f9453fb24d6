"""k-token decode (speculative verify) in Mosaic GPU: one state read, a store after each token.

The Triton k-token decode (:mod:`pallas_kernels.common.multi_decode_gpu`) measured 54-61 % of
copy at k = 4 on an H200 (BENCHMARKS.md; bytes: one state read and k + 1 writes): each
program holds one ``[64, Dk]`` tile and its token loop's stores are plain ones, issued one
after another. This kernel is the one-token Mosaic GPU decode's design
(:mod:`pallas_kernels.common.decode_mgpu`) carried over k tokens:

- ``programs`` persistent programs (default one an SM) walk the items ``(row, head, 64 rows of
  S^T)``; each item's copies on one barrier of its buffer: the tile ``pool[src, h, vb]`` and its
  row's k tokens' inputs (``vectors [k, n, Dk]``, ``gates [k, 3, H]``, ``v [k, 64]``: three TMA
  copies whatever k, from :func:`decode_mgpu.gdn_inputs` / ``kda_inputs`` over the step's tokens,
  padded by k rows so a row's window never leaves the arrays); ``buffers - 1`` items in flight;
- the state stays in registers through the row's tokens (``t < len``; after the last one the
  window's next tokens update it, but nothing is stored any more); after token ``t`` the state
  goes to a store buffer and TMA stores it to each checkpoint slot at offset ``t + 1`` and to
  ``dst`` at the row's last token, and ``o_t`` leaves from its own buffer. A token's stores
  are one commit group; the two store buffers alternate over the program's tokens, so a buffer
  is rewritten once the group before the last has read it (``wait_smem_to_gmem(1,
  wait_read_only=True)``), and a load buffer is refilled as soon as its item's tile is in
  registers (no store reads it).

Slot contract (DESIGN.md §3) as ``multi_decode_gpu``: ``src`` 0 reads zeros, ``dst`` 0 and
checkpoint slot 0 write nothing, tokens of padding rows and rows ``>= num_seqs`` read and write
nothing, their outputs zero. A live row longer than ``max_tokens`` (only detectable under
``jit``) is poisoned after the kernel as there: its outputs and its ``dst`` state NaN, its
checkpoints at offsets ``<= max_tokens`` exact.

Checked in Pallas' GPU interpreter against the prefill references and lowered at the 80B /
Kimi heads (tests); on an H200 (BENCHMARKS.md) checked against them compiled and timed beside
Triton's: 1.44x at k = 4, slower at k = 1 and 2. ``multi_decode_gpu.gdn_multi_decode`` /
``kda_multi_decode`` run it by default for rows of at least :data:`MGPU_MIN_TOKENS` tokens
(``max_tokens``), and when asked (``kernel="mgpu"`` or ``HYJAX_MULTI_DECODE_KERNEL=mgpu``).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.chunk_scan_mgpu import (
    SMEM_BYTES,
    GpuOps,
    InterpretOps,
    _plgpu,
    choose_mgpu,
    pool_kernel,
)
from pallas_kernels.common.decode_mgpu import (
    BV,
    LANES,
    _round_up,
    padded_inputs,
    program_count,
    smem_bytes,
    tile_reason,
)
from pallas_kernels.common.slots import StateSlots

BUFFERS = 3  # items a program has in shared memory: BUFFERS - 1 in flight beside the one updated
PROGRAMS_PER_SM = 1
f32 = jnp.float32
# The k-token decode a GPU runs when not told (``kernel=None``): ``"auto"``, this one for rows of
# at least MGPU_MIN_TOKENS tokens and Triton's below. On an H200 (2026-11-29, BENCHMARKS.md) at
# k = 4 it took 279 against 400 us (GDN, 64 rows, 1.44x) and made the engine's verify step at
# K = 3 4.4 % faster; at k = 1 and 2 Triton's was 1.25x and 1.11x faster (one state store a
# token from registers against this kernel's trip through shared memory). k = 3 is not yet
# measured. HYJAX_MULTI_DECODE_KERNEL=mgpu | triton | auto sets it for a process.
MULTI_DECODE_DEFAULT = os.environ.get("HYJAX_MULTI_DECODE_KERNEL", "auto")
MGPU_MIN_TOKENS = 4


def _scratch(rows, heads, dk, nvec, num_ckpt, k, pool_dtype, buffers):
    """The tiles (``buffers``), two store buffers of the state and of ``o``, the rows' plan,
    the barriers (a buffer's: its tile and three token copies; the plan's), then the k tokens'
    inputs of each buffer."""
    plgpu = _plgpu()
    return (
        plgpu.SMEM((buffers, BV, dk), pool_dtype),
        plgpu.SMEM((2, BV, dk), pool_dtype),
        plgpu.SMEM((2, BV), f32),
        plgpu.SMEM((4 + 2 * num_ckpt, _round_up(rows, LANES)), jnp.int32),
        plgpu.Barrier(num_arrivals=4, num_barriers=buffers),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
        plgpu.SMEM((buffers, k, nvec, dk), f32),
        plgpu.SMEM((buffers, k, 3, _round_up(heads, LANES)), f32),
        plgpu.SMEM((buffers, k, BV), f32),
    )


def unsupported_reason(
    rows, heads, dk, dv, num_ckpt, k, pool_dtype, vectors=2, buffers=None
) -> str | None:
    """Why this kernel cannot take a k-token decode (the Triton one then does), or None;
    ``buffers`` None: :data:`BUFFERS` (read at the call: a benchmark's sweep sets it)."""
    buffers = BUFFERS if buffers is None else buffers
    if why := tile_reason(pool_dtype, dk):
        return why
    if dv % BV:
        return f"Dv={dv} (a multiple of {BV})"
    need = smem_bytes(_scratch(rows, heads, dk, vectors, num_ckpt, k, pool_dtype, buffers))
    if need > SMEM_BYTES:
        return f"{rows} rows of {k} tokens: shared memory {need} bytes over {SMEM_BYTES}"
    return None


def multi_decode_is_mgpu(
    kernel, state, slots: StateSlots, max_tokens: int, vectors: int, interpret: bool
) -> bool:
    """Whether a GDN (``vectors`` 2) / KDA (3) k-token GPU decode runs this kernel: its
    ``kernel`` (``"mgpu"``, ``"triton"``, or None: :data:`MULTI_DECODE_DEFAULT`, where
    ``"auto"`` is this kernel from :data:`MGPU_MIN_TOKENS` tokens a row on; Triton in
    interpret mode); see ``chunk_scan_mgpu.choose_mgpu``."""
    _, heads, dv, dk = state.shape
    num_ckpt = slots.ckpt_offsets.shape[1]

    def why():
        args = (slots.num_rows, heads, dk, dv, num_ckpt, max_tokens, state.dtype, vectors)
        return unsupported_reason(*args)

    default = MULTI_DECODE_DEFAULT
    if default == "auto":
        default = "mgpu" if max_tokens >= MGPU_MIN_TOKENS else "triton"
    return choose_mgpu(
        "kernel", kernel, default, "HYJAX_MULTI_DECODE_KERNEL", interpret, why,
        "k-token decode",
    )  # fmt: skip


def _row_plan(qsl, slots: StateSlots, k: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """i32 ``[4 + 2M, S padded]``: each row's first token (clamped to ``[0, T]``: a padding
    row's window stays inside the inputs), its tokens (at most ``k``; 0 for a
    row ``>= num_seqs``), ``src``, ``dst`` (0 where nothing is read or written), checkpoint
    offsets, checkpoint slots (0: none); and each row's whether it is longer than ``k``."""
    rows = slots.num_rows
    live = jnp.arange(rows) < slots.num_seqs
    length = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    first = jnp.clip(qsl[:-1], 0, num_tokens)
    cols = [first, jnp.minimum(length, k), jnp.where(live, slots.src_slot, 0)]
    cols.append(jnp.where(live, slots.dst_slot, 0))
    ck = jnp.where(live[:, None], slots.ckpt_slots, 0)
    plan = jnp.concatenate([jnp.stack(cols), slots.ckpt_offsets.T, ck.T]).astype(jnp.int32)
    return jnp.pad(plan, [(0, 0), (0, _round_up(rows, LANES) - rows)]), length > k


def _store_if(cond, src, dst):
    """A TMA store of ``src`` (shared memory) to ``dst`` where ``cond``, in the open group."""

    @pl.when(cond)
    def _():
        _plgpu().copy_smem_to_gmem(src, dst, commit_group=False)


def _body(refs, scratch, *, ops, rows, programs, buffers, ratio, per_channel, k):
    plgpu = _plgpu()
    plan_ref, vec_ref, gate_ref, v_ref, pool_in, pool_out, o_ref = refs
    tile_s, st_s, o_s, plan_s, bars, plan_bar, vec_s, gate_s, v_s = scratch
    heads, dv = pool_in.shape[1], pool_in.shape[2]
    num_ckpt = (plan_s.shape[0] - 4) // 2
    nvb = dv // BV
    c = jax.lax.axis_index("c")

    plgpu.copy_gmem_to_smem(plan_ref, plan_s, plan_bar.at[0])
    plgpu.barrier_wait(plan_bar.at[0])
    n = (rows * heads * nvb - c + programs - 1) // programs  # this program's items

    def item(j):  # (row, head, Dv block) of this program's j-th item
        i = c + j * programs
        return i // (nvb * heads), (i // nvb) % heads, i % nvb

    def issue(j, b):
        r, h, vb = item(j)
        bar, toks, vs = bars.at[b], pl.ds(plan_s[0, r], k), pl.ds(vb * BV, BV)
        plgpu.copy_gmem_to_smem(pool_in.at[plan_s[2, r], h, vs], tile_s.at[b], bar)
        plgpu.copy_gmem_to_smem(vec_ref.at[toks, h // ratio], vec_s.at[b], bar)
        plgpu.copy_gmem_to_smem(gate_ref.at[toks], gate_s.at[b], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[toks, h, vs], v_s.at[b], bar)

    for p in range(buffers - 1):

        @pl.when(p < n)
        def _(p=p):
            issue(p, p)

    shape = (BV, tile_s.shape[2])

    def row_vec(b, t, i):  # vectors[t, i] of buffer b, broadcast over the tile's rows
        return jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[b, t, i]), shape, (1,))

    def step(j, carry):
        b = j % buffers
        ahead = j + buffers - 1

        @pl.when(ahead < n)
        def _():  # buffer (j - 1) % buffers: item j - 1's tile is past (no store reads it)
            issue(ahead, ahead % buffers)

        r, h, vb = item(j)
        vs = pl.ds(vb * BV, BV)
        start, length, src, dst = plan_s[0, r], plan_s[1, r], plan_s[2, r], plan_s[3, r]
        plgpu.barrier_wait(bars.at[b])
        s = ops.load(tile_s.at[b], optimized=False).astype(f32)  # S^T [BV, Dk]
        s = jnp.where(src > 0, s, 0.0)  # slot 0's tile was read, not used
        for t in range(k):
            valid = t < length
            decay = row_vec(b, t, 2) if per_channel else gate_s[b, t, 0, h]
            q, kk = row_vec(b, t, 0), row_vec(b, t, 1)
            beta = gate_s[b, t, 1, h]  # past the row: s changes, and is stored no more
            s = s * decay
            pred = jnp.sum(s * kk, axis=1)  # S^T k [BV]
            sq = jnp.sum(s * q, axis=1)
            delta = beta * (ops.load_col_vector(v_s.at[b, t]) - pred)
            o = sq + delta * gate_s[b, t, 2, h]
            s = s + jax.lax.broadcast_in_dim(delta, s.shape, (0,)) * kk
            # store buffer p: the program's token count alternates them; the group before the
            # last (token t - 2's, or an earlier item's) has read it
            p = (j * k + t) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            st_s.at[p][...] = s.astype(st_s.dtype)
            o_s.at[p][...] = o
            plgpu.commit_smem()
            hits = [
                (plan_s[4 + num_ckpt + m, r], plan_s[4 + m, r] == t + 1) for m in range(num_ckpt)
            ]
            hits.append((dst, length == t + 1))
            for slot, hit in hits:
                _store_if(valid & (slot > 0) & hit, st_s.at[p], pool_out.at[slot, h, vs])
            _store_if(valid, o_s.at[p], o_ref.at[start + t, h, vs])
            plgpu.commit_smem_to_gmem_group()  # (empty where the token stores nothing)
        return carry

    jax.lax.fori_loop(0, n, step, 0)
    plgpu.wait_smem_to_gmem(0)


def multi_decode_mgpu(
    token_inputs: tuple[jax.Array, ...],  # decode_mgpu.gdn_inputs' / kda_inputs' over [T]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,
    *,
    max_tokens: int,
    out_dtype,
    name: str,
    programs: int | None = None,
    buffers: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel (module docstring) on the step's token inputs (``vectors [T, Hk, n, Dk]``,
    ``gates [T, 3, H]``, ``v [T, H, Dv]``). Returns ``(o [T, H, Dv], state)``; outputs of
    tokens past ``qsl[num_seqs]`` are zero."""
    plgpu = _plgpu()
    _, heads, dv, dk = state.shape
    rows, num_ckpt = slots.num_rows, slots.ckpt_offsets.shape[1]
    vectors, gates, v = token_inputs
    num_tokens, hk, nvec = vectors.shape[0], vectors.shape[1], vectors.shape[2]
    k = max_tokens
    buffers = BUFFERS if buffers is None else buffers
    why = unsupported_reason(rows, heads, dk, dv, num_ckpt, k, state.dtype, nvec, buffers)
    if why:
        raise ValueError(f"the Mosaic GPU k-token decode cannot take this batch: {why}")
    if buffers < 2:
        raise ValueError(f"buffers={buffers}: at least 2 (one item in flight)")
    qsl = query_start_loc.astype(jnp.int32)
    plan, too_long = _row_plan(qsl, slots, k, num_tokens)
    args = (plan, *padded_inputs(vectors, gates, v, heads, tokens_after=k))
    programs = program_count(programs, rows * heads * (dv // BV), PROGRAMS_PER_SM, interpret)
    scratch = _scratch(rows, heads, dk, nvec, num_ckpt, k, state.dtype, buffers)
    body = functools.partial(
        _body, ops=InterpretOps if interpret else GpuOps, rows=rows, programs=programs,
        buffers=buffers, ratio=heads // hk, per_channel=nvec == 3, k=k,
    )  # fmt: skip
    mesh = plgpu.Mesh(grid=(programs,), grid_names=("c",))
    o_type = jax.ShapeDtypeStruct((num_tokens, heads, dv), f32)
    length = plan[1, :rows]  # dst written at the row's last token, a checkpoint inside the row
    ck_off, ck_slot = plan[4 : 4 + num_ckpt, :rows], plan[4 + num_ckpt :, :rows]
    written = jnp.concatenate([
        jnp.where(length > 0, plan[3:4, :rows], 0),
        jnp.where((ck_off >= 1) & (ck_off <= length[None]), ck_slot, 0),
    ])  # fmt: skip
    o, state = pool_kernel(
        body, scratch, mesh, args, state, o_type, written, name=f"{name}_mgpu",
        interpret=interpret,
    )  # fmt: skip
    # tokens no live row owns were never written; a row longer than k poisoned (module doc)
    token = jnp.arange(num_tokens)
    row = jnp.clip(jnp.searchsorted(qsl, token, side="right") - 1, 0, rows - 1)
    live = token < qsl[jnp.asarray(slots.num_seqs, jnp.int32)]
    o = jnp.where(live[:, None, None], jnp.where(too_long[row][:, None, None], jnp.nan, o), 0)
    bad = jnp.where(too_long & (plan[3, :rows] > 0), plan[3, :rows], state.shape[0])
    state = state.at[bad].set(jnp.nan, mode="drop")
    return o.astype(out_dtype), state
