"""Experimental GDN and KDA decode kernels (issue 19): layouts and tilings to time on a GPU.

The benchmark of record for the decode layout: ``benchmarks/decode_variants.py`` times them
against ``gdn_decode`` / ``conv_gdn_decode`` / ``kda_decode`` and an XLA copy of the same
state bytes. Its winner (``DecodeTiling("vk", block_v=16, num_warps=1)``) is what
``gdn_decode`` and ``kda_decode`` now run, on the engine's pool, which is stored ``[V, K]``
(DESIGN.md §3); the ``"kv"`` variants remain as the earlier layout's experiment. Same math,
slot contract and argument order as :func:`pallas_kernels.gdn.gpu.gdn_decode` and
:func:`pallas_kernels.kda.gpu.kda_decode` (DESIGN.md §3: ``src`` 0 reads a zero state, ``dst``
0 writes nothing, checkpoints at offset 1 are written, padding rows write zeros to ``o``);
what varies is described by a :class:`DecodeTiling`:

``layout``
    ``"kv"``: the earlier pool, ``[slots, H, Dk, Dv]``; a program's tile ``[Dk, BV]`` and the
    two reductions over Dk run down the non-contiguous axis (across warps, through shared
    memory). ``"vk"`` (variant A): the pool stored transposed, ``[slots, H, Dv, Dk]`` (the
    engine's layout now); the tile
    ``[BV, Dk]`` is one contiguous ``BV * Dk`` run of the pool, and the reductions run along
    the contiguous axis, inside a warp (FlashInfer's "pretranspose" decode)::

        kv tile (BV = 4 of Dv):         vk tile:
            k0: s s s s . . . .             v0: s s s s s s s s   <- Dk contiguous
            k1: s s s s . . . .             v1: s s s s s s s s
            ...  (stride Dv)                ...  (rows BV * Dk contiguous)

``tiles``, ``prefetch``, ``num_stages`` (variant B)
    A program walks ``tiles`` consecutive (row, Dv block) tiles of one head with a
    ``fori_loop`` (tile ``t`` = row ``t // (Dv / BV)``, block ``t % (Dv / BV)``), so Triton's
    software pipeliner (``num_stages > 1``) may issue the next tile's load under this tile's
    math; ``prefetch`` does it by hand instead: the loop carries the next tile, loaded before
    this one is updated and stored (two tiles in registers).

``reduce``
    ``"sum"``: ``S^T k`` and ``S^T q`` as elementwise products and ``jnp.sum``; ``"dot"``: both
    at once as one ``[BV, Dk] x [Dk, 16]`` product (columns: k, q, zeros; IEEE f32 FMA);
    ``"dot3"`` the same on tensor cores in 3xTF32 (not exact f32: the GPU check says how far).

``fused_output``
    ``o = S'^T q`` with ``S' = S + k delta^T`` equals ``S^T q + delta (k . q)``: both
    reductions read the decayed state ``S`` (independent of each other, one pass), and the
    update only feeds the store. Off: ``o`` is reduced from the updated state, as the earlier
    kernels did.

Every variant loads its state tile before computing the token's inputs (q, k l2-norms and
gates), so that arithmetic runs under the load's latency.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.delta_rule import group_refs, l2norm, softplus
from pallas_kernels.common.delta_rule_gpu import (
    DecodeSlots,
    check_key_dim,
    compiler_params,
    pick_block_v,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn.gpu import token_inputs
from pallas_kernels.gdn.reference import check_gdn_args
from pallas_kernels.kda.reference import check_kda_args

LAYOUTS = ("kv", "vk")
REDUCES = {
    "sum": None,
    "dot": jax.lax.Precision.HIGHEST,  # IEEE f32 in the Triton lowering
    "dot3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
}
DOT_COLUMNS = 16  # Triton's smallest dot tile: the matvec's two vectors, padded with zeros


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """How a decode launch cuts and walks the state pool (see the module docstring)."""

    layout: str = "vk"
    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1
    tiles: int = 1
    prefetch: bool = False
    reduce: str = "sum"
    fused_output: bool = True
    evict_first: bool = False  # the state tile's load and stores marked streaming (L2)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce={self.reduce!r} must be one of {tuple(REDUCES)}")
        if self.tiles < 1:
            raise ValueError(f"tiles={self.tiles} must be >= 1")
        if self.reduce != "sum" and self.block_v < DOT_COLUMNS:
            raise ValueError(f"reduce={self.reduce!r} needs block_v >= {DOT_COLUMNS}")

    @property
    def name(self) -> str:
        """A readable id, e.g. ``vk_bv32_w4_s1_t1`` or ``kv_bv64_w4_s3_t4_pf_dot``."""
        extra = "_pf" * self.prefetch + f"_{self.reduce}" * (self.reduce != "sum")
        extra += "_unfused" * (not self.fused_output) + "_ef" * self.evict_first
        return (
            f"{self.layout}_bv{self.block_v}_w{self.num_warps}_s{self.num_stages}"
            f"_t{self.tiles}{extra}"
        )

    def pool_shape(self, num_slots: int, heads: int, dk: int, dv: int) -> tuple[int, ...]:
        """The state pool's shape in this layout."""
        return (num_slots, heads, dk, dv) if self.layout == "kv" else (num_slots, heads, dv, dk)


