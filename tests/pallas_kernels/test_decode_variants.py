"""The experimental GDN / KDA decode variants vs the references, in Pallas interpret mode.

The references take the engine's pool, ``[slots, H, Dv, Dk]`` (what a ``vk`` variant takes
too); a ``kv`` variant (the earlier ``[slots, H, Dk, Dv]`` layout) gets it transposed in and
gives it back transposed. Slots as in ``test_gdn_gpu``: rows that
start from zero, a row that writes nothing, one updated in place, checkpoints at offsets 1 and
0, a padding row, and NaN in every slot nobody reads. Timing them is
``benchmarks/decode_variants.py`` on a GPU machine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn.decode_variants import (
    DecodeTiling,
    gdn_decode_variant,
    kda_decode_variant,
    to_layout,
)
from pallas_kernels.gdn.reference import gdn_decode_reference
from pallas_kernels.kda.reference import kda_decode_reference
from tests.pallas_kernels.ragged_cases import (
    abstract_slots,
    assert_close,
    assert_rel_close,
    state_slots,
)

ROWS, NUM_SEQS, HK, HV, DK, DV, M = 6, 5, 2, 4, 16, 32, 2

TILINGS = [
    # variant A: the transposed pool
    DecodeTiling("vk", block_v=16),
    DecodeTiling("vk", block_v=8, fused_output=False),
    # variant B: today's pool, several tiles a program (5 of 12: the last program's tail)
    DecodeTiling("kv", block_v=16, tiles=5, prefetch=True, num_stages=3),
    DecodeTiling("kv", block_v=16, tiles=2, reduce="dot", fused_output=False),
]


def _slots():
    src = np.array([1, 2, 0, 3, 4, 0], np.int32)
    dst = np.array([1, 0, 7, 3, 8, 0], np.int32)  # row 0 in place, row 1 writes nothing
    ck_off = np.zeros((ROWS, M), np.int32)
    ck_slot = np.zeros((ROWS, M), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [12, 13]
    ck_off[3, 1], ck_slot[3, 1] = 0, 14  # offset 0: not this token's
    return src, state_slots(src, dst, ck_off, ck_slot, NUM_SEQS)


def _pool(rng, src, heads, dtype):
    pool = np.full((16, heads, DV, DK), np.nan, np.float32)
    pool[src[src > 0]] = rng.normal(size=(4, heads, DV, DK))
    return jnp.asarray(pool, dtype)


def _gdn_inputs(rng):
    q, k = rng.normal(size=(2, ROWS, HK, DK))
    v = rng.normal(size=(ROWS, HV, DV))
    a, b = rng.normal(size=(2, ROWS, HV))
    A_log, dt_bias = rng.normal(size=(2, HV))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return [f32(x) for x in (q, k, v, a, b, A_log, dt_bias)]


def _kda_inputs(rng):
    q, k = rng.normal(size=(2, ROWS, HV, DK))
    v = rng.normal(size=(ROWS, HV, DV))
    g = 2 * rng.normal(size=(ROWS, HV, DK))
    b = rng.normal(size=(ROWS, HV))
    A_log, dt_bias = rng.normal(size=HV), rng.normal(size=(HV, DK))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return [f32(x) for x in (q, k, v, g, b, A_log, dt_bias)]


FAMILIES = {
    "gdn": (_gdn_inputs, gdn_decode_reference, gdn_decode_variant),
    "kda": (_kda_inputs, kda_decode_reference, kda_decode_variant),
}


def _run(family, tiling, state_dtype, seed=3):
    make_inputs, reference, kernel = FAMILIES[family]
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rng)
    src, slots = _slots()
    pool = _pool(rng, src, HV, state_dtype)
    want_o, want_s = jax.jit(reference)(*inputs, pool, slots)
    run = jax.jit(lambda *x: kernel(*x, tiling, interpret=True))
    got_o, got_s = run(*inputs, to_layout(pool, tiling.layout), slots)
    return got_o, to_layout(got_s, tiling.layout), want_o, want_s


@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: t.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference(family, tiling):
    got_o, got_s, want_o, want_s = _run(family, tiling, jnp.float32)
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_pool(family):
    tiling = DecodeTiling("vk", block_v=16, tiles=3, prefetch=True)
    got_o, got_s, want_o, want_s = _run(family, tiling, jnp.bfloat16)
    assert_rel_close(got_o, want_o, tol=1e-2, what="outputs")
    assert_rel_close(got_s, want_s, tol=1e-2, what="state pool")


def test_rejects_bad_tilings():
    with pytest.raises(ValueError, match="layout='xy' must be one of"):
        DecodeTiling("xy")
    with pytest.raises(ValueError, match="reduce='dot' needs block_v >= 16"):
        DecodeTiling(block_v=8, reduce="dot")
    z = jnp.zeros  # a pool in the kv layout handed to a vk launch
    with pytest.raises(ValueError, match=r"state \(3, 4, 32, 16\) must be \(3, 4, 16, 32\)"):
        gdn_decode_variant(
            z((2, 2, 32)), z((2, 2, 32)), z((2, 4, 16)), z((2, 4)), z((2, 4)), z(4), z(4),
            z((3, 4, 32, 16)), _slots_of(2), DecodeTiling("vk"), interpret=True,
        )  # fmt: skip


def _slots_of(rows):
    zeros = np.zeros(rows, np.int32)
    return state_slots(zeros, zeros, np.zeros((rows, 1), np.int32), zeros[:, None], 1)


@pytest.mark.parametrize(
    "tiling",
    [DecodeTiling("vk", block_v=32), DecodeTiling("kv", block_v=64, tiles=4, prefetch=True,
                                                   num_stages=2, reduce="dot")],
    ids=lambda t: t.name,
)  # fmt: skip
def test_lowers_to_triton_at_80b_shapes(tiling):
    rows, d = 8, 128
    sd = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    pool = sd(tiling.pool_shape(rows + 1, 32, d, d), f32)
    gdn = [sd((rows, 16, d), bf)] * 2 + [sd((rows, 32, d), bf)] + [sd((rows, 32), bf)] * 2
    kda = [sd((rows, 32, d), bf)] * 4 + [sd((rows, 32), bf)]
    for fn, acts, gates in [
        (gdn_decode_variant, gdn, [sd((32,), f32)] * 2),
        (kda_decode_variant, kda, [sd((32,), f32), sd((32, d), f32)]),
    ]:
        run = jax.jit(functools.partial(fn, tiling=tiling))
        lowered = run.trace(*acts, *gates, pool, abstract_slots(rows, 2))
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
