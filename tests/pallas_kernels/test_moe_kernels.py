"""The Triton grouped-matmul MoE experts vs the ``ragged_dot`` reference, in Pallas interpret mode.

Interpret mode checks the routing plan (sort, padding to row blocks, block experts, the skipped
blocks past ``used``), the in-kernel gather of token rows and the combine; the weights of experts
no pair picks are NaN, so a block that reads them fails loudly. A last test lowers the kernels to
Triton for CUDA at Qwen3-Next-80B shapes (no GPU needed). Compiling and timing them on a GPU is
``benchmarks/moe_kernels.py``.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyjax.layers.moe import SparseMoe, local_experts, parallel_routed_experts
from hyjax.ops import REFERENCE, get_ops
from hyjax.sharding import make_mesh
from pallas_kernels.moe import gpu
from pallas_kernels.moe.reference import moe_experts_reference
from tests.pallas_kernels.ragged_cases import assert_close

SMALL = gpu.MoeTiles(4, 16, 16, 4, 1, 32, 16, 4, 1)  # several blocks, K steps and N tiles


def _case(t, e, k, d, f, *, dtype, picks=None, seed=0):
    """Random inputs; each token picks ``k`` experts from ``picks`` (default: all ``e``)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(e) if picks is None else np.asarray(picks)
    experts = np.stack([rng.choice(pool, k, replace=len(pool) < k) for _ in range(t)])
    x = rng.normal(size=(t, d))
    weights = rng.random((t, k))
    w = [rng.normal(size=s) * d**-0.5 for s in ((e, d, f), (e, d, f), (e, f, d))]
    return x, weights, experts.astype(np.int32), w


def _poison(w, experts, e):
    """The weights with NaN in every expert no pair picks: a block that reads one fails."""
    unpicked = np.setdiff1d(np.arange(e), experts)
    out = [m.copy() for m in w]
    for m in out:
        m[unpicked] = np.nan
    return out


def _reference(x, weights, experts, w):
    """The oracle: float32, NaN-free weights (a group of no rows must not matter)."""
    f32 = [jnp.asarray(np.nan_to_num(a), jnp.float32) for a in (x, weights, *w)]
    return np.asarray(moe_experts_reference(f32[0], f32[1], jnp.asarray(experts), *f32[2:]))


# One jitted kernel for every test: cases of equal shapes and tiles share one compile.
_KERNEL = jax.jit(gpu.moe_experts, static_argnames=("tiles", "interpret"))


def _kernel(x, weights, experts, w, dtype, tiles):
    args = [jnp.asarray(a, dtype) for a in (x, weights, *w)]
    out = _KERNEL(args[0], args[1], jnp.asarray(experts), *args[2:], tiles=tiles, interpret=True)
    return np.asarray(out.astype(jnp.float32))


def _check(got, want, dtype):
    assert not np.isnan(got).any()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (2e-2 if dtype == jnp.bfloat16 else 1e-5), f"relative error {err:.2e}"


CASES = [
    # (name, T, k, picks, dtype, tiles); T = 12, k = 3 share one compile per dtype
    ("spread", 12, 3, None, jnp.float32, SMALL),
    ("spread", 12, 3, None, jnp.bfloat16, SMALL),
    ("unpicked_experts", 12, 3, [1, 6], jnp.float32, SMALL),
    # one expert takes every pair (a token naming it more than once): 9 blocks, 0 padding
    ("one_expert_all_pairs", 12, 3, [3], jnp.float32, SMALL),
    ("one_expert_all_pairs", 12, 3, [3], jnp.bfloat16, SMALL),
    ("one_token", 1, 4, None, jnp.float32, SMALL),
    ("default_tiles", 9, 2, None, jnp.float32, None),  # BM = 16: mostly padding rows
]
IDS = [f"{n}_{t=}_{k=}_{jnp.dtype(dt).name}" for n, t, k, _, dt, _ in CASES]


@pytest.mark.parametrize("name,t,k,picks,dtype,tiles", CASES, ids=IDS)
def test_matches_reference(name, t, k, picks, dtype, tiles):
    """E = 8; groups of 0 to 36 rows, padded to blocks of 4 (most groups end in padding)."""
    x, weights, experts, w = _case(t, 8, k, 64, 32, dtype=dtype, picks=picks, seed=t + k)
    got = _kernel(x, weights, experts, _poison(w, experts, 8), dtype, tiles)
    _check(got, _reference(x, weights, experts, w), dtype)