def to_layout(state: jax.Array, layout: str) -> jax.Array:
    """The engine's ``[slots, H, Dv, Dk]`` pool in ``layout`` (``"kv"`` swaps the last two
    axes; the swap is its own inverse, so this also brings a ``kv`` pool back)."""
    return state if layout == "vk" else jnp.swapaxes(state, -1, -2)


# ----------------------------------------------------------------------------- tile math


def _load_tile(pool_in, slot, h, vs, vk: bool, enabled, evict: str | None = None):
    """The f32 state tile of ``slot``: ``[BV, Dk]`` (vk) or ``[Dk, BV]`` (kv); zeros and no
    read where not ``enabled``; ``evict``: the load's L2 eviction policy."""
    dk = pool_in.shape[3] if vk else pool_in.shape[2]
    ref, shape = (
        (pool_in.at[slot, h, vs, :], (vs.size, dk))
        if vk
        else (pool_in.at[slot, h, :, vs], (dk, vs.size))
    )
    mask = jnp.full(shape, enabled)
    return pltr.load(ref, mask=mask, other=0.0, eviction_policy=evict).astype(jnp.float32)


def _store_tile(pool_out, slot, h, vs, vk: bool, s, enabled, evict: str | None = None):
    ref = pool_out.at[slot, h, vs, :] if vk else pool_out.at[slot, h, :, vs]
    pltr.store(
        ref, s.astype(pool_out.dtype), mask=jnp.full(s.shape, enabled), eviction_policy=evict
    )


def _along_k(x, vk: bool):
    """A ``[Dk]`` vector broadcast against the tile's Dk axis."""
    return x[None, :] if vk else x[:, None]


def _contract_k(s, k, q, vk: bool, reduce: str):
    """``(S^T k, S^T q)``, each ``[BV]``: two reductions over the tile's Dk axis, or one
    ``[BV, Dk] x [Dk, 16]`` product whose first two columns they are."""
    if reduce == "sum":
        axis = 1 if vk else 0
        return jnp.sum(s * _along_k(k, vk), axis=axis), jnp.sum(s * _along_k(q, vk), axis=axis)
    dk = k.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (dk, DOT_COLUMNS), 1)
    kq = jnp.where(col == 0, k[:, None], jnp.where(col == 1, q[:, None], 0.0))  # [Dk, 16]
    contract = ((1,), (0,)) if vk else ((0,), (0,))
    r = jax.lax.dot_general(s, kq, (contract, ((), ())), precision=REDUCES[reduce])  # [BV, 16]
    rc = jax.lax.broadcasted_iota(jnp.int32, r.shape, 1)
    return jnp.sum(jnp.where(rc == 0, r, 0.0), axis=1), jnp.sum(jnp.where(rc == 1, r, 0.0), axis=1)


def _update(s, q, k, v, beta, decay, vk: bool, tiling: DecodeTiling):
    """One token on the tile: returns ``(o [BV], S')``. ``decay`` is a scalar (GDN) or
    ``[Dk]`` per key channel (KDA)."""
    s = s * (decay if decay.ndim == 0 else _along_k(decay, vk))
    pred, sq = _contract_k(s, k, q, vk, tiling.reduce)  # S^T k, S^T q on the decayed state
    delta = beta * (v - pred)  # [BV]
    s = s + (delta[:, None] * k[None, :] if vk else k[:, None] * delta[None, :])
    if tiling.fused_output:
        return sq + delta * jnp.sum(k * q), s
    return _contract_k(s, k, q, vk, tiling.reduce)[1], s


