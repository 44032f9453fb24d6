"""Mosaic GPU kernels lower on a CPU host: the conv benchmark's Mosaic GPU ``silu`` ceiling.

``benchmarks/conv1d_kernels.py --ceiling-only`` times Pallas' two GPU lowerings (Triton and
Mosaic GPU) and XLA moving the conv's ``[T, C]`` bytes once (BENCHMARKS.md: the Triton
lowering's ceiling is 63-65 % of copy bandwidth on an H200). Here, without a GPU: every Mosaic
GPU tiling it times lowers to a Mosaic GPU custom call at the benchmark's shape (Mosaic GPU's
own checks run at lowering: shared memory, TMA copy sizes), and the kernel computes ``silu``
in Pallas' interpreter.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.conv1d_kernels import (
    CHANNELS,
    MGPU_CEILING,
    MGPU_KERNEL_CEILING,
    silu_mosaic_gpu,
    silu_mosaic_gpu_kernel,
)


@pytest.mark.parametrize("tiles", MGPU_CEILING, ids=lambda t: "bt{}_bc{}_s{}".format(*t))
def test_silu_ceiling_lowers_to_mosaic_gpu(tiles):
    bt, bc, steps = tiles
    x = jax.ShapeDtypeStruct((4096, CHANNELS), jnp.bfloat16)
    fn = jax.jit(lambda x: silu_mosaic_gpu(x, block_t=bt, block_c=bc, steps=steps))
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.parametrize("tiles", MGPU_KERNEL_CEILING, ids=lambda t: "bt{}_bc{}_s{}_g{}".format(*t))
def test_silu_ceiling_through_plgpu_kernel_lowers(tiles):
    """The same through ``plgpu.kernel`` and ``emit_pipeline`` (``pallas_call`` for Mosaic GPU
    is deprecated in jax 0.10: the benchmark times both, in case the GPU's jax dropped it)."""
    bt, bc, steps, groups = tiles
    x = jax.ShapeDtypeStruct((4096, CHANNELS), jnp.bfloat16)
    fn = jax.jit(
        lambda x: silu_mosaic_gpu_kernel(x, block_t=bt, block_c=bc, steps=steps, groups=groups)
    )
    assert "custom_call @mosaic_gpu" in fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()


def test_mosaic_gpu_lowering_checks_shared_memory():
    """A tiling over the shared memory is refused at lowering, on this host: the test above
    would catch a ceiling variant that cannot run."""
    x = jax.ShapeDtypeStruct((4096, 512), jnp.float32)
    fn = jax.jit(lambda x: silu_mosaic_gpu(x, block_t=256, block_c=256, steps=4))
    with pytest.raises(ValueError, match="shared memory"):
        fn.trace(x).lower(lowering_platforms=("cuda",))


def test_silu_ceiling_computes_silu():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 512)), jnp.bfloat16)
    got = silu_mosaic_gpu(x, block_t=64, block_c=256, steps=2, interpret=True)
    want = np.asarray(jax.nn.silu(x.astype(jnp.float32)), np.float32)
    # The kernel rounds its f32 silu to bf16 once: within one bf16 step (2^-7 relative) of
    # the f32 value, whatever exp / logistic the host's XLA vectorizes to.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=1e-6)
    with pytest.raises(ValueError, match="do not divide"):
        silu_mosaic_gpu(x, block_t=96, block_c=256, steps=2, interpret=True)


def test_serial_scan_experiment_lowers_to_mosaic_gpu():
    """The delta-rule serial launch in Mosaic GPU (TMA copies, wgmma products, the state as the
    accumulator: ``pallas_kernels.common.chunk_scan_mgpu``, an experiment timed by
    ``benchmarks.gdn_kernels --mgpu-scan``) at the 80B's GDN heads, two rows of 4096 tokens:
    its layouts, copies and shared memory pass Mosaic GPU's checks."""
    from pallas_kernels.common.chunk_scan_mgpu import serial_scan_mgpu

    sd = jax.ShapeDtypeStruct
    h, t, d, rows = 32, 8192, 128, 2
    bf = jnp.bfloat16
    tiles = [sd((h, t, d), bf), sd((h, d, t), bf), sd((h, t, d), bf), sd((h, t, d), bf)]
    f32 = jnp.float32
    args = (*tiles, sd((h, t, 64), bf), sd((h, t // 64), f32), sd((rows, h, d, d), f32))
    fn = jax.jit(lambda *a: serial_scan_mgpu(*a, rows=rows))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
    with pytest.raises(ValueError, match="multiple of 64"):
        serial_scan_mgpu(*(jnp.zeros(a.shape, a.dtype) for a in args), rows=3)


def test_serial_scan_experiment_arithmetic_is_the_triton_launchs():
    """The Mosaic GPU experiment's transposed recurrence (``serial_scan_reference``, its
    products and roundings in plain JAX) gives the Triton serial launch's outputs and final
    states on the same intra-launch scratch: two rows of two chunks, one from a state, one
    from zeros, GVA heads, bf16 operands."""
    from benchmarks.common import prefill_batch
    from pallas_kernels.common import chunk_scan_gpu
    from pallas_kernels.common.chunk_scan_mgpu import serial_scan_reference
    from pallas_kernels.gdn import gpu

    rows, per_row, hk, hv, d = 2, 128, 1, 2, 16
    n = rows * per_row
    qsl, slots, num_slots = prefill_batch(rows, per_row)
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(n, hk, d)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(n, hv, d)), jnp.bfloat16)
    a, b = (jnp.asarray(rng.normal(size=(n, hv)), jnp.bfloat16) for _ in range(2))
    # slow gates (g ~ -1e-3 a token): each chunk's state reaches the next one's output
    A_log, dt_bias = jnp.log(jnp.linspace(0.01, 0.05, hv)), jnp.full(hv, -3.0)
    pool = jnp.asarray(0.1 * rng.normal(size=(num_slots, hv, d, d)), jnp.float32)
    plan, rp, x = gpu.prefill_scratch(
        q, k, v, a, b, A_log, dt_bias, qsl, slots, operand_dtype=jnp.bfloat16, precision=None,
        interpret=True,
    )  # fmt: skip
    o, pool_out = chunk_scan_gpu.scan_launches(
        rp, x, jnp.copy(pool), plan.start, plan.length,
        out_dtype=jnp.bfloat16, bv=8, precision=None, num_warps=4, num_stages=1,
        vb_first=True, three_launches=False, block_v_out=None, interpret=True,
        name="gdn_prefill",
    )  # fmt: skip
    src = np.asarray(slots.src_slot)
    assert src[0] > 0 and src[1] == 0  # one row from a state, one from zeros
    s0 = jnp.where((src > 0)[:, None, None, None], pool[src], 0.0)
    o_t, s = serial_scan_reference(
        x.w[:, :n], jnp.swapaxes(x.u[:, :n], 1, 2), x.q_dec[:, :n], x.k_dec[:, :n],
        x.a_qk[:, :n], x.decay[: n // 64].T, s0, rows=rows,
    )  # fmt: skip
    got_o = np.asarray(jnp.transpose(o_t, (2, 0, 1)), np.float32)
    want_o = np.asarray(o[:n], np.float32)
    assert np.linalg.norm(got_o - want_o) < 1e-2 * np.linalg.norm(want_o)
    want_s = np.asarray(pool_out)[np.asarray(slots.dst_slot)]
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-3, atol=1e-3)