def test_out_of_range_experts_are_skipped():
    """Ids outside [0, E) (expert parallel: other devices' experts) add nothing, whatever
    their weight; a batch of only such pairs gives zeros."""
    x, weights, experts, w = _case(12, 8, 3, 64, 32, dtype=jnp.float32, seed=3)
    experts[::2, 0] = 8  # one past the last expert
    experts[1::3, 2] = -1
    weights[experts >= 8] = np.nan
    weights[experts < 0] = np.nan
    got = _kernel(x, weights, experts, w, jnp.float32, SMALL)
    _check(got, _reference(x, weights, experts, w), jnp.float32)

    none = np.full_like(experts, 8)
    assert (_kernel(x, weights, none, w, jnp.float32, SMALL) == 0).all()


def test_expert_parallel_shares_sum_to_the_whole():
    """Each of 2 devices runs its 4 experts on its local view of the routing (the EP shard_map
    body's :func:`local_experts`); the shares sum to the whole layer."""
    x, weights, experts, w = _case(12, 8, 3, 64, 32, dtype=jnp.float32, seed=5)
    total = 0
    for dev in range(2):
        wl, el = local_experts(jnp.asarray(weights), jnp.asarray(experts), dev * 4, 4)
        share = [m[dev * 4 : (dev + 1) * 4] for m in w]
        total = total + _kernel(x, np.asarray(wl), np.asarray(el), share, jnp.float32, SMALL)
    _check(total, _reference(x, weights, experts, w), jnp.float32)


def test_runs_inside_the_experts_shard_map():
    """``parallel_routed_experts`` calls the op in its expert-parallel shard_map body (a
    one-device mesh here; the multi-device split is tests/serving/test_tensor_parallel.py with
    the reference op, the other devices' pairs test_expert_parallel_shares_sum_to_the_whole)."""
    x, weights, experts, w = _case(12, 8, 3, 64, 32, dtype=jnp.float32, seed=7)
    mesh = make_mesh(1)
    op = functools.partial(gpu.moe_experts, tiles=SMALL, interpret=True)
    fn = jax.jit(functools.partial(parallel_routed_experts, mesh=mesh, axis="model",
                                   expert_parallel=True, experts_op=op))  # fmt: skip
    args = [jnp.asarray(a, jnp.float32) for a in (x, weights, *w)]
    got = np.asarray(fn(args[0], args[1], jnp.asarray(experts), *args[2:]))
    _check(got, _reference(x, weights, experts, w), jnp.float32)


_KERNEL_PLAN = functools.partial(gpu.route_kernel, interpret=True)


@pytest.mark.parametrize(
    "plan_of", [gpu.route, gpu.route_pairwise, _KERNEL_PLAN], ids=["sort", "pairwise", "kernel"]
)
def test_route_pins_blocks_rows_and_pairs(plan_of):
    """The module docstring's picture: e0 x5, e2 x9, two skipped pairs, E = 3, BM = 4."""
    ids = np.array([2, 0, 2, 5, 0, 2, 2, 0, 2, -1, 2, 0, 2, 2, 0, 2], np.int32)  # T=16, k=1
    route = jax.jit(functools.partial(plan_of, num_experts=3, block_m=4))
    plan = route(jnp.asarray(ids[:, None]), jnp.ones((16, 1)))
    assert int(plan.used[0]) == 5
    assert plan.block_expert.shape[0] >= gpu.num_blocks(16, 3, 4) == 6  # the kernel's: 8
    assert np.asarray(plan.block_expert)[:5].tolist() == [0, 0, 2, 2, 2]
    e0, e2 = np.flatnonzero(ids == 0), np.flatnonzero(ids == 2)  # tokens in order (stable)
    want = np.full(24, -1)
    want[0:5], want[8:17] = e0, e2
    got = np.asarray(plan.row_token)
    assert got[:20].tolist() == want[:20].tolist()
    assert (np.asarray(plan.row_weight)[:20] == (want[:20] >= 0)).all()
    pair_row = np.asarray(plan.pair_row)[:, 0]
    assert pair_row[[3, 9]].tolist() == [-1, -1]
    kept = np.flatnonzero((ids >= 0) & (ids < 3))
    assert (got[pair_row[kept]] == kept).all()


ROUTE_CASES = [  # (T, k, E, BM, ids drawn from): decode-sized plans, skipped ids, repeats
    (8, 10, 512, 16, "distinct"),
    (8, 10, 64, 16, "distinct"),
    (16, 4, 8, 4, "any"),  # a token may name an expert twice; ids -2..E+1 (some skipped)
    (1, 3, 3, 64, "any"),
    (5, 4, 4, 16, "distinct"),  # every expert in every token: blocks of many pairs
    (16, 8, 256, 16, "distinct"),  # the kernel plan's most pairs (128)
    (3, 5, 7, 2, "any"),  # 15 pairs, 2-row blocks: every output in pieces of 8, 4, 2, 1
]