# ----------------------------------------------------------------------------- the kernel


def _kernel(
    p: DecodeSlots,
    *refs,  # the family's input refs, then pool_in, o_ref [S, H, Dv], pool_out (aliased)
    inputs: Callable,  # inputs(*input_refs, r, h, vs) -> (q, k [Dk], v [BV], beta, decay)
    tiling: DecodeTiling,
    num_tiles: int,  # rows * (Dv // BV)
):
    """Program ``(i, h)``: tiles ``i * tiles .. i * tiles + tiles - 1`` of head ``h``. A tile
    index past ``num_tiles`` (the last program's tail) is clamped and writes nothing."""
    *in_refs, pool_in, o_ref, pool_out = refs
    i, h = pl.program_id(0), pl.program_id(1)
    bv, vk = tiling.block_v, tiling.layout == "vk"
    evict = "evict_first" if tiling.evict_first else None
    dv = pool_in.shape[2] if vk else pool_in.shape[3]
    nvb = dv // bv
    token = functools.partial(inputs, *in_refs)

    def locate(j):
        """Tile ``j`` of this program: (row, Dv columns, in range, live row)."""
        t = i * tiling.tiles + j
        ok = t < num_tiles
        t = jnp.minimum(t, num_tiles - 1)
        r = t // nvb
        return r, pl.ds((t % nvb) * bv, bv), ok, ok & (r < p.num_seqs[0])

    def load(j, enabled=True):
        r, vs, _, live = locate(j)
        src = p.src[r]
        return _load_tile(pool_in, src, h, vs, vk, enabled & live & (src > 0), evict)

    def finish(j, s):
        """Decay, update and store tile ``j`` (already loaded as ``s``)."""
        r, vs, ok, live = locate(j)
        q, k, v, beta, decay = token(r, h, vs)
        o, s = _update(s, q, k, v, beta, decay, vk, tiling)
        o = jnp.where(live, o, 0.0).astype(o_ref.dtype)  # padding rows: zeros
        pltr.store(o_ref.at[r, h, vs], o, mask=jnp.full(o.shape, ok))
        dst = p.dst[r]
        _store_tile(pool_out, dst, h, vs, vk, s, live & (dst > 0), evict)
        for m in range(p.ck_off.shape[1]):
            slot = p.ck_slot[r, m]
            ck = live & (slot > 0) & (p.ck_off[r, m] == 1)
            _store_tile(pool_out, slot, h, vs, vk, s, ck, evict)

    if tiling.tiles == 1:
        finish(0, load(0))
    elif tiling.prefetch:

        def body(j, s):
            nxt = load(jnp.minimum(j + 1, tiling.tiles - 1), enabled=j + 1 < tiling.tiles)
            finish(j, s)
            return nxt

        jax.lax.fori_loop(0, tiling.tiles, body, load(0))
    else:

        def body(j, carry):
            finish(j, load(j))
            return carry

        jax.lax.fori_loop(0, tiling.tiles, body, jnp.int32(0))


def _launch(
    inputs: Callable,
    args: tuple[jax.Array, ...],  # the family's inputs (gate params first), row-major
    state: jax.Array,  # the pool in tiling.layout, donated
    slots: StateSlots,
    tiling: DecodeTiling,
    *,
    out_dtype,
    name: str,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    vk = tiling.layout == "vk"
    _, heads, d2, d3 = state.shape
    dv = d2 if vk else d3
    bv = pick_block_v(dv, tiling.block_v)
    rows = slots.num_rows
    num_tiles = rows * (dv // bv)
    all_args = (*slots.arrays(), *args, state)
    kernel = group_refs(_kernel, DecodeSlots, inputs=inputs, tiling=tiling, num_tiles=num_tiles)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tiles, tiling.tiles), heads),
        out_shape=[
            jax.ShapeDtypeStruct((rows, heads, dv), out_dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(all_args) - 1: 1},
        compiler_params=compiler_params(tiling.num_warps, tiling.num_stages),
        interpret=interpret,
        name=name,
    )(*all_args)


