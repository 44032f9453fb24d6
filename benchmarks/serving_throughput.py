"""SGLang-style serving throughput on full-size random weights (issues 20 and 23).

Random prompts of ``--input-len`` tokens, ``--output-len`` tokens out (ignore_eos), at most
``--concurrency`` requests in flight (a new one enters when one finishes), through the engine
in this process. For each concurrency: output tokens per second, TTFT / ITL / TPOT percentiles
(vLLM ``bench serve``'s definitions, host wall clock around the engine's steps).

The model is built on the devices (``benchmarks.full_size``). Compile time is bounded by the
workload: ``--max-num-seqs`` is the concurrency, one prefill token bucket (the step budget) with
rows padded to ``min(T, max_num_seqs)``, and the decode buckets of 1, 2, 4, ... rows up to the
concurrency. All of them compile before the measured run (the run's tail meets the small
decode buckets as requests finish), then a short pass of the same workload
(``--warmup-output-len`` tokens out) runs; together timed and printed as ``compile``
(``compiles_while_measured`` in the JSON should be 0). ``--max-seconds`` stops the run cleanly
(every request aborted) and still writes the JSON, with ``"partial": true``.

    python -m benchmarks.serving_throughput --model qwen3-next-80b --tp 4 --concurrency 8 64 \\
        --out SERVE.json
    python -m benchmarks.serving_throughput --model qwen3-next-80b --layers 24 \\
        --scheduling sync async --profile-steps 16 --profile-prefill   # an A/B, one machine
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.serving_throughput --model tiny-qwen3-next --tp 2 --input-len 40 \\
        --output-len 8 --concurrency 4 --dtype float32   # a CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import time

import jax
import numpy as np

from benchmarks.common import device_name
from benchmarks.full_size import add_model_args, build_for_engine
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine


def percentiles(xs: list[float], qs=(50, 90, 99), scale: float = 1e3) -> dict[str, float]:
    """``{"p50": ..., ...}`` in milliseconds (``scale``); NaN-free: empty gives None."""
    if not xs:
        return {f"p{q}": None for q in qs} | {"mean": None}
    a = np.asarray(xs) * scale
    return {f"p{q}": round(float(np.percentile(a, q)), 3) for q in qs} | {
        "mean": round(float(a.mean()), 3)
    }


@dataclasses.dataclass
class Trace:
    """What one request saw: submission, each token's arrival."""

    submitted: float
    token_times: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False


def drive(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    deadline: float,
) -> tuple[dict[str, Trace], float, bool]:
    """Runs ``prompts`` with at most ``concurrency`` in flight until done or ``deadline``
    (``time.perf_counter()``); then aborts what is left. Returns the traces by request id,
    the wall seconds and whether the deadline cut it short."""
    pending = list(prompts)
    traces: dict[str, Trace] = {}
    in_flight = 0
    start = time.perf_counter()
    cut = False
    while pending or engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            cut = True
            for rid, t in traces.items():
                if not t.finished:
                    engine.abort_request(rid)
            break
        while pending and in_flight < concurrency:
            rid = engine.add_request(EngineRequest(pending.pop(0), params))
            traces[rid] = Trace(time.perf_counter())
            in_flight += 1
        for o in engine.step():
            now = time.perf_counter()
            t = traces[o.request_id]
            t.token_times.extend([now] * len(o.delta_token_ids))
            if o.finished:
                t.finished = True
                t.cached_tokens = o.num_cached_tokens
                in_flight -= 1
    # Async scheduling may hold a dispatched step: drain it so the next engine starts clean.
    while engine.has_unfinished_requests():
        engine.step()
    return traces, time.perf_counter() - start, cut


def metrics(traces: dict[str, Trace], seconds: float) -> dict:
    """vLLM ``bench serve``'s metrics: TTFT (submission to first token), ITL (gaps between a
    request's consecutive tokens; tokens of one step share its time), TPOT per request
    ((last - first token) / (tokens - 1))."""
    ttft, itl, tpot = [], [], []
    out_tokens = 0
    for t in traces.values():
        out_tokens += len(t.token_times)
        if t.token_times:
            ttft.append(t.token_times[0] - t.submitted)
            itl.extend(np.diff(t.token_times).tolist())
        if len(t.token_times) > 1:
            tpot.append((t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1))
    return {
        "requests": len(traces),
        "completed": sum(t.finished for t in traces.values()),
        "seconds": round(seconds, 3),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / seconds, 2) if seconds else None,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "tpot_ms": percentiles(tpot),
    }


