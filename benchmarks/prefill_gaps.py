"""Where a short prefill's device waits: the default GDN prefill's chain of calls
(:func:`benchmarks.common.time_stateful`'s program) traced once, its device timeline cut into
calls, each gap between two kernels named by the kernels on both sides, and the host's thunks
(:func:`benchmarks.step_profile.step_thunks`: how long the host took to launch each).

    python -m benchmarks.prefill_gaps --shapes 1x4096 --out gaps.json

Run it once per ``XLA_FLAGS`` setting to compare (e.g. ``--xla_gpu_enable_command_buffer=``:
no CUDA graphs). On a CPU host there are no device events; it then checks its own path only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import itertools
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import distinct_copies, prefill_batch, stateful_chain
from benchmarks.gdn_kernels import _activations, _pool
from benchmarks.step_profile import device_events, step_thunks
from pallas_kernels.gdn import gpu

ITERS = 10


def _program(batch: int, seq_len: int, donate_acc: bool):
    qsl, slot_args, num_slots = prefill_batch(batch, seq_len)
    acts = _activations(jax.random.PRNGKey(4), batch * seq_len)
    pool = _pool(jax.random.PRNGKey(5), num_slots)
    kernel = jax.jit(functools.partial(gpu.gdn_prefill, precision=jax.lax.Precision.HIGHEST))

    def one(st, acts, slots):
        o, st = kernel(*acts, st, *slots)
        return st, o

    chain = stateful_chain(one, ITERS)
    if not donate_acc:  # the timed program before 2026-11-30: a new scalar buffer every run
        donated = chain

        @functools.partial(jax.jit, donate_argnums=0)
        def chain(state, operand_sets, acc):
            return donated.__wrapped__(state, operand_sets, acc)

    return chain, pool, distinct_copies((acts, (qsl, slot_args)), ITERS)


def timeline(events: list[dict]) -> dict:
    """The device's kernels in order, their gaps, and the gaps summed by the pair of kernels
    around them (the 10 calls' kernels repeat, so a pair's sum is ten of its gaps)."""
    ks = sorted((e for e in events if e.get("dur") is not None), key=lambda e: e["ts"])
    if not ks:
        return {"kernels": 0}
    rows, by_pair, end = [], collections.Counter(), ks[0]["ts"]
    for prev, e in zip([None, *ks[:-1]], ks):
        gap = max(0.0, e["ts"] - end) if prev is not None else 0.0
        if prev is not None:
            by_pair[(prev["name"][:60], e["name"][:60])] += gap
        rows.append({"name": e["name"][:80], "start_us": round(e["ts"] - ks[0]["ts"], 1),
                     "dur_us": round(e["dur"], 1), "gap_before_us": round(gap, 1)})  # fmt: skip
        end = max(end, e["ts"] + e["dur"])
    busy = sum(e["dur"] for e in ks)
    return {
        "kernels": len(ks),
        "span_us": round(end - ks[0]["ts"], 1),
        "busy_us": round(busy, 1),
        "gaps_us": round(sum(r["gap_before_us"] for r in rows), 1),
        "gaps_by_pair": [
            {"before": a, "after": b, "us": round(us, 1)} for (a, b), us in by_pair.most_common(12)
        ],
        "first_call": rows[: len(rows) // ITERS + 1],
    }


def _module_events(trace_dir: str):
    """The host's events inside the last traced run of the executable, and that run's event."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        return None
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
              if e.get("ph") == "X"]  # fmt: skip
    modules = [e for e in events if e["name"].endswith("XLA GPU module")]
    if not modules:
        return None
    m = modules[-1]
    end = m["ts"] + m["dur"]
    inside = [e for e in events if e["pid"] == m["pid"] and e["tid"] == m["tid"]
              and m["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= end]  # fmt: skip
    return inside, m


def milestones(trace_dir: str, device: list[dict]) -> dict:
    """The last traced run's host and device times (us) from the host's start of the
    executable: when its graph launch began and returned, when the device's first kernel
    started and its last one ended, when the host's executable returned."""
    found = _module_events(trace_dir)
    if not found or not device:
        return {}
    inside, m = found
    t0, end = m["ts"], m["ts"] + m["dur"]
    launch = [e for e in inside if e["name"].startswith("cuGraphLaunch")]
    kernels = [e for e in device if t0 - 1e3 <= e["ts"] <= end + 1e5]
    out = {"host_module_end": round(end - t0, 1)}
    if launch:
        out["graph_launch_start"] = round(launch[-1]["ts"] - t0, 1)
        out["graph_launch_end"] = round(launch[-1]["ts"] + launch[-1]["dur"] - t0, 1)
    if kernels:
        out["first_kernel_start"] = round(min(e["ts"] for e in kernels) - t0, 1)
        out["last_kernel_end"] = round(max(e["ts"] + e["dur"] for e in kernels) - t0, 1)
    return out


def host_events(trace_dir: str, top: int = 25) -> list[dict]:
    """The host's events inside the last traced run of the program, longest first (what the
    launch of its command buffer spent its time on)."""
    found = _module_events(trace_dir)
    if not found:
        return []
    inside, _ = found
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in inside:
        by_name[e["name"][:90]][0] += 1
        by_name[e["name"][:90]][1] += e.get("dur", 0.0)
    rows = [{"name": n, "calls": c, "us": round(us, 1)} for n, (c, us) in by_name.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def fusion_index(hlo: str) -> dict:
    """The optimized HLO text's fusions by kernel name (a trace names a fusion's kernel after
    its instruction, ``.`` and ``-`` as ``_``): each one's kind, the opcodes of the
    computation it calls, counted, and the jax ops it came from (their ``op_name``s' last
    parts), counted."""
    bodies = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^%([\w.\-]+) \(.*?\{\n(.*?)^\}", hlo, re.S | re.M)
    }
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = .*? fusion\(.*?\), kind=(\w+), calls=%([\w.\-]+)", hlo):
        body = bodies.get(m.group(3), "")
        ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", body))
        ops.pop("parameter", None)
        names = collections.Counter(
            "/".join(n.split("/")[-2:]) for n in re.findall(r'op_name="([^"]+)"', body)
        )
        out[re.sub(r"[.\-]", "_", m.group(1))] = {
            "kind": m.group(2),
            "ops": dict(ops.most_common(8)),
            "from": dict(names.most_common(6)),
        }
    return out


def kernels_by_name(events: list[dict], hlo: str, top: int = 16) -> list[dict]:
    """The traced kernels' device time by name, longest first, each with its
    :func:`fusion_index` entry (which of XLA's ops and of jax's a fusion's time is)."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e.get("dur", 0.0)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    index = fusion_index(hlo)
    return [{"name": n, "calls": c, "us": round(us, 1), **index.get(n, {})}
            for n, (c, us) in rows]  # fmt: skip


def measure(batch: int, seq_len: int, donate_acc: bool) -> dict:
    chain, pool, operands = _program(batch, seq_len, donate_acc)
    acc = jnp.zeros((), jnp.float32)
    hlo = chain.lower(pool, operands, acc).compile().as_text() or ""
    pool, acc = jax.block_until_ready(chain(pool, operands, acc))  # compile + warm up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        pool, acc = jax.block_until_ready(chain(pool, operands, acc))
        times.append((time.perf_counter() - t0) / ITERS)
    out = {"ms": 1e3 * float(np.median(times)), "ms_all": [1e3 * t for t in times]}
    for _ in range(2):  # a process's first trace may record no device events
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(2):
                    pool, acc = jax.block_until_ready(chain(pool, operands, acc))
            events = device_events(d)
            thunks = step_thunks(d)
            hosts = host_events(d)
            marks = milestones(d, events)
        if events or jax.default_backend() == "cpu":
            break
    # the second traced run only: the first may carry the profiler's start-up
    if events:
        starts = sorted(e["ts"] for e in events)
        cut = starts[len(starts) // 2]
        events = [e for e in events if e["ts"] >= cut]
    out["timeline"] = timeline(events)
    out["kernels_by_name"] = kernels_by_name(events, hlo)
    out["host_events"] = hosts
    out["milestones_us"] = marks
    # back to back: the next run launched while the last one runs (as async serving steps
    # and a CUDA graph's replays are); the host's launch overlaps the device's work
    for runs in (1, 5):
        jax.block_until_ready((pool, acc))
        t0 = time.perf_counter()
        for _ in range(runs):
            pool, acc = chain(pool, operands, acc)
        jax.block_until_ready((pool, acc))
        out[f"ms_{runs}_back_to_back"] = 1e3 * (time.perf_counter() - t0) / (runs * ITERS)
    out["host_thunks"] = [
        {"module": r["module"], "runs": r["runs"], "host_syncs": r["host_syncs"],
         "host_us_total": sum(t["host_us"] for t in r["thunks"]),
         "thunks": r["thunks"][:80]}
        for r in thunks
    ]  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x4096")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", "")}  # fmt: skip
    for shape, donate in itertools.product(args.shapes.split(","), (True, False)):
        b, t = map(int, shape.split("x"))
        r = measure(b, t, donate)
        shape = shape + ("" if donate else "_acc_moving")
        res[shape] = r
        tl = r["timeline"]
        print(f"{shape}: {r['ms']:.3f} ms a call; kernels {tl.get('kernels')}, span "
              f"{tl.get('span_us')} us, busy {tl.get('busy_us')}, "
              f"gaps {tl.get('gaps_us')}")  # fmt: skip
        for g in tl.get("gaps_by_pair", [])[:8]:
            print(f"   {g['us']:8.1f} us  {g['before']}  ->  {g['after']}")
        for h in r["host_thunks"][:3]:
            print(f"   host: {h['module']} x{h['runs']}: {h['host_us_total']} us of thunks, "
                  f"{len(h['thunks'])} thunks, syncs {h['host_syncs'][:4]}")  # fmt: skip
        print(
            f"   milestones: {r['milestones_us']}; back to back: "
            f"{r['ms_5_back_to_back']:.3f} ms a call (alone {r['ms_1_back_to_back']:.3f})"
        )
        for h in r["host_events"][:6]:
            print(f"   host event: {h['us']:8.1f} us x{h['calls']}  {h['name']}")
        for k in r["kernels_by_name"][:12]:
            print(f"   kernel {k['us']:8.1f} us x{k['calls']}  {k['name'][:50]}  "
                  f"{k.get('kind', '')} {k.get('from', '')}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
