"""MoE routed experts on one GPU: the Triton grouped matmul vs XLA's ``ragged_dot``, checked.

Run on an H100/H200 (``python benchmarks/moe_kernels.py --out $OUT/moe.json``) at Qwen3-Next-80B
expert shapes (D=2048, F=512, top-10, bf16) with E=64 (the bench config) and E=512 (the real
model), uniform random routing:

1. checks :func:`pallas_kernels.moe.gpu.moe_experts` against a float32 oracle on the host (the
   reference's math, expert by expert in numpy: an f32 ``ragged_dot`` on GPU is TF32 or, at
   HIGHEST, far too slow through XLA's dense expansion at E=512), as the error ratio
   ``rms(got - want) / rms(want)``; bf16 at every shape, float32 (TF32 and IEEE dots) at two;
2. times, at decode (T=64, 256) and prefill (T=1024, 4096), the kernel with its default tiles
   and the candidates of ``--sweep``, and the reference op (``ragged_dot``, what the model ran);
   reports TFLOP/s (``6 T k D F`` useful flops) and the weight bandwidth (bytes of the experts
   hit / time);
3. times torch's ``_grouped_mm`` (CUTLASS grouped GEMM) on the same rows already sorted by
   expert, the three products and silu*up only (no routing, gather or combine: a floor for
   the matmul part), from a CUDA graph, when it runs (else says why).

Every JAX timing is one jitted program of ``iters`` chained calls, unrolled (each call's input
depends on the last output), divided by the calls: not a ``fori_loop``, whose every trip is a
host round trip on GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_chained
from pallas_kernels.moe import gpu
from pallas_kernels.moe.reference import moe_experts_reference

D, F, K = 2048, 512, 10
SHAPES = [(t, e) for e in (64, 512) for t in (64, 256, 1024, 4096)]
T0 = time.perf_counter()

# Candidate tiles per kind of shape (the default is always timed too).
T_ = gpu.MoeTiles
SWEEP = {
    "decode": [
        T_(16, 128, 64, 4, 4, 128, 128, 4, 3),
        T_(32, 64, 128, 4, 4, 128, 64, 4, 4),
        T_(64, 64, 64, 4, 4, 128, 64, 4, 3),
    ],
    "prefill": [
        T_(16, 128, 64, 4, 4, 128, 128, 4, 3),
        T_(32, 64, 128, 4, 4, 128, 64, 4, 4),
        T_(64, 64, 64, 4, 4, 128, 64, 4, 3),
        T_(128, 128, 64, 8, 3, 128, 64, 8, 3),
        T_(128, 128, 32, 8, 4, 256, 32, 8, 4),
    ],
}
# XLA's dense expansion of ragged_dot past this many rows x experts asks for more memory than an
# H100 has (T=4096, E=512: an 80 GiB buffer, out of memory in the first run).
REFERENCE_MAX_ROWS_X_EXPERTS = 1024 * 512


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def elapsed() -> float:
    return time.perf_counter() - T0


# ----------------------------------------------------------------------------- inputs


def inputs(t: int, e: int, dtype=jnp.bfloat16, seed: int = 0):
    """x, weights, experts (softmax top-k of random logits, renormalised), w_gate/up/down."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(t, e)).astype(np.float32)
    experts = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    w = np.exp(np.take_along_axis(logits, experts, axis=1))
    w = w / w.sum(axis=1, keepdims=True)
    key = jax.random.key(seed)
    k = jax.random.split(key, 4)
    x = jax.random.normal(k[0], (t, D), dtype)
    wg = (jax.random.normal(k[1], (e, D, F), jnp.float32) * D**-0.5).astype(dtype)
    wu = (jax.random.normal(k[2], (e, D, F), jnp.float32) * D**-0.5).astype(dtype)
    wd = (jax.random.normal(k[3], (e, F, D), jnp.float32) * F**-0.5).astype(dtype)
    return x, jnp.asarray(w, dtype), jnp.asarray(experts), wg, wu, wd


def oracle(x, weights, experts, wg, wu, wd) -> np.ndarray:
    """The reference's math in float32 on the host, expert by expert."""
    x, weights = np.asarray(x, np.float32), np.asarray(weights, np.float32)
    experts = np.asarray(experts)
    wg, wu, wd = (np.asarray(a, np.float32) for a in (wg, wu, wd))
    out = np.zeros_like(x)
    for e in np.unique(experts):
        tok, j = np.nonzero(experts == e)
        xs = x[tok]
        h = xs @ wg[e]
        h = h / (1 + np.exp(-h)) * (xs @ wu[e])
        np.add.at(out, tok, (h @ wd[e]) * weights[tok, j][:, None])
    return out


def err_ratio(got, want) -> float:
    got = np.asarray(got, np.float32)
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2)))


# ----------------------------------------------------------------------------- timing


def one_call(fn, args) -> float:
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def figures(t: int, e_hit: int, seconds: float) -> dict:
    flops = 6 * t * K * D * F
    weight_bytes = e_hit * 3 * D * F * 2
    return {
        "ms": seconds * 1e3,
        "tflops": flops / seconds / 1e12,
        "weight_gbps": weight_bytes / seconds / 1e9,
    }


