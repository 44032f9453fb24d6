"""Causal conv1d prefill on a GPU at Qwen3-Next-80B's shapes: the Pallas kernel vs XLA.

The op is memory bound (4 multiply-adds per element): its floor is the bytes it must move,
``x`` read + ``y`` written + the conv windows read from ``src`` and written to ``dst`` and the
checkpoints, at the device's copy bandwidth. This script

1. measures that bandwidth (:func:`benchmarks.common.copy_bandwidth`: read + write bytes of
   an elementwise pass over 1 GiB of float32, chained and unrolled);
2. checks the kernel (``pallas_kernels/conv1d/gpu.py``) against the reference on a ragged
   batch with in-place rows, rows shorter than the kernel width and checkpoints;
3. times the kernel and the XLA reference (the GPU path before the kernel) in the same
   process with :func:`benchmarks.common.time_stateful` (pool donated, every output consumed)
   at B=1 T=4096, B=1 T=16384 and B=8 T=4096, 8192 channels, width 4, bf16, and reports the
   bytes moved per second as a percentage of the copy bandwidth.

It prints one JSON summary and writes it to ``--out``::

    python -m benchmarks.conv1d_kernels --out CONV1D_KERNELS.json
    python -m benchmarks.conv1d_kernels --sweep        # also tile / warp sweeps at B=1 T=4096
    python -m benchmarks.conv1d_kernels --interpret --quick   # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_name, guarded_entries, time_stateful
from hyjax.layers.conv_channels import pack_conv_channels, split_qkvz
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d import gpu
from pallas_kernels.conv1d.reference import causal_conv1d_prefill_reference

# Qwen3-Next-80B's GDN conv: q and k (16 heads x 128) and v (32 heads x 128), width 4.
CHANNELS, WIDTH, DTYPE = 2 * 16 * 128 + 32 * 128, 4, jnp.bfloat16
MAX_CKPT = 2
INTERPRET = False  # --interpret: Pallas interpret mode on CPU, one timed call (a smoke run)


def prefill_batch(batch: int, seq_len: int, channels: int, ckpt_every: int):
    """``batch`` rows of ``seq_len`` tokens, each updating its slot ``1 + row`` in place and
    writing ``MAX_CKPT`` checkpoints every ``ckpt_every`` tokens (when they fall inside)."""
    key = jax.random.PRNGKey(batch * seq_len)
    kx, kw, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch * seq_len, channels), DTYPE)
    weight = 0.5 * jax.random.normal(kw, (channels, WIDTH), DTYPE)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * seq_len
    running = 1 + jnp.arange(batch, dtype=jnp.int32)
    offs = jnp.arange(1, MAX_CKPT + 1, dtype=jnp.int32) * ckpt_every
    ck_off = jnp.broadcast_to(jnp.where(offs <= seq_len, offs, 0), (batch, MAX_CKPT))
    ck_slot = 1 + batch + jnp.arange(batch * MAX_CKPT, dtype=jnp.int32).reshape(batch, MAX_CKPT)
    ck_slot = jnp.where(ck_off > 0, ck_slot, 0)
    slots = StateSlots(running, running, ck_off, ck_slot, jnp.int32(batch))
    pool = jax.random.normal(kp, (1 + batch * (1 + MAX_CKPT), WIDTH - 1, channels), DTYPE)
    writes = batch * (1 + int(jnp.sum(ck_off[0] > 0)))
    return x, weight, pool, qsl, slots, writes


def bytes_moved(x, pool, batch: int, writes: int) -> int:
    """x read + y written + the source windows read + every window written."""
    window = pool[0].nbytes
    return 2 * x.nbytes + (batch + writes) * window


def check(channels: int, **tiles) -> dict:
    """Kernel vs reference on a ragged batch: in-place rows, rows shorter than K - 1, a fresh
    destination, checkpoints at offsets 1, 2, 64 and 700, a padding row and padding tokens."""
    rng = np.random.default_rng(0)
    lens = [1, 2, 700, 64, 3]
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [sum(lens)]]), jnp.int32)
    src = jnp.array([1, 2, 0, 3, 4, 0], jnp.int32)
    dst = jnp.array([1, 2, 5, 3, 6, 0], jnp.int32)
    ck_off = jnp.array([[0, 0], [1, 0], [64, 700], [2, 64], [0, 0], [0, 0]], jnp.int32)
    ck_slot = jnp.array([[0, 0], [7, 0], [8, 9], [10, 11], [0, 0], [0, 0]], jnp.int32)
    slots = StateSlots(src, dst, ck_off, ck_slot, jnp.int32(len(lens)))
    x = jnp.asarray(rng.normal(size=(sum(lens) + 9, channels)), DTYPE)
    w = jnp.asarray(0.5 * rng.normal(size=(channels, WIDTH)), DTYPE)
    pool = jnp.asarray(rng.normal(size=(12, WIDTH - 1, channels)), DTYPE)
    args = (x, w, pool, qsl, slots)
    want_y, want_s = jax.jit(causal_conv1d_prefill_reference)(*args)
    kernel = functools.partial(gpu.causal_conv1d_prefill, interpret=INTERPRET, **tiles)
    got_y, got_s = jax.jit(kernel)(*args)
    got_y, want_y = np.asarray(got_y, np.float32), np.asarray(want_y, np.float32)
    return {
        "output_max_abs_err": float(np.abs(got_y - want_y).max()),
        "output_max_abs": float(np.abs(want_y).max()),
        "output_bits_equal_fraction": float(np.mean(got_y == want_y)),
        "pool_bit_exact": bool(np.array_equal(np.asarray(got_s, np.float32),
                                              np.asarray(want_s, np.float32))),
    }  # fmt: skip


def _step(fn, qsl, slots):
    """One call; its output is the next call's input, so XLA must compute all of it (with one
    element of the output consumed, XLA's fusion of the reference computed only that one)."""

    def one(carry, weight):
        pool, x = carry
        y, pool = fn(x, weight, pool, qsl, slots)
        return (pool, y.astype(x.dtype)), y[:1, :1]

    return one


