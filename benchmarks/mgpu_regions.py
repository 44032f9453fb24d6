"""Where a chunk's time goes in the Mosaic GPU serial launch: Mosaic GPU's own profiler.

    python -m benchmarks.mgpu_regions --out regions.json [--shapes 1x4096,8x4096]

For each shape and each variant (the unfolded prefill's serial launch, GDN's ``fold`` with its
exps from ``ex2.approx`` (the default) and exact) one prefill runs with
``chunk_scan_mgpu.PROFILE_DIR`` set: every warpgroup records the clock at the start and end
of the named regions of its chunk loop
(``jax.named_scope`` in ``chunk_scan_mgpu._body``: ``issue``, ``wait``, ``mma1``, ``vt``,
``update_o``, ``scale``, ``finish``). The trace is summarised here (the raw one is ~MBs):
cycles a chunk per region, averaged over the launch's warpgroups, and the whole loop's cycles
a chunk. The regions are sequential in the program; a region's cycles are those of its issue
and of any wait inside it (``mma1`` and ``update_o`` end in their products' wait).

Then the same variants are timed without the profiler (``benchmarks.gdn_kernels.
time_prefill``: ten chained calls, outputs consumed), so a change the profile suggests is
judged by the wall clock in the same process.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import tempfile
from collections import defaultdict

import numpy as np

from benchmarks import gdn_kernels as gk
from benchmarks.common import guarded_entries, write_summary
from pallas_kernels.common import chunk_scan_mgpu

VARIANTS = {  # name: (gdn_prefill's tuning, the fold launch's approx_math)
    "default": (dict(serial="mgpu", fold=False), True),  # (no exps: approx_math has no effect)
    "fold": (dict(serial="mgpu", fold=True), True),
    "fold_exact": (dict(serial="mgpu", fold=True), False),
    # the fold's scratch by gdn.intra_mgpu: its launch's regions too (a program's one block)
    "fold_intra_mgpu": (dict(serial="mgpu", fold=True, fold_intra="mgpu"), True),
    # and each chunk's Aqk made with the scratch (gpu.FOLD_AQK)
    "fold_aqk": (dict(serial="mgpu", fold=True, fold_intra="mgpu", fold_aqk=True), True),
}


def summarise(trace_file: str, chunks_per_row: int) -> dict:
    """Cycles per chunk of each region, over warpgroups (the trace's ``tid``): mean and the
    10th / 90th percentiles of the warpgroups' means."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    per_wg: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    open_at: dict[tuple[int, str], float] = {}
    span: dict[int, list[float]] = defaultdict(list)
    for e in events:  # "ts" is the clock / 1e3 (cycles): back to cycles
        tid, name, ts = e["tid"], e["name"], 1e3 * e["ts"]
        span[tid].append(ts)
        if e["ph"] == "B":
            open_at[(tid, name)] = ts
        elif (tid, name) in open_at:
            per_wg[tid][name].append(ts - open_at.pop((tid, name)))
    out = {"warpgroups": len(per_wg), "chunks_per_row": chunks_per_row}
    names = sorted({n for regions in per_wg.values() for n in regions})
    for n in names:
        means = np.array([np.sum(r[n]) / chunks_per_row for r in per_wg.values() if n in r])
        out[f"{n}_cycles_per_chunk"] = float(means.mean())
        out[f"{n}_p10_p90"] = [float(np.percentile(means, 10)), float(np.percentile(means, 90))]
    loop = np.array([(max(t) - min(t)) / chunks_per_row for t in span.values()])
    out["loop_cycles_per_chunk"] = float(loop.mean())
    return out


def profile(b: int, t: int, tuning: dict, approx: bool, folder: str) -> dict:
    import jax

    os.makedirs(folder, exist_ok=True)
    chunk_scan_mgpu.PROFILE_DIR, chunk_scan_mgpu.FOLD_APPROX_MATH = folder, approx
    chunk_scan_mgpu.PROFILE_SPACE = 8 * (t // 64) + 64  # regions a chunk, and the prologue
    try:
        qsl, slot_args, num_slots = gk.prefill_batch(b, t, max_ckpt=2, ckpt_every=None)
        acts = gk._activations(jax.random.PRNGKey(4), b * t)
        pool = gk._pool(jax.random.PRNGKey(5), num_slots)
        fn = jax.jit(lambda *a: gk.gpu.gdn_prefill(*a, **tuning))
        jax.block_until_ready(fn(*acts, pool, qsl, slot_args))
    finally:
        chunk_scan_mgpu.PROFILE_DIR, chunk_scan_mgpu.FOLD_APPROX_MATH = "", True
    files = sorted(glob.glob(os.path.join(folder, "*-trace.json")))
    if not files:
        return {"failed": "no trace written"}
    out = summarise(files[-1], t // 64)
    for f in files[:-1]:  # other launches' (gdn.intra_mgpu's: one block a program)
        out[os.path.basename(f)] = summarise(f, 1)
    return out


def timed(b: int, t: int, tuning: dict, approx: bool) -> dict:
    chunk_scan_mgpu.FOLD_APPROX_MATH = approx
    try:
        return gk.time_prefill(b, t, None, reference=False, **tuning)
    finally:
        chunk_scan_mgpu.FOLD_APPROX_MATH = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x4096,8x4096", help="BxT, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--time-shapes", default=None, help="BxT timed (default: --shapes), or none")
    p.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    variants = args.variants.split(",")
    if bad := set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(bad)}; of {list(VARIANTS)}")
    summary = {"device": gk.device_name()}
    guarded = guarded_entries(summary, args.out, tuple(args.only.split(",")) if args.only else None)
    scratch = tempfile.mkdtemp(prefix="mgpu_regions_")
    for b, t in shapes:
        for v in variants:
            tuning, approx = VARIANTS[v]
            name = f"B{b}_T{t}_{v}"
            run = functools.partial(profile, b, t, tuning, approx, os.path.join(scratch, name))
            guarded(f"regions_{name}", run)
    timed_shapes = (
        shapes
        if args.time_shapes is None
        else []
        if args.time_shapes == "none"
        else [tuple(int(x) for x in s.split("x")) for s in args.time_shapes.split(",") if s]
    )
    if timed_shapes:
        for b, t in timed_shapes:
            for v in variants:
                tuning, approx = VARIANTS[v]
                guarded(f"prefill_B{b}_T{t}_{v}", functools.partial(timed, b, t, tuning, approx))
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