ROUTE_IDS = [f"{t}x{k}_E{e}_BM{bm}_{draw}" for t, k, e, bm, draw in ROUTE_CASES]


@pytest.mark.parametrize("plan_of", [gpu.route_pairwise, _KERNEL_PLAN], ids=["pairwise", "kernel"])
@pytest.mark.parametrize("t,k,e,bm,draw", ROUTE_CASES, ids=ROUTE_IDS)
def test_route_plans_are_the_sorted_plan(t, k, e, bm, draw, plan_of):
    """Every field of the pairwise plan, and of the one-kernel plan (in interpret mode), equals
    the sorted one's, blocks past ``used`` too."""
    rng = np.random.default_rng(t * k + e)
    if draw == "any":
        ids = rng.integers(-2, e + 2, (t, k))
    else:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    ids, weights = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32)
    want = jax.jit(functools.partial(gpu.route, num_experts=e, block_m=bm))(ids, weights)
    got = jax.jit(functools.partial(plan_of, num_experts=e, block_m=bm))(ids, weights)
    nb = gpu.num_blocks(t * k, e, bm)  # the kernel plan pads its block table with E - 1,
    assert (np.asarray(got.block_expert)[nb:] == e - 1).all()  # its rows with -1 and 0
    assert (np.asarray(got.row_token)[nb * bm :] == -1).all()
    assert (np.asarray(got.row_weight)[nb * bm :] == 0).all()
    got = got._replace(
        block_expert=got.block_expert[:nb],
        row_token=got.row_token[: nb * bm],
        row_weight=got.row_weight[: nb * bm],
    )
    for name in want._fields:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def _small_experts_op():
    """The experts op (interpret mode) on 12 tokens x top-3 of 8 experts, only 1, 2 and 6
    picked (the others' weights NaN), checked against the oracle; returns the op, its
    expert weights and its jaxpr."""
    x, weights, experts, w = _case(12, 8, 3, 64, 32, dtype=jnp.float32, picks=[1, 2, 6], seed=9)
    fn = jax.jit(functools.partial(gpu.moe_experts, tiles=SMALL, interpret=True))
    args = [jnp.asarray(a, jnp.float32) for a in (x, weights, *_poison(w, experts, 8))]
    got = np.asarray(fn(args[0], args[1], jnp.asarray(experts), *args[2:]))
    _check(got, _reference(x, weights, experts, w), jnp.float32)
    traced = str(jax.make_jaxpr(fn)(args[0], args[1], jnp.asarray(experts), *args[2:]))
    return fn, args[2:], traced


def test_kernel_with_the_pairwise_plan(monkeypatch):
    """The experts op through the pairwise plan (decode steps of 129 to 640 pairs)."""
    monkeypatch.setattr(gpu, "PAIRWISE_ROUTE_MAX_PAIRS", 1 << 20)
    _, _, traced = _small_experts_op()
    assert " sort" not in traced  # the pairwise plan ran, not the sort
    assert "moe_route" not in traced


def test_kernel_with_the_kernel_plan(monkeypatch):
    """With the expert threshold lowered to 8, up to 128 pairs the plan is one kernel; 129 take
    the pairwise one; more than the kernel takes is refused by name."""
    monkeypatch.setattr(gpu, "KERNEL_ROUTE_MIN_EXPERTS", 8)
    fn, expert_weights, traced = _small_experts_op()
    assert traced.count("pallas_call") == 3 and "moe_route" in traced and " sort" not in traced
    sd = jax.ShapeDtypeStruct
    over = (sd((43, 64), jnp.float32), sd((43, 3), jnp.float32), sd((43, 3), jnp.int32))
    over_traced = str(jax.make_jaxpr(fn)(*over, *expert_weights))
    assert "moe_route" not in over_traced and over_traced.count("pallas_call") == 2
    with pytest.raises(ValueError, match="129 pairs > KERNEL_ROUTE_MAX_PAIRS=128"):
        gpu.route_kernel(over[2], over[1], num_experts=8, block_m=16)


def test_sparse_moe_layer_through_ops():
    """The layer takes its experts op from ``ops``; the pallas backend on CPU is ragged_dot."""
    build = functools.partial(SparseMoe, 64, num_experts=8, top_k=3, expert_dim=32,
                              shared_dim=32, norm_topk_prob=True, dtype=jnp.float32)  # fmt: skip
    # Shapes only, then random values: no per-initializer compiles.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.2, a.dtype), state)
    forward = jax.jit(lambda state, x, ops: nnx.merge(graphdef, state)(x, ops), static_argnums=2)
    x = jnp.asarray(rng.normal(size=(6, 64)), jnp.float32)
    kernel = functools.partial(gpu.moe_experts, tiles=SMALL, interpret=True)
    ops = dataclasses.replace(REFERENCE, moe_experts=kernel)
    traced = jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x, ops))(state, x)
    assert str(traced).count("pallas_call") == 2  # the layer ran the op it was given
    got = forward(state, x, ops)
    want = forward(state, x, REFERENCE)
    assert_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    args = _case(5, 8, 3, 64, 32, dtype=jnp.float32)
    args = [jnp.asarray(a) for a in (*args[:3], *args[3])]
    on_cpu = jax.make_jaxpr(get_ops("pallas").moe_experts)(*args)
    assert str(on_cpu) == str(jax.make_jaxpr(moe_experts_reference)(*args))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pairs", [640, 40960], ids=["decode", "prefill"])
