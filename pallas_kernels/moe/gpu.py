"""Routed MoE experts for NVIDIA GPUs: a grouped matmul in Pallas (Triton lowering).

Same signature and semantics as :func:`pallas_kernels.moe.reference.moe_experts_reference`
(plus tuning keywords). XLA lowers ``ragged_dot`` on GPU to dense matmuls over every expert;
here only the rows routed to an expert meet its weights.

Plan (XLA, loop-free: an XLA ``while`` trip is a host round trip on GPU)
------------------------------------------------------------------------
The ``P = T * k`` (token, expert) pairs are sorted by expert (skipped pairs, ids outside
``[0, E)``, sort last and get no row) and each expert's group is padded to a multiple of the
row block ``BM``, so a block of ``BM`` rows belongs to one expert::

    experts of the sorted pairs:  e0 x5 | e2 x9 | skipped x2              (E = 3, BM = 4)
    padded rows (sorted place):   | 0 1 2 3 | 4 - - - | 5 6 7 8 | 9 10 11 12 | 13 - - - | ...
    block:                            0         1         2          3           4     5 ..
    block_expert:                     0         0         2          2           2    (unused)

    NB = (P + min(E, P) * (BM - 1)) // BM  (static bound: each non-empty group wastes < BM rows)

Per padded row: the token it reads (``-1``: padding) and its routing weight (0 for padding);
per block: its expert; ``used`` = the blocks that hold any pair. Programs of blocks past
``used`` return at once (``pl.when``).

Three ways to the same plan: up to 128 pairs over 512 experts or more, every pair compared
with every pair in one Pallas kernel (:func:`route_kernel`); up to 640 pairs the same
comparisons as XLA row reductions (:func:`route_pairwise`); past that a sort (:func:`route`).

Kernels
-------
A. grid ``(NB, F // BN_a)``: gathers the block's token rows of ``x`` in the kernel (a masked
   gather: padding rows read nothing) and writes ``h = silu(x W_gate[e]) * (x W_up[e])`` for
   its ``BN_a`` columns, both products accumulated in float32 over ``D`` in ``BK_a`` steps::

       h[rows, cols] = silu(x[tok] @ W_gate[e][:, cols]) * (x[tok] @ W_up[e][:, cols])

B. grid ``(NB, D // BN_b)``: ``y[rows, cols] = w_row * (h[rows] @ W_down[e][:, cols])``.

Combine (XLA): each token has exactly ``k`` pairs, so ``out[t] = sum_j y[row(t, j)]`` is a
gather and a float32 sum over ``k`` (deterministic; no scatter-add).

Tiles: :func:`default_tiles` picks them from the rows per expert (decode: ~10 rows meet an
expert, ``BM = 16``; up to 256 rows ``BM = 64``; past that ``BM = 128``) and shrinks the depth
step until the operand pipeline fits in shared memory (H100: 227 KiB a block). Requirements:
tile sizes powers of two dividing ``D`` and ``F``; each operand under 2**31 elements (Triton's
32-bit offsets). ``interpret=True`` runs the kernels with Pallas' generic interpreter on CPU.

On an H100 at Qwen3-Next-80B expert shapes (BENCHMARKS.md, "MoE grouped matmul"): decode reads
the expert weights at 2.2-2.6 TB/s (T = 64: 0.19 ms against ``ragged_dot``'s 0.56 at E = 64),
prefill runs 323 TFLOP/s (T = 4096: 0.80 ms against 25.8), both close to torch's CUTLASS
grouped GEMM; the route plan is 0.04-0.13 ms of it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.moe.reference import check_moe_args

# Shared memory the operand pipeline may take (of the H100's 227 KiB a block): the rest is
# left to Triton's layout conversions and the epilogue.
SMEM_BUDGET = 160 * 1024


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    """Tile sizes and launch parameters of the two kernels (all static)."""

    block_m: int  # rows (pairs) per block; each expert's group is padded to a multiple of it
    block_n_a: int  # kernel A: columns of F per program
    block_k_a: int  # kernel A: depth step over D
    warps_a: int
    stages_a: int
    block_n_b: int  # kernel B: columns of D per program
    block_k_b: int  # kernel B: depth step over F
    warps_b: int
    stages_b: int

    def smem_bytes(self, itemsize: int) -> tuple[int, int]:
        """Shared memory of each kernel's operand pipeline (A: x, W_gate, W_up tiles; B: h,
        W_down tiles), per stage times stages."""
        a = (self.block_m + 2 * self.block_n_a) * self.block_k_a * itemsize * self.stages_a
        b = (self.block_m + self.block_n_b) * self.block_k_b * itemsize * self.stages_b
        return a, b


# Rows per expert -> tiles (bf16): the best of the H100 sweep in BENCHMARKS.md ("MoE grouped
# matmul"): 16-row blocks while an expert meets ~10 rows (decode: the weights are the traffic),
# 64 up to 256 rows, 128 x 128 (x2 for gate and up) past that.
_TILES = (
    (24, MoeTiles(16, 64, 128, 4, 4, 128, 64, 4, 4)),
    (256, MoeTiles(64, 64, 64, 4, 4, 128, 64, 4, 3)),
    (None, MoeTiles(128, 128, 32, 8, 4, 256, 32, 8, 4)),
)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fit(tiles: MoeTiles, d: int, f: int, itemsize: int) -> MoeTiles:
    """Clamps the tiles to the largest powers of two dividing the shapes (D = 2304: 256) and
    halves the depth steps (then the stages) until both pipelines fit :data:`SMEM_BUDGET`
    (float32 takes twice the bytes of bf16)."""
    pd, pf = d & -d, f & -f  # the largest power of two dividing each
    t = dataclasses.replace(
        tiles,
        block_n_a=min(tiles.block_n_a, pf), block_k_a=min(tiles.block_k_a, pd),
        block_n_b=min(tiles.block_n_b, pd), block_k_b=min(tiles.block_k_b, pf),
    )  # fmt: skip
    while t.smem_bytes(itemsize)[0] > SMEM_BUDGET:
        if t.block_k_a > 16:
            t = dataclasses.replace(t, block_k_a=t.block_k_a // 2)
        elif t.stages_a > 2:
            t = dataclasses.replace(t, stages_a=t.stages_a - 1)
        else:
            break
    while t.smem_bytes(itemsize)[1] > SMEM_BUDGET:
        if t.block_k_b > 16:
            t = dataclasses.replace(t, block_k_b=t.block_k_b // 2)
        elif t.stages_b > 2:
            t = dataclasses.replace(t, stages_b=t.stages_b - 1)
        else:
            break
    return t


# The narrowest tile :func:`_fit` may clamp to. On an H200 (benchmarks/gpu_check.py
# --diagnose-tf32, results/gpu_check_tf32_h200_89aed57.json) 4-wide tiles (F = 12) gave wrong
# results with tensor-core (TF32) dots, logprob error 0.78 of the largest logit, while IEEE
# (FMA) dots were right; 16-wide ones were right in both.
MIN_TILE = 16


def unsupported_reason(d: int, f: int) -> str | None:
    """Why the kernels cannot take a hidden size ``d`` and (per device) intermediate size ``f``,
    or None. Tiles clamp to the largest power of two dividing each (:func:`_fit`)."""
    for name, size in (("hidden size", d), ("expert intermediate size", f)):
        if size & -size < MIN_TILE:
            return f"{name} {size} has no power-of-two tile of >= {MIN_TILE}"
    return None


def default_tiles(num_pairs: int, num_experts: int, d: int, f: int, dtype) -> MoeTiles:
    """The tiles for ``num_pairs`` (token, expert) pairs over ``num_experts`` experts."""
    rows = num_pairs / num_experts
    tiles = next(t for limit, t in _TILES if limit is None or rows <= limit)
    return _fit(tiles, d, f, jnp.dtype(dtype).itemsize)


def check_tiles(tiles: MoeTiles, d: int, f: int) -> None:
    for name, size, dim in (
        ("block_m", tiles.block_m, None), ("block_n_a", tiles.block_n_a, f),
        ("block_k_a", tiles.block_k_a, d), ("block_n_b", tiles.block_n_b, d),
        ("block_k_b", tiles.block_k_b, f),
    ):  # fmt: skip
        if not _is_pow2(size) or (dim is not None and dim % size):
            raise ValueError(f"{name}={size} must be a power of two dividing {dim}")


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the row blocks: each non-empty group wastes fewer than ``block_m``."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


# ----------------------------------------------------------------------------- plan


class RoutePlan(NamedTuple):
    """Where every pair sits in the padded, expert-sorted rows (device arrays; a pytree)."""

    block_expert: jax.Array  # i32[NB]  expert of each block (clamped to E - 1 past `used`)
    used: jax.Array  # i32[1]  blocks holding any pair
    row_token: jax.Array  # i32[NB * BM]  token a row reads; -1: padding
    row_weight: jax.Array  # f32[NB * BM]  routing weight of the row's pair; 0: padding
    pair_row: jax.Array  # i32[T, k]  padded row of each pair; -1: skipped


def route(
    experts: jax.Array,  # i32[T, k]  ids outside [0, E) are skipped
    weights: jax.Array,  # [T, k]
    *,
    num_experts: int,
    block_m: int,
) -> RoutePlan:
    """Sorts the pairs by expert and pads each group to a multiple of ``block_m`` rows.

    Only a sort, cumulative sums, compares and gathers, plus one scatter of a permutation
    (unique indices): no loop, no searchsorted (whose default is a while loop)."""
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    nb = num_blocks(num_pairs, num_experts, block_m)
    e_max = num_experts - 1
    flat = experts.reshape(-1).astype(jnp.int32)  # [P]
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)  # skipped pairs sort last
    place = jnp.arange(num_pairs, dtype=jnp.int32)
    if (num_experts + 1) * num_pairs < 2**31:
        # One int32 operand (expert, pair) packed: a plain sort that XLA may hand to a radix
        # sort, where a stable argsort sorts (key, index) pairs with a comparator.
        order = jax.lax.sort(key * num_pairs + place) % num_pairs  # [P] pair at each place
    else:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # [E]
    padded = (sizes + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded)  # [E]
    pad_start = pad_end - padded
    start = jnp.cumsum(sizes) - sizes  # [E] first sorted place of each group
    used = pad_end[-1] // block_m

    # block -> expert: the number of groups that end at or before the block's first row
    b0 = jnp.arange(nb, dtype=jnp.int32) * block_m
    block_expert = jnp.sum(pad_end[None, :] <= b0[:, None], axis=1, dtype=jnp.int32)  # [NB, E]
    block_expert = jnp.minimum(block_expert, e_max)

    # padded row -> pair
    r = jnp.arange(nb * block_m, dtype=jnp.int32)
    e_r = block_expert[r // block_m]
    rank = r - pad_start[e_r]  # place inside the expert's group
    row_ok = (r < used * block_m) & (rank < sizes[e_r])
    pair = order[jnp.clip(start[e_r] + rank, 0, num_pairs - 1)]
    row_token = jnp.where(row_ok, pair // top_k, -1)
    w = weights.reshape(-1)[pair].astype(jnp.float32)
    row_weight = jnp.where(row_ok, w, 0.0)

    # pair -> padded row, for the combine
    key_sorted = key[order]
    e_s = jnp.minimum(key_sorted, e_max)
    row_sorted = jnp.where(key_sorted < num_experts, pad_start[e_s] + place - start[e_s], -1)
    pair_row = jnp.zeros(num_pairs, jnp.int32).at[order].set(row_sorted, unique_indices=True)
    return RoutePlan(
        block_expert=block_expert, used=used.reshape(1).astype(jnp.int32), row_token=row_token,
        row_weight=row_weight, pair_row=pair_row.reshape(num_tokens, top_k),
    )  # fmt: skip


# The route plan of at most this many (token, expert) pairs is computed pairwise
# (:func:`route_pairwise`: a few row reductions, no sort, no scatter) instead of by
# :func:`route`'s sort: 64 tokens at top-10. ``benchmarks.moe_kernels --route-only`` on an
# H200 (2026-11-28), each plan chained with a sum of its fields, us a call, sort / pairwise:
# T = 8: 35.7 / 20.2 (E = 64), 37.6 / 26.6 (E = 512); T = 16: 44.3 / 28.3, 42.1 / 23.9;
# T = 64: 37.8 / 30.7, 38.1 / 32.4. The [P, P] reductions grow with the square of the pairs.
PAIRWISE_ROUTE_MAX_PAIRS = 640


def route_pairwise(
    experts: jax.Array,  # i32[T, k]  ids outside [0, E) are skipped
    weights: jax.Array,  # [T, k]
    *,
    num_experts: int,
    block_m: int,
) -> RoutePlan:
    """:func:`route`'s plan, equal to it, from comparisons of every pair with every pair.

    For a few pairs (decode: T * k of ~10-100) the sort, the bincount scatter, the cumulative
    sums and the permutation scatter of :func:`route` are a dozen small kernels on a GPU. Here
    every quantity is a reduction over the pairs along the last axis::

        rank[i]  = #{j < i : key[j] == key[i]}        place of pair i in its expert's group
        size[i]  = #{j : key[j] == key[i]}            its group's size
        first[j] = rank[j] == 0                       one pair stands for each group
        start[i] = sum_j first[j] * (key[j] < key[i]) * padded(size[j])   its group's 1st row
        row      = start + rank                       (the stable order: experts, then pairs)
        block_expert[b] = the key of the group whose rows hold b * BM (E - 1 past ``used``)
        row_token[r]    = the pair whose row is r (-1: none), as a token (one scatter)

    O(P * (P + NB)) work in [P, P] and [NB, P] comparisons.
    """
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    nb = num_blocks(num_pairs, num_experts, block_m)
    flat = experts.reshape(-1).astype(jnp.int32)  # [P]
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    place = jnp.arange(num_pairs, dtype=jnp.int32)
    same = key[:, None] == key[None, :]  # [P, P]
    rank = jnp.sum(same & (place[None, :] < place[:, None]), axis=1, dtype=jnp.int32)
    size = jnp.sum(same, axis=1, dtype=jnp.int32)
    padded = jnp.where(valid & (rank == 0), (size + block_m - 1) // block_m * block_m, 0)  # [P]
    start = jnp.sum(jnp.where(key[None, :] < key[:, None], padded[None, :], 0), axis=1)  # [P]
    end = start + padded  # per group's first pair; 0 rows elsewhere
    used = jnp.sum(padded) // block_m
    row = jnp.where(valid, start + rank, -1)  # [P]  padded row of each pair

    # block -> expert: the group whose rows [start, end) hold the block's first row
    b0 = jnp.arange(nb, dtype=jnp.int32)[:, None] * block_m  # [NB, 1]
    holds = (start[None, :] <= b0) & (b0 < end[None, :]) & (padded[None, :] > 0)  # [NB, P]
    block_expert = jnp.max(jnp.where(holds, key[None, :], -1), axis=1)
    block_expert = jnp.where(block_expert < 0, num_experts - 1, block_expert)

    # padded row -> pair: one scatter of the pairs' places (a skipped pair's index is out of
    # range, and distinct: the indices stay unique)
    rows = nb * block_m
    to = jnp.where(valid, row, rows + place)
    pair = jnp.full(rows, -1, jnp.int32).at[to].set(place, mode="drop", unique_indices=True)
    w = weights.reshape(-1)[jnp.maximum(pair, 0)].astype(jnp.float32)
    return RoutePlan(
        block_expert=block_expert.astype(jnp.int32), used=used.reshape(1).astype(jnp.int32),
        row_token=jnp.where(pair >= 0, pair // top_k, -1), row_weight=jnp.where(pair >= 0, w, 0.0),
        pair_row=row.reshape(num_tokens, top_k),
    )  # fmt: skip


# The route plan of at most this many pairs, over at least this many experts, is one Pallas
# kernel (:func:`route_kernel`) instead of the pairwise plan's ~10 small XLA kernels a layer
# (BENCHMARKS.md's optimized HLO): fewer kernels, and XLA's launch costs ~2 us of host a
# kernel. Measured on an H200 (2026-11-28), Qwen3-Next-80B at 24 layers, c8, off / on / off in
# one call: 1755.7 / **1805.1** / 1755.7 tok/s (launch 2.91 / 2.39 / 3.12 ms a step, the
# traced kernels the same). Alone, chained, us a call (8 warps): T = 8, E = 512: 26.0 against
# the pairwise 29.4; T = 8, E = 64: 27.2 against 20.8 (then 65 row programs of 16 rows each,
# every one ranking all pairs; now 128 rows a program, the rows padded, not yet timed): so
# only from 512 experts.
KERNEL_ROUTE_MAX_PAIRS = 128  # also the most the kernel takes: [P, P] in registers
KERNEL_ROUTE_MIN_EXPERTS = 512
_ROUTE_ROWS = 128  # at most this many padded rows a program of the route kernel fills


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _route_kernel(
    experts_ref,  # i32[P]  ids outside [0, E) are skipped
    weights_ref,  # [P]
    block_expert_ref,  # out i32[NBP]  (NB padded to a power of two; the rest: E - 1)
    used_ref,  # out i32[1]
    row_token_ref,  # out i32[NB * BM]
    row_weight_ref,  # out f32[NB * BM]
    pair_row_ref,  # out i32[PP]  (P padded to a power of two; the rest: -1)
    *, num_pairs: int, num_experts: int, block_m: int, top_k: int, rows_per_program: int,
):  # fmt: skip
    """:func:`route_pairwise`'s plan. Every program ranks all pairs (a [PP, PP] comparison in
    registers); the first ones fill ``rows_per_program`` padded rows each, the last one the
    per-pair and per-block fields. Each output element is written by one program, once, and
    every store is unmasked (a masked store's clamped lanes would write twice in interpret
    mode): the per-pair and per-block outputs are padded to powers of two."""
    pp = jnp.arange(pair_row_ref.shape[0], dtype=jnp.int32)  # pairs, padded to a power of two
    live = pp < num_pairs
    at = jnp.minimum(pp, num_pairs - 1)
    ids = pltr.load(experts_ref.at[at], mask=live, other=-1)
    key = jnp.where(live & (ids >= 0) & (ids < num_experts), ids, num_experts)  # E: skipped
    valid = key < num_experts
    same = key[:, None] == key[None, :]  # [PP, PP]
    rank = jnp.sum(jnp.where(same & (pp[None, :] < pp[:, None]), 1, 0), axis=1)
    size = jnp.sum(jnp.where(same, 1, 0), axis=1)
    padded = jnp.where(valid & (rank == 0), (size + block_m - 1) // block_m * block_m, 0)
    first = jnp.sum(jnp.where(key[None, :] < key[:, None], padded[None, :], 0), axis=1)
    row = jnp.where(valid, first + rank, -1)  # padded row of each pair
    pid = pl.program_id(0)
    row_programs = row_token_ref.shape[0] // rows_per_program
    r0 = pid * rows_per_program  # (program ids are read out here: the interpreter wants so)

    @pl.when(pid < row_programs)
    def _():
        w = pltr.load(weights_ref.at[at], mask=live, other=0).astype(jnp.float32)
        r = r0 + jnp.arange(rows_per_program, dtype=jnp.int32)
        hit = row[None, :] == r[:, None]  # [ROWS, PP]: at most one pair a row
        pair = jnp.max(jnp.where(hit, pp[None, :], -1), axis=1)
        weight = jnp.max(jnp.where(hit, w[None, :], -jnp.inf), axis=1)
        rows = pl.ds(r0, rows_per_program)
        row_token_ref[rows] = jnp.where(pair >= 0, pair // top_k, -1)
        row_weight_ref[rows] = jnp.where(pair >= 0, weight, 0.0)

    @pl.when(pid == row_programs)
    def _():
        pair_row_ref[...] = row
        used_ref[...] = jnp.full((1,), jnp.sum(padded) // block_m, jnp.int32)
        b0 = jnp.arange(block_expert_ref.shape[0], dtype=jnp.int32)[:, None] * block_m
        end = first + padded  # at a group's first pair; elsewhere padded is 0
        holds = (first[None, :] <= b0) & (b0 < end[None, :]) & (padded[None, :] > 0)
        expert = jnp.max(jnp.where(holds, key[None, :], -1), axis=1)
        block_expert_ref[...] = jnp.where(expert < 0, num_experts - 1, expert)


def route_kernel(
    experts: jax.Array,  # i32[T, k]  ids outside [0, E) are skipped
    weights: jax.Array,  # [T, k]
    *,
    num_experts: int,
    block_m: int,
    num_warps: int = 8,
    interpret: bool = False,
) -> RoutePlan:
    """:func:`route`'s plan in one Pallas kernel (at most ``KERNEL_ROUTE_MAX_PAIRS`` pairs):
    :func:`route_pairwise`'s comparisons, in registers. Equal to :func:`route`'s fields but
    for padding: ``block_expert`` to a power of two with ``E - 1``, ``row_token`` and
    ``row_weight`` to a multiple of 128 rows with -1 and 0 (the experts kernels read the first
    ``NB`` blocks; a slice would be one more kernel). 128 rows a program: fewer programs,
    each ranking all pairs again."""
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    if num_pairs > KERNEL_ROUTE_MAX_PAIRS:
        raise ValueError(f"{num_pairs} pairs > KERNEL_ROUTE_MAX_PAIRS={KERNEL_ROUTE_MAX_PAIRS}")
    nb = num_blocks(num_pairs, num_experts, block_m)
    rows = nb * block_m
    per_program = min(_ROUTE_ROWS, _pow2(rows))
    padded_rows = -(-rows // per_program) * per_program
    kernel = functools.partial(
        _route_kernel, num_pairs=num_pairs, num_experts=num_experts, block_m=block_m,
        top_k=top_k, rows_per_program=per_program,
    )  # fmt: skip
    i32 = jnp.int32
    block_expert, used, row_token, row_weight, pair_row = pl.pallas_call(
        kernel,
        grid=(padded_rows // per_program + 1,),
        out_shape=(
            jax.ShapeDtypeStruct((_pow2(nb),), i32),
            jax.ShapeDtypeStruct((1,), i32),
            jax.ShapeDtypeStruct((padded_rows,), i32),
            jax.ShapeDtypeStruct((padded_rows,), jnp.float32),
            jax.ShapeDtypeStruct((_pow2(num_pairs),), i32),
        ),  # fmt: skip
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(experts.reshape(-1).astype(i32), weights.reshape(-1))
    return RoutePlan(
        block_expert=block_expert, used=used, row_token=row_token, row_weight=row_weight,
        pair_row=pair_row[:num_pairs].reshape(num_tokens, top_k),
    )  # fmt: skip


# ----------------------------------------------------------------------------- kernels


def _mm(x, y, precision):
    """``x @ y`` accumulated in float32."""
    return jax.lax.dot_general(
        x, y, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _gate_up_kernel(
    blk_expert_ref,  # i32[NB]
    used_ref,  # i32[1]
    row_token_ref,  # i32[NB * BM]
    x_ref,  # [T, D]
    wg_ref, wu_ref,  # [E, D, F]
    h_ref,  # [NB * BM, F]  out: silu(x W_gate) * (x W_up) of each row (0 on padding rows)
    *, bm: int, bn: int, bk: int, precision,
):  # fmt: skip
    b, n = pl.program_id(0), pl.program_id(1)

    @pl.when(b < used_ref[0])
    def _():
        e = blk_expert_ref[b]
        rows, cols = pl.ds(b * bm, bm), pl.ds(n * bn, bn)
        tok = row_token_ref[rows]  # [BM]
        ok = tok >= 0
        tok = jnp.where(ok, tok, 0)
        kk = jnp.arange(bk, dtype=jnp.int32)

        def body(i, acc):
            g, u = acc
            depth = i * bk + kk  # [BK]
            mask = ok[:, None] & (depth[None, :] >= 0)
            xa = pltr.load(x_ref.at[tok[:, None], depth[None, :]], mask=mask, other=0.0)
            ks = pl.ds(i * bk, bk)
            g = g + _mm(xa, wg_ref[e, ks, cols], precision)  # [BM, BN]
            u = u + _mm(xa, wu_ref[e, ks, cols], precision)
            return g, u

        zeros = jnp.zeros((bm, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, (zeros, zeros))
        h = g / (1.0 + jnp.exp(-g)) * u  # silu(g) * u
        h_ref[rows, cols] = h.astype(h_ref.dtype)


def _down_kernel(
    blk_expert_ref,  # i32[NB]
    used_ref,  # i32[1]
    row_weight_ref,  # f32[NB * BM]
    h_ref,  # [NB * BM, F]
    wd_ref,  # [E, F, D]
    y_ref,  # [NB * BM, D]  out: w_row * (h W_down) of each row
    *, bm: int, bn: int, bk: int, precision,
):  # fmt: skip
    b, n = pl.program_id(0), pl.program_id(1)

    @pl.when(b < used_ref[0])
    def _():
        e = blk_expert_ref[b]
        rows, cols = pl.ds(b * bm, bm), pl.ds(n * bn, bn)

        def body(i, acc):
            ks = pl.ds(i * bk, bk)
            return acc + _mm(h_ref[rows, ks], wd_ref[e, ks, cols], precision)  # [BM, BN]

        acc = jax.lax.fori_loop(0, h_ref.shape[1] // bk, body, jnp.zeros((bm, bn), jnp.float32))
        y_ref[rows, cols] = (acc * row_weight_ref[rows][:, None]).astype(y_ref.dtype)


def moe_experts(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k]  routing weight of each chosen expert
    experts: jax.Array,  # i32[T, k]  ids outside [0, E) are skipped
    w_gate: jax.Array,  # [E, D, F]
    w_up: jax.Array,  # [E, D, F]
    w_down: jax.Array,  # [E, F, D]
    *,
    tiles: MoeTiles | None = None,
    precision: jax.lax.Precision | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``sum_j weights[:, j] * expert_j(x)`` with SwiGLU experts. Returns [T, D] in x.dtype.

    ``tiles``: :func:`default_tiles` of the shapes unless given. ``precision``: of the
    in-kernel dots (float32 inputs: ``None`` lets Triton use TF32, ``HIGHEST`` is IEEE f32).
    """
    check_moe_args(x, weights, experts, w_gate, w_up, w_down)
    num_tokens, d = x.shape
    num_experts, _, f = w_gate.shape
    top_k = experts.shape[1]
    if tiles is None:
        tiles = default_tiles(num_tokens * top_k, num_experts, d, f, x.dtype)
    check_tiles(tiles, d, f)
    for name, a in (("w_gate", w_gate), ("w_down", w_down), ("x", x)):
        if a.size >= 2**31:
            raise ValueError(
                f"{name} {a.shape} has {a.size} >= 2**31 elements: the Triton kernel's 32-bit "
                "offsets would wrap; shard the experts (expert parallel) or their F dim"
            )
    bm = tiles.block_m
    num_pairs = num_tokens * top_k
    if num_pairs <= KERNEL_ROUTE_MAX_PAIRS and num_experts >= KERNEL_ROUTE_MIN_EXPERTS:
        plan_of = functools.partial(route_kernel, interpret=interpret)
    elif num_pairs <= PAIRWISE_ROUTE_MAX_PAIRS:
        plan_of = route_pairwise
    else:
        plan_of = route
    plan = plan_of(experts, weights, num_experts=num_experts, block_m=bm)
    nb = num_blocks(num_pairs, num_experts, bm)  # (the kernel plan pads block_expert)
    rows = nb * bm
    if rows * max(d, f) >= 2**31:
        raise ValueError(f"{rows} padded rows x {max(d, f)} >= 2**31 elements: split the batch")

    gate_up = functools.partial(
        _gate_up_kernel, bm=bm, bn=tiles.block_n_a, bk=tiles.block_k_a, precision=precision
    )
    h = pl.pallas_call(
        gate_up,
        grid=(nb, f // tiles.block_n_a),
        out_shape=jax.ShapeDtypeStruct((rows, f), w_down.dtype),
        compiler_params=pltr.CompilerParams(num_warps=tiles.warps_a, num_stages=tiles.stages_a),
        interpret=interpret,
        name="moe_gate_up",
    )(plan.block_expert, plan.used, plan.row_token, x, w_gate, w_up)

    down = functools.partial(
        _down_kernel, bm=bm, bn=tiles.block_n_b, bk=tiles.block_k_b, precision=precision
    )
    y = pl.pallas_call(
        down,
        grid=(nb, d // tiles.block_n_b),
        out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=tiles.warps_b, num_stages=tiles.stages_b),
        interpret=interpret,
        name="moe_down",
    )(plan.block_expert, plan.used, plan.row_weight, h, w_down)

    # Each token's k rows, summed in float32; skipped pairs add nothing.
    ok = plan.pair_row >= 0  # [T, k]
    picked = y[jnp.where(ok, plan.pair_row, 0)].astype(jnp.float32)  # [T, k, D]
    return jnp.sum(jnp.where(ok[..., None], picked, 0.0), axis=1).astype(x.dtype)
