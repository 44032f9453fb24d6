"""Where the engine process's memory goes: the embedded model (or ``--model``) on CPU with the
flags ``hyjax serve`` uses by default, one fresh process per configuration.

Resident set size (``VmRSS``, after ``malloc_trim``) at each stage: jax imported, the engine
built (weights and pools), every step bucket compiled, a request served. The pools' and the
weights' own bytes are printed beside it, so what is left is the runtime and the compiled
executables. Configurations: mixed steps with power-of-two row buckets (the accelerator default)
and without (the CPU default since they cost nothing there), same process type, one after the
other::

    python -m benchmarks.engine_memory --out benchmarks/results/engine_memory_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from benchmarks.cold_start import write_report


def _rss_mb() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return round(kb / 1024, 1)


def measure(model: str | None, row_buckets: bool) -> dict:
    """Runs in the child process."""
    out: dict = {"mixed_row_buckets": row_buckets, "rss_mb": {"start": _rss_mb()}}
    import jax

    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    out["rss_mb"]["jax"] = _rss_mb()
    from serving.engine.engine_args import resolve_model

    args = EngineArgs(
        model=resolve_model(model),
        dtype="float32" if model is None else "auto",  # as `hyjax serve` runs the embedded one
        warmup=False,
        progress=False,
        mixed_row_buckets=row_buckets,
    )
    engine = LLMEngine(args)
    runner = engine.runner
    mem = runner.memory
    out["rss_mb"]["engine"] = _rss_mb()
    out["weights_mb"] = round(
        sum(x.nbytes for x in jax.tree.leaves(runner._state_leaves)) / 2**20, 1
    )
    out["pools_mb"] = round((mem.kv_bytes + mem.state_bytes) / 2**20, 1)
    out["pools"] = mem.describe().splitlines()
    start = time.perf_counter()
    runner.warmup(progress=False)
    out["compile_s"] = round(time.perf_counter() - start, 1)
    out["buckets"] = len(engine.sched_config.step_shapes())
    out["rss_mb"]["compiled"] = _rss_mb()
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine.add_request(
        EngineRequest("Write a function that checks whether a number is prime.", greedy)
    )
    engine.run_to_completion()
    out["rss_mb"]["served"] = _rss_mb()
    per = (out["rss_mb"]["compiled"] - out["rss_mb"]["engine"]) / out["buckets"]
    out["mb_per_bucket"] = round(per, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["rows", "norows"], default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        print(json.dumps(measure(ns.model, ns.child == "rows")))
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    runs = []
    for child in ("rows", "norows"):
        cmd = [sys.executable, "-m", "benchmarks.engine_memory", "--child", child]
        if ns.model:
            cmd += ["--model", ns.model]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    write_report(runs, ns.model, ns.out)


if __name__ == "__main__":
    main()
