"""The Mosaic TPU gated-delta-rule kernels vs the pure-JAX reference, in TPU interpret mode.

Pools are NaN-poisoned (see ``ragged_cases``): a read of a slot nobody should read shows up
as NaN outputs, a write to a slot nobody should write as a changed slot. A last test lowers
both kernels for TPU at Qwen3-Next-80B shapes, which runs Mosaic's Python lowering rules
(block shapes, supported primitives) without a TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gdn import tpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from tests.pallas_kernels.ragged_cases import (
    abstract_slots,
    assert_close,
    assert_rel_close,
    ragged_case,
    state_slots,
    zero_slots,
)

INTERPRET = pltpu.InterpretParams()
TOL = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(tol=2e-2)}


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _inputs(rng, n, hk, hv, dk, dv, dtype):
    q, k = rng.normal(size=(2, n, hk, dk))
    v = rng.normal(size=(n, hv, dv))
    a, b = rng.normal(size=(2, n, hv))
    A_log, dt_bias = rng.normal(size=(2, hv))
    cast = [jnp.asarray(x, dtype) for x in (q, k, v, a, b)]
    return cast + [jnp.asarray(A_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32)]


def _compare(got, want, dtype, what):
    if dtype == jnp.float32:
        assert_close(got, want, what=what, **TOL[dtype])
    else:
        assert_rel_close(got, want, what=what, **TOL[dtype])


PREFILL_CASES = [
    # (lens, hk, hv, dk, dv, dtype, heads_per_block)
    ([1, 63, 64, 65, 130], 2, 6, 16, 8, jnp.float32, None),
    ([5], 2, 6, 16, 8, jnp.float32, 3),
    ([64, 1, 1], 2, 2, 8, 16, jnp.float32, 1),
    ([200, 7], 2, 4, 16, 16, jnp.bfloat16, 2),
]


@pytest.mark.parametrize(
    "lens,hk,hv,dk,dv,dtype,hb",
    PREFILL_CASES,
    ids=[f"{lens=}_{hv=}_{jnp.dtype(d).name}_{hb=}" for lens, _, hv, _, _, d, hb in PREFILL_CASES],
)
def test_prefill_matches_reference(lens, hk, hv, dk, dv, dtype, hb):
    rng = np.random.default_rng(sum(lens))
    case = ragged_case(lens)
    inputs = _inputs(rng, case.num_tokens, hk, hv, dk, dv, dtype)
    pool = jnp.asarray(case.pool(rng, (hv, dv, dk), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(gdn_prefill_reference)(*args)
    run = jax.jit(lambda *x: tpu.gdn_prefill(*x, heads_per_block=hb, interpret=INTERPRET))
    got_o, got_s = run(*args)
    assert got_o.dtype == inputs[2].dtype and got_o.shape == want_o.shape
    assert not np.isnan(np.asarray(got_o, np.float32)).any(), "a poisoned slot was read"
    _compare(got_o, want_o, dtype, "outputs")
    _compare(got_s, want_s, dtype, "state pool")
    assert np.all(np.asarray(got_o, np.float32)[case.query_start_loc[case.num_seqs] :] == 0)


def test_prefill_unaligned_checkpoints_and_empty_rows():
    """Checkpoint offsets off the 64 grid split chunks; zero-length live rows write nothing."""
    rng = np.random.default_rng(11)
    lens = [150, 0, 3]
    case = ragged_case(lens, max_ckpt=3)
    case.ckpt_offsets[0] = [1, 100, 129]
    case.ckpt_slots[0] = [case.num_slots - 1, case.num_slots - 2, 1]
    case.dst[1] = case.src[1]  # zero tokens: its slot is never written
    inputs = _inputs(rng, case.num_tokens, 2, 6, 16, 8, jnp.float32)
    pool = jnp.asarray(case.pool(rng, (6, 8, 16), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = gdn_prefill_reference(*args)
    got_o, got_s = tpu.gdn_prefill(*args, interpret=INTERPRET)
    assert_close(got_o, want_o, rtol=1e-4, atol=1e-4, what="outputs")
    assert_close(got_s, want_s, rtol=1e-4, atol=1e-4, what="state pool")
    np.testing.assert_array_equal(np.asarray(got_s)[case.src[1]], pool[case.src[1]])


DECODE_CASES = [(5, 4, jnp.float32, None), (9, 9, jnp.float32, 2), (6, 3, jnp.bfloat16, None)]


@pytest.mark.parametrize(
    "rows,num_seqs,dtype,hb",
    DECODE_CASES,
    ids=[f"{rows=}_{seqs=}_{jnp.dtype(d).name}_{hb=}" for rows, seqs, d, hb in DECODE_CASES],
)
def test_decode_matches_reference(rows, num_seqs, dtype, hb):
    rng = np.random.default_rng(rows)
    hk, hv, dk, dv, m = 2, 6, 16, 8, 2
    inputs = _inputs(rng, rows, hk, hv, dk, dv, dtype)
    num_slots = 2 * rows + 4
    pool = np.full((num_slots, hv, dv, dk), np.nan, np.float32)
    src = np.where(np.arange(rows) % 3 == 2, 0, 1 + np.arange(rows)).astype(np.int32)
    src[num_seqs:] = 0
    pool[src[src > 0]] = rng.normal(size=(int((src > 0).sum()), hv, dv, dk))
    dst = src.copy()  # in place, except: a fresh row writes a new slot, row 1 writes nothing
    dst[src == 0] = rows + 1 + np.arange(rows)[src == 0]
    dst[1] = 0
    dst[num_seqs:] = 0
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [num_slots - 1, num_slots - 2]  # two checkpoints at once
    ck_off[2, 1], ck_slot[2, 1] = 0, num_slots - 3  # offset 0: ignored
    args = (
        *inputs,
        jnp.asarray(pool),
        state_slots(src, dst, ck_off, ck_slot, num_seqs),
    )
    want_o, want_s = jax.jit(gdn_decode_reference)(*args)
    run = jax.jit(lambda *x: tpu.gdn_decode(*x, heads_per_block=hb, interpret=INTERPRET))
    got_o, got_s = run(*args)
    _compare(got_o, want_o, dtype, "outputs")
    _compare(got_s, want_s, dtype, "state pool")
    assert np.isnan(np.asarray(got_s)[num_slots - 3]).all()
    assert np.all(np.asarray(got_o, np.float32)[num_seqs:] == 0)


def test_decode_continues_prefill():
    """Prefill 70 tokens into a slot, then 3 decode steps == one 73-token prefill."""
    rng = np.random.default_rng(5)
    hk, hv, dk, dv, n = 2, 6, 16, 8, 73
    q, k, v, a, b, A_log, dt = _inputs(rng, n, hk, hv, dk, dv, jnp.float32)
    pool = jnp.full((4, hv, dv, dk), jnp.nan, jnp.float32)
    z = np.zeros((1, 1), np.int32)
    qsl = jnp.array([0, 70], jnp.int32)
    fresh, running = state_slots([0], [1], z, z, 1), state_slots([1], [1], z, z, 1)
    o, pool = tpu.gdn_prefill(
        q[:70], k[:70], v[:70], a[:70], b[:70], A_log, dt, pool, qsl, fresh, interpret=INTERPRET
    )
    outs = [o]
    for t in range(70, n):
        sl = slice(t, t + 1)
        o, pool = tpu.gdn_decode(
            q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt, pool, running, interpret=INTERPRET,
        )  # fmt: skip
        outs.append(o)
    full_o, full_s = gdn_prefill_reference(
        q, k, v, a, b, A_log, dt, jnp.zeros((2, hv, dv, dk)), jnp.array([0, n], jnp.int32), fresh
    )
    assert_close(jnp.concatenate(outs), full_o, rtol=1e-4, atol=1e-4, what="outputs")
    assert_close(pool[1], full_s[1], rtol=1e-4, atol=1e-4, what="final state")


def _shape_args(hk=2, hv=6, dk=16, dv=8, n=10, rows=3, m=2, num_slots=4):
    z = jnp.zeros
    return dict(
        q=z((n, hk, dk)), k=z((n, hk, dk)), v=z((n, hv, dv)), a=z((n, hv)), b=z((n, hv)),
        A_log=z(hv), dt_bias=z(hv), state=z((num_slots, hv, dv, dk)),
        query_start_loc=z(rows + 1, jnp.int32), slots=zero_slots(rows, m),
    )  # fmt: skip


BAD = {
    "k_shape": (dict(k=jnp.zeros((10, 2, 8))), "q .* and k .* must both be"),
    "heads_not_divisible": (dict(v=jnp.zeros((10, 5, 8))), "hv=5 value heads must be a multiple"),
    "gates_shape": (dict(a=jnp.zeros((10, 5))), r"a \(10, 5\) and b"),
    "A_log_shape": (dict(A_log=jnp.zeros(5)), "A_log .* must be"),
    "state_shape": (dict(state=jnp.zeros((4, 6, 16, 8))), "state .* must be"),  # [K, V]
    "state_dtype": (dict(state=jnp.zeros((4, 6, 8, 16), jnp.float16)), "must be float32 or bf"),
    "ckpt_shape": (
        dict(slots=zero_slots(3, 2, ckpt_slots=jnp.zeros((3, 1), jnp.int32))),
        "ckpt_slots .* must match",
    ),
    "qsl_shape": (dict(query_start_loc=jnp.zeros(3, jnp.int32)), "query_start_loc .* must be"),
    "heads_per_block": (dict(heads_per_block=4), "heads_per_block=4 must divide hv=6"),
}


@pytest.mark.parametrize("bad,match", BAD.values(), ids=BAD.keys())
def test_prefill_rejects_bad_shapes(bad, match):
    kwargs = {**_shape_args(), **bad}
    with pytest.raises(ValueError, match=match):
        tpu.gdn_prefill(**kwargs, interpret=INTERPRET)


def test_decode_rejects_rows_mismatch():
    kw = _shape_args(n=4)
    del kw["query_start_loc"]
    with pytest.raises(ValueError, match="decode rows 4 must equal"):
        tpu.gdn_decode(**kw, interpret=INTERPRET)


def test_kernels_lower_for_tpu_at_80b_shapes():
    """Mosaic's lowering (block shapes, primitives) accepts both kernels at real shapes."""
    hk, hv, d, n, rows, m = 16, 32, 128, 256, 4, 2
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    gates = [sd((hv,), f32)] * 2
    slots = abstract_slots(rows, m)
    pool = sd((8, hv, d, d), f32)
    mesh = jax.sharding.AbstractMesh(
        (), (), abstract_device=jax.sharding.AbstractDevice("TPU v6e", 1, "tpu")
    )
    with jax.sharding.use_abstract_mesh(mesh):
        kernels = [(n, tpu.gdn_prefill, [sd((rows + 1,), i32)]), (rows, tpu.gdn_decode, [])]
        for t, f, extra in kernels:
            acts = [sd((t, hk, d), bf)] * 2 + [sd((t, hv, d), bf)] + [sd((t, hv), bf)] * 2
            lowered = jax.jit(f).trace(*acts, *gates, pool, *extra, slots)
            text = lowered.lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
