"""A bfloat16 recurrent-state pool (``--state-dtype bfloat16``) in every GDN / KDA op.

Every op computes in float32 whatever the pool holds: it reads a slot into f32 and rounds the
state to the pool's dtype where it writes it, and a prefill rounds the state it carries after
every 64 tokens of a row (``ROUND_EVERY``). So, run on a bf16 pool, an op must give

- within 64 tokens, the outputs of the f32 run started from the same (bf16-rounded) states,
  to f32 noise (the recurrence itself never sees bf16), and that run's states rounded to
  bf16, in a pool that stays bf16, untouched slots bit-identical (poisoned ones still NaN);
- against the f32 pool of unrounded states, outputs and states within bf16 rounding;
- over a long row, the same outputs and state whether the row runs in one step or in
  64-token steps through its slot: the rounding points do not depend on the chunking.

Each op runs on every backend that has it: the reference, the TPU kernels in the TPU
interpreter, the GPU kernels in Pallas' interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gdn import fused_decode
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.gdn import tpu as gdn_tpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from pallas_kernels.kda import fused_decode as kda_fused_decode
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda import tpu as kda_tpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from tests.pallas_kernels.ragged_cases import (
    assert_close,
    assert_rel_close,
    ragged_case,
    state_slots,
)

TPU = dict(interpret=pltpu.InterpretParams())
GPU = dict(interpret=True)
HK, HV, H, DK, DV = 2, 4, 2, 16, 8  # GDN key / value heads, KDA heads; GPU tiles need Dk >= 8
LENS = [5, 63]  # within ROUND_EVERY: only the stores round (checkpoints 1, 2 and 1, 31)


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)


def _gdn_acts(rng, n):
    q, k = _normal(rng, (n, HK, DK)), _normal(rng, (n, HK, DK))
    v, a, b = _normal(rng, (n, HV, DV)), _normal(rng, (n, HV)), _normal(rng, (n, HV))
    return q, k, v, a, b, _normal(rng, (HV,)), _normal(rng, (HV,))


def _kda_acts(rng, n):
    q, k, v = _normal(rng, (n, H, DK)), _normal(rng, (n, H, DK)), _normal(rng, (n, H, DV))
    g, b = _normal(rng, (n, H, DK), 2.0), _normal(rng, (n, H))
    return q, k, v, g, b, _normal(rng, (H,)), _normal(rng, (H, DK))


def _prefill(op, acts, heads):
    """``op`` over the ragged case ``LENS``: ``(run(pool) -> (o, pool), pool f32)``."""

    def make(rng=None, *, chunked=False):
        if chunked:
            return _one_row_in_steps(op, acts, heads)
        case = ragged_case(LENS)
        args = acts(rng, case.num_tokens)
        qsl, slots = jnp.asarray(case.query_start_loc), case.slots()
        pool = case.pool(rng, (heads, DV, DK), np.float32)
        return jax.jit(lambda p: op(*args, p, qsl, slots)), pool

    return make


def _decode_slots():
    # rows: 0 in place (src == dst) with a checkpoint at offset 1, 1 reads without writing,
    # 2 from zero, 3 reads slot 3 into slot 7 and checkpoint 10; row 4 is padding.
    src = np.array([1, 2, 0, 3, 0], np.int32)
    dst = np.array([1, 0, 6, 7, 0], np.int32)
    ck_off = np.array([[1], [0], [0], [1], [0]], np.int32)
    ck_slot = np.array([[9], [0], [0], [10], [0]], np.int32)
    return state_slots(src, dst, ck_off, ck_slot, 4)


def _decode_pool(rng, heads):
    pool = np.full((12, heads, DV, DK), np.nan, np.float32)
    for s in (1, 2, 3):
        pool[s] = rng.normal(size=(heads, DV, DK))
    return pool


def _decode(op, acts, heads):
    def make(rng):
        args, slots = acts(rng, 5), _decode_slots()
        return jax.jit(lambda p: op(*args, p, slots)), _decode_pool(rng, heads)

    return make


def _fused_decode(op, c: int, gate_shapes, heads: int, **kw):
    """A fused conv1d + delta-rule decode (``op(mixed, weight, conv, *gates, pool, slots,
    **kw)``, ``gate_shapes`` its four gate inputs'); its conv state stays f32 (the
    activations' dtype)."""

    def make(rng):
        mixed, weight = _normal(rng, (5, c)), _normal(rng, (c, 4), 0.5)
        conv = _normal(rng, (12, 3, c))
        gates = [_normal(rng, s) for s in gate_shapes]
        slots = _decode_slots()

        def run(p):
            o, _, p = op(mixed, weight, conv, *gates, p, slots, **kw)
            return o, p

        return jax.jit(run), _decode_pool(rng, heads)

    return make


# GDN: a, b [S, Hv], A_log, dt_bias [Hv]; KDA: g [S, H, Dk], b [S, H], A_log [H], dt_bias [H, Dk]
GDN_FUSED = (2 * HK * DK + HV * DV, ((5, HV), (5, HV), (HV,), (HV,)), HV)
KDA_FUSED = (H * (2 * DK + DV), ((5, H, DK), (5, H), (H,), (H, DK)), H)


def _one_row_in_steps(op, acts, heads, n=150):
    """``run(pool, steps) -> (o [n, ...], final state)``: one row of ``n`` tokens from slot 1,
    run in the steps given (token counts) through slot 2, and the f32 pool."""
    rng = np.random.default_rng(1)
    args = acts(rng, n)
    pool = np.full((3, heads, DV, DK), np.nan, np.float32)
    pool[1] = rng.normal(size=(heads, DV, DK))
    no_ckpt = np.zeros((1, 1), np.int32)
    fn = jax.jit(op)

    def run(p, steps):
        outs, t, src = [], 0, 1
        for length in steps:
            part = [x[t : t + length] for x in args[:5]]
            slots = state_slots([src], [2], no_ckpt, no_ckpt, 1)
            o, p = fn(*part, *args[5:], p, jnp.array([0, length], jnp.int32), slots)
            outs.append(o)
            t, src = t + length, 2
        return jnp.concatenate(outs), p[2]

    return run, pool


CASES = {
    "gdn_prefill_reference": _prefill(gdn_prefill_reference, _gdn_acts, HV),
    "gdn_prefill_tpu": _prefill(functools.partial(gdn_tpu.gdn_prefill, **TPU), _gdn_acts, HV),
    "gdn_prefill_gpu": _prefill(functools.partial(gdn_gpu.gdn_prefill, **GPU), _gdn_acts, HV),
    "gdn_decode_reference": _decode(gdn_decode_reference, _gdn_acts, HV),
    "gdn_decode_tpu": _decode(functools.partial(gdn_tpu.gdn_decode, **TPU), _gdn_acts, HV),
    "gdn_decode_gpu": _decode(functools.partial(gdn_gpu.gdn_decode, **GPU), _gdn_acts, HV),
    "conv_gdn_decode_reference": _fused_decode(
        fused_decode.conv_gdn_decode_reference, *GDN_FUSED, num_k_heads=HK
    ),
    "conv_gdn_decode_gpu": _fused_decode(
        fused_decode.conv_gdn_decode, *GDN_FUSED, num_k_heads=HK, min_rows=0, **GPU
    ),
    "kda_prefill_reference": _prefill(kda_prefill_reference, _kda_acts, H),
    "kda_prefill_tpu": _prefill(functools.partial(kda_tpu.kda_prefill, **TPU), _kda_acts, H),
    "kda_prefill_gpu": _prefill(functools.partial(kda_gpu.kda_prefill, **GPU), _kda_acts, H),
    "kda_decode_reference": _decode(kda_decode_reference, _kda_acts, H),
    "kda_decode_tpu": _decode(functools.partial(kda_tpu.kda_decode, **TPU), _kda_acts, H),
    "kda_decode_gpu": _decode(functools.partial(kda_gpu.kda_decode, **GPU), _kda_acts, H),
    "conv_kda_decode_reference": _fused_decode(
        kda_fused_decode.conv_kda_decode_reference, *KDA_FUSED
    ),
    "conv_kda_decode_gpu": _fused_decode(kda_fused_decode.conv_kda_decode, *KDA_FUSED, **GPU),
}


# The chunking check on the reference and GPU prefills (the TPU kernels' bf16 stores are held
# to the f32 recurrence above; chunked, they are CI's slowest interpret cases).
PREFILL = {name: make for name, make in CASES.items() if "_prefill_" in name and "tpu" not in name}


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("make", CASES.values(), ids=CASES.keys())
def test_bf16_pool_is_the_f32_recurrence_rounded_on_store(make):
    run, pool = make(np.random.default_rng(0))
    pool16 = jnp.asarray(pool, jnp.bfloat16)
    o16, s16 = run(pool16)
    assert s16.dtype == jnp.bfloat16 and s16.shape == pool.shape, "the pool changed dtype"
    assert o16.dtype == jnp.float32
    # The same recurrence in f32 from the same states (bf16 values are exact in f32).
    o32r, s32r = run(jnp.asarray(pool16, jnp.float32))
    assert_close(o16, o32r, rtol=1e-5, atol=1e-5, what="outputs: f32 math from the same states")
    np.testing.assert_array_equal(
        _f32(s16), _f32(s32r.astype(jnp.bfloat16)), err_msg="states: the f32 ones rounded"
    )
    # Against the f32 pool of unrounded states: bf16 rounding of the initial states only.
    o32, s32 = run(jnp.asarray(pool))
    assert_rel_close(o16, o32, tol=2e-2, what="outputs vs the f32 pool")
    assert_rel_close(s16, s32, tol=2e-2, what="states vs the f32 pool")


@pytest.mark.parametrize("make", PREFILL.values(), ids=PREFILL.keys())
def test_bf16_prefill_rounds_the_same_however_chunked(make):
    """150 tokens in one step equal 64 + 64 + 22 through a bf16 slot: the step that carries
    the state across 64 and 128 rounds it there as the slot stores of the split run do."""
    run, pool = make(chunked=True)
    pool16 = jnp.asarray(pool, jnp.bfloat16)
    o_one, s_one = run(pool16, [150])
    o_split, s_split = run(pool16, [64, 64, 22])
    assert s_one.dtype == jnp.bfloat16
    assert_close(o_one, o_split, rtol=1e-5, atol=1e-5, what="outputs")
    np.testing.assert_array_equal(_f32(s_one), _f32(s_split), err_msg="final state")
    o32, s32 = run(jnp.asarray(pool), [150])
    assert_rel_close(o_one, o32, tol=2e-2, what="outputs vs the f32 pool")
    assert_rel_close(s_one, s32, tol=2e-2, what="state vs the f32 pool")
