"""What the GDN and KDA Triton GPU kernels share: tiles, slot loads and stores, the row scan.

The chunk step's math is :mod:`pallas_kernels.common.delta_rule`; the families
(:mod:`pallas_kernels.gdn.gpu`, :mod:`pallas_kernels.kda.gpu`, and the fused conv + GDN decode
:mod:`pallas_kernels.gdn.fused_decode`) own their grids and gates and call the helpers below.
The kernels use ``jax.experimental.pallas.triton`` (masked loads/stores, ``tl.dot``);
``interpret=True`` runs them with Pallas' generic interpreter on CPU.

Tiles and the pool layout: the pool stores each head's state transposed, ``S^T [Dv, Dk]``
(``[num_slots, H, Dv, Dk]``, DESIGN.md §3). Triton tiles are powers of two. A program holds all
of ``Dk`` (a power of two) and ``BV`` rows of ``Dv`` (:func:`pick_block_v`: a power of two
dividing ``Dv``), so a state block ``state[slot, h, v0:v0+BV, :]`` is one contiguous run of
``BV * Dk`` elements (``[BV, Dk]`` f32 in registers; the pool is f32 or bf16:
:func:`load_state` widens, :func:`store_state` rounds); :func:`unsupported_reason` says which
head dims ``hyjax.ops`` must leave to the reference.

Decode (memory bound: one read of the source state, one write per destination), on the
``[BV, Dk]`` tile, both reductions over K along the contiguous axis (inside a warp)::

    S^T = src > 0 ? pool[src, h, vblk, :] : 0     (masked load: nothing read)
    S^T = S^T decay;  delta = beta (v - S^T k);  o = S^T q + delta (k . q)
    S^T += delta k^T                                                (decode_update)
    pool[dst, h, vblk, :] = S^T   (masked store: dst 0 writes nothing)
    pool[ckpt_slots[m], ...] = S^T where ckpt_offsets[m] == 1

grid = (S * Dv / BV, H): program ``i`` is row ``i // (Dv / BV)``, block ``i % (Dv / BV)``, so
consecutive programs stream consecutive blocks of one slot's head. The tiling (16 rows of V,
one warp) is the H200 winner of ``benchmarks/decode_variants.py`` (BENCHMARKS.md, "Decode in
the transposed state layout": 0.89 of copy bandwidth for GDN, 0.86 for KDA).

Prefill windows: the chunk plan of :mod:`pallas_kernels.common.chunking` cuts the ragged batch
into chunks of at most ``C`` tokens that never straddle sequences or checkpoint offsets. A
chunk is read as a ``C``-row window whose start is clamped into ``[0, T - C]`` (the wrappers pad
``T`` up to ``C``); rows outside the chunk are masked to zero, which is exact (``g = beta = 0``
rows contribute nothing)::

    tokens:   ... | x x x [c c c c c] x x ... |        window = C rows starting at s0
    rows:          0 ...  ^start-s0  ^end-s0    C-1     mask = start <= s0 + i < start + len

The serial launches walk a row's chunks in order (:func:`scan_row_chunks`, one program per
row, head and Dv block: :func:`serial_grid`): the chunk math works on ``S [Dk, BV]``, so the
tile is transposed where it meets the pool (once when the row's source slot is read, once per
chunk where it is stored); it stays in registers, is stored to every checkpoint slot whose
offset is the chunk's end and, after the row's last chunk, to ``dst``.
The chunks of a row are consecutive in the plan (:func:`row_plan`: first chunk and count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import register_cap  # noqa: F401  (HYJAX_TRITON_MAXNREG's caps)
from pallas_kernels.common.chunking import ChunkPlan
from pallas_kernels.common.delta_rule import group_refs, mm
from pallas_kernels.common.slots import ROUND_EVERY, StateSlots

# The narrowest tile a kernel here takes on a head dim (the tiny test models' Dv = 8). Narrower
# ones would run as Triton FMA loops nobody has compiled on a GPU: those models take the
# reference ops instead (``unsupported_reason``).
MIN_TILE = 8

# The decode kernels' tiling (module docstring): 16 rows of V, one warp a program.
DECODE_BLOCK_V = 16
DECODE_NUM_WARPS = 1


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pick_block_v(dv: int, requested: int | None, default: int = 32) -> int:
    """The Dv columns a program owns: ``requested``, else the largest power of two dividing Dv
    up to ``default`` (Dv = 48: 16), so a Dv that is not a power of two still tiles exactly."""
    bv = min(dv & -dv, default) if requested is None else requested
    if not (is_pow2(bv) and dv % bv == 0):
        raise ValueError(f"block_v={bv} must be a power of two dividing {dv=}")
    return bv


def unsupported_reason(dk: int, dv: int) -> str | None:
    """Why the delta-rule GPU kernels cannot take these head dims, or None. Triton tiles are
    powers of two: a program holds all of Dk, and Dv in tiles of the largest power of two
    dividing it."""
    if not (is_pow2(dk) and dk >= MIN_TILE):
        return f"key head dim {dk} is not a power of two >= {MIN_TILE} (one Triton tile holds Dk)"
    if dv & -dv < MIN_TILE:
        return f"value head dim {dv} has no power-of-two tile of >= {MIN_TILE} columns"
    return None


def check_key_dim(dk: int) -> None:
    if not is_pow2(dk):
        raise ValueError(f"{dk=} must be a power of two for the Triton kernels")


def compiler_params(num_warps: int, num_stages: int):
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def operand_dtype_for(dtype, requested=None):
    """The dtype of the prefill's matmul operands and scratch: ``requested``, else 16-bit
    activations' own (FLA's choice: bf16 products, f32 accumulation and state) and float32
    otherwise (float32 models keep float32 products)."""
    if requested is not None:
        return jnp.dtype(requested)
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


# ----------------------------------------------------------------------------- state blocks


def load_state(pool_in, slot, h, vs, enabled):
    """``pool_in[slot, h, vs, :]`` as ``[BV, Dk]`` f32 (``S^T``'s rows ``vs``; a bf16 pool's
    state widened), zeros where not ``enabled`` (no read)."""
    mask = jnp.full((vs.size, pool_in.shape[3]), enabled)
    return pltr.load(pool_in.at[slot, h, vs, :], mask=mask, other=0.0).astype(jnp.float32)


def store_state(pool_out, slot, h, vs, s, enabled):
    """``pool_out[slot, h, vs, :] = s`` (``[BV, Dk]``) rounded to the pool's dtype, where
    ``enabled`` (a masked store: nothing otherwise)."""
    s = s.astype(pool_out.dtype)
    pltr.store(pool_out.at[slot, h, vs, :], s, mask=jnp.full(s.shape, enabled))


def decode_update(s, q, k, v, beta):
    """One token on a decayed state tile ``s = S^T [BV, Dk]``: ``q, k [Dk]``, ``v [BV]``,
    ``beta`` a scalar. Returns ``(o [BV], s)``.

    ``o = S'^T q`` with ``S' = S + k delta^T`` is ``S^T q + delta (k . q)``: both reductions
    read the decayed tile (independent, one pass over it) and the update only feeds the store.
    """
    pred = jnp.sum(s * k[None, :], axis=1)  # [BV] = S^T k
    sq = jnp.sum(s * q[None, :], axis=1)  # [BV] = S^T q
    delta = beta * (v - pred)  # [BV]
    return sq + delta * jnp.sum(k * q), s + delta[:, None] * k[None, :]


class DecodeSlots(NamedTuple):
    """A decode kernel's slot refs, ``StateSlots.arrays()``."""

    src: jax.Array  # i32[S]
    dst: jax.Array  # i32[S]
    ck_off: jax.Array  # i32[S, M]
    ck_slot: jax.Array  # i32[S, M]
    num_seqs: jax.Array  # i32[1]


