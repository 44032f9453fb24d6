"""Prefix-repetition workload, prefix caching on vs off, in one run on one model.

In the style of vLLM's ``bench serve --dataset-name prefix_repetition``: ``num_prefixes``
random prefixes of ``prefix_len`` tokens, each request one of them plus a random suffix of
``suffix_len`` tokens, ``output_len`` tokens out (ignore_eos), at most ``concurrency`` requests
in flight (a new one is sent when one finishes). TTFT is from a request's submission to its
first token; all times are host wall clock around the engine's synchronous steps.

    python -m benchmarks.prefix_repetition --out BENCH.json
    python -m benchmarks.prefix_repetition --model qwen3-next-80b --tp 8 --out BENCH.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.prefix_repetition --model tiny-qwen3-next --tp 8 --dtype float32 \\
        --prefix-len 128 --suffix-len 16 --output-len 8 --num-prompts 8 --concurrency 4 \\
        --block-size 16 --max-num-batched-tokens 128 --cache-gib 0.05   # a CPU dry run

The model is one of ``benchmarks.full_size``'s (``--model``, default ``bench``: 80B layer
shapes, 8 layers, 64 experts), built on the devices, sharded by ``--tp`` /
``--expert-parallel``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np

from benchmarks.common import device_name
from benchmarks.full_size import add_model_args, build_for_engine
from serving.core.block_pool import BlockPool
from serving.core.request import EngineRequest, SamplingParams
from serving.core.state_pool import StatePool
from serving.engine.llm_engine import EngineArgs, LLMEngine


def workload(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    vocab = args.vocab
    prefixes = [rng.integers(0, vocab, args.prefix_len).tolist() for _ in range(args.num_prefixes)]
    prompts = []
    for i in range(args.num_prompts):
        suffix = rng.integers(0, vocab, args.suffix_len).tolist()
        prompts.append(prefixes[i % args.num_prefixes] + suffix)
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], args) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    pending = list(prompts)
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}
    out_tokens = 0
    cached = 0
    index: dict[str, int] = {}  # request id -> prompt index
    tokens: list[list[int]] = [[] for _ in prompts]
    sent_step: dict[str, int] = {}  # request id -> engine steps taken before it was sent
    ttft_steps: dict[str, int] = {}  # request id -> engine steps until its first token
    steps = 0
    # Each request's scheduled chunks: (step, tokens computed, samples) per step it ran in
    # before its first token, and the cached tokens it was admitted with.
    chunks: dict[str, list[tuple[int, int, bool]]] = {}
    schedule = engine.scheduler.schedule

    def traced_schedule():
        out = schedule()
        if out is not None:
            for req, n, smp in zip(out.requests, out.num_new_tokens, out.samples, strict=True):
                if req.request_id not in ttft:
                    chunks.setdefault(req.request_id, []).append((steps, n, bool(smp)))
        return out

    engine.scheduler.schedule = traced_schedule
    engine.timing.reset()
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and _in_flight(submitted) < args.concurrency:
            i = len(prompts) - len(pending)  # the prompt popped next
            rid = engine.add_request(EngineRequest(pending.pop(0), params))
            index[rid] = i
            submitted[rid] = time.perf_counter()
            sent_step[rid] = steps
        outputs = engine.step()
        steps += 1
        for o in outputs:
            now = time.perf_counter()
            if o.request_id not in ttft and o.delta_token_ids:
                ttft[o.request_id] = now - submitted[o.request_id]
                ttft_steps[o.request_id] = steps - sent_step[o.request_id]
            if o.finished:
                out_tokens += len(o.output_token_ids)
                tokens[index[o.request_id]] = list(o.output_token_ids)
                cached += o.num_cached_tokens
                submitted[o.request_id] = -1.0  # done: no longer in flight
    seconds = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    t = sorted(ttft.values())
    # The first ``concurrency`` requests are sent at once into an empty cache (only sharing
    # inside that wave can hit); the rest arrive one by one as earlier ones finish.
    first = [v for rid, v in ttft.items() if index[rid] < args.concurrency]
    later = [v for rid, v in ttft.items() if index[rid] >= args.concurrency]
    later_steps = [v for rid, v in ttft_steps.items() if index[rid] >= args.concurrency]
    return {
        "requests": len(prompts),
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(out_tokens / seconds, 1),
        "ttft_mean_s": round(statistics.mean(t), 4),
        "ttft_p50_s": round(t[len(t) // 2], 4),
        "ttft_p99_s": round(t[min(len(t) - 1, int(len(t) * 0.99))], 4),
        "ttft_first_wave_mean_s": round(statistics.mean(first), 4) if first else None,
        "ttft_later_mean_s": round(statistics.mean(later), 4) if later else None,
        # Engine steps from a later request's sending to its first token (1: the next step
        # gave it): many steps point at scheduling, few long ones at the step's cost.
        "ttft_later_steps_mean": round(statistics.mean(later_steps), 2) if later_steps else None,
        "ttft_later_steps_max": max(later_steps) if later_steps else None,
        # Steps from sending to the first token of each first-wave request, in prompt order
        # (the wave is sent at step 0): where the prefixes' computation puts each of them.
        "ttft_first_wave_steps": [
            ttft_steps.get(rid)
            for rid in sorted(index, key=index.get)
            if index[rid] < args.concurrency
        ],  # fmt: skip
        "steps": steps,
        # The later requests' first chunks: [sent at step, [(step, tokens, samples), ...]]
        "later_chunks": [
            [sent_step[rid], chunks.get(rid, [])]
            for rid in sorted(index, key=index.get)
            if index[rid] >= args.concurrency
        ][:8],
        "cached_tokens": cached,
        "host_s_per_step": round(engine.timing.host / max(engine.timing.steps, 1), 6),
        "device_s_per_step": round(engine.timing.device / max(engine.timing.steps, 1), 6),
        "spec": engine.spec_summary(),
        "tokens": tokens,
    }


def _in_flight(submitted: dict[str, float]) -> int:
    return sum(1 for v in submitted.values() if v >= 0)


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.set_defaults(model="bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-prefixes", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--min-token-bucket", type=int, default=256,
        help="the smallest token bucket of a step with prefill tokens (the engine's default is "
        "8; 2048 here before 2026-11-28: then a hit's ~200-token step padded to 2048 tokens)",
    )  # fmt: skip
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--cache-gib", type=float, default=16.0)
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding in both runs, as hyjax serve's flag (the bench model has no "
        'MTP layer: \'{"method": "ngram", "num_speculative_tokens": 2}\'); the report counts '
        "the requests whose greedy tokens are the same with caching on as off",
    )
    p.add_argument(
        "--plain-lru-baseline",
        action="store_true",
        help="a third run, caching on with the state slots evicted in plain LRU order (the "
        "eviction before segmented LRU), in this process",
    )
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="default: the engine's (on for one process on a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--scheduling-policy", nargs="+", default=["fcfs"], choices=["fcfs", "lpm"],
        help="the caching-on run under each policy (one process; the off run is fcfs)",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model, cfg, info = build_for_engine(args, dtype=args.dtype)
    args.vocab = min(cfg.vocab_size, 150000)
    prompts = workload(args)
    results = {"device": device_name(), "config": vars(args), "model": info}
    policies = list(dict.fromkeys(args.scheduling_policy))
    runs = [("off", False, "fcfs")]
    runs += [("on" if i == 0 else f"on_{pol}", True, pol) for i, pol in enumerate(policies)]
    runs += [("on_plain_lru", True, policies[0])] * args.plain_lru_baseline
    for name, caching, policy in runs:
        engine_args = EngineArgs(
            model=".",  # no tokenizer: token-id prompts
            block_size=args.block_size,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.prefix_len + args.suffix_len + args.output_len + 64,
            enable_prefix_caching=caching,
            kernel_backend=args.kernel_backend,
            # Token buckets from --min-token-bucket up (a hit's suffix step runs in a small
            # one) and one row count for every step with prefill tokens: ~8 buckets to
            # compile instead of ~20.
            min_token_bucket=args.min_token_bucket,
            mixed_row_buckets=False,
            cache_bytes=int(args.cache_gib * 2**30),  # the same pools (and buckets) both runs
            num_checkpoint_slots=4 * args.num_prefixes + 2 * args.concurrency,
            speculative_config=args.speculative_config,
            tensor_parallel_size=args.tp,
            enable_expert_parallel=args.expert_parallel,
            scan_layers=args.scan_layers,
            dtype=args.dtype,
            async_scheduling=args.async_scheduling,
            scheduling_policy=policy,
        )
        t0 = time.perf_counter()
        engine = LLMEngine(engine_args, preloaded=(model, cfg))
        compile_s = time.perf_counter() - t0
        segmented = StatePool._push_freed
        if name == "on_plain_lru":  # every freed checkpoint back to the one LRU queue
            StatePool._push_freed = BlockPool._push_freed
        compiles = engine.runner.compile_count()
        try:
            r = run(engine, prompts, args)
        finally:
            StatePool._push_freed = segmented
        # Should be 0: a compile inside the timed run is start-up time counted as TTFT.
        r["compiles_while_measured"] = engine.runner.compile_count() - compiles
        r["startup_s"] = round(compile_s, 1)
        r["async_scheduling"] = engine.async_scheduling
        r["scheduling_policy"] = policy
        results[name] = r
        shown = {k: v for k, v in r.items() if k != "tokens"}
        print(name, json.dumps(shown), flush=True)
        del engine
        gc.collect()
    if args.plain_lru_baseline:
        lru = results["on_plain_lru"]
        lru.pop("tokens")
        results["ttft_plain_lru_over_off"] = round(
            lru["ttft_mean_s"] / results["off"]["ttft_mean_s"], 4
        )
    for pol in policies[1:]:  # the other policies' caching-on runs against the off run
        other = results[f"on_{pol}"]
        same = [a == b for a, b in zip(other.pop("tokens"), results["off"]["tokens"], strict=True)]
        results[f"requests_equal_on_{pol}_off"] = f"{sum(same)}/{len(same)}"
        results[f"ttft_on_{pol}_over_off"] = round(
            other["ttft_mean_s"] / results["off"]["ttft_mean_s"], 4
        )
    on, off = results["on"], results["off"]
    # Requests whose greedy tokens are the same with caching on as off. The model is random
    # and bf16: its logits are near ties, and a hit changes the chunking (so the rounding), so a
    # few flips are expected here; exactness is held by the f32 tests (tests/serving/).
    same = [a == b for a, b in zip(on.pop("tokens"), off.pop("tokens"), strict=True)]
    results["requests_equal_on_off"] = f"{sum(same)}/{len(same)}"
    results["ttft_on_over_off"] = round(on["ttft_mean_s"] / off["ttft_mean_s"], 4)
    if on["ttft_later_mean_s"] and off["ttft_later_mean_s"]:  # the requests that can hit
        results["ttft_later_on_over_off"] = round(
            on["ttft_later_mean_s"] / off["ttft_later_mean_s"], 4
        )
    results["output_tps_on_over_off"] = round(on["output_tok_per_s"] / off["output_tok_per_s"], 3)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
