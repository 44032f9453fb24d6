"""Where the device time of an engine step goes: prefill and decode passes under the profiler.

The random Qwen3-Next-shaped model of ``benchmarks.common``; each workload runs once to
compile, then once under ``jax.profiler.trace``. The Perfetto trace's device events (GPU
kernels, TPU ops) are summed by name, so the kernels that dominate a step are named.

    python -m benchmarks.step_profile --layers 4 --out PROFILE.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import add_engine_workload_args, device_name, workload_engine
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import LLMEngine


def device_events(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the first device in the newest Perfetto trace under
    trace_dir (under tensor parallel every device runs the same program)."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = sorted((name, pid) for pid, name in names.items() if "/device:" in name)
    if not devices:
        return []  # e.g. CPU: XLA's ops do not appear as device events
    first = devices[0][1]
    return [e for e in events if e.get("ph") == "X" and e.get("pid") == first]


def summarize(events: list[dict], top: int) -> dict:
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        total[e["name"]] += float(e.get("dur", 0.0))
        count[e["name"]] += 1
    busy = sum(total.values())
    span = 0.0
    if events:
        span = max(e["ts"] + e.get("dur", 0.0) for e in events) - min(e["ts"] for e in events)
    return {
        "device_busy_us": round(busy),
        "device_span_us": round(span),  # first kernel start to last kernel end
        "kernels": len(events),
        "top": [
            {"name": n[:160], "us": round(us), "calls": count[n], "share": round(us / busy, 3)}
            for n, us in total.most_common(top)
        ],
    }


def _workload(engine: LLMEngine, phase: str, args, seed: int) -> tuple[int, float]:
    rng = np.random.default_rng(seed)
    if phase == "prefill":
        n, prompt, out = args.prefill_requests, args.prompt_len, 1
    else:
        n, prompt, out = args.decode_requests, 32, args.output_len
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, 150000, prompt).tolist(), params))
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_workload_args(p, layers=4, prefill_requests=8, output_len=32, cache_gib=4.0)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine, _ = workload_engine(args, args.kernel_backend, args.tp, args.expert_parallel)
    results = {
        "device": device_name(),
        "jax": jax.__version__,
        "model": f"bench_config({args.layers} layers, {args.experts} experts), bf16",
        "kernel_backend": args.kernel_backend,
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.expert_parallel,
    }
    for phase in ("prefill", "decode"):
        _workload(engine, phase, args, seed=0)  # compiles
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                steps, seconds = _workload(engine, phase, args, seed=1)
            events = device_events(d)
        res = summarize(events, args.top)
        res.update(steps=steps, wall_ms_per_step=round(1e3 * seconds / steps, 2))
        res["device_ms_per_step"] = round(res["device_busy_us"] / 1e3 / steps, 2)
        res["kernels_per_step"] = round(res["kernels"] / steps, 1)
        results[phase] = res
        print(phase, json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