def route_only(tiles: gpu.MoeTiles, plan_of=gpu.route):
    """The routing plan alone (``gpu.route``: sort, pad, tables; or ``gpu.route_pairwise``),
    chained through x so nothing is hoisted, every field consumed."""

    def fn(x, weights, experts, w_gate, *_):
        experts = experts + (x[0, 0] * 0).astype(jnp.int32)
        plan = plan_of(experts, weights, num_experts=w_gate.shape[0], block_m=tiles.block_m)
        total = sum(jnp.sum(f.astype(jnp.float32)) for f in plan)
        return x * 0 + total.astype(x.dtype)

    return fn


def route_plans(iters: int = 20) -> dict:
    """``--route-only``: the route plans at decode sizes (T = 8, 16, 64 tokens, top-10): the
    sort, the pairwise one and (up to 128 pairs) the one-kernel one, each alone, chained;
    microseconds a call (the chain's link, a sum of the plan, included), and whether each
    plan's fields equal the sort's."""
    out = {}
    for e in (64, 512):
        for t in (8, 16, 64):
            a = inputs(t, e)
            tiles = gpu.default_tiles(t * K, e, D, F, jnp.bfloat16)
            row = {}
            plans = {"sort": gpu.route, "pairwise": gpu.route_pairwise}
            if t * K <= gpu.KERNEL_ROUTE_MAX_PAIRS:
                plans["kernel_4warps"] = functools.partial(gpu.route_kernel, num_warps=4)
                plans["kernel_8warps"] = gpu.route_kernel
            want = None
            nb = gpu.num_blocks(t * K, e, tiles.block_m)
            for name, plan_of in plans.items():
                plan = jax.jit(functools.partial(plan_of, num_experts=e, block_m=tiles.block_m))
                got = jax.device_get(plan(a[2], a[1]))
                rows = nb * tiles.block_m  # the kernel plan's block table and rows are padded
                got = got._replace(
                    block_expert=got.block_expert[:nb],
                    row_token=got.row_token[:rows],
                    row_weight=got.row_weight[:rows],
                )
                want = got if want is None else want
                row[f"{name}_equal"] = all(
                    np.array_equal(x, y) for x, y in zip(got, want, strict=True)
                )
                fn = route_only(tiles, plan_of)
                row[f"{name}_us"] = round(1e6 * time_chained(fn, a, iters), 1)
            out[f"T={t}_E={e}"] = row
            print(f"route T={t} E={e}", json.dumps(row), flush=True)
    return out


def router_top_ks(iters: int = 20) -> dict:
    """``--route-only`` too: the router's top-k, ``lax.top_k`` against
    ``hyjax.layers.moe.router_top_k`` (pairwise ranks) at decode sizes (Qwen3-Next's 512
    experts top-10, Kimi-Linear's 256 top-8), us a call, chained through the scores."""
    from hyjax.layers.moe import router_top_k

    out = {}
    for e, k in ((512, 10), (256, 8)):
        for t in (8, 16):
            x = jax.random.normal(jax.random.key(t), (t, e), jnp.float32)
            row = {}
            pairwise = functools.partial(router_top_k, pairwise=True)
            for name, fn in (("lax", jax.lax.top_k), ("pairwise", pairwise)):

                def link(x, fn=fn, k=k):
                    v, i = fn(x, k)
                    return x + (jnp.sum(v) + jnp.sum(i).astype(x.dtype)) * 0

                row[f"{name}_us"] = round(1e6 * time_chained(link, (x,), iters), 1)
            out[f"T={t}_E={e}_k={k}"] = row
            print(f"router top-k T={t} E={e} k={k}", json.dumps(row), flush=True)
    return out


# ----------------------------------------------------------------------------- torch


def _torch_case(torch, t: int, e: int) -> dict:
    dev = "cuda"
    _, _, experts, *_ = inputs(t, e)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=e)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.randn(int(counts.sum()), D, device=dev, dtype=torch.bfloat16, generator=g)

    def w(shape):  # column-major last two dims, as the CUTLASS path wants
        m = torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * shape[1] ** -0.5
        return m.transpose(-2, -1).contiguous().transpose(-2, -1)

    wg, wu, wd = w((e, D, F)), w((e, D, F)), w((e, F, D))

    def call():
        h = torch._grouped_mm(xs, wg, offs=offs)
        u = torch._grouped_mm(xs, wu, offs=offs)
        return torch._grouped_mm(torch.nn.functional.silu(h) * u, wd, offs=offs)

    call()
    torch.cuda.synchronize()
    iters = 20
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    return figures(t, int((counts > 0).sum()), float(np.median(times)))