def decode_program(
    p: DecodeSlots,
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [S, H, Dv]
    pool_out,  # aliased to pool_in
    *,
    bv: int,
    inputs: Callable,  # inputs(r, h, vs) -> (q, k [Dk], v [BV], beta, decay: exp(g))
):
    """Program ``(i, h)`` of a decode kernel: row ``r = i // (Dv / BV)``'s state block
    ``vs`` of head ``h`` (``[BV, Dk]``), decayed by the family's ``decay`` (a scalar, or
    ``[1, Dk]`` per key channel), updated, stored to ``dst`` and to the checkpoints at offset 1.
    Padding rows write zeros to ``o``."""
    i, h = pl.program_id(0), pl.program_id(1)
    nvb = pool_in.shape[2] // bv
    r = i // nvb
    vs = pl.ds((i % nvb) * bv, bv)
    live = r < p.num_seqs[0]
    src, dst = p.src[r], p.dst[r]
    # The tile's load is issued first: the token's inputs (l2 norms, gates) run under it.
    s = load_state(pool_in, src, h, vs, live & (src > 0))  # [BV, Dk]
    q, k, v, beta, decay = inputs(r, h, vs)
    o, s = decode_update(s * decay, q, k, v, beta)
    o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
    store_state(pool_out, dst, h, vs, s, live & (dst > 0))
    for m in range(p.ck_off.shape[1]):
        slot = p.ck_slot[r, m]
        store_state(pool_out, slot, h, vs, s, live & (slot > 0) & (p.ck_off[r, m] == 1))


