"""MLA on the paged latent cache, GPU kernel at Kimi-Linear-48B shapes: checks and timings.

Run on an H100/H200 (``python benchmarks/mla_kernels.py --out $OUT/mla.json``); CPU smoke run
of the script itself: ``--interpret`` (tiny contexts, the kernel interpreted).

1. the device copy bandwidth (read + write bytes / s of a 1 GiB elementwise pass);
2. checks of ``mla_gpu.mla_prefill`` / ``mla_decode`` against the reference ops computing in
   IEEE float32 (``Precision.HIGHEST``): decode, prefill and mixed batches, both prefill paths
   (decompressed rows, absorbed rows, rows past the workspace), block sizes 16 and 64, bf16
   and f32 caches, pages handed out at random, the null block and an unused page NaN;
3. prefill chunks (1k-4k tokens, fresh and after 8k-16k cached) and a mixed batch (32 decode
   rows at 16k + a chunk): the default op (decompressed prefill) beside the absorbed-only
   kernel (``decompress_tokens=0``) with today's and with the previous long-launch tiles;
   TFLOP/s counted both as the absorbed kernel's ``2H(2L + R)`` and as decompressed
   attention's ``2H(Dn + R + Dv)`` flops per visible (query, key) pair;
4. a tuning sweep of the decompressed prefill; decode spot checks (absorbed kernel, as before).

Timings are jitted ``fori_loop``s of chained calls (each call's query depends on the last
output), divided by the number of calls; each trip of the loop costs a host round trip on
GPU (~10 us), negligible against ms-scale prefill. Results are written after every item, so a
run cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_chained
from pallas_kernels.attention import mla_gpu
from pallas_kernels.attention.mla_reference import mla_decode_reference, mla_prefill_reference

H, L, R, DN, DV = 32, 512, 64, 128, 128  # Kimi-Linear-48B-A3B
SCALE = (DN + R) ** -0.5
ATTN = dict(nope_dim=DN, scale=SCALE)
INTERPRET = False


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def paged_batch(rng, q_lens, ctx_lens, *, block_size=64, dtype=jnp.bfloat16, poison=True):
    """A ragged batch over a latent pool with pages in random order.

    Returns (mla_prefill args, latent bytes the batch reads)."""
    q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
    s = len(q_lens)
    blocks_per = -(-ctx_lens // block_size)
    num_blocks = int(blocks_per.sum()) + 2  # + null block + one unused page
    ids = rng.permutation(np.arange(1, num_blocks))
    bt = np.zeros((s, int(blocks_per.max())), np.int32)
    at = 0
    for i, nb in enumerate(blocks_per):
        bt[i, :nb] = ids[at : at + nb]
        at += nb
    key = jax.random.key(int(rng.integers(1 << 30)))
    cache = jax.random.normal(key, (num_blocks, block_size, L + R), dtype)
    if poison:
        cache = cache.at[jnp.asarray([0, ids[-1]])].set(jnp.nan)
    t = int(q_lens.sum())
    q = jax.random.normal(jax.random.fold_in(key, 1), (t, H, DN + R), dtype)
    w = jax.random.normal(jax.random.fold_in(key, 2), (L, H, DN + DV), dtype) * L**-0.5
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, cache, w, jnp.asarray(qsl), jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(bt),
            jnp.int32(s))  # fmt: skip
    return args, int(ctx_lens.sum()) * (L + R) * jnp.dtype(dtype).itemsize


def pairs(q_lens, ctx_lens) -> int:
    """Visible (query, key) pairs of a causal ragged batch."""
    total = 0
    for ql, c in zip(q_lens, ctx_lens, strict=True):
        first = c - ql + 1
        total += ql * first + ql * (ql - 1) // 2
    return total


def absorbed_flops(q_lens, ctx_lens) -> float:
    return 2.0 * H * (2 * L + R) * pairs(q_lens, ctx_lens)


def decompressed_flops(q_lens, ctx_lens) -> float:
    """Attention over decompressed K (Dn + R) / V (Dv), decompression not counted."""
    return 2.0 * H * (DN + R + DV) * pairs(q_lens, ctx_lens)


def time_fn(fn, args, iters: int = 10, repeats: int = 3) -> float:
    """Median seconds per call of ``fn(*args)`` (``common.time_chained``, unrolled: the
    ``fori_loop`` this used counted a host round trip per call on a GPU; once in interpret)."""
    if INTERPRET:
        iters, repeats = 1, 1
    return time_chained(fn, args, iters, repeats)


def time_copy(nbytes: int) -> float:
    """Seconds of a jitted elementwise pass over ``nbytes`` of bf16 (reads and writes them)."""
    x = jnp.ones((max(1, nbytes // 2),), jnp.bfloat16)
    return time_fn(lambda x: x * 1.0001, (x,), iters=10)


def copy_bandwidth() -> float:
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    return 2 * x.nbytes / time_fn(lambda x: x * 1.0001, (x,), iters=10) / 1e9


def err_ratio(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(q_lens, ctx_lens, *, block_size, dtype, decode, **tuning) -> dict:
    rng = np.random.default_rng(sum(ctx_lens) + block_size)
    args, _ = paged_batch(rng, q_lens, ctx_lens, block_size=block_size, dtype=dtype)
    q, cache, w, qsl, lens, bt, n = args
    # a padding token / row past num_seqs, as the runner's buckets have
    q = jnp.concatenate([q, jnp.full((1, H, DN + R), jnp.nan, q.dtype)])
    lens = jnp.concatenate([lens, jnp.zeros(1, jnp.int32)])
    bt = jnp.concatenate([bt, jnp.zeros((1, bt.shape[1]), jnp.int32)])
    if decode:
        args = (q, cache, w, lens, bt, n)
        want = jax.jit(functools.partial(mla_decode_reference, **ATTN))(*args)
        got = jax.jit(functools.partial(mla_gpu.mla_decode, **ATTN, interpret=INTERPRET))(*args)
    else:
        qsl = jnp.concatenate([qsl, qsl[-1:]])
        args = (q, cache, w, qsl, lens, bt, n)
        want = jax.jit(functools.partial(mla_prefill_reference, **ATTN))(*args)
        got = jax.jit(
            functools.partial(mla_gpu.mla_prefill, **ATTN, interpret=INTERPRET, **tuning)
        )(*args)
    got = np.asarray(got, np.float32)
    live = int(sum(q_lens))
    ratio = err_ratio(got[:live], want[:live])
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    nan = bool(np.isnan(got).any())
    pad_zero = bool((got[live:] == 0).all())
    return {"err_ratio": ratio, "tol": tol, "nan": nan, "pad_zero": pad_zero,
            "ok": ratio < tol and not nan and pad_zero}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--budget-s", type=float, default=230.0, help="skip what starts after this")
    args = p.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    t_start = time.perf_counter()
    summary = {"device": device_name(), "jax": jax.__version__,
               "shapes": f"{H=} {L=} {R=} {DN=} {DV=} bf16 cache"}  # fmt: skip

    def write():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)

    def guarded(name, fn):
        if time.perf_counter() - t_start > args.budget_s:
            summary[name] = {"skipped": "time budget"}
        else:
            try:
                summary[name] = fn()
            except Exception as e:  # noqa: BLE001 - keep going, report the failure
                summary[name] = {"failed": f"{type(e).__name__}: {str(e)[:400]}"}
                traceback.print_exc()
        print(f"[{time.perf_counter() - t_start:6.1f}s]", name, json.dumps(summary[name]),
              flush=True)  # fmt: skip
        write()

    small = INTERPRET
    bw = None
    if not small:
        guarded("copy_bandwidth_GBps", copy_bandwidth)
        bw = summary.get("copy_bandwidth_GBps")
        bw = bw if isinstance(bw, float) else None

    # checks first: the decompressed prefill (rows of >= 64 new tokens) and the absorbed
    # kernel (decode rows, short chunks, rows past the workspace) against the reference
    ck = 40 if small else 4096
    big = 96 if small else 1024
    checks = {
        "prefill_bs64_bf16": (False, [min(ck, 300), 40], [min(ck, 300), 40 + ck // 4], 64,
                              jnp.bfloat16, {}),
        "mixed_bs64_bf16": (False, [1, 1, 37, 1, 130], [ck, 5, 37 + ck // 2, ck // 3, 130], 64,
                            jnp.bfloat16, {}),
        # f32 (IEEE products), 16-token pages: the absorbed kernel (f32's default)
        "prefill_bs16_f32": (False, [100, 40], [100, 40 + min(ck, 300)], 16, jnp.float32, {}),
        f"chunk{big}_at{big}_bs64_bf16": (False, [big, 70], [2 * big, 70], 64, jnp.bfloat16, {}),
        # the second row does not fit the workspace: the absorbed long launch takes it
        "overflow_bs64_bf16": (False, [big, 70], [2 * big, 70], 64, jnp.bfloat16,
                               dict(decompress_tokens=2 * big + 32)),
        "decode_bs64_bf16": (True, [1] * 4, [ck, ck // 2 + 3, 17, 1], 64, jnp.bfloat16, {}),
    }  # fmt: skip
    for name, (decode, ql, cl, bs, dt, tuning) in checks.items():
        guarded(
            f"check_{name}",
            lambda d=decode, ql=ql, cl=cl, bs=bs, dt=dt, t=tuning: check(
                ql, cl, block_size=bs, dtype=dt, decode=d, **t
            ),
        )
    summary["all_checks_ok"] = all(
        v.get("ok", False) for k, v in summary.items() if k.startswith("check_")
    )
    write()

    def timed_decode(b, c, with_ref=True, **tuning):
        rng = np.random.default_rng(0)
        a, nbytes = paged_batch(rng, [1] * b, [c] * b, poison=False)
        q, cache, w, _, lens, bt, n = a
        dargs = (q, cache, w, lens, bt, n)
        s = time_fn(functools.partial(mla_gpu.mla_decode, **ATTN, interpret=INTERPRET,
                                      **tuning), dargs)  # fmt: skip
        res = {"us": s * 1e6, "latent_GBps": nbytes / s / 1e9}
        if bw:
            res["frac_copy_bw"] = res["latent_GBps"] / bw
        if with_ref and not tuning:
            res["copy_same_bytes_us"] = time_copy(nbytes) * 1e6
            try:
                r = time_fn(functools.partial(mla_decode_reference, **ATTN), dargs, iters=3)
                res["reference_us"] = r * 1e6
                res["speedup_vs_reference"] = r / s
            except Exception as e:  # noqa: BLE001 - the reference may not fit
                res["reference"] = f"{type(e).__name__}: {str(e)[:200]}"
        return res

    def timed_prefill(q_lens, ctx_lens, with_ref=False, **tuning):
        rng = np.random.default_rng(1)
        a, nbytes = paged_batch(rng, q_lens, ctx_lens, poison=False)
        s = time_fn(functools.partial(mla_gpu.mla_prefill, **ATTN, interpret=INTERPRET,
                                      **tuning), a, iters=5)  # fmt: skip
        res = {
            "us": s * 1e6,
            "TFLOPs_absorbed": absorbed_flops(q_lens, ctx_lens) / s / 1e12,
            "TFLOPs_decompressed": decompressed_flops(q_lens, ctx_lens) / s / 1e12,
        }
        if with_ref:
            try:
                r = time_fn(functools.partial(mla_prefill_reference, **ATTN), a, iters=2,
                            repeats=2)  # fmt: skip
                res["reference_us"] = r * 1e6
                res["speedup_vs_reference"] = r / s
            except Exception as e:  # noqa: BLE001
                res["reference"] = f"{type(e).__name__}: {str(e)[:200]}"
        return res

    # prefill chunks: the new path (default) and the absorbed-only baselines side by side:
    # "absorbed_only" = the absorbed kernel with today's long-launch tiles (8 warps, 64-key
    # blocks), "absorbed_old_tiles" = as it was before (4 warps, 32-key blocks)
    absorbed = dict(decompress_tokens=0)
    old_tiles = dict(decompress_tokens=0, num_warps_prefill=4, block_k_prefill=32)
    if small:
        cases = [("chunk64_fresh", [64], [64]), ("chunk64_at64", [64], [128])]
        mixed_name, mixed = "mixed_4x64_plus_chunk64_at32", ([1] * 4 + [64], [64] * 4 + [96])
    else:
        cases = [
            ("chunk4096_fresh", [4096], [4096]),
            ("chunk2048_at8192", [2048], [10240]),
            ("chunk1024_fresh", [1024], [1024]),
            ("chunk2048_fresh", [2048], [2048]),
            ("chunk1024_at8192", [1024], [9216]),
            ("chunk2048_at16384", [2048], [18432]),
        ]
        mixed_name = "mixed_32x16384_plus_chunk2048_at8192"
        mixed = ([1] * 32 + [2048], [16384] * 32 + [2048 + 8192])
    head = [(f"prefill_{cases[0][0]}", cases[0][1], cases[0][2]), (mixed_name, *mixed)]
    for name, ql, cl in head:  # the reference would build ~19 GB for the mixed case
        guarded(name, lambda ql=ql, cl=cl: timed_prefill(ql, cl))
        guarded(name + "_absorbed_old_tiles",
                lambda ql=ql, cl=cl: timed_prefill(ql, cl, **old_tiles))  # fmt: skip
        guarded(name + "_absorbed_only", lambda ql=ql, cl=cl: timed_prefill(ql, cl, **absorbed))
    for name, ql, cl in cases[1:]:
        guarded(f"prefill_{name}", lambda ql=ql, cl=cl: timed_prefill(ql, cl))
    for name, ql, cl in (cases[1], cases[-1]):
        guarded(f"prefill_{name}_absorbed_only",
                lambda ql=ql, cl=cl: timed_prefill(ql, cl, **absorbed))  # fmt: skip

    sweep_prefill = [dict(flash_block_q=64), dict(flash_warps=4), dict(flash_stages=3),
                     dict(flash_block_k=32), dict(decompress_block_w=128, decompress_warps=8),
                     dict(flash_block_q=64, flash_warps=4), dict(flash_block_k=128)]  # fmt: skip
    if small:
        sweep_prefill = sweep_prefill[:1]
    for tuning in sweep_prefill:
        tag = "_".join(f"{k}{v}" for k, v in tuning.items())
        for name, ql, cl in cases[:2]:
            guarded(f"sweep_prefill_{name}_{tag}",
                    lambda ql=ql, cl=cl, t=tuning: timed_prefill(ql, cl, **t))  # fmt: skip

    # where decompression starts to pay: short chunks after a long context, both paths
    for ql in (16,) if small else (64, 128, 256):
        ctx = 64 if small else 16384
        for tag, t in (("", dict(decompress_min_q=min(ql, 64))), ("_absorbed_only", absorbed)):
            guarded(f"prefill_chunk{ql}_at{ctx}{tag}",
                    lambda ql=ql, ctx=ctx, t=t: timed_prefill([ql], [ql + ctx], **t))  # fmt: skip

    # decode: the same absorbed kernel as before (a spot check that it is unchanged)
    for b, c in ((32, 64) if small else (32, 32768), (8, 64) if small else (8, 4096)):
        guarded(f"decode_ctx{c}_b{b}", lambda b=b, c=c: timed_decode(b, c, with_ref=False))
    summary["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(summary, indent=1))
    write()


if __name__ == "__main__":
    main()
