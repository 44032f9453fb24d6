"""Host time per engine step with 256 running requests, next to the device step it feeds.

Host: ``schedule`` + ``update`` + detokenize/report (``LLMEngine.timing``); device:
``runner.execute`` (transfer, the jitted step, waiting for the sampled tokens). Only steps in
which all requests decode are counted.

    python -m benchmarks.host_overhead --out HOST.json
    python -m benchmarks.host_overhead --tiny --kernel-backend reference --cache-gib 1  # a CPU

``--tiny``: the tiny Qwen3-Next preset of ``benchmarks.full_size`` instead of the bench model
(the host's work per row is the same; the CPU's device step stays short). ``--replay-device``:
the first full decode step's result is returned for every later one (``runner.execute``
replaced), so only the host's scheduling, update and reporting are timed, as main-thread CPU
time (``time.thread_time``: a noisy host's other load stays out); ``--ignore-eos`` keeps every
row running to ``--output-len``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.common import bench_config, device_name, random_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--tiny", action="store_true", help="the tiny preset (a CPU host run)")
    p.add_argument("--cache-gib", type=float, default=16.0, help="KV + state pools")
    p.add_argument("--replay-device", action="store_true", help="time the host's work only")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        from benchmarks.full_size import model_config

        cfg = model_config("tiny-qwen3-next")
    else:
        cfg = bench_config(args.layers, args.experts)
    model = random_model(cfg)
    n = args.num_requests
    engine = LLMEngine(
        EngineArgs(
            model=".",
            max_num_seqs=n,
            max_num_batched_tokens=max(2048, n),
            max_model_len=args.prompt_len + args.output_len + 64,
            kernel_backend=args.kernel_backend,
            min_token_bucket=1024,
            cache_bytes=int(args.cache_gib * 2**30),
            warmup=False,  # compile lazily: only the buckets this workload meets
        ),
        preloaded=(model, cfg),
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.8, top_p=0.95, seed=1, ignore_eos=args.ignore_eos
    )
    vocab = min(cfg.vocab_size, 150000)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, vocab, args.prompt_len).tolist(), params))
    if args.replay_device:
        execute, replay = engine.runner.execute, {}

        def replayed(plan):
            full = plan.shape.decode_only and plan.shape.num_seqs == n
            if full and "result" in replay:
                return replay["result"]
            result = execute(plan)
            if full:
                replay["result"] = result
            return result

        engine.runner.execute = replayed
    host, device, cpu = [], [], []
    seen_full = 0
    while engine.has_unfinished_requests():
        c0 = time.thread_time()
        engine.step()
        c1 = time.thread_time()
        rows, decode_only, h, d = engine.timing.last
        if decode_only and rows == n:
            seen_full += 1
            if seen_full > 3:  # skip the first (compiling) steps of the bucket
                host.append(h)
                device.append(d)
                cpu.append(c1 - c0)
    res = {
        "device": device_name(),
        "running_requests": n,
        "steps_measured": len(host),
        "host_ms_per_step": round(1e3 * statistics.median(host), 3),
        "device_ms_per_step": round(1e3 * statistics.median(device), 3),
        "replay_device": args.replay_device,
        "main_thread_cpu_ms_per_step": round(1e3 * statistics.median(cpu), 3),
        "main_thread_cpu_ms_per_step_min": round(1e3 * min(cpu), 3),
    }
    res["host_over_device"] = round(res["host_ms_per_step"] / res["device_ms_per_step"], 4)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