def engine_args(args, concurrency: int, max_model_len: int, **overrides) -> EngineArgs:
    """The engine for one concurrency: buckets limited to what the workload meets."""
    budget = args.max_num_batched_tokens
    kw = dict(
        model=".",  # no tokenizer: token-id prompts
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=concurrency,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        min_token_bucket=budget,  # one token bucket for every step with prefill tokens
        mixed_row_buckets=False,  # ... and one row count for it
        enable_prefix_caching=False,
        kernel_backend=args.kernel_backend,
        state_dtype=args.state_dtype,
        cache_bytes=int(args.cache_gib * 2**30) if args.cache_gib else None,
        async_scheduling=args.async_scheduling,
        scan_layers=args.scan_layers,
        branch_free_step=args.branch_free_step,
        dispatch_thread=args.dispatch_thread,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.expert_parallel,
        compilation_cache_dir=args.compilation_cache_dir,
        min_seq_bucket=min(args.min_seq_bucket, concurrency),
        warmup=False,
        progress=False,
    )
    kw.update(overrides)
    return EngineArgs(**kw)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def run_one(model, cfg, args, concurrency: int, deadline: float) -> dict:
    max_len = args.input_len + args.output_len + 64
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args(args, concurrency, max_len), preloaded=(model, cfg))
    res = {"concurrency": concurrency, "engine_start_s": round(time.perf_counter() - t0, 2)}
    res["async_scheduling"] = engine.async_scheduling
    res["branch_free_step"] = engine.runner.branch_free
    res["dispatch_thread"] = engine._dispatch is not None
    res["kv_blocks_per_device"] = engine.runner.memory.num_kv_blocks
    res["state_slots_per_device"] = engine.runner.memory.num_state_slots
    vocab = min(cfg.vocab_size, 150000)
    num = args.num_prompts or concurrency
    # Warm-up: every bucket of this engine (the decode buckets of 1, 2, 4, ... rows up to the
    # concurrency, which the run's tail meets as requests finish, and the one prefill bucket),
    # then the same rows and prompt lengths with a few tokens out.
    compiles = engine.runner.compile_count()
    t0 = time.perf_counter()
    engine.runner.warmup(progress=False)
    warm = SamplingParams(max_tokens=args.warmup_output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(concurrency, args.input_len, vocab, args.seed + 1)
    _, _, cut = drive(engine, prompts, warm, concurrency, deadline)
    warm_s = time.perf_counter() - t0
    res["compile_s"] = round(warm_s, 2)
    res["buckets_compiled"] = engine.runner.compile_count() - compiles
    print(f"compile: {warm_s:.1f} s for {res['buckets_compiled']} step buckets "
          f"(concurrency {concurrency})", flush=True)  # fmt: skip
    if cut:
        res["partial"] = True
        return res
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, args.input_len, vocab, args.seed)
    compiles = engine.runner.compile_count()
    engine.timing.reset()
    traces, seconds, cut = drive(engine, prompts, params, concurrency, deadline)
    res |= metrics(traces, seconds)
    res["partial"] = cut
    res["compiles_while_measured"] = engine.runner.compile_count() - compiles
    steps = max(engine.timing.steps, 1)
    res["engine_steps"] = engine.timing.steps
    res["host_ms_per_step"] = round(engine.timing.host / steps * 1e3, 3)
    res["device_ms_per_step"] = round(engine.timing.device / steps * 1e3, 3)
    if engine.timing.launches:  # async scheduling: the launch sequence alone
        res["launch_ms_per_step"] = round(engine.timing.launch / engine.timing.launches * 1e3, 3)
    del engine
    gc.collect()
    return res