def test_default_tiles_fit_shared_memory(pairs, dtype):
    tiles = gpu.default_tiles(pairs, 64, 2048, 512, dtype)
    gpu.check_tiles(tiles, 2048, 512)
    assert max(tiles.smem_bytes(jnp.dtype(dtype).itemsize)) <= gpu.SMEM_BUDGET
    assert tiles.block_m == (16 if pairs == 640 else 128)
    # Kimi-Linear-48B (D = 2304, F = 1024) split over 8 devices: tiles divide what is left
    gpu.check_tiles(gpu.default_tiles(pairs, 256, 2304, 128, dtype), 2304, 128)


def test_bad_arguments_are_named():
    x, weights, experts, w = _case(4, 8, 2, 64, 32, dtype=jnp.float32)
    args = [jnp.asarray(a, jnp.float32) for a in (x, weights, *w)]
    ids = jnp.asarray(experts)
    with pytest.raises(ValueError, match="block_n_a=24 must be a power of two dividing 32"):
        bad = gpu.MoeTiles(4, 24, 16, 4, 1, 32, 16, 4, 1)
        gpu.moe_experts(*args[:2], ids, *args[2:], tiles=bad)
    with pytest.raises(ValueError, match="w_down must be"):
        gpu.moe_experts(*args[:2], ids, args[2], args[3], args[4][:, :16])
    with pytest.raises(ValueError, match="weights.shape=.* must equal experts.shape"):
        gpu.moe_experts(args[0], args[1][:, :1], ids, *args[2:])


def test_lowers_to_triton_at_80b_shapes():
    """Two Triton kernels and loop-free XLA around them (an XLA while trip is a host round
    trip on GPU)."""
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for t in (8, 64, 4096):
        w_in, w_out = sd((64, 2048, 512), bf), sd((64, 512, 2048), bf)
        args = (sd((t, 2048), bf), sd((t, 10), bf), sd((t, 10), jnp.int32), w_in, w_in, w_out)
        text = jax.jit(gpu.moe_experts).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("moe_gate_up") >= 1 and text.count("moe_down") >= 1
        assert "moe_route" not in text  # 64 experts: the pairwise plan or the sort
        assert "stablehlo.while" not in text
        assert set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)) <= {
            "__gpu$xla.gpu.triton"
        }
    # Qwen3-Next-80B's 512 experts at decode's 80 pairs: the one-kernel plan, loop-free too
    w_in, w_out = sd((512, 2048, 512), bf), sd((512, 512, 2048), bf)
    args = (sd((8, 2048), bf), sd((8, 10), bf), sd((8, 10), jnp.int32), w_in, w_in, w_out)
    text = jax.jit(gpu.moe_experts).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_route" in text and "stablehlo.while" not in text


@pytest.mark.parametrize("tokens,experts,k", [(8, 512, 10), (16, 256, 8), (5, 64, 4)])
def test_router_top_k_is_lax_top_k(tokens, experts, k):
    """The routers' top-k by pairwise ranks (a GPU's at decode sizes, forced here) equals
    ``lax.top_k``: values, indices and the order of ties (lower index first), with ties inside
    and across the top k, masked (-inf) experts, negative scores."""
    from hyjax.layers.moe import PAIRWISE_TOP_K_MAX, router_top_k

    rng = np.random.default_rng(tokens + experts)
    x = rng.normal(size=(tokens, experts)).astype(np.float32)
    x[0] = np.round(x[0])  # many ties, some at the k-th place
    x[1, : experts // 2] = -np.inf  # a masked half (Kimi's groups)
    x[2] = 0.25  # every score equal
    x[3, [7, 3, 50, 9]] = 9.0  # a tie for the top: indices in order 3, 7, 9, 50
    x[4] = -np.abs(x[4]) - 1.0  # every score negative
    got = jax.jit(functools.partial(router_top_k, k=k, pairwise=True))(jnp.asarray(x))
    want = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert tokens * experts * experts <= PAIRWISE_TOP_K_MAX  # a GPU ranks these pairwise
