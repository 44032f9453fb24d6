"""The Mosaic TPU causal conv1d kernels vs the pure-JAX reference, in TPU interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.conv1d import tpu
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
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


def _compare(got, want, dtype, what):
    if dtype == jnp.float32:
        assert_close(got, want, rtol=1e-5, atol=1e-5, what=what)
    else:
        assert_rel_close(got, want, tol=1e-2, what=what)


PREFILL_CASES = [
    # (lens, channels, kernel width, dtype, chunk, channels_per_block)
    ([1, 63, 64, 65, 130], 40, 4, jnp.float32, 64, None),
    ([2, 1, 5], 24, 4, jnp.float32, 8, None),  # sequences shorter than K - 1
    ([64, 1, 1], 256, 3, jnp.bfloat16, 32, 128),
    ([200, 7], 40, 4, jnp.float32, 128, None),
]


PREFILL_IDS = [
    f"{lens=}_{c=}_{kw=}_{jnp.dtype(dtype).name}_{chunk=}"
    for lens, c, kw, dtype, chunk, _ in PREFILL_CASES
]


@pytest.mark.parametrize("lens,c,kw,dtype,chunk,cb", PREFILL_CASES, ids=PREFILL_IDS)
def test_prefill_matches_reference(lens, c, kw, dtype, chunk, cb):
    rng = np.random.default_rng(sum(lens) + c)
    case = ragged_case(lens, max_ckpt=2)
    x = jnp.asarray(rng.normal(size=(case.num_tokens, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    pool = jnp.asarray(case.pool(rng, (kw - 1, c), np.float32), dtype)
    args = (x, w, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_y, want_s = jax.jit(causal_conv1d_prefill_reference)(*args)
    run = jax.jit(
        lambda *a: tpu.causal_conv1d_prefill(
            *a, chunk=chunk, channels_per_block=cb, interpret=INTERPRET
        )
    )
    got_y, got_s = run(*args)
    assert got_y.dtype == dtype and got_s.dtype == dtype
    assert not np.isnan(np.asarray(got_y, np.float32)).any(), "a poisoned slot was read"
    _compare(got_y, want_y, dtype, "outputs")
    _compare(got_s, want_s, dtype, "conv state pool")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_update_matches_reference(dtype):
    rng = np.random.default_rng(1)
    rows, num_seqs, c, kw, m = 6, 5, 256, 4, 2
    num_slots = 16
    pool = np.full((num_slots, kw - 1, c), np.nan, np.float32)
    src = np.array([1, 2, 0, 3, 4, 0], np.int32)
    pool[src[src > 0]] = rng.normal(size=(4, kw - 1, c))
    dst = np.array([1, 0, 7, 3, 8, 0], np.int32)  # in place, none, fresh
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [12, 13]
    ck_off[3, 1], ck_slot[3, 1] = 2, 14  # offset 2 in decode: ignored
    x = jnp.asarray(rng.normal(size=(rows, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    args = (
        x, w, jnp.asarray(pool, dtype), state_slots(src, dst, ck_off, ck_slot, num_seqs),
    )  # fmt: skip
    want_y, want_s = causal_conv1d_update_reference(*args)
    got_y, got_s = jax.jit(
        lambda *a: tpu.causal_conv1d_update(*a, channels_per_block=128, interpret=INTERPRET)
    )(*args)
    _compare(got_y, want_y, dtype, "outputs")
    _compare(got_s, want_s, dtype, "conv state pool")
    assert np.all(np.asarray(got_y, np.float32)[num_seqs:] == 0)


BAD = {
    "x_rank": (dict(x=jnp.zeros((10, 2, 8))), r"x .* must be \[T, C\]"),
    "weight_channels": (dict(weight=jnp.zeros((7, 4))), "weight .* must be"),
    "kernel_width": (dict(weight=jnp.zeros((8, 12))), "kernel width K=12"),
    "state_shape": (dict(conv_state=jnp.zeros((4, 2, 8))), "conv_state .* must be"),
    "ckpt_shape": (
        dict(slots=zero_slots(3, 2, ckpt_slots=jnp.zeros((3, 1), jnp.int32))),
        "ckpt_slots .* must match",
    ),
    "qsl_shape": (dict(query_start_loc=jnp.zeros(2, jnp.int32)), "query_start_loc .* must be"),
    "channels_per_block": (dict(channels_per_block=3), "channels_per_block=3 must divide"),
}


@pytest.mark.parametrize("bad,match", BAD.values(), ids=BAD.keys())
def test_prefill_rejects_bad_shapes(bad, match):
    z = jnp.zeros
    kw = dict(
        x=z((10, 8)), weight=z((8, 4)), conv_state=z((4, 3, 8)),
        query_start_loc=z(4, jnp.int32), slots=zero_slots(3, 2),
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        tpu.causal_conv1d_prefill(**{**kw, **bad}, interpret=INTERPRET)


def test_kernels_lower_for_tpu_at_80b_shapes():
    c, kw, n, rows, m = 8192, 4, 256, 4, 2
    sd = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    slots = abstract_slots(rows, m)
    pool = sd((8, kw - 1, c), bf)
    mesh = jax.sharding.AbstractMesh(
        (), (), abstract_device=jax.sharding.AbstractDevice("TPU v6e", 1, "tpu")
    )
    prefill = jax.jit(lambda *a: tpu.causal_conv1d_prefill(*a, channels_per_block=1024))
    update = jax.jit(lambda *a: tpu.causal_conv1d_update(*a, channels_per_block=1024))
    with jax.sharding.use_abstract_mesh(mesh):
        for f, args in [
            (prefill, [sd((n, c), bf), sd((c, kw), bf), pool, sd((rows + 1,), i32), slots]),
            (update, [sd((rows, c), bf), sd((c, kw), bf), pool, slots]),
        ]:
            text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
