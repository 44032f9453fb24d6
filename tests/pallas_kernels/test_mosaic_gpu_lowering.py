"""Mosaic GPU kernels lower on a CPU host: the conv benchmark's ``silu`` ceiling, GDN's serial
launch.

``benchmarks/conv1d_kernels.py --ceiling-only`` times Pallas' two GPU lowerings (Triton and
Mosaic GPU) and XLA moving the conv's ``[T, C]`` bytes once (BENCHMARKS.md: the Triton
lowering's ceiling is 63-65 % of copy bandwidth on an H200). Here, without a GPU: every Mosaic
GPU tiling it times lowers to a Mosaic GPU custom call at the benchmark's shape (Mosaic GPU's
own checks run at lowering: shared memory, TMA copy sizes), and the kernel computes ``silu``
in Pallas' interpreter.
"""

import functools

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
from tests.xla_flags import jaxlib_before


@pytest.mark.skipif(
    not jaxlib_before(0, 11), reason="jax 0.11 has no lowering of pallas_call for Mosaic GPU"
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
    """A tiling over the shared memory is refused at lowering, on this host: the tests above
    would catch a ceiling variant that cannot run."""
    x = jax.ShapeDtypeStruct((4096, 512), jnp.float32)
    fn = jax.jit(lambda x: silu_mosaic_gpu_kernel(x, block_t=256, block_c=256, steps=4, groups=1))
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


@pytest.mark.parametrize(
    "rows, per_row, hk, hv, d, every, fold",
    [(2, 4096, 16, 32, 128, 1024, False), (3, 200, 2, 4, 64, 100, False),
     (2, 4096, 16, 32, 128, 1024, True), (3, 200, 2, 4, 64, 100, True),
     (2, 4096, 16, 32, 128, 1024, "triton"), (3, 200, 2, 4, 64, 100, "triton"),
     (2, 4096, 16, 32, 128, 1024, "cols"), (3, 200, 2, 4, 64, 100, "cols"),
     (2, 4096, 16, 32, 128, 1024, "aqk"), (3, 200, 2, 4, 64, 100, "aqk"),
     (2, 4096, 16, 32, 128, 1024, "plain"), (2, 4096, 16, 32, 128, 1024, "plain_aqk"),
     (8, 4096, 16, 32, 128, 1024, "pair"), (3, 200, 2, 4, 64, 100, "pair_dk64"),
     (8, 4096, 16, 32, 128, 1024, "pair_dynamic")],
    ids=["80b", "embedded", "80b_fold", "embedded_fold", "80b_fold_triton",
         "embedded_fold_triton", "80b_fold_cols", "embedded_fold_cols", "80b_fold_aqk",
         "embedded_fold_aqk", "80b_fold_plain", "80b_fold_plain_aqk", "80b_8x4096_pair",
         "dk64_pair", "80b_8x4096_pair_dynamic"],
)  # fmt: skip
def test_gdn_serial_launch_lowers_to_mosaic_gpu(monkeypatch, rows, per_row, hk, hv, d, every, fold):
    """GDN prefill's Mosaic GPU serial launch (``pallas_kernels.common.chunk_scan_mgpu``:
    TMA copies, ``wgmma`` products, the state the accumulator), the GPU prefill's default: at
    the 80B's GDN heads, two rows of 4096 tokens, and at the embedded model's (``Dk = Dv = 64``),
    three rows of 200 (off the 64-token grid), checkpoints in each row: its layouts, copies (a
    warpgroup's copy is a multiple of 128 bytes) and shared memory pass Mosaic GPU's checks,
    and the pool is aliased in and out of the kernel (written in place). ``fold``: the
    launch making ``Aqk`` and the rows' scalings from q's and k's rows (``gdn_prefill(fold=
    True)``: its vectors' copies, the products' operands and the row / column broadcasts),
    its scratch by ``gdn.intra_mgpu``'s launch (the default: two Mosaic GPU kernels, no
    Triton one), ``"triton"`` by the Triton intra launch, ``"cols"`` by it with ``Tm
    diag(beta)`` made by columns (``fold_beta_rows=False``), ``"aqk"`` by the Mosaic GPU one
    with each chunk's ``Aqk`` (``fold_aqk=True``: one more tile a stage in the serial launch),
    ``"plain"`` by it as the plain launch (``intra_mgpu.PERSIST = 0``; the persistent one,
    two stages and W from its stage's k tile, is the default), with Aqk or not; ``"pair"``
    its serial launch's two Dv blocks in one program, a warpgroup each (``serial_pair=True``:
    two threads, each one's tiles in a ``RefUnion``), at eight rows of 4096 (its chunk plan's
    shared memory near the bound), and with ``Dk = 64`` (the embedded model's key dim, Dv
    128); ``"pair_dynamic"`` both serial launches, the plan picking one on the device
    (``serial_pair="dynamic"``)."""
    from benchmarks.common import prefill_batch
    from pallas_kernels.gdn import gpu, intra_mgpu

    # (the persistent scratch launch is the default: "plain" cases lower the plain one)
    monkeypatch.setattr(intra_mgpu, "PERSIST", 0 if str(fold).startswith("plain") else None)

    qsl, slots, num_slots = prefill_batch(rows, per_row, ckpt_every=every)
    n = rows * per_row
    pair = str(fold).startswith("pair")
    dv = 128 if pair else d
    sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    acts = (sd((n, hk, d), bf), sd((n, hk, d), bf), sd((n, hv, dv), bf), sd((n, hv), bf),
            sd((n, hv), bf))  # fmt: skip
    args = (*acts, sd((hv,), f32), sd((hv,), f32), sd((num_slots, hv, dv, d), f32))

    def prefill(*a):
        return gpu.gdn_prefill(
            *a, qsl, slots, precision=None, serial="mgpu", fold=bool(fold),
            fold_beta_rows=fold != "cols", fold_aqk=str(fold).endswith("aqk"),
            fold_intra="triton" if fold in ("triton", "cols") else None,
            serial_pair=("dynamic" if fold.endswith("dynamic") else True) if pair else "0",
        )  # fmt: skip

    text = jax.jit(prefill, donate_argnums=7).trace(*args).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    by_mosaic_gpu = fold in (True, "aqk", "plain", "plain_aqk") or pair  # (intra_mgpu's)
    # (a dynamic pair: both serial launches, the pair writing o in place of the other's)
    serial = 2 if str(fold).endswith("dynamic") else 1
    assert text.count("custom_call @mosaic_gpu") == (1 + serial if by_mosaic_gpu else serial)
    assert ("triton" in text) != by_mosaic_gpu  # the intra launch: Triton's, or none
    assert "tf.aliasing_output" in text  # the donated pool is the kernel's output


@pytest.mark.parametrize(
    "tuning, folds",
    [({}, True), (dict(fold=False), False), (dict(intra_form="whole"), False),
     (dict(serial="triton"), False)],
    ids=["default", "fold_off", "whole_form", "triton_serial"],
)  # fmt: skip
def test_gdn_prefill_folds_by_default_where_it_can(monkeypatch, tuning, folds):
    """GDN's ``fold`` is the GPU prefill's default (``gpu.FOLD``: 1.16-1.20x the unfolded
    prefill at 4x4096 and 8x4096 on an H200) wherever it can run: the Mosaic GPU serial launch
    and a blocked intra form. Told otherwise, or on the whole chunk's intra form or the Triton
    serial launch, the prefill runs unfolded. Counted by the fold's chunk step being traced."""
    from benchmarks.common import prefill_batch
    from pallas_kernels.common import chunk_scan_mgpu
    from pallas_kernels.gdn import gpu

    traced = []
    step = chunk_scan_mgpu._fold_step
    monkeypatch.setattr(
        chunk_scan_mgpu, "_fold_step", lambda *a, **k: traced.append(1) or step(*a, **k)
    )
    qsl, slots, num_slots = prefill_batch(1, 256)
    sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    acts = (sd((256, 2, 64), bf), sd((256, 2, 64), bf), sd((256, 4, 64), bf), sd((256, 4), bf),
            sd((256, 4), bf))  # fmt: skip
    args = (*acts, sd((4,), f32), sd((4,), f32), sd((num_slots, 4, 64, 64), f32))

    def prefill(*a):
        return gpu.gdn_prefill(*a, qsl, slots, precision=None, **tuning)

    text = jax.jit(prefill, donate_argnums=7).trace(*args).lower(lowering_platforms=("cuda",))
    assert ("custom_call @mosaic_gpu" in text.as_text()) == (tuning.get("serial") != "triton")
    assert bool(traced) == folds


@pytest.mark.parametrize(
    "diagnostic, prefetch", [("chain", 0), ("loads", 0), (None, 1), (None, 2), ("chain", 1)]
)
def test_gdn_serial_launch_variants_lower_to_mosaic_gpu(diagnostic, prefetch):
    """The serial launch's benchmark decompositions (``scan_mgpu(diagnostic=...)``, timed by
    ``benchmarks.gdn_kernels --mgpu-scan``: fewer copies a stage, the barrier's arrivals
    following, no ``o`` products) and its L2 prefetches of later chunks' tiles
    (``prefetch``), at the 80B's GDN heads, one row of 1024 tokens with checkpoints."""
    from benchmarks.common import prefill_batch
    from pallas_kernels.common import chunk_scan_mgpu
    from pallas_kernels.gdn import gpu

    qsl, slots, num_slots = prefill_batch(1, 1024, ckpt_every=256)
    n, hk, hv, d = 1024, 16, 32, 128
    sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    acts = (sd((n, hk, d), bf), sd((n, hk, d), bf), sd((n, hv, d), bf), sd((n, hv), bf),
            sd((n, hv), bf), sd((hv,), f32), sd((hv,), f32))  # fmt: skip

    def serial(acts, pool):
        _, rp, x = gpu.prefill_scratch(
            *acts, qsl, slots, operand_dtype=bf, precision=None, tma_layout=True
        )
        return chunk_scan_mgpu.scan_mgpu(
            rp, x, pool, out_dtype=bf, diagnostic=diagnostic, prefetch=prefetch
        )

    pool = sd((num_slots, hv, d, d), f32)
    lowered = jax.jit(serial, donate_argnums=1).trace(acts, pool)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
    # the kernel's TMA prefetches into L2, only if asked (jax 0.11's Mosaic GPU also prefetches
    # its tensor maps, "prefetch.tensormap", in every kernel)
    assert ("cp.async.bulk.prefetch" in text) == bool(prefetch)


def test_gdn_serial_launch_lowers_in_a_layer_scan_under_shard_map():
    """Where the engine would call it: wrapped as the TP op (``hyjax.sharding._shard_op`` with
    Qwen3-Next's ``gdn_prefill`` specs, here on a one-device mesh) in a ``lax.scan`` over layers
    whose pools are the scan's operand; the pool's ref is made and frozen inside each call."""
    from benchmarks.common import prefill_batch
    from hyjax.models.qwen3_next.sharding import SHARDING
    from hyjax.sharding import _shard_op, make_mesh
    from pallas_kernels.gdn import gpu

    rows, per_row, hk, hv, d = 2, 512, 16, 32, 128
    qsl, slots, num_slots = prefill_batch(rows, per_row, ckpt_every=256)
    n = rows * per_row
    sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    acts = (sd((n, hk, d), bf), sd((n, hk, d), bf), sd((n, hv, d), bf), sd((n, hv), bf),
            sd((n, hv), bf), sd((hv,), f32), sd((hv,), f32))  # fmt: skip
    in_specs, out_specs = SHARDING.ops["gdn_prefill"]
    prefill = functools.partial(gpu.gdn_prefill, precision=None, serial="mgpu")
    sharded = _shard_op(prefill, make_mesh(1), in_specs, out_specs, 1)

    def step(acts, pools):
        def layer(total, pool):
            o, pool = sharded(*acts, pool, qsl, slots)
            return total + o.astype(f32).sum(), pool

        return jax.lax.scan(layer, 0.0, pools)

    pools = sd((2, num_slots, hv, d, d), f32)
    lowered = jax.jit(step, donate_argnums=1).trace(acts, pools).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()


def test_kda_serial_launch_lowers_to_mosaic_gpu():
    """KDA's prefill on the Mosaic GPU launch at Kimi-Linear-48B's heads (32 heads of 128):
    the per-channel decay (a ``[Dk]`` f32 vector a stage, loaded to scale ``S^T``'s columns)
    passes Mosaic GPU's layout checks."""
    from benchmarks.common import prefill_batch
    from pallas_kernels.kda import gpu as kda_gpu

    rows, per_row, h, d = 2, 2048, 32, 128
    qsl, slots, num_slots = prefill_batch(rows, per_row, ckpt_every=512)
    n = rows * per_row
    sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    acts = (sd((n, h, d), bf), sd((n, h, d), bf), sd((n, h, d), bf), sd((n, h, d), bf),
            sd((n, h), bf))  # fmt: skip
    args = (*acts, sd((h,), f32), sd((h, d), f32), sd((num_slots, h, d, d), f32))

    def prefill(*a):
        return kda_gpu.kda_prefill(*a, qsl, slots, precision=None, serial="mgpu")

    lowered = jax.jit(prefill, donate_argnums=7).trace(*args).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize(
    "pool_dtype, item_rows, lag",
    [(jnp.float32, 64, 1), (jnp.bfloat16, 64, 1), (jnp.float32, 64, 0), (jnp.float32, 128, 1)],
)  # fmt: skip
def test_decode_lowers_to_mosaic_gpu(family, pool_dtype, item_rows, lag):
    """The Mosaic GPU decode (``pallas_kernels.common.decode_mgpu``) at the 80B's GDN heads /
    Kimi-Linear-48B's KDA heads, 256 rows, two checkpoint columns: its layouts (the state tile,
    the row and column vectors, their reductions and broadcasts), copies and shared memory pass
    Mosaic GPU's checks, and the pool is aliased in and out (written in place). The defaults
    (one program an SM of 5 buffers, ``lag`` 1: each item's stores one commit group, waited
    for one item late), the first design's (``lag`` 0, 3 buffers), and ``item_rows`` 128: a
    64 KB tile a copy, updated in two halves (3 buffers)."""
    from pallas_kernels.common import decode_mgpu
    from pallas_kernels.common.slots import StateSlots

    rows, d = 256, 128
    hk, hv = (16, 32) if family == "gdn" else (32, 32)
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    gate = sds((rows, hv), bf) if family == "gdn" else sds((rows, hv, d), bf)
    acts = (sds((rows, hk, d), bf), sds((rows, hk, d), bf), sds((rows, hv, d), bf), gate,
            sds((rows, hv), bf), sds((hv,), jnp.float32),
            sds((hv,) if family == "gdn" else (hv, d), jnp.float32))  # fmt: skip
    i32 = jnp.int32
    slots = StateSlots(sds((rows,), i32), sds((rows,), i32), sds((rows, 2), i32),
                       sds((rows, 2), i32), sds((), i32))  # fmt: skip
    pool = sds((rows + 1, hv, d, d), pool_dtype)
    kernel = decode_mgpu.gdn_decode_mgpu if family == "gdn" else decode_mgpu.kda_decode_mgpu
    fn = jax.jit(
        lambda acts, p, s: kernel(
            *acts,
            p,
            s,
            programs=132,
            item_rows=item_rows,
            lag=lag,
            buffers=decode_mgpu.BUFFERS if lag and item_rows == 64 else 3,
        ),
        donate_argnums=1,
    )
    text = fn.trace(acts, pool, slots).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
    assert "tf.aliasing_output" in text  # the donated pool is the kernel's output


def test_kda_decode_route_lowers_in_a_layer_scan_under_shard_map():
    """The engine's KDA decode on the Mosaic GPU decode (``kda_decode(kernel="mgpu")``, what
    ``HYJAX_DECODE_KERNEL=mgpu`` selects), wrapped as the TP op with Kimi-Linear's specs on a
    one-device mesh, in a ``lax.scan`` over layers whose pools are the scan's operand."""
    from hyjax.models.kimi_linear.sharding import SHARDING
    from hyjax.sharding import _shard_op, make_mesh
    from pallas_kernels.common.slots import StateSlots
    from pallas_kernels.kda import gpu as kda_gpu

    rows, h, d = 64, 32, 128
    sd, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    acts = (sd((rows, h, d), bf), sd((rows, h, d), bf), sd((rows, h, d), bf),
            sd((rows, h, d), bf), sd((rows, h), bf), sd((h,), f32), sd((h, d), f32))  # fmt: skip
    slots = StateSlots(sd((rows,), i32), sd((rows,), i32), sd((rows, 2), i32),
                       sd((rows, 2), i32), sd((), i32))  # fmt: skip
    in_specs, out_specs = SHARDING.ops["kda_decode"]
    decode = functools.partial(kda_gpu.kda_decode, kernel="mgpu")
    sharded = _shard_op(decode, make_mesh(1), in_specs, out_specs, 1)

    def step(acts, pools, slots):
        def layer(total, pool):
            o, pool = sharded(*acts, pool, slots)
            return total + o.astype(f32).sum(), pool

        return jax.lax.scan(layer, 0.0, pools)

    pools = sd((2, rows + 1, h, d, d), f32)
    lowered = jax.jit(step, donate_argnums=1).trace(acts, pools, slots)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text