def launch_decode(
    kernel: Callable,  # kernel(DecodeSlots, *inputs, pool_in, o, pool_out, *, bv, **params)
    *,
    name: str,
    slots: StateSlots,
    inputs: Sequence[jax.Array],  # the gate parameters, then the row-major activations
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    out_dtype,
    bv: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    **params,
) -> tuple[jax.Array, jax.Array]:
    """One ``pallas_call`` over grid ``(S * Dv / BV, H)``; returns ``(o [S, H, Dv], state)``."""
    rows = slots.num_rows
    _, h, dv, _ = state.shape
    args = (*slots.arrays(), *inputs, state)
    return pl.pallas_call(
        group_refs(kernel, DecodeSlots, bv=bv, **params),
        grid=(rows * (dv // bv), h),
        out_shape=[
            jax.ShapeDtypeStruct((rows, h, dv), out_dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*args)


# ----------------------------------------------------------------------------- prefill


def pad_tokens(
    xs: Sequence[jax.Array], chunk: int, multiple: int = 1
) -> tuple[list[jax.Array], int]:
    """The token-major inputs padded to at least ``chunk`` tokens (a window needs ``T >= C``)
    and to a ``multiple`` of tokens, and the padded count."""
    n = xs[0].shape[0]
    pad = -(-max(n, chunk) // multiple) * multiple - n

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

    return list(map(padded, xs)), n + pad


class Window(NamedTuple):
    rows: pl.Slice  # the C token rows read, [w0, w0 + C)
    tok: jax.Array  # i32[C]  their token indices
    valid: jax.Array  # bool[C]  inside the chunk
    start: jax.Array  # i32[]  the chunk's first token
    length: jax.Array  # i32[]


def window(start, length, num_tokens: int, chunk: int, aligned: bool = False) -> Window:
    """The ``chunk``-row window of a chunk (start clamped in bounds) and its valid-row mask;
    ``aligned``: the ``chunk``-token block of the batch the chunk lies in (a token-aligned
    plan: ``chunking.plan_chunks(token_aligned=True)``, ``num_tokens`` a multiple of it)."""
    w0 = start - start % chunk if aligned else jnp.minimum(start, num_tokens - chunk)
    tok = w0 + jnp.arange(chunk, dtype=jnp.int32)
    return Window(pl.ds(w0, chunk), tok, (tok >= start) & (tok < start + length), start, length)


def sub_rows(w0, b: int, sub: int, start, length):
    """Sub-block ``b`` of ``sub`` rows of a window starting at ``w0``: its rows and their
    valid mask (inside the chunk ``[start, start + length)``)."""
    tok = w0 + b * sub + jnp.arange(sub, dtype=jnp.int32)
    return pl.ds(w0 + b * sub, sub), (tok >= start) & (tok < start + length)


def operand_precision(precision, operand_dtype):
    """The precision of a dot on ``operand_dtype`` operands: ``precision`` for f32; HIGHEST
    for bf16, which the Triton lowering turns into a plain bf16 MMA (DEFAULT would request
    TF32 inputs) and the CPU interpreter into a bf16 product accumulated in f32."""
    return precision if jnp.dtype(operand_dtype) == jnp.float32 else jax.lax.Precision.HIGHEST


def operand_products(precision, operand_dtype) -> Callable:
    """An intra launch's score and W / U products, ``prod(a, b, contract=NN)``: both operands
    cast to ``operand_dtype``, f32 accumulation, at :func:`operand_precision` (bf16: as FLA's
    chunk kernels round them)."""
    prec = operand_precision(precision, operand_dtype)

    def prod(a, b, contract=((1,), (0,))):
        return mm(a.astype(operand_dtype), b.astype(operand_dtype), contract, prec)

    return prod


def store_blocked_w_u(
    t, kb_dec, rows, valid, beta, h, v_ref, w_ref, u_ref, pmm, tma_layout, v_blocks=None,
    w_row_scale=None,
):  # fmt: skip
    """An intra launch's ``W = Tm (beta e^gam k)`` and ``U = Tm (beta v)`` by 16-row blocks
    (GDN's blocked form, KDA's): ``t[i, j]`` the inverse's blocks (``j <= i``), ``kb_dec[j]``
    W's operand, ``rows`` / ``valid`` / ``beta`` each block's; ``pmm`` the products. v's rows
    are read for each product (from L2 after the first: no v tile kept live), or taken from
    ``v_blocks`` (each block's ``[16, Dv]`` rows, read by the caller: :func:`load_v_blocks`);
    ``U^T`` with ``tma_layout``; ``u_ref`` None: W only. ``w_row_scale`` (each block's
    ``[16]``): W's rows scaled by it before they are stored."""
    nsub = len(rows)
    for bi in range(nsub):
        w = sum(pmm(t[bi, bj], kb_dec[bj]) for bj in range(bi + 1))
        if w_row_scale is not None:
            w = w * w_row_scale[bi][:, None]
        pltr.store(w_ref.at[h, rows[bi], :], w.astype(w_ref.dtype), mask=valid[bi][:, None])
    if u_ref is None:
        return
    dv = v_ref.shape[-1]
    bv = dv & -dv  # Dv itself when a power of two (one tile), else its largest such divisor

    def v_beta(bj, vs):
        if v_blocks is not None and bv == dv:
            vt = v_blocks[bj]
        else:
            vt = pltr.load(v_ref.at[rows[bj], h, vs], mask=valid[bj][:, None], other=0.0)
        return vt.astype(jnp.float32) * beta[bj][:, None]

    for bi in range(nsub):
        r, ok = rows[bi], valid[bi][:, None]
        for vb in range(dv // bv):
            vs = pl.ds(vb * bv, bv)
            u = sum(pmm(t[bi, bj], v_beta(bj, vs)) for bj in range(bi + 1))  # [16, BV]
            if tma_layout:
                pltr.store(u_ref.at[h, vs, r], u.T.astype(u_ref.dtype), mask=ok.T)
            else:
                pltr.store(u_ref.at[h, r, vs], u.astype(u_ref.dtype), mask=ok)


def load_v_blocks(v_ref, rows, valid, h):
    """Each 16-row block's ``v [16, Dv]`` (zeros outside the chunk) in its own dtype, for
    :func:`store_blocked_w_u`'s ``v_blocks``; None where ``Dv`` is not a power of two (that
    function then reads v by column tiles)."""
    dv = v_ref.shape[-1]
    if dv & (dv - 1):
        return None
    return [pltr.load(v_ref.at[r, h, :], mask=ok[:, None], other=0.0) for r, ok in zip(rows, valid)]


class RowPlan(NamedTuple):
    """A serial launch's plan refs (:func:`row_plan`)."""

    row_first: jax.Array  # i32[S]  first chunk of each row in the plan
    row_chunks: jax.Array  # i32[S]  its chunk count
    c_start: jax.Array  # i32[NC]
    c_len: jax.Array  # i32[NC]
    c_end: jax.Array  # i32[NC]
    src: jax.Array  # i32[S]
    dst: jax.Array  # i32[S]
    ck_off: jax.Array  # i32[S, M]
    ck_slot: jax.Array  # i32[S, M]


def row_plan(plan: ChunkPlan, slots: StateSlots, num_chunks: int) -> RowPlan:
    """The chunk plan by row, with the slots: what :func:`scan_row_chunks` walks."""
    rows = slots.num_rows
    # Chunks of a row are consecutive in the plan: its first chunk and how many.
    is_first = (plan.first == 1) & (plan.length > 0)
    row_first = (
        jnp.zeros(rows, jnp.int32)
        .at[jnp.where(is_first, plan.seq, rows)]
        .set(jnp.arange(num_chunks, dtype=jnp.int32), mode="drop")
    )
    row_chunks = jnp.zeros(rows, jnp.int32).at[plan.seq].add((plan.length > 0).astype(jnp.int32))
    return RowPlan(row_first, row_chunks, plan.start, plan.length, plan.end, *slots.arrays()[:4])


# The serial launches' grid order on NVIDIA (:func:`serial_grid`; benchmarks.gdn_kernels --sweep).
SERIAL_VB_FIRST = True


def serial_grid(rows: int, heads: int, num_v_blocks: int, vb_first: bool) -> tuple[int, ...]:
    """A serial launch's grid over (row, head, Dv block). ``vb_first`` puts the Dv blocks on
    the fastest-launched axis, so the programs of one (row, head) run side by side and read
    each chunk's shared operands (the rows over all of Dk) through L2 once, instead of once
    per Dv block from memory when rows x heads x blocks outnumber the resident programs."""
    return (num_v_blocks, rows, heads) if vb_first else (rows, heads, num_v_blocks)


def resident_programs() -> int:
    """How many programs of a serial launch run at once, one per SM: the first device's SM
    count where JAX reports it (``core_count`` on CUDA devices), else an H100's / H200's 132."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except RuntimeError:  # no backend initialised (tracing for a foreign platform)
        return 132


def serial_block_v(rows: int, heads: int, dv: int, requested: int | None) -> int:
    """The serial launch's Dv block when not given: 64 columns when the launch still fills the
    SMs with them (one wave, within 10 %), else 32 (twice the programs). Wider blocks read each
    chunk's shared operands (the rows over all of Dk) half as often; narrower ones give a short
    batch the programs to spread over. ``rows`` is the launch's row count (padding rows'
    programs exit at once). H200, ``benchmarks.gdn_kernels --sweep``: B=1 T=4096 (64 vs 128
    programs) 0.31 vs 0.27 ms; B=2 0.375 vs 0.489; B=8 1.33 vs 1.78."""
    if requested is not None:
        return pick_block_v(dv, requested)
    wide = pick_block_v(dv, None, default=64)
    if rows * heads * (dv // wide) >= 0.9 * resident_programs():
        return wide
    return pick_block_v(dv, None, default=32)


def serial_ids(vb_first: bool):
    """This program's ``(row, head, Dv block)`` under :func:`serial_grid`'s layout."""
    if vb_first:
        return pl.program_id(1), pl.program_id(2), pl.program_id(0)
    return pl.program_id(0), pl.program_id(1), pl.program_id(2)


def scan_row_chunks(
    p: RowPlan,
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    pool_out,  # aliased to pool_in
    *,
    r,  # this program's row
    h,  # and head
    vs: pl.Slice,  # and Dv columns
    num_tokens: int,
    chunk: int,
    step: Callable,  # step(ci, w: Window, s [Dk, BV]) -> s after chunk ci
):
    """Program ``(r, h, vs)`` of a serial launch: ``S <- pool[src[r], h, vs, :]^T`` (zeros
    when src == 0), then row ``r``'s chunks in order, storing ``S^T`` where a checkpoint's
    offset is the chunk's end and, after the last chunk, to ``dst``. A bf16 pool's state is
    rounded every ``ROUND_EVERY`` tokens of the row (``pallas_kernels.common.slots``)."""
    n_chunks = p.row_chunks[r]
    src, dst = p.src[r], p.dst[r]
    s0 = load_state(pool_in, src, h, vs, (n_chunks > 0) & (src > 0)).T  # [Dk, BV]

    def body(i, s):
        ci = p.row_first[r] + i
        start, length, end = p.c_start[ci], p.c_len[ci], p.c_end[ci]
        s = step(ci, window(start, length, num_tokens, chunk), s)
        if pool_out.dtype != jnp.float32:  # a bf16 pool: the carried state rounds too
            s = jnp.where(end % ROUND_EVERY == 0, s.astype(pool_out.dtype).astype(s.dtype), s)
        s_t = s.T  # [BV, Dk]: the pool's layout, for every store of this chunk
        for m in range(p.ck_off.shape[1]):
            slot = p.ck_slot[r, m]
            store_state(pool_out, slot, h, vs, s_t, (slot > 0) & (p.ck_off[r, m] == end))
        store_state(pool_out, dst, h, vs, s_t, (i == n_chunks - 1) & (dst > 0))
        return s

    jax.lax.fori_loop(0, n_chunks, body, s0)