def _engine_view(state: jax.Array, tiling: DecodeTiling, v: jax.Array, dk: int):
    """The pool as the engine's ``[slots, H, Dv, Dk]`` (shape and dtype only), for the
    references' argument checks, after checking it against ``tiling.layout``."""
    _, heads, dv = v.shape
    want = tiling.pool_shape(state.shape[0], heads, dk, dv)
    if state.ndim != 4 or state.shape != want:
        raise ValueError(f"state {state.shape} must be {want} in the {tiling.layout!r} layout")
    return jax.ShapeDtypeStruct(DecodeTiling("vk").pool_shape(*want[:2], dk, dv), state.dtype)


# ----------------------------------------------------------------------------- GDN


def gdn_decode_variant(
    q: jax.Array,  # [S, Hk, Dk]
    k: jax.Array,  # [S, Hk, Dk]
    v: jax.Array,  # [S, Hv, Dv]
    a: jax.Array,  # [S, Hv]
    b: jax.Array,  # [S, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dk, Dv] ("kv") or [.., Dv, Dk] ("vk"); donated
    slots: StateSlots,  # DESIGN.md §3
    tiling: DecodeTiling = DecodeTiling(),
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``gdn_decode`` with the pool in ``tiling.layout``. Returns ``(o [S, Hv, Dv], state)``,
    the state in the same layout, updated in place."""
    pool = _engine_view(state, tiling, v, q.shape[-1])
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, pool, slots)
    rows, hk, dk = q.shape
    hv = v.shape[1]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    check_key_dim(dk)
    inputs = functools.partial(token_inputs, ratio=hv // hk, scale=float(dk) ** -0.5)
    return _launch(
        inputs,
        (A_log, dt_bias, q, k, v, a, b),
        state,
        slots,
        tiling,
        out_dtype=v.dtype,
        name=f"gdn_decode_{tiling.layout}_gpu",
        interpret=interpret,
    )


# ----------------------------------------------------------------------------- KDA


def _kda_inputs(neg_a_ref, dt_ref, q_ref, k_ref, g_ref, v_ref, b_ref, tok, h, vs, *, scale):
    """One token's KDA inputs for head ``h``, Dv columns ``vs``: ``(q, k [Dk], v [BV], beta,
    decay [Dk])`` (the decay as a vector: each layout broadcasts it along its own Dk axis)."""
    q = l2norm(q_ref[tok, h, :].astype(jnp.float32)) * scale  # [Dk]
    k = l2norm(k_ref[tok, h, :].astype(jnp.float32))
    v = v_ref[tok, h, vs].astype(jnp.float32)  # [BV]
    g = neg_a_ref[h] * softplus(g_ref[tok, h, :].astype(jnp.float32) + dt_ref[h, :])  # [Dk]
    beta = jax.nn.sigmoid(b_ref[tok, h].astype(jnp.float32))
    return q, k, v, beta, jnp.exp(g)


def kda_decode_variant(
    q: jax.Array,  # [S, H, Dk]
    k: jax.Array,  # [S, H, Dk]
    v: jax.Array,  # [S, H, Dv]
    g: jax.Array,  # [S, H, Dk]  raw gate projection
    b: jax.Array,  # [S, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dk, Dv] ("kv") or [.., Dv, Dk] ("vk"); donated
    slots: StateSlots,  # DESIGN.md §3
    tiling: DecodeTiling = DecodeTiling(),
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``kda_decode`` with the pool in ``tiling.layout``. Returns ``(o [S, H, Dv], state)``,
    the state in the same layout, updated in place."""
    pool = _engine_view(state, tiling, v, q.shape[-1])
    check_kda_args(q, k, v, g, b, A_log, dt_bias, pool, slots)
    rows, _, dk = q.shape
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    check_key_dim(dk)
    neg_a = -jnp.exp(A_log.astype(jnp.float32))
    return _launch(
        functools.partial(_kda_inputs, scale=float(dk) ** -0.5),
        (neg_a, dt_bias.astype(jnp.float32), q, k, g, v, b),
        state,
        slots,
        tiling,
        out_dtype=v.dtype,
        name=f"kda_decode_{tiling.layout}_gpu",
        interpret=interpret,
    )