def profile_one(model, cfg, args, concurrency: int) -> dict:
    """``profile_decode`` on an engine of its own, after every measured run: a run measured
    after a profiled one in the same process was slower (two H200s, TP 2: 276 against 434
    tok/s), so no measurement follows a ``jax.profiler`` session. The buckets were compiled by
    the measured run (kept in-process)."""
    max_len = args.input_len + args.output_len + 64
    engine = LLMEngine(engine_args(args, concurrency, max_len), preloaded=(model, cfg))
    engine.runner.warmup(progress=False)
    prof = profile_decode(engine, model, cfg, args, concurrency)
    del engine
    gc.collect()
    return prof


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """The engine flags the serving benchmarks share."""
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--cache-gib", type=float, default=None, help="KV + state pools per device (default: 90%%)"
    )
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="default: the engine's (on for one process on a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--min-seq-bucket", type=int, default=1,
        help="decode steps pad to at least this many rows (fewer buckets to compile; the run's "
        "tail pads)",
    )  # fmt: skip
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument(
        "--branch-free-step", action=argparse.BooleanOptionalAction, default=None,
        help="the engine's --branch-free-step (default: the engine's, on for TP on a GPU; "
        "--no-branch-free-step for the step with its lax.conds)",
    )  # fmt: skip
    p.add_argument(
        "--dispatch-thread", action="store_true",
        help="the engine's --dispatch-thread (steps launched from a thread of their own; "
        "'host ms / step' is then the engine thread's time without the launches)",
    )  # fmt: skip
    p.add_argument(
        "--max-seconds", type=float, default=510.0, help="stop cleanly, JSON written, after this"
    )
    p.add_argument(
        "--profile-steps", type=int, default=0,
        help="after the measured runs, trace this many decode steps at each run's concurrency "
        "and sum the device kernels by name",
    )  # fmt: skip
    p.add_argument("--profile-top", type=int, default=40)
    p.add_argument("--profile-dir", default=None, help="keep the trace here")
    p.add_argument(
        "--profile-prefill", action="store_true",
        help="trace the profile's prefill steps too (the host's thunks, when each step returned)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="write the results as JSON here")


def profile_decode(engine: LLMEngine, model, cfg, args, concurrency: int) -> dict:
    """``--profile-steps`` decode steps of ``concurrency`` rows under ``jax.profiler.trace``,
    after the measured run: the requests' prompts (``--input-len``) are prefilled first, outside
    the trace, so the traced steps are all decode; device kernels summed by name, against the
    step's byte floor where the model is Qwen3-Next-shaped."""
    import tempfile

    from benchmarks.step_profile import (
        decode_floor_bytes,
        device_events,
        step_thunks,
        summarize,
    )  # fmt: skip

    n = args.profile_steps
    params = SamplingParams(max_tokens=n + 4, temperature=0.0, ignore_eos=True)
    vocab = min(cfg.vocab_size, 150000)
    for prompt in random_prompts(concurrency, args.input_len, vocab, args.seed + 2):
        engine.add_request(EngineRequest(prompt, params))
    prefill = {"step_return_ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        # the prefill steps: traced (host thunks only) with --profile-prefill
        ctx = jax.profiler.trace(tmp + "/p", create_perfetto_trace=True)
        decoded, t0 = 0, time.perf_counter()
        with ctx if args.profile_prefill else contextlib.nullcontext():
            while decoded < 2 * concurrency:  # every row past its prefill, one decode step more
                out = engine.step()
                decoded += sum(len(o.delta_token_ids) for o in out)
                now = time.perf_counter()
                prefill["step_return_ms"].append([round(1e3 * (now - t0), 2), len(out)])
        if args.profile_prefill:
            prefill["host_thunks"] = step_thunks(tmp + "/p")
    with tempfile.TemporaryDirectory() as tmp:
        d = args.profile_dir or tmp
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(n):
                engine.step()
        seconds = time.perf_counter() - t0
        events = device_events(d)
        thunks = step_thunks(d)
    while engine.has_unfinished_requests():
        engine.step()
    res = summarize(events, args.profile_top) | {"steps": n, "host_thunks": thunks}
    res["prefill"] = prefill
    res["wall_ms_per_step_traced"] = round(1e3 * seconds / n, 2)
    res["device_ms_per_step"] = round(res["device_busy_us"] / 1e3 / n, 3)
    res["kernels_per_step"] = round(res["kernels"] / n, 1)
    if args.copy_bandwidth:  # timed by main() before any pool; the floor a card
        floor = decode_floor_bytes(model, cfg, concurrency, args.input_len + n)
        res["floor_bytes"] = floor
        res["floor_ms"] = floor_fields(floor, args.tp, args.copy_bandwidth, None)[
            "floor_ms_per_card"
        ]
        res["device_over_floor"] = round(res["device_ms_per_step"] / res["floor_ms"], 2)
    return res


def write(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def floor_fields(floor_bytes: dict, tp: int, bandwidth: float, itl_ms: dict | None) -> dict:
    """A run's decode byte floor a card (``step_profile.decode_floor_bytes`` of the whole step,
    split evenly over the ``tp`` cards: every large array of the step is sharded over them) at
    the copy ``bandwidth`` (bytes a second), and the run's ITL p50 over it."""
    per_card = floor_bytes["total"] / tp
    floor_ms = 1e3 * per_card / bandwidth
    out = {"floor_gb_per_card": round(per_card / 1e9, 2), "floor_ms_per_card": round(floor_ms, 3)}
    if itl_ms and itl_ms.get("p50"):
        out["itl_p50_over_floor"] = round(itl_ms["p50"] / floor_ms, 2)
    return out


def wait_all_shards() -> None:
    """``--wait-all-shards``: the runner's ``fetch`` also waits for every device's shard of a
    step's results (it reads one device's), so they are freed at once when the step is
    dropped. An experiment for TP: XLA re-records the second card's CUDA graphs every other
    step because its temp buffer alternates between two addresses (BENCHMARKS.md); one
    suspect is a deferred free of the last step's unread shards on that card interleaving
    with its next allocations."""
    from serving.worker.runner import ModelRunner

    fetch = ModelRunner.fetch

    def fetch_all(step):
        got = fetch(step)
        jax.block_until_ready(step.out)
        return got

    ModelRunner.fetch = staticmethod(fetch_all)


def main() -> None:
    start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    add_serving_args(p)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--num-prompts", type=int, default=None, help="default: the concurrency")
    p.add_argument("--warmup-output-len", type=int, default=4)
    p.add_argument(
        "--scheduling", nargs="+", choices=["sync", "async"], default=[],
        help="run each concurrency once per mode, in this order (an A/B on one machine); "
        "default: once, as --[no-]async-scheduling says",
    )  # fmt: skip
    p.add_argument(
        "--wait-all-shards", action="store_true",
        help="an experiment: the runner also waits for every device's shard of a step's "
        "results before dropping them (wait_all_shards)",
    )  # fmt: skip
    args = p.parse_args()
    deadline = start + args.max_seconds
    if args.wait_all_shards:
        wait_all_shards()
    model, cfg, info = build_for_engine(args, dtype=args.dtype)
    print(f"build: {info['build_s']} s, {info['param_gb_per_device']} GB of parameters per "
          "device", flush=True)  # fmt: skip
    # The copy bandwidth for each run's byte floor (Qwen3-Next-shaped models on a GPU), timed
    # before any engine takes the memory for its pools (it copies 1 GiB).
    bandwidth = args.copy_bandwidth = None
    if jax.devices()[0].platform == "gpu" and hasattr(cfg, "linear_num_value_heads"):
        from benchmarks.step_profile import copy_bandwidth

        bandwidth = args.copy_bandwidth = copy_bandwidth()
    results = {
        "device": device_name(),
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "model": info,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
            "num_prompts": args.num_prompts,
            "wait_all_shards": args.wait_all_shards,
        },  # fmt: skip
        "runs": [],
        "partial": False,
    }
    if bandwidth:
        results["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    write(results, args.out)
    # --scheduling sync async: both engines per concurrency, one after the other on this
    # machine (the second compiles little: the step's executables are shared in-process)
    modes = [{"sync": False, "async": True}[m] for m in args.scheduling] or [args.async_scheduling]
    for c in args.concurrency:
        for mode in modes:
            if time.perf_counter() > deadline:
                results["partial"] = True
                break
            args.async_scheduling = mode
            r = run_one(model, cfg, args, c, deadline)
            if bandwidth:  # the decode steps' mean context: the prompt and half the output
                from benchmarks.step_profile import decode_floor_bytes

                floor = decode_floor_bytes(model, cfg, c, args.input_len + args.output_len // 2)
                r |= floor_fields(floor, args.tp, bandwidth, r.get("itl_ms"))
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
            results["partial"] |= bool(r.get("partial"))
            write(results, args.out)  # after every run: a later failure keeps the earlier ones
    for r in results["runs"] if args.profile_steps else ():
        if r.get("partial") or time.perf_counter() > deadline:
            continue
        args.async_scheduling = r["async_scheduling"]
        r["profile"] = profile_one(model, cfg, args, r["concurrency"])
        print(json.dumps(r["profile"], indent=1), flush=True)
        write(results, args.out)
    results["total_s"] = round(time.perf_counter() - start, 1)
    write(results, args.out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
