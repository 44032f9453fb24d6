"""The Mosaic TPU KDA kernels vs the pure-JAX reference, in TPU interpret mode.

Pools are NaN-poisoned (see ``ragged_cases``): a read of a slot nobody should read shows up
as NaN outputs, a write to a slot nobody should write as a changed slot. A strong decay
(``A_log`` up to log 16, large raw gates) checks that nothing overflows inside a chunk.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import tpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from tests.pallas_kernels.ragged_cases import (
    abstract_slots,
    assert_close,
    assert_rel_close,
    ragged_case,
    state_slots,
    zero_slots,
)

INTERPRET = pltpu.InterpretParams()


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _inputs(rng, n, h, dk, dv, dtype, gate_scale=2.0):
    q, k = rng.normal(size=(2, n, h, dk))
    v = rng.normal(size=(n, h, dv))
    g = gate_scale * rng.normal(size=(n, h, dk))
    b = rng.normal(size=(n, h))
    A_log = rng.uniform(-1.0, np.log(16.0), size=h)
    dt_bias = rng.normal(size=(h, dk))
    cast = [jnp.asarray(x, dtype) for x in (q, k, v, g, b)]
    return cast + [jnp.asarray(A_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32)]


PREFILL_CASES = [
    # (lens, h, dk, dv, dtype, heads_per_block, gate_scale); the interpreter is slow: few chunks
    # strong decay (gate_scale 20): exp(gam) underflows to 0 inside the chunks
    ([1, 16, 17, 21], 2, 16, 8, jnp.float32, None, 20.0),
    ([20, 2], 3, 8, 16, jnp.bfloat16, 1, 2.0),
]


@pytest.mark.parametrize(
    "lens,h,dk,dv,dtype,hb,gs",
    PREFILL_CASES,
    ids=[
        f"{lens=}_{h=}_{jnp.dtype(d).name}_{hb=}_{gs=}"
        for lens, h, _, _, d, hb, gs in PREFILL_CASES
    ],
)
def test_prefill_matches_reference(lens, h, dk, dv, dtype, hb, gs):
    rng = np.random.default_rng(sum(lens))
    case = ragged_case(lens)
    inputs = _inputs(rng, case.num_tokens, h, dk, dv, dtype, gs)
    pool = jnp.asarray(case.pool(rng, (h, dv, dk), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(kda_prefill_reference)(*args)
    kernel = lambda *x: tpu.kda_prefill(*x, heads_per_block=hb, interpret=INTERPRET)  # noqa: E731
    got_o, got_s = jax.jit(kernel)(*args)
    assert not np.isnan(np.asarray(got_o, np.float32)).any(), "a poisoned slot was read"
    if dtype == jnp.float32:
        assert_close(got_o, want_o, rtol=1e-4, atol=1e-4, what="outputs")
        assert_close(got_s, want_s, rtol=1e-4, atol=1e-4, what="state pool")
    else:
        assert_rel_close(got_o, want_o, tol=2e-2, what="outputs")
        assert_rel_close(got_s, want_s, tol=2e-2, what="state pool")


def test_decode_matches_reference():
    rng = np.random.default_rng(2)
    rows, num_seqs, h, dk, dv, m = 6, 5, 4, 16, 8, 2
    inputs = _inputs(rng, rows, h, dk, dv, jnp.float32)
    pool = np.full((16, h, dv, dk), np.nan, np.float32)
    src = np.array([1, 2, 0, 3, 4, 0], np.int32)
    pool[src[src > 0]] = rng.normal(size=(4, h, dv, dk))
    dst = np.array([1, 0, 7, 3, 8, 0], np.int32)
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [12, 13]
    ck_off[3, 1], ck_slot[3, 1] = 0, 14
    args = (
        *inputs, jnp.asarray(pool), state_slots(src, dst, ck_off, ck_slot, num_seqs),
    )  # fmt: skip
    want_o, want_s = jax.jit(kda_decode_reference)(*args)
    kernel = lambda *x: tpu.kda_decode(*x, heads_per_block=2, interpret=INTERPRET)  # noqa: E731
    got_o, got_s = jax.jit(kernel)(*args)
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")


def test_rejects_bad_heads_per_block():
    z = jnp.zeros
    with pytest.raises(ValueError, match="heads_per_block=3 must divide h=4"):
        tpu.kda_decode(
            z((2, 4, 16)), z((2, 4, 16)), z((2, 4, 8)), z((2, 4, 16)), z((2, 4)), z(4),
            z((4, 16)), z((3, 4, 8, 16)), zero_slots(2, 1), heads_per_block=3,
        )  # fmt: skip


def test_kernels_lower_for_tpu_at_48b_shapes():
    """Mosaic's lowering (block shapes, primitives) accepts both kernels at real shapes."""
    h, d, n, rows, m = 32, 128, 256, 4, 2
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    gates = [sd((h,), f32), sd((h, d), f32)]
    slots = abstract_slots(rows, m)
    pool = sd((8, h, d, d), f32)
    mesh = jax.sharding.AbstractMesh(
        (), (), abstract_device=jax.sharding.AbstractDevice("TPU v6e", 1, "tpu")
    )
    with jax.sharding.use_abstract_mesh(mesh):
        kernels = [(n, tpu.kda_prefill, [sd((rows + 1,), i32)]), (rows, tpu.kda_decode, [])]
        for t, f, extra in kernels:
            acts = [sd((t, h, d), bf)] * 4 + [sd((t, h), bf)]
            lowered = jax.jit(f).trace(*acts, *gates, pool, *extra, slots)
            text = lowered.lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
