"""Fused conv1d + KDA decode (GPU kernel, Pallas interpret mode) vs the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import fused_decode
from tests.pallas_kernels.ragged_cases import (
    FUSED_UNTOUCHED,
    abstract_slots,
    assert_close,
    fused_decode_case,
    zero_slots,
)


def _case(rng, *, h, dk, dv, kernel, dtype):
    rows, c = 7, h * (2 * dk + dv)
    mixed = jnp.asarray(rng.normal(size=(rows, c)), dtype)
    weight = jnp.asarray(rng.normal(size=(c, kernel)) * 0.5, dtype)
    g = jnp.asarray(rng.normal(size=(rows, h, dk)), dtype)
    b = jnp.asarray(rng.normal(size=(rows, h)), dtype)
    A_log = jnp.asarray(rng.normal(size=h), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=(h, dk)), jnp.float32)
    conv, ssm, slots = fused_decode_case(rng, c, kernel, (h, dv, dk), dtype)
    return mixed, weight, conv, g, b, A_log, dt_bias, ssm, slots


@pytest.mark.parametrize(
    "h,dk,dv,kernel,bv,dtype",
    [(2, 16, 16, 4, 8, jnp.float32), (3, 16, 8, 3, None, jnp.float32),
     (2, 16, 16, 4, 16, jnp.bfloat16)],
    ids=["bv8_f32", "k3_f32", "bf16"],
)  # fmt: skip
@pytest.mark.parametrize("two_kernels", [False, True], ids=["fused", "two_kernels"])
def test_fused_kda_decode_matches_reference(h, dk, dv, kernel, bv, dtype, two_kernels):
    """The fused kernel, and the Pallas conv update handing q, k, v to ``kda_decode``."""
    rng = np.random.default_rng(h * 100 + dv + kernel)
    args = _case(rng, h=h, dk=dk, dv=dv, kernel=kernel, dtype=dtype)
    want = jax.jit(fused_decode.conv_kda_decode_reference)(*args)
    if two_kernels:
        fn = functools.partial(fused_decode.two_kernel_conv_kda_decode, interpret=True)
    else:
        fn = functools.partial(fused_decode.conv_kda_decode, block_v=bv, interpret=True)
    got = jax.jit(fn)(*args)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(["outputs", "conv state", "ssm state"], got, want):
        assert_close(g, w, rtol=tol, atol=tol, what=name)
    # The untouched slots stay poisoned; slot 0 is never written.
    assert np.isnan(np.asarray(got[2], np.float32)[FUSED_UNTOUCHED]).all()
    assert np.isnan(np.asarray(got[1], np.float32)[FUSED_UNTOUCHED]).all()


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


def test_tpu_column_composes_the_two_mosaic_kernels():
    """The op table's TPU cell (the conv update and KDA decode kernels in turn, in the TPU
    interpreter) gives the reference's outputs and pools."""
    from hyjax.ops import REFERENCE, backend_ops

    op = backend_ops("interpret", "cpu").conv_kda_decode
    assert op is not REFERENCE.conv_kda_decode  # the kernels, not the reference twice
    rng = np.random.default_rng(7)
    args = _case(rng, h=2, dk=128, dv=128, kernel=4, dtype=jnp.float32)
    want = jax.jit(fused_decode.conv_kda_decode_reference)(*args)
    got = jax.jit(op)(*args)
    for name, g, w in zip(["outputs", "conv state", "ssm state"], got, want):
        assert_close(g, w, rtol=1e-4, atol=1e-4, what=name)
    assert np.isnan(np.asarray(got[2], np.float32)[FUSED_UNTOUCHED]).all()
