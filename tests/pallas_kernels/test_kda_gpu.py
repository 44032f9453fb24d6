"""The Triton-lowered GPU KDA kernels vs the reference, in Pallas interpret mode.

Interpret mode checks the indexing (ragged chunk windows, masks, slots, NaN-poisoned pools);
a last test lowers both kernels to Triton IR for CUDA at Kimi-Linear-48B shapes (no GPU
needed). Compiling and timing them is ``benchmarks/kda_kernels.py`` on a GPU machine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import gpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from tests.pallas_kernels.ragged_cases import (
    abstract_slots,
    assert_close,
    assert_rel_close,
    ragged_case,
    state_slots,
    zero_slots,
)


def _inputs(rng, n, h, dk, dv, dtype):
    q, k = rng.normal(size=(2, n, h, dk))
    v = rng.normal(size=(n, h, dv))
    g = 2 * rng.normal(size=(n, h, dk))
    b = rng.normal(size=(n, h))
    A_log, dt_bias = rng.normal(size=h), rng.normal(size=(h, dk))
    cast = [jnp.asarray(x, dtype) for x in (q, k, v, g, b)]
    return cast + [jnp.asarray(A_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32)]


PREFILL_CASES = [
    # (lens, h, dk, dv, dtype, block_v)
    ([1, 15, 16, 17, 70], 2, 16, 8, jnp.float32, 4),
    ([5, 2], 2, 16, 16, jnp.float32, None),  # T < 64: the wrapper pads
    ([100, 7], 1, 16, 16, jnp.bfloat16, 8),
    ([130, 64, 3], 1, 32, 16, jnp.float32, 8),  # full 64-token chunks, a window at T's end
]
PREFILL_IDS = [
    f"{lens=}_{h=}_{jnp.dtype(dt).name}_{bv=}" for lens, h, _, _, dt, bv in PREFILL_CASES
]
# The two-launch path (default), the output in a launch of its own, and bf16 dot operands.
PATHS = {
    "two": {},
    "three": {"three_launches": True},
    "bf16_operands": {"operand_dtype": jnp.bfloat16},
}


# Each case takes ~40 s of XLA compilation in interpret mode: bf16 operands run on the float32
# cases with several chunks per row only (a bf16 case's default path already takes bf16
# operands), the three-launch path on two cases.
PREFILL_PATH_CASES = [
    pytest.param(*case, path, id=f"{case_id}-{path}")
    for i, (case, case_id) in enumerate(zip(PREFILL_CASES, PREFILL_IDS))
    for path in PATHS
    if (path != "bf16_operands" or (max(case[0]) > 64 and case[4] == jnp.float32))
    and (path != "three" or i in (0, 2))
]


@pytest.mark.parametrize("lens,h,dk,dv,dtype,bv,path", PREFILL_PATH_CASES)
def test_prefill_matches_reference(lens, h, dk, dv, dtype, bv, path):
    _check_prefill(lens, h, dk, dv, dtype, bv, path)


@pytest.mark.parametrize(
    "form,case",
    [("columns", 3), ("launch_rows", 3), ("launch_rows", 2), ("mid", 3), ("mid", 2)],
)
def test_prefill_diagonal_blocks_other_forms(form, case, monkeypatch):
    """The diagonal blocks' other forms (the default makes them in a launch of their own,
    each column's row taken out of the tiles, which the other prefill tests run):
    ``"columns"``, the column loop inside the intra launch, ``"launch_rows"``, each
    column's row of k and of the gates read from memory, and ``"mid"``, two products through
    each block's middle row (these gates' decays allow it everywhere; the strong gates' test
    runs its column loop), on the ragged case whose chunks fill all four 16-row blocks, and
    one shorter than a block; the second also on bf16 inputs."""
    monkeypatch.setattr(gpu, "DIAG_FORM", form)
    lens, h, dk, dv, dtype, bv = PREFILL_CASES[case]
    _check_prefill(lens, h, dk, dv, dtype, bv, "two")


def test_an_unknown_diagonal_form_is_named():
    with pytest.raises(ValueError, match="diagonal block form 'fast'"):
        gpu.intra_launch(*([None] * 8), num_chunks=1, operand_dtype=jnp.float32,
                         precision=None, diag_form="fast")  # fmt: skip


def _check_prefill(lens, h, dk, dv, dtype, bv, path):
    rng = np.random.default_rng(sum(lens))
    case = ragged_case(lens)
    inputs = _inputs(rng, case.num_tokens, h, dk, dv, dtype)
    pool = jnp.asarray(case.pool(rng, (h, dv, dk), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(kda_prefill_reference)(*args)
    kernel = functools.partial(gpu.kda_prefill, block_v=bv, interpret=True, **PATHS[path])
    got_o, got_s = jax.jit(kernel)(*args)
    assert not np.isnan(np.asarray(got_o, np.float32)).any(), "a poisoned slot was read"
    if dtype == jnp.float32 and path != "bf16_operands":
        assert_close(got_o, want_o, rtol=1e-4, atol=1e-4, what="outputs")
        assert_close(got_s, want_s, rtol=1e-4, atol=1e-4, what="state pool")
    else:
        assert_rel_close(got_o, want_o, tol=2e-2, what="outputs")
        assert_rel_close(got_s, want_s, tol=2e-2, what="state pool")


@pytest.mark.parametrize("diag_form", gpu.DIAG_FORMS)
def test_prefill_strong_gates_stay_finite(diag_form, monkeypatch):
    """Decays of ~e^-100 per token: every exp argument in the chunk must stay <= 0 (a factored
    form e^gam_i e^-gam_j would overflow), and the tiny products underflow to exact zeros.
    Every form of the scores (:data:`gpu.DIAG_FORMS`)."""
    monkeypatch.setattr(gpu, "DIAG_FORM", diag_form)
    rng = np.random.default_rng(7)
    case = ragged_case([150, 40])
    h, dk, dv = 1, 16, 16
    q, k, v, g, b, _, dt_bias = _inputs(rng, case.num_tokens, h, dk, dv, jnp.float32)
    A_log = jnp.full((h,), np.log(16.0), jnp.float32)
    g = g + 6.0  # softplus ~ 6..12: g ~ -100..-200 per token and channel
    pool = jnp.asarray(case.pool(rng, (h, dv, dk), np.float32))
    args = (q, k, v, g, b, A_log, dt_bias, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(kda_prefill_reference)(*args)
    got_o, got_s = jax.jit(functools.partial(gpu.kda_prefill, interpret=True))(*args)
    assert np.isfinite(np.asarray(got_o)).all()
    assert_close(got_o, want_o, rtol=1e-4, atol=1e-4, what="outputs")
    assert_close(got_s, want_s, rtol=1e-4, atol=1e-4, what="state pool")


def test_decode_matches_reference():
    rng = np.random.default_rng(2)
    rows, num_seqs, h, dk, dv, m = 6, 5, 3, 16, 8, 2
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
    got_o, got_s = jax.jit(lambda *x: gpu.kda_decode(*x, block_v=4, interpret=True))(*args)
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")


def test_rejects_bad_blocks():
    z = jnp.zeros
    with pytest.raises(ValueError, match="block_v=3 must be a power of two"):
        gpu.kda_decode(
            z((2, 1, 16)), z((2, 1, 16)), z((2, 1, 12)), z((2, 1, 16)), z((2, 1)), z(1),
            z((1, 16)), z((3, 1, 12, 16)), zero_slots(2, 1), block_v=3, interpret=True,
        )  # fmt: skip


@pytest.mark.parametrize("diag_form", [None, "mid"])
def test_kernels_lower_to_triton_at_48b_shapes(diag_form, monkeypatch):
    """The prefill (its default diagonal form, and ``"mid"``: a branch between two products
    and the column loop) and the decode lower at Kimi-Linear-48B's heads."""
    if diag_form:
        monkeypatch.setattr(gpu, "DIAG_FORM", diag_form)
    h, d, n, rows, m = 32, 128, 256, 4, 2
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    gates = [sd((h,), f32), sd((h, d), f32)]
    slots = abstract_slots(rows, m)
    pool = sd((8, h, d, d), f32)
    for t, f, extra in [(n, gpu.kda_prefill, [sd((rows + 1,), i32)]), (rows, gpu.kda_decode, [])]:
        acts = [sd((t, h, d), bf)] * 4 + [sd((t, h), bf)]
        lowered = jax.jit(f).trace(*acts, *gates, pool, *extra, slots)
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_softplus_poly_matches_float64():
    """The prefill launches' softplus (a polynomial for log1p) within a few f32 ulps of the
    exact value at every x whose value is a normal f32 (below -87 both flush to 0), and x
    itself above PyTorch's threshold of 20."""
    from pallas_kernels.common.delta_rule import softplus, softplus_poly

    x = np.concatenate([np.linspace(-80.0, 90.0, 400_001), [-20.0, -1e-7, 0.0, 1e-7, 20.0]])
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(softplus_poly)(jnp.asarray(x)), np.float64)
    exact = np.logaddexp(0.0, x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 6e-7
    big = x > 20.0
    np.testing.assert_array_equal(got[big], x[big])
    # the same function as the references' softplus, to their own rounding
    ref = np.asarray(jax.jit(softplus)(jnp.asarray(x)), np.float64)
    assert np.max(np.abs(got - ref) / exact) < 1e-6
