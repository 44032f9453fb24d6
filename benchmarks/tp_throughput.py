"""Tensor parallel 1 vs N: prefill and decode throughput of the engine, in the same run.

A Qwen3-Next-shaped random model (``benchmarks.common.bench_config``: the 80B's layer shapes,
fewer layers and experts) that fits one device, served with ``tensor_parallel_size`` 1 and N
(and optionally expert parallel). Each configuration runs its workloads twice; the second run
is measured (the first compiles the buckets it meets).

- prefill: ``--prefill-requests`` prompts of ``--prompt-len`` tokens, one output token each;
  prompt tokens per second of wall time.
- decode: ``--decode-requests`` short prompts, ``--output-len`` tokens each; output tokens per
  second over the steps in which every row decodes (host + device time of those steps).

    python -m benchmarks.tp_throughput --tp 1 2 --out TP.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import numpy as np

from benchmarks.common import add_engine_workload_args, device_name, workload_engine
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import LLMEngine


def _prefill(engine: LLMEngine, n: int, prompt_len: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, 150000, prompt_len).tolist(), params))
    start = time.perf_counter()
    engine.run_to_completion()
    return n * prompt_len / (time.perf_counter() - start)


def _decode(engine: LLMEngine, n: int, output_len: int, seed: int) -> tuple[float, float]:
    """Output tokens per second over the all-decode steps, and the device's share of them."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, 150000, 32).tolist(), params))
    tokens, seconds, device = 0, 0.0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        rows, decode_only, host, dev = engine.timing.last
        if decode_only and rows == n:
            tokens += rows
            seconds += host + dev
            device += dev
    if not seconds:
        return float("nan"), float("nan")
    return tokens / seconds, device / seconds


def run(tp: int, expert_parallel: bool, backend: str, args) -> dict:
    engine, model = workload_engine(args, backend, tp, expert_parallel)
    res = {
        "kernel_backend": backend,
        "tensor_parallel_size": tp,
        "expert_parallel": expert_parallel,
    }
    for rep in range(2):  # the first compiles
        compiles = engine.runner.compile_count()
        res["prefill_tok_s"] = round(_prefill(engine, args.prefill_requests, args.prompt_len, rep))
        tok_s, share = _decode(engine, args.decode_requests, args.output_len, rep)
        res["decode_tok_s"], res["decode_device_share"] = round(tok_s), round(share, 3)
        # A measured rep that compiles means the step's shardings drift from step to step.
        res["compiles_in_rep"] = engine.runner.compile_count() - compiles
    res["kv_blocks_per_device"] = engine.runner.memory.num_kv_blocks
    del engine, model
    gc.collect()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--expert-parallel", action="store_true", help="also N with EP")
    add_engine_workload_args(p, layers=8, prefill_requests=16, output_len=64, cache_gib=8.0)
    p.add_argument("--kernel-backend", nargs="+", default=["auto"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {
        "device": device_name(),
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "kernel_backends": args.kernel_backend,
        "model": f"bench_config({args.layers} layers, {args.experts} experts), bf16",
        "runs": [],
    }
    configs = [(tp, False) for tp in args.tp]
    if args.expert_parallel:
        configs += [(tp, True) for tp in args.tp if tp > 1]
    for backend in args.kernel_backend:
        for tp, ep in configs:
            r = run(tp, ep, backend, args)
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
            if args.out:  # after every run: a later failure keeps the earlier numbers
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
