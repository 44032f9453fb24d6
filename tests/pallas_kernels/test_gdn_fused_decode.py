"""Fused conv1d + gated-delta-rule decode (GPU kernel, Pallas interpret mode) vs the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import fused_decode
from tests.pallas_kernels.ragged_cases import (
    FUSED_UNTOUCHED,
    abstract_slots,
    assert_close,
    fused_decode_case,
    zero_slots,
)


def _case(rng, *, hk, hv, dk, dv, kernel, dtype):
    rows, c = 7, 2 * hk * dk + hv * dv
    mixed = jnp.asarray(rng.normal(size=(rows, c)), dtype)
    weight = jnp.asarray(rng.normal(size=(c, kernel)) * 0.5, dtype)
    a, b = (jnp.asarray(x, dtype) for x in rng.normal(size=(2, rows, hv)))
    A_log = jnp.asarray(rng.normal(size=hv), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=hv), jnp.float32)
    conv, ssm, slots = fused_decode_case(rng, c, kernel, (hv, dv, dk), dtype)
    return mixed, weight, conv, a, b, A_log, dt_bias, ssm, slots


@pytest.mark.parametrize(
    "variant", [0, 8, "two_kernels"], ids=["fused", "small_batch_unfused", "two_kernels"]
)
@pytest.mark.parametrize(
    "hk,hv,dk,dv,kernel,bv,dtype",
    [(2, 4, 16, 16, 4, 8, jnp.float32), (1, 3, 16, 8, 3, None, jnp.float32),
     (2, 4, 16, 16, 4, 16, jnp.bfloat16)],
    ids=["gva2_bv8_f32", "gva3_k3_f32", "gva2_bf16"],
)  # fmt: skip
def test_fused_decode_matches_reference(hk, hv, dk, dv, kernel, bv, dtype, variant):
    """``variant``: the fused kernel's ``min_rows`` (8: its unfused small-batch path), or the
    Pallas conv update handing q, k, v to ``gdn_decode`` (``two_kernel_conv_gdn_decode``)."""
    rng = np.random.default_rng(hk * 100 + hv + kernel)
    args = _case(rng, hk=hk, hv=hv, dk=dk, dv=dv, kernel=kernel, dtype=dtype)
    ref = jax.jit(lambda *x: fused_decode.conv_gdn_decode_reference(*x, num_k_heads=hk))
    if variant == "two_kernels":
        fn = functools.partial(fused_decode.two_kernel_conv_gdn_decode, interpret=True)
    else:
        fn = functools.partial(
            fused_decode.conv_gdn_decode, block_v=bv, min_rows=variant, interpret=True
        )
    got_fn = jax.jit(lambda *x: fn(*x, num_k_heads=hk))
    want = ref(*args)
    got = got_fn(*args)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(["outputs", "conv state", "ssm state"], got, want):
        assert_close(g, w, rtol=tol, atol=tol, what=name)
    # The untouched slots stay poisoned; slot 0 is never written.
    assert np.isnan(np.asarray(got[2], np.float32)[FUSED_UNTOUCHED]).all()
    assert np.isnan(np.asarray(got[1], np.float32)[FUSED_UNTOUCHED]).all()


def test_fused_decode_rejects_bad_channel_count():
    z = jnp.zeros
    with pytest.raises(ValueError, match=r"mixed \(2, 10\) must be \[S, 2\*Hk\*Dk \+ Hv\*Dv = 12"):
        fused_decode.conv_gdn_decode_reference(
            z((2, 10)), z((12, 4)), z((3, 3, 12)), z((2, 1)), z((2, 1)), z(1), z(1),
            z((3, 1, 4, 4)), zero_slots(2, 1), num_k_heads=1,
        )  # fmt: skip


def test_fused_decode_lowers_to_triton_at_80b_shapes():
    hk, hv, d, rows, m = 16, 32, 128, 8, 2
    c = 2 * hk * d + hv * d
    sd = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    args = (
        sd((rows, c), bf), sd((c, 4), bf), sd((6, 3, c), bf), sd((rows, hv), bf),
        sd((rows, hv), bf), sd((hv,), f32), sd((hv,), f32), sd((6, hv, d, d), f32),
        abstract_slots(rows, m),
    )  # fmt: skip
    fn = jax.jit(lambda *x: fused_decode.conv_gdn_decode(*x, num_k_heads=hk))
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