def time_prefill(batch, seq_len, channels, *, reference: bool, ckpt_every: int, bw, **tiles):
    """Kernel (and reference) seconds per call, bytes moved per second, % of copy bandwidth."""
    x, weight, pool, qsl, slots, writes = prefill_batch(batch, seq_len, channels, ckpt_every)
    moved = bytes_moved(x, pool, batch, writes)
    iters, repeats = (1, 1) if INTERPRET else (20, 5)
    fns = {"pallas": functools.partial(gpu.causal_conv1d_prefill, interpret=INTERPRET, **tiles)}
    if reference:
        fns["xla"] = causal_conv1d_prefill_reference
    out = {"bytes_moved_MB": moved / 1e6}
    for name, fn in fns.items():
        t = time_stateful(
            _step(fn, qsl, slots),
            (jnp.copy(pool), jnp.copy(x)),
            (weight,),
            iters=iters,
            repeats=repeats,
        )
        out[f"{name}_us"] = 1e6 * t
        out[f"{name}_GBps"] = moved / t / 1e9
        if bw:
            out[f"{name}_pct_of_copy_bw"] = 100 * moved / t / bw
    if reference:
        out["speedup"] = out["xla_us"] / out["pallas_us"]
    return out


def _time_variants(variants, want, pool, operands, moved: int, bw) -> dict:
    """Each ``fn(pool, *operands) -> (pool, outputs)`` of ``variants``: its outputs compared
    with ``want`` on the device, then us per call (10 chained calls a program, the pool
    donated: 20 took the qkvz section past 200 s on 2026-11-29), the first call's seconds
    (compile + one call) and % of copy bandwidth."""
    iters, repeats = (1, 1) if INTERPRET else (10, 5)
    out = {}
    for name, fn in variants.items():
        try:
            t0 = time.perf_counter()
            got = jax.block_until_ready(jax.jit(fn)(jnp.copy(pool), *operands)[1])
            first_call_s = time.perf_counter() - t0
            equal = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True))
            t = time_stateful(fn, jnp.copy(pool), operands, iters=iters, repeats=repeats)
            out[name] = {"us": 1e6 * t, "outputs_equal_packed": equal, "first_call_s": first_call_s}
            if bw:
                out[name]["pct_of_copy_bw"] = 100 * moved / t / bw
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
            out[name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {name}: {out[name]}", flush=True)
    return out


# The GDN layer's conv as the engine runs it (the 80B's heads: 16 key heads of 128, 2 value
# heads each): XLA packs q | k | v out of the projection's output, the conv kernel runs, XLA
# slices its output back into q, k, v; against the kernel reading the projection's output in
# place and writing q, k, v apart (`causal_conv1d_prefill_qkvz`), at these tilings
# (block_t, block_c, num_warps).
QKVZ_HEADS = (16, 128, 128, 2)  # (Hk, Dk, Dv, r)
# The first three at B=1 T=4096 on an H200 (2026-11-29): 80.3 / 83.9 / 89.6 us; 16 x 256 on 2
# warps 99.7, 8 x 512 on 4 warps 91.4.
QKVZ_TILES = [(8, 256, 2), (8, 128, 1), (8, 256, 4)]


def _pack_qkvz(qkvz, hk, dk, dv, ratio):
    """The layer's split and packing of the projection's output (one shard)."""
    q, k, v, _ = split_qkvz(qkvz, hk, dk, dv, ratio)
    return pack_conv_channels(q, k, v, 1)


def time_qkvz(batch, seq_len, *, ckpt_every: int, bw) -> dict:
    """The packed path against the in-place kernel at each of ``QKVZ_TILES``: us per call,
    outputs checked equal first. q, k, v leave through an optimization barrier, as they leave
    for the delta-rule kernel (a custom call takes dense arrays): XLA must write them whole."""
    hk, dk, dv, r = QKVZ_HEADS
    c = 2 * hk * dk + hk * r * dv
    x, weight, pool, qsl, slots, writes = prefill_batch(batch, seq_len, c, ckpt_every)
    key = jax.random.PRNGKey(7)
    qkvz = jax.random.normal(key, (batch * seq_len, hk * (2 * dk + 2 * r * dv)), DTYPE)
    splits = (hk * dk, hk * dk, hk * r * dv)

    def packed(pool, qkvz, weight):
        y, pool = gpu.causal_conv1d_prefill(
            _pack_qkvz(qkvz, hk, dk, dv, r), weight, pool, qsl, slots, interpret=INTERPRET
        )
        bounds = np.cumsum((0, *splits))
        parts = tuple(y[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        return pool, jax.lax.optimization_barrier(parts)

    def in_place(pool, qkvz, weight, tiles):
        bt, bc, nw = tiles
        *parts, pool = gpu.causal_conv1d_prefill_qkvz(
            qkvz, weight, pool, qsl, slots, num_k_heads=hk, head_dims=(dk, dv), block_t=bt,
            block_c=bc, num_warps=nw, interpret=INTERPRET,
        )  # fmt: skip
        return pool, jax.lax.optimization_barrier(tuple(parts))

    want = jax.jit(packed)(jnp.copy(pool), qkvz, weight)[1]
    moved = bytes_moved(x, pool, batch, writes)
    out = {"bytes_moved_MB": moved / 1e6}
    variants = {"packed_xla_pack_and_slices": packed}
    for tiles in QKVZ_TILES:
        variants["in_place_bt{}_bc{}_w{}".format(*tiles)] = functools.partial(in_place, tiles=tiles)
    return {**out, **_time_variants(variants, want, pool, (qkvz, weight), moved, bw)}


# Kimi-Linear-48B's KDA conv: q, k, v projections of 32 heads x 128 each, held apart.
SPLIT_WIDTHS = (4096, 4096, 4096)


def time_split(batch, seq_len, *, ckpt_every: int, bw) -> dict:
    """A KDA layer's conv as the engine ran it (XLA concatenates q, k, v, the kernel, XLA
    slices them back out) against ``causal_conv1d_prefill_split`` (each read and written in
    place): us per call, outputs checked equal first, q, k, v leaving through an optimization
    barrier (as they leave for the KDA kernel)."""
    c = sum(SPLIT_WIDTHS)
    x, weight, pool, qsl, slots, writes = prefill_batch(batch, seq_len, c, ckpt_every)
    keys = jax.random.split(jax.random.PRNGKey(9), len(SPLIT_WIDTHS))
    xs = tuple(
        jax.random.normal(k, (batch * seq_len, n), DTYPE)
        for k, n in zip(keys, SPLIT_WIDTHS, strict=True)
    )

    def packed(pool, xs, weight):
        y, pool = gpu.causal_conv1d_prefill(
            jnp.concatenate(xs, axis=1), weight, pool, qsl, slots, interpret=INTERPRET
        )
        bounds = np.cumsum((0, *SPLIT_WIDTHS))
        parts = tuple(y[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        return pool, jax.lax.optimization_barrier(parts)

    def apart(pool, xs, weight):
        ys, pool = gpu.causal_conv1d_prefill_split(
            xs, weight, pool, qsl, slots, interpret=INTERPRET
        )
        return pool, jax.lax.optimization_barrier(ys)

    want = jax.jit(packed)(jnp.copy(pool), xs, weight)[1]
    moved = bytes_moved(x, pool, batch, writes)
    out = {"bytes_moved_MB": moved / 1e6}
    variants = {"packed_xla_concat_and_slices": packed, "apart": apart}
    return {**out, **_time_variants(variants, want, pool, (xs, weight), moved, bw)}


# (block_t, block_c, num_warps, num_stages); 16-byte loads need BC = 256 x warps
SWEEP = [
    (8, 256, 2, 1), (16, 256, 2, 1), (16, 512, 2, 1), (8, 512, 2, 1), (8, 1024, 4, 1),
    (16, 128, 1, 1), (8, 128, 1, 1), (4, 256, 2, 1), (8, 256, 1, 1), (8, 256, 4, 1),
]  # fmt: skip
# The same bytes through the simplest kernels: y = silu(x) tile by tile in Pallas (the
# Triton lowering's ceiling for one read and one write of [T, C] at that tiling), and XLA's.
CEILING = [(16, 256, 2), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 128, 4)]


def _check_tiles(x, block_t: int, block_c: int) -> None:
    if x.shape[0] % block_t or x.shape[1] % block_c:
        raise ValueError(f"tiles ({block_t}, {block_c}) do not divide x's shape {x.shape}")


def _silu_refs(x_ref, y_ref):
    v = x_ref[...].astype(jnp.float32)
    y_ref[...] = (v * jax.nn.sigmoid(v)).astype(y_ref.dtype)


def _silu_tiled(x, *, block_t: int, block_c: int, compiler_params, interpret: bool, name: str):
    """``silu(x)`` for ``[T, C]`` in ``[block_t, block_c]`` BlockSpec tiles (T and C
    divisible), lowered as ``compiler_params`` choose (Triton or Mosaic GPU)."""
    from jax.experimental import pallas as pl

    _check_tiles(x, block_t, block_c)
    spec = pl.BlockSpec((block_t, block_c), lambda i, j: (i, j))
    return pl.pallas_call(
        _silu_refs,
        grid=(x.shape[0] // block_t, x.shape[1] // block_c),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(x)


def silu_pallas(x, *, block_t: int, block_c: int, num_warps: int):
    """The Triton lowering's ceiling (:func:`_silu_tiled`)."""
    from jax.experimental.pallas import triton as pltr

    params = pltr.CompilerParams(num_warps=num_warps, num_stages=1)
    return _silu_tiled(x, block_t=block_t, block_c=block_c, compiler_params=params,
                       interpret=INTERPRET, name="silu_ceiling")  # fmt: skip


# The same ceiling through Pallas' Mosaic GPU lowering (TMA copies, pipelined by the grid's
# BlockSpecs): (block_t, block_c, max_concurrent_steps); an async copy moves <= 256 a dimension.
MGPU_CEILING = [(64, 256, 2), (128, 256, 2), (64, 256, 4), (128, 128, 4), (256, 128, 2)]


def silu_mosaic_gpu(x, *, block_t: int, block_c: int, steps: int, interpret: bool = False):
    """The Mosaic GPU lowering's (:func:`_silu_tiled`): the pipeline of ``pallas_call``'s grid
    streams the tiles by TMA, ``steps`` in flight."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = plgpu.CompilerParams(max_concurrent_steps=steps)
    return _silu_tiled(x, block_t=block_t, block_c=block_c, compiler_params=params,
                       interpret=interpret, name="silu_ceiling_mgpu")  # fmt: skip


# The same through ``plgpu.kernel`` (the API jax 0.10 points Mosaic GPU users to; ``pallas_call``
# for Mosaic GPU warns that it is deprecated): a grid of (token tiles, channel groups), each
# program pipelining its group's channel tiles by TMA. (block_t, block_c, steps, groups).
MGPU_KERNEL_CEILING = [(64, 256, 2, 4), (32, 256, 3, 4), (32, 256, 2, 8), (64, 128, 3, 8)]


def silu_mosaic_gpu_kernel(x, *, block_t: int, block_c: int, steps: int, groups: int):
    """``silu(x)`` through ``plgpu.kernel``: program ``(i, g)`` owns tokens
    ``[i * block_t, (i + 1) * block_t)`` and the ``g``-th of ``groups`` equal channel groups,
    which ``plgpu.emit_pipeline`` streams in ``[block_t, block_c]`` tiles, ``steps`` in flight.
    (No CPU interpreter: its TMA copies have no discharge rule.)"""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _check_tiles(x, block_t, block_c * groups)
    width = x.shape[1] // groups

    def body(x_gmem, y_gmem):
        i, g = jax.lax.axis_index("t"), jax.lax.axis_index("g")
        part = (pl.ds(i * block_t, block_t), pl.ds(g * width, width))

        def step(_, x_smem, y_smem):
            _silu_refs(x_smem, y_smem)

        spec = pl.BlockSpec((block_t, block_c), lambda j: (0, j))
        plgpu.emit_pipeline(
            step, grid=(width // block_c,), in_specs=[spec], out_specs=[spec],
            max_concurrent_steps=steps,
        )(x_gmem.at[part], y_gmem.at[part])  # fmt: skip

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // block_t, groups),
        grid_names=("t", "g"),
    )(x)


def time_ceiling(batch, seq_len, channels, *, bw, tiles=None, backend="triton") -> dict:
    """One read and one write of the conv's ``x``: Pallas ``silu`` at ``tiles`` (Triton:
    block_t, block_c, num_warps; ``backend="mosaic_gpu"``: block_t, block_c, steps in
    flight), or XLA's ``silu`` with ``tiles=None``."""
    x = jax.random.normal(jax.random.PRNGKey(0), (batch * seq_len, channels), DTYPE)
    if tiles is None:
        fn = jax.nn.silu
    elif backend == "mosaic_gpu_kernel":
        bt, bc, steps, groups = tiles
        fn = functools.partial(
            silu_mosaic_gpu_kernel, block_t=bt, block_c=bc, steps=steps, groups=groups
        )
    elif backend == "mosaic_gpu":
        bt, bc, steps = tiles
        fn = functools.partial(
            silu_mosaic_gpu, block_t=bt, block_c=bc, steps=steps, interpret=INTERPRET
        )
    else:
        bt, bc, nw = tiles
        fn = functools.partial(silu_pallas, block_t=bt, block_c=bc, num_warps=nw)

    # A fast kernel that computes something else is no ceiling: checked against XLA's first.
    want = jax.nn.silu(x.astype(jnp.float32))
    err = float(jnp.max(jnp.abs(jax.jit(fn)(x).astype(jnp.float32) - want)))

    def step(x):
        # the barrier: XLA fused the chained silu calls without it (2026-11-29: its "ceiling"
        # read 111 % of copy at B=8 T=4096)
        y = jax.lax.optimization_barrier(fn(x))
        return y, y[:1, :1]

    iters, repeats = (1, 1) if INTERPRET else (20, 5)
    t = time_stateful(step, x, (), iters=iters, repeats=repeats)
    moved = 2 * x.nbytes
    out = {"bytes_moved_MB": moved / 1e6, "us": 1e6 * t, "GBps": moved / t / 1e9}
    out["max_abs_err_vs_f32"] = err  # bf16 rounding of silu: <= ~0.03 for |x| < 5
    if bw:
        out["pct_of_copy_bw"] = 100 * moved / t / bw
    return out


TRITON_BEST = [(16, 256, 2), (64, 256, 8)]  # CEILING's fastest two on an H200 (2026-11-29)


def ceiling_pass(guarded, b, t, channels, bw) -> None:
    """The ``silu`` ceilings at one shape: the Triton lowering's best tiles, every Mosaic GPU
    variant, and XLA's fusion."""
    for tiles in TRITON_BEST:
        name = "bt{}_bc{}_w{}".format(*tiles)
        guarded(
            f"ceiling_B{b}_T{t}_silu_pallas_{name}",
            lambda tiles=tiles: time_ceiling(b, t, channels, bw=bw, tiles=tiles),
        )
    for tiles in MGPU_CEILING:
        name = "bt{}_bc{}_s{}".format(*tiles)
        guarded(
            f"ceiling_B{b}_T{t}_silu_mgpu_{name}",
            lambda tiles=tiles: time_ceiling(
                b, t, channels, bw=bw, tiles=tiles, backend="mosaic_gpu"
            ),
        )
    for tiles in MGPU_KERNEL_CEILING:
        name = "bt{}_bc{}_s{}_g{}".format(*tiles)
        guarded(
            f"ceiling_B{b}_T{t}_silu_mgpu_kernel_{name}",
            lambda tiles=tiles: time_ceiling(
                b, t, channels, bw=bw, tiles=tiles, backend="mosaic_gpu_kernel"
            ),
        )
    guarded(f"ceiling_B{b}_T{t}_silu_xla", lambda: time_ceiling(b, t, channels, bw=bw))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--sweep", action="store_true", help="tile / warp sweep at B=1 T=4096")
    p.add_argument(
        "--qkvz-only",
        action="store_true",
        help="only the GDN layer's conv: packed by XLA against read in place, every shape",
    )
    p.add_argument(
        "--split-only",
        action="store_true",
        help="only the KDA layer's conv: concatenated by XLA against read apart, every shape",
    )
    p.add_argument(
        "--ceiling-only",
        action="store_true",
        help="only the silu ceilings (Triton, Mosaic GPU, XLA) at every shape, no conv",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    shapes = [(1, 4096), (1, 16384), (8, 4096)]
    channels, ckpt_every = CHANNELS, 1024
    if args.quick:
        shapes, channels, ckpt_every = [(1, 64), (3, 32)], 256, 16
    summary = {
        "device": device_name(),
        "jax": jax.__version__,
        "shapes": f"C={channels} K={WIDTH} {jnp.dtype(DTYPE).name}, in-place rows, "
        f"{MAX_CKPT} checkpoints a row every {ckpt_every} tokens",
    }

    guarded = guarded_entries(summary, args.out)

    copy_bytes = 2**20 if args.quick else 2**30
    iters = dict(iters=1, repeats=1) if INTERPRET else {}
    guarded("copy_bandwidth_GBps", lambda: copy_bandwidth(copy_bytes, **iters) / 1e9)
    bw = summary["copy_bandwidth_GBps"]
    bw = bw * 1e9 if isinstance(bw, float) else None
    # the two extra passes around a layer's conv, or none: GDN's q | k | v in its projection's
    # output (qkvz), KDA's q, k, v apart (split)
    layer_conv = {"qkvz": (args.qkvz_only, time_qkvz), "split": (args.split_only, time_split)}
    layer_conv = {name: fn for name, (on, fn) in layer_conv.items() if on}
    if layer_conv:
        for name, fn in layer_conv.items():
            for b, t in shapes:
                guarded(
                    f"{name}_B{b}_T{t}",
                    lambda b=b, t=t, fn=fn: fn(b, t, ckpt_every=ckpt_every, bw=bw),
                )
        shapes = []
    elif args.ceiling_only:  # which lowering moves [T, C] bytes fastest, at every shape
        for b, t in shapes:
            ceiling_pass(guarded, b, t, channels, bw)
        shapes = []  # and no conv
    else:
        guarded("check", lambda: check(channels))
    for b, t in shapes:
        guarded(
            f"prefill_B{b}_T{t}",
            lambda b=b, t=t: time_prefill(
                b, t, channels, reference=True, ckpt_every=ckpt_every, bw=bw
            ),
        )
    if args.sweep and shapes:
        b, t = shapes[0]
        timed = []  # (us, tiles) of every tiling that ran
        for bt, bc, nw, ns in SWEEP:
            tiles = dict(block_t=bt, block_c=bc, num_warps=nw, num_stages=ns)
            name = f"sweep_B{b}_T{t}_bt{bt}_bc{bc}_w{nw}_s{ns}"
            guarded(
                name,
                lambda tiles=tiles: time_prefill(
                    b, t, channels, reference=False, ckpt_every=ckpt_every, bw=bw, **tiles
                ),
            )
            if "pallas_us" in summary[name]:
                timed.append((summary[name]["pallas_us"], tiles))
        for bt, bc, nw in CEILING:
            guarded(
                f"ceiling_B{b}_T{t}_silu_pallas_bt{bt}_bc{bc}_w{nw}",
                lambda tiles=(bt, bc, nw): time_ceiling(b, t, channels, bw=bw, tiles=tiles),
            )
        guarded(f"ceiling_B{b}_T{t}_silu_xla", lambda: time_ceiling(b, t, channels, bw=bw))
        # The three fastest tilings at every shape.
        for _, tiles in sorted(timed, key=lambda v: v[0])[:3]:
            tag = "_".join(f"{k}{v}" for k, v in tiles.items())
            for bb, tt in shapes[1:]:
                guarded(
                    f"best_B{bb}_T{tt}_{tag}",
                    lambda bb=bb, tt=tt, tiles=tiles: time_prefill(
                        bb, tt, channels, reference=False, ckpt_every=ckpt_every, bw=bw, **tiles
                    ),
                )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
