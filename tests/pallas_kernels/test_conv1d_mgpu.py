"""The Mosaic GPU conv1d prefill (``pallas_kernels.conv1d.mgpu``) against the pure-JAX reference
in Pallas' GPU interpreter on CPU, and lowered for CUDA at a Qwen3-Next layer's shapes.

Its main pass reads the batch as one sequence; each row's first K - 1 tokens are then
recomputed from the row's source window. Both sum the taps in the reference's order in float32;
rounded to bf16 the outputs are at most a bf16 step apart (one host's compiler may fuse a
multiply-add the other keeps apart), and the pool (copies of inputs) is bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d import mgpu
from pallas_kernels.conv1d.reference import causal_conv1d_prefill_reference
from tests.pallas_kernels.ragged_cases import abstract_slots, assert_rel_close, ragged_case


@pytest.mark.parametrize("width, steps", [(4, 1), (4, 2), (2, 3), (4, 8)])
def test_ragged_batch_matches_the_reference(width, steps):
    """Rows of 70, 2, 130, 1 and 64 tokens (the second and fourth from a state and shorter than
    K - 1; rows starting inside tiles and on a tile's edge), checkpoints, two empty rows, 47
    padding tokens (zeros), NaN in every slot no row reads or writes. Five tiles: a program
    walks one, two (both buffers twice), three (the last program one) or all of them."""
    rng = np.random.default_rng(0)
    case = ragged_case([70, 2, 130, 1, 64])
    num_tokens, channels = 320, 256
    x = jnp.asarray(rng.normal(size=(num_tokens, channels)), jnp.bfloat16)
    w = jnp.asarray(0.5 * rng.normal(size=(channels, width)), jnp.bfloat16)
    pool = jnp.asarray(case.pool(rng, (width - 1, channels), np.float32), jnp.bfloat16)
    qsl, slots = jnp.asarray(case.query_start_loc), case.slots()
    want_y, want_s = jax.jit(causal_conv1d_prefill_reference)(x, w, pool, qsl, slots)
    run = jax.jit(lambda *a: mgpu.causal_conv1d_prefill_mgpu(*a, steps=steps, interpret=True))
    got_y, got_s = run(x, w, pool, qsl, slots)
    got_y, want_y = np.asarray(got_y, np.float32), np.asarray(want_y, np.float32)
    assert not np.isnan(got_y).any(), "a poisoned slot was read"
    assert_rel_close(got_y, want_y, tol=8e-3, what="outputs")
    assert (got_y[int(case.query_start_loc[-1]) :] == 0).all()
    np.testing.assert_array_equal(np.asarray(got_s, np.float32), np.asarray(want_s, np.float32))


def test_shapes_it_cannot_take_are_named():
    reason = mgpu.unsupported_reason
    assert reason(4096, 8192, 4, jnp.bfloat16) is None
    assert "T=100" in reason(100, 8192, 4, jnp.bfloat16)
    assert "C=96" in reason(128, 96, 4, jnp.bfloat16)
    assert "float32" in reason(128, 128, 4, jnp.float32)
    assert "K=10" in reason(128, 128, 10, jnp.bfloat16)
    x = jnp.zeros((100, 128), jnp.bfloat16)
    pool = jnp.zeros((2, 3, 128), jnp.bfloat16)
    slots = ragged_case([100], extra_rows=0).slots()
    with pytest.raises(ValueError, match="steps=0"):
        mgpu.causal_conv1d_prefill_mgpu(
            x[:64], jnp.zeros((128, 4), jnp.bfloat16), pool, jnp.array([0, 64], jnp.int32),
            ragged_case([64], extra_rows=0).slots(), steps=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="T=100"):
        mgpu.causal_conv1d_prefill_mgpu(
            x, jnp.zeros((128, 4), jnp.bfloat16), pool, jnp.array([0, 100], jnp.int32), slots
        )


def test_lowers_to_mosaic_gpu_at_the_80b_conv_shapes():
    """Qwen3-Next-80B's GDN conv (q, k, v: 8192 channels, K = 4), 8 rows of 1024 tokens with
    checkpoints: the copies (a box's row a multiple of 16 bytes), layouts and shared memory
    pass Mosaic GPU's checks."""
    sd = jax.ShapeDtypeStruct
    rows, per_row, channels = 8, 1024, 8192
    fn = jax.jit(mgpu.causal_conv1d_prefill_mgpu, donate_argnums=2)
    args = (sd((rows * per_row, channels), jnp.bfloat16), sd((channels, 4), jnp.bfloat16),
            sd((1 + 3 * rows, 3, channels), jnp.bfloat16), sd((rows + 1,), jnp.int32),
            abstract_slots(rows, 2))  # fmt: skip
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
