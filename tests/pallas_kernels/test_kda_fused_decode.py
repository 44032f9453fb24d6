"""Fused conv1d + KDA decode (GPU kernel, Pallas interpret mode) vs the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import fused_decode
from tests.pallas_kernels.ragged_cases import abstract_slots, assert_close, state_slots, zero_slots


def _case(rng, *, h, dk, dv, kernel, dtype):
    rows, num_seqs, m, num_slots = 7, 5, 2, 16
    c = h * (2 * dk + dv)
    mixed = jnp.asarray(rng.normal(size=(rows, c)), dtype)
    weight = jnp.asarray(rng.normal(size=(c, kernel)) * 0.5, dtype)
    g = jnp.asarray(rng.normal(size=(rows, h, dk)), dtype)
    b = jnp.asarray(rng.normal(size=(rows, h)), dtype)
    A_log = jnp.asarray(rng.normal(size=h), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=(h, dk)), jnp.float32)
    # rows: 0 in place (src == dst), 1 reads without writing, 2 from zero, 3 and 4 read a
    # shared slot and write their own; 5, 6 are padding. Slots nobody reads hold NaN.
    src = np.array([1, 2, 0, 3, 3, 0, 0], np.int32)
    dst = np.array([1, 0, 6, 7, 8, 0, 0], np.int32)
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [10, 11]  # two checkpoints after the one token
    ck_off[3, 1], ck_slot[3, 1] = 0, 12  # offset 0: no write
    ck_off[4, 0], ck_slot[4, 0] = 1, 13
    conv = np.full((num_slots, kernel - 1, c), np.nan, np.float32)
    ssm = np.full((num_slots, h, dv, dk), np.nan, np.float32)
    for s in (1, 2, 3):
        conv[s] = rng.normal(size=(kernel - 1, c))
        ssm[s] = rng.normal(size=(h, dv, dk))
    return (
        mixed, weight, jnp.asarray(conv, dtype), g, b, A_log, dt_bias, jnp.asarray(ssm),
        state_slots(src, dst, ck_off, ck_slot, num_seqs),
    )  # fmt: skip


@pytest.mark.parametrize(
    "h,dk,dv,kernel,bv,dtype",
    [(2, 16, 16, 4, 8, jnp.float32), (3, 16, 8, 3, None, jnp.float32),
     (2, 16, 16, 4, 16, jnp.bfloat16)],
    ids=["bv8_f32", "k3_f32", "bf16"],
)  # fmt: skip
def test_fused_kda_decode_matches_reference(h, dk, dv, kernel, bv, dtype):
    rng = np.random.default_rng(h * 100 + dv + kernel)
    args = _case(rng, h=h, dk=dk, dv=dv, kernel=kernel, dtype=dtype)
    want = jax.jit(fused_decode.conv_kda_decode_reference)(*args)
    got = jax.jit(lambda *x: fused_decode.conv_kda_decode(*x, block_v=bv, interpret=True))(*args)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(["outputs", "conv state", "ssm state"], got, want):
        assert_close(g, w, rtol=tol, atol=tol, what=name)
    # The untouched slots stay poisoned; slot 0 is never written.
    assert np.isnan(np.asarray(got[2], np.float32)[[0, 4, 5, 9, 12, 14, 15]]).all()
    assert np.isnan(np.asarray(got[1], np.float32)[[0, 4, 5, 9, 12, 14, 15]]).all()


def test_fused_kda_decode_rejects_bad_channel_count():
    z = jnp.zeros
    with pytest.raises(ValueError, match=r"mixed \(2, 10\) must be \[S, H\*\(2\*Dk \+ Dv\) = 12"):
        fused_decode.conv_kda_decode_reference(
            z((2, 10)), z((12, 4)), z((3, 3, 12)), z((2, 1, 4)), z((2, 1)), z(1), z((1, 4)),
            z((3, 1, 4, 4)), zero_slots(2, 1),
        )  # fmt: skip


def test_fused_kda_decode_lowers_to_triton_at_kimi_48b_shapes():
    h, d, rows, m = 32, 128, 8, 2
    c = 3 * h * d
    sd = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    args = (
        sd((rows, c), bf), sd((c, 4), bf), sd((6, 3, c), bf), sd((rows, h, d), bf),
        sd((rows, h), bf), sd((h,), f32), sd((h, d), f32), sd((6, h, d, d), f32),
        abstract_slots(rows, m),
    )  # fmt: skip
    text = jax.jit(fused_decode.conv_kda_decode).trace(*args).lower(lowering_platforms=("cuda",))
    assert text.as_text().count("triton") >= 2  # both launches
