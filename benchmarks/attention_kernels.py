"""Ragged paged attention on one GPU: checks against the reference, timings, torch SDPA baseline.

Run on an H100/H200 (``python benchmarks/attention_kernels.py --out $OUT/attn.json``):

1. the device copy bandwidth (read + write bytes / s of a 1 GiB elementwise pass), the floor a
   memory-bound decode is measured against;
2. checks of the Pallas GPU kernel against the float32 reference at Qwen3-Next-80B attention
   shapes (Hq=16, Hkv=2, D=256) and at D=128 (Hq=32, Hkv=4): decode, prefill and mixed batches,
   block sizes 16 and 128, KV pages scattered at random, unused pages NaN;
3. timings: decode at contexts 4k/16k/64k and batch 1..64 (KV bytes read / time vs the copy
   bandwidth), a mixed batch (decode rows + one prefill chunk), a prefill chunk (TFLOP/s);
4. torch ``scaled_dot_product_attention`` (flash backend, GQA) at the same shapes on contiguous
   KV (no paging: it reads the same bytes), in the same process;
5. with ``--baseline FILE``, the same timings of another kernel file of the same signature (an
   older revision: before/after on one card in one run);
6. with ``--decode-only``, decode cases call the kernel with ``decode_only=True`` (what the
   engine's decode buckets run), ours and the baseline's, and checks of that path are added;
   ``--only PREFIX`` keeps the timed cases whose names start with it.

Every JAX timing is one jitted program of ``iters`` chained calls, unrolled (each call's query
depends on the last output, so nothing is hoisted), divided by the number of calls. Not a
``fori_loop``: on GPU every trip of an XLA while loop costs a host round trip (~10 us), which
the earlier figures counted as the kernel's. torch is timed the same way: ``iters`` calls
captured in one CUDA graph, replayed (its eager, launch-bound time is kept beside it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import guarded_entries, time_chained
from pallas_kernels.attention import gpu
from pallas_kernels.attention.reference import ragged_paged_attention_reference

HQ, HKV, D = 16, 2, 256
INTERPRET = False


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


# ----------------------------------------------------------------------------- inputs


def paged_batch(rng, q_lens, ctx_lens, *, hq=HQ, hkv=HKV, d=D, block_size=64, poison=True):
    """A ragged batch over a KV pool whose pages are handed out in random order.

    Returns (args for the kernel, kv bytes the batch's attention reads)."""
    q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
    s = len(q_lens)
    blocks_per = -(-ctx_lens // block_size)
    max_blocks = int(blocks_per.max())
    num_blocks = int(blocks_per.sum()) + 2  # + null block + one unused page
    ids = rng.permutation(np.arange(1, num_blocks))
    bt = np.zeros((s, max_blocks), np.int32)
    at = 0
    for i, nb in enumerate(blocks_per):
        bt[i, :nb] = ids[at : at + nb]
        at += nb
    shape = (num_blocks, block_size, hkv, d)
    key = jax.random.key(int(rng.integers(1 << 30)))
    k_cache = jax.random.normal(key, shape, jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
    if poison:  # the unused page and the null block: a stray read gives NaN
        unused = jnp.asarray([0, ids[-1]])
        k_cache = k_cache.at[unused].set(jnp.nan)
        v_cache = v_cache.at[unused].set(jnp.nan)
    t = int(q_lens.sum())
    q = jax.random.normal(jax.random.fold_in(key, 2), (t, hq, d), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (
        q, k_cache, v_cache, jnp.asarray(qsl), jnp.asarray(ctx_lens, jnp.int32),
        jnp.asarray(bt), jnp.int32(s),
    )  # fmt: skip
    kv_bytes = int(ctx_lens.sum()) * hkv * d * 2 * 2
    return args, kv_bytes


def attention_flops(q_lens, ctx_lens, hq=HQ, d=D) -> float:
    """4 * Hq * D per (query, visible key) pair, causal."""
    total = 0
    for ql, c in zip(q_lens, ctx_lens, strict=True):
        first = c - ql + 1  # keys visible to the first new token
        total += ql * first + ql * (ql - 1) // 2
    return 4.0 * hq * d * total


# ----------------------------------------------------------------------------- timing


def time_attention(fn, args, iters: int, repeats: int = 3) -> float:
    """Median seconds per call of ``fn(*args)`` (``common.time_chained``; once in interpret)."""
    if INTERPRET:
        iters, repeats = 1, 1
    return time_chained(fn, args, iters, repeats)


def copy_bandwidth() -> float:
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda x: x * 1.0001)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / float(np.median(times)) / 1e9


def kernel_fn(module=None, **tuning):
    """The kernel under test (``module``: another implementation, e.g. an older revision)."""
    fn = (module or gpu).ragged_paged_attention
    return functools.partial(fn, scale=D**-0.5, interpret=INTERPRET, **tuning)


def load_module(path: str):
    """A kernel module from a file (``git show REV:pallas_kernels/attention/gpu.py > F``)."""
    spec = importlib.util.spec_from_file_location("attention_gpu_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- checks


def err_ratio(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(q_lens, ctx_lens, *, hq=HQ, hkv=HKV, d=D, block_size=64, **tuning) -> dict:
    rng = np.random.default_rng(sum(ctx_lens))
    args, _ = paged_batch(rng, q_lens, ctx_lens, hq=hq, hkv=hkv, d=d, block_size=block_size)
    # one padding token and one padding row past num_seqs, as the runner's buckets have
    q, kc, vc, qsl, lens, bt, n = args
    q = jnp.concatenate([q, jnp.full((1, hq, d), jnp.nan, q.dtype)])
    qsl = jnp.concatenate([qsl, qsl[-1:]])
    lens = jnp.concatenate([lens, jnp.zeros(1, jnp.int32)])
    bt = jnp.concatenate([bt, jnp.zeros((1, bt.shape[1]), jnp.int32)])
    args = (q, kc, vc, qsl, lens, bt, n)
    scale = d**-0.5
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=scale))(*args)
    fn = functools.partial(gpu.ragged_paged_attention, scale=scale, interpret=INTERPRET, **tuning)
    got = jax.jit(fn)(*args)
    got_np = np.asarray(got, np.float32)
    live = int(qsl[-1])
    ratio = err_ratio(got_np[:live], want[:live])
    return {
        "err_ratio": ratio,
        "nan": bool(np.isnan(got_np).any()),
        "pad_zero": bool((got_np[live:] == 0).all()),
        "ok": ratio < 1e-2 and not np.isnan(got_np).any(),
    }


# ----------------------------------------------------------------------------- torch


def torch_sdpa(cases) -> dict:
    """torch SDPA, flash backend, on contiguous KV at the same shapes (None when unusable)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dev = "cuda"
    out = {"torch": torch.__version__}

    def cuda_time(fn, iters=50):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters / 1e3

    def graph_time(fn, iters=50):
        """``iters`` calls captured in one CUDA graph (no launch overhead), per call."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        return cuda_time(graph.replay, 3) / iters

    def timings(fn) -> dict:
        res = {"eager_s": cuda_time(fn)}
        try:
            res["graph_s"] = graph_time(fn)
        except RuntimeError as e:  # not capturable: eager only
            res["graph_failed"] = str(e)[:200]
        res["s"] = min(res["eager_s"], res.get("graph_s", res["eager_s"]))
        return res

    x = torch.empty(1 << 30, device=dev, dtype=torch.uint8)  # 1 GiB
    y = torch.empty_like(x)
    out["copy_bandwidth_GBps"] = 2 * x.numel() / cuda_time(lambda x=x, y=y: y.copy_(x), 20) / 1e9
    x = y = None
    for name, q_lens, ctx_lens in cases:
        try:
            parts = []
            for ql, c in zip(q_lens, ctx_lens, strict=True):  # group equal shapes into a batch
                parts.append((ql, c))
            groups = {}
            for ql, c in parts:
                groups[(ql, c)] = groups.get((ql, c), 0) + 1
            calls = []
            for (ql, c), b in groups.items():
                q = torch.randn(b, HQ, ql, D, device=dev, dtype=torch.bfloat16)
                k = torch.randn(b, HKV, c, D, device=dev, dtype=torch.bfloat16)
                v = torch.randn(b, HKV, c, D, device=dev, dtype=torch.bfloat16)
                mask = causal_lower_right(ql, c) if ql > 1 else None
                calls.append((q, k, v, mask))

            def run(calls=calls, backends=(SDPBackend.FLASH_ATTENTION,)):
                with sdpa_kernel(list(backends)):
                    for q, k, v, mask in calls:
                        if mask is None:
                            torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, enable_gqa=True
                            )
                        else:
                            torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, attn_mask=mask, enable_gqa=True
                            )

            try:
                out[name] = {**timings(run), "backend": "flash"}
            except RuntimeError as e:  # flash refused these shapes: torch's best instead
                best = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
                out[name] = {
                    **timings(functools.partial(run, backends=best)),
                    "backend": "cudnn/efficient",
                    "flash_failed": str(e)[:200],
                }
            del calls
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - report and go on
            out[name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--sweep", action="store_true", help="decode tuning sweep")
    p.add_argument(
        "--baseline",
        default=None,
        help="time this kernel file too (same cases, its defaults): before/after",
    )
    p.add_argument("--contexts", default="4096,16384,65472", help="decode contexts")
    p.add_argument("--batches", default="1,2,4,8,32,64", help="decode batch sizes")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--decode-only", action="store_true", help="decode cases: decode_only=True")
    p.add_argument("--only", default="", help="time only the cases whose names start so")
    p.add_argument("--checks", default="decode,prefill,mixed", help="which checks to run")
    args = p.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    summary = {"device": device_name(), "jax": jax.__version__, "shapes": f"{HQ=} {HKV=} {D=}"}

    guarded = guarded_entries(summary, args.out)  # saved as it goes

    small = INTERPRET
    if not small:
        guarded("copy_bandwidth_GBps", copy_bandwidth)
    # checks: decode, prefill, mixed; two block sizes; D=256 (16/2) and D=128 (32/4)
    ck = 64 if small else 4096
    checks = {
        "decode": ([1] * 4, [ck, ck // 2 + 3, 17, 1]),
        "prefill": ([min(ck, 300), 40], [min(ck, 300), 40 + ck // 4]),
        "mixed": ([1, 1, 37, 1, 130], [ck, 5, 37 + ck // 2, ck // 3, 130]),
    }
    wanted = set(args.checks.split(","))
    for name, (ql, cl) in ({} if args.skip_checks else checks).items():
        if name not in wanted:
            continue
        for bs in (16, 128):
            guarded(
                f"check_{name}_bs{bs}_d256",
                lambda ql=ql, cl=cl, bs=bs: check(ql, cl, block_size=bs),
            )
        guarded(
            f"check_{name}_bs64_d128",
            lambda ql=ql, cl=cl: check(ql, cl, hq=32, hkv=4, d=128),
        )
    if args.decode_only and not args.skip_checks:  # one and several splits, both group sizes
        ql, cl = checks["decode"]
        for tp, bs in ((256, 16), (1, 128)):
            guarded(
                f"check_decode_only_tp{tp}_bs{bs}_d256",
                lambda tp=tp, bs=bs: check(ql, cl, block_size=bs, decode_only=True,
                                           target_programs=tp),
            )  # fmt: skip
        guarded(
            "check_decode_only_bs64_d128",
            lambda: check(ql, cl, hq=32, hkv=4, d=128, decode_only=True),
        )

    # timings
    bw = summary.get("copy_bandwidth_GBps")
    # 64k - 64: at batch 64 the pool stays under the GPU kernel's 2**31-element limit
    contexts = [256] if small else [int(x) for x in args.contexts.split(",")]
    batches = [1, 2] if small else [int(x) for x in args.batches.split(",")]
    cases = []
    for c in contexts:
        for b in batches:
            cases.append((f"decode_ctx{c}_b{b}", [1] * b, [c] * b))
    mixed_ctx = 64 if small else 16384
    chunk = 32 if small else 2048
    rows = 4 if small else 32
    cases.append(
        (f"mixed_{rows}x{mixed_ctx}_plus_chunk{chunk}_at{mixed_ctx // 2}",
         [1] * rows + [chunk], [mixed_ctx] * rows + [chunk + mixed_ctx // 2])
    )  # fmt: skip
    pf = 64 if small else 4096
    cases.append((f"prefill_chunk{pf}_fresh", [pf], [pf]))
    cases.append((f"prefill_chunk{pf // 2}_at{pf * 4}", [pf // 2], [pf * 4 + pf // 2]))

    cases.append(("decode_ctx64_b1_floor", [1], [64]))  # the fixed cost of one call
    # rows past num_seqs must cost nothing: hyjax pads S to a power of two (at most 2x);
    # one or four live rows in a 64-row bucket is the stress case
    bucket = 8 if small else 64
    padded = {}
    for b in (1, 4):
        c = contexts[-1]
        name = f"decode_ctx{c}_b{b}_bucket{bucket}"
        cases.append((name, [1] * b, [c] * b))
        padded[name] = bucket - b

    cases = [c for c in cases if c[0].startswith(args.only)]

    def timed(q_lens, ctx_lens, module=None, pad_rows=0, **tuning):
        if args.decode_only and max(q_lens) == 1:
            tuning["decode_only"] = True
        rng = np.random.default_rng(0)
        a, kv_bytes = paged_batch(rng, q_lens, ctx_lens, poison=False)
        if pad_rows:  # padding rows of one token each, past num_seqs, as the runner's buckets
            q, kc, vc, qsl, lens, bt, n = a
            q = jnp.concatenate([q, jnp.zeros((pad_rows,) + q.shape[1:], q.dtype)])
            qsl = jnp.concatenate([qsl, jnp.full((pad_rows,), qsl[-1], qsl.dtype)])
            lens = jnp.concatenate([lens, jnp.zeros((pad_rows,), lens.dtype)])
            bt = jnp.concatenate([bt, jnp.zeros((pad_rows, bt.shape[1]), bt.dtype)])
            a = (q, kc, vc, qsl, lens, bt, n)
        s = time_attention(kernel_fn(module, **tuning), a, iters=20)
        res = {"s": s, "us": s * 1e6, "kv_GBps": kv_bytes / s / 1e9}
        res["TFLOPs"] = attention_flops(q_lens, ctx_lens) / s / 1e12
        if bw:
            res["frac_copy_bw"] = res["kv_GBps"] / bw
        return res

    for name, ql, cl in cases:
        guarded(name, lambda ql=ql, cl=cl, n=name: timed(ql, cl, pad_rows=padded.get(n, 0)))
    if args.baseline:
        base = load_module(args.baseline)
        for name, ql, cl in cases:
            guarded(
                f"baseline_{name}",
                lambda ql=ql, cl=cl, n=name: timed(ql, cl, base, pad_rows=padded.get(n, 0)),
            )
    if args.sweep and not small:
        by_name = {name: (ql, cl) for name, ql, cl in cases}
        decode_sweep = [(4, 2, 64, 128), (4, 2, 64, 512), (8, 2, 128, 256)]
        sweep_names = [n for n in by_name if n.startswith("decode_") and n.endswith(
            ("ctx65472_b1", "ctx65472_b2", "ctx16384_b8"))]  # fmt: skip
        for nw, ns, bk, tp in decode_sweep:
            for name in sweep_names:
                tag = f"sweep_{name}_w{nw}_s{ns}_bk{bk}_tp{tp}"
                tuning = dict(num_warps=nw, num_stages=ns, block_k_decode=bk, target_programs=tp)
                guarded(tag, lambda n=name, t=tuning: timed(*by_name[n], **t))
        # (rows, block_k, warps, stages, max prefill splits)
        prefill_sweep = [(64, 32, 4, 2, 4), (128, 64, 8, 3, 1), (128, 64, 8, 3, 8)]
        for name in [n for n in by_name if n.startswith(("prefill_", "mixed_"))]:
            for rows, bk, nw, ns, ms in prefill_sweep:
                tag = f"sweep_{name}_rows{rows}_bk{bk}_w{nw}_s{ns}_ms{ms}"
                tuning = dict(rows_prefill=rows, block_k_prefill=bk, num_warps_prefill=nw,
                              num_stages_prefill=ns, max_splits_prefill=ms)  # fmt: skip
                guarded(tag, lambda n=name, t=tuning: timed(*by_name[n], **t))
    if not args.skip_torch and not small:
        guarded("torch_sdpa_flash", lambda: torch_sdpa(cases))
        t = summary.get("torch_sdpa_flash", {})
        # the bar: the best copy either framework measured (decode must reach 80% of it)
        bw = max(bw or 0.0, t.get("copy_bandwidth_GBps", 0.0)) or None
        summary["best_copy_bandwidth_GBps"] = bw
        for name, _, _ in cases:
            ours, theirs = summary.get(name, {}), t.get(name, {})
            if "s" in ours and "s" in theirs:
                ours["torch_s"] = theirs["s"]
                ours["speedup_vs_torch"] = theirs["s"] / ours["s"]
            if "kv_GBps" in ours and bw:
                ours["frac_copy_bw"] = ours["kv_GBps"] / bw
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