def torch_grouped_mm(shapes) -> dict:
    """torch._grouped_mm on expert-sorted rows: the three products and silu * up."""
    try:
        import torch
    except ImportError as e:
        return {"skipped": f"no torch: {e}"}
    if not hasattr(torch, "_grouped_mm"):
        return {"skipped": f"torch {torch.__version__} has no _grouped_mm"}
    out = {"torch": torch.__version__}
    for t, e in shapes:
        try:
            out[f"T={t}_E={e}"] = _torch_case(torch, t, e)
        except Exception as exc:  # noqa: BLE001 - report and go on
            out[f"T={t}_E={e}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    torch.cuda.empty_cache()
    return out


def timed(t: int, e_hit: int, fn, a, iters: int) -> dict:
    return figures(t, e_hit, time_chained(fn, a, iters))


def check(fn, a, want) -> float:
    return err_ratio(jax.jit(fn)(*a), want)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_kernels.json")
    ap.add_argument("--sweep", action="store_true", help="time the candidate tiles too")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later sweeps skip")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--sweep-shapes", default="", help="e.g. T=1024_E=512,T=4096_E=512")
    ap.add_argument(
        "--route-only", action="store_true",
        help="only the route plans at decode sizes: the sort against the pairwise one",
    )  # fmt: skip
    args = ap.parse_args()
    res: dict = {"device": device_name(), "jax": jax.__version__, "shapes": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if args.route_only:
        res["route_plans"] = route_plans()
        res["router_top_k"] = router_top_ks()
        save()
        return

    if not args.no_torch:  # first, before JAX holds the GPU memory
        res["torch_grouped_mm"] = torch_grouped_mm(SHAPES)
        print("torch", json.dumps(res["torch_grouped_mm"]), flush=True)
    save()

    def guarded(name, fn, *fn_args):
        try:
            return fn(*fn_args)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {exc}"[:600], "where": name}

    # 1. checks
    checks = {}
    for t, e in SHAPES:
        a = inputs(t, e)
        want = oracle(*a)
        checks[f"bf16_T={t}_E={e}"] = guarded("check", check, gpu.moe_experts, a, want)
        if t == 256:  # the model's old path, for scale
            checks[f"bf16_ragged_dot_T={t}_E={e}"] = guarded(
                "check", check, moe_experts_reference, a, want
            )
    for t, e in ((256, 64), (1024, 64)):
        a = inputs(t, e, jnp.float32)
        want = oracle(*a)
        for name, prec in (("tf32", None), ("ieee", jax.lax.Precision.HIGHEST)):
            fn = functools.partial(gpu.moe_experts, precision=prec)
            checks[f"f32_{name}_T={t}_E={e}"] = guarded("check", check, fn, a, want)
    res["checks"] = checks
    print("checks", json.dumps(checks), f"t={elapsed():.0f}s", flush=True)
    save()

    # 2. timings
    slow_reference = [0.0]
    for t, e in SHAPES:
        a = inputs(t, e)
        e_hit = int(np.unique(np.asarray(a[2])).size)
        kind = "decode" if t <= 256 else "prefill"
        default = gpu.default_tiles(t * K, e, D, F, jnp.bfloat16)
        row = {"kind": kind, "experts_hit": e_hit, "default_tiles": list(default.__dict__.values())}
        iters = 10 if t <= 256 else 5
        row["kernel"] = guarded("kernel", timed, t, e_hit, gpu.moe_experts, a, iters)
        row["route_only"] = guarded("route", timed, t, e_hit, route_only(default), a, iters)
        if t * e > REFERENCE_MAX_ROWS_X_EXPERTS:
            single = f"skipped: XLA's dense expansion needs more than the GPU's memory at {t=} {e=}"
            row["ragged_dot"] = {"skipped": single}
        elif slow_reference[0]:
            single = f"skipped: one call took {slow_reference[0]:.2f} s at a smaller shape"
            row["ragged_dot"] = {"skipped": single}
        else:
            single = guarded("ragged_dot", one_call, moe_experts_reference, a)
        if isinstance(single, float) and single > 0.5:
            slow_reference[0] = single
        if isinstance(single, float) and single < 0.05:
            row["ragged_dot"] = guarded(
                "ragged_dot", timed, t, e_hit, moe_experts_reference, a, iters
            )
        elif isinstance(single, float):
            row["ragged_dot"] = {**figures(t, e_hit, single), "note": "one call, not chained"}
        elif isinstance(single, dict):
            row["ragged_dot"] = single
        wanted = args.sweep_shapes.split(",") if args.sweep_shapes else None
        if args.sweep and (wanted is None or f"T={t}_E={e}" in wanted):
            row["sweep"] = {}
            for tiles in SWEEP[kind]:
                if elapsed() > args.budget:
                    row["sweep"]["skipped"] = f"budget {args.budget}s spent"
                    break
                name = "_".join(map(str, tiles.__dict__.values()))
                fn = functools.partial(gpu.moe_experts, tiles=tiles)
                row["sweep"][name] = guarded(name, timed, t, e_hit, fn, a, iters)
        res["shapes"][f"T={t}_E={e}"] = row
        k_ms = row["kernel"].get("ms") if isinstance(row["kernel"], dict) else None
        r_ms = row["ragged_dot"].get("ms") if isinstance(row["ragged_dot"], dict) else None
        print(f"T={t} E={e}: kernel {k_ms} ms, ragged_dot {r_ms} ms, t={elapsed():.0f}s")
        print(json.dumps(row), flush=True)
        save()
        del a
    print("done", f"t={elapsed():.0f}s")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
