"""Where the device time of an engine step goes: prefill and decode passes under the profiler.

The random Qwen3-Next-shaped model of ``benchmarks.common``; each workload runs once to
compile, then once under ``jax.profiler.trace``. The Perfetto trace's device events (GPU
kernels, TPU ops) are summed by name, so the kernels that dominate a step are named.

    python -m benchmarks.step_profile --layers 4 --out PROFILE.json
    python -m benchmarks.step_profile --layers 8 --decode-rows 16,64,256 --out PROFILE.json

Each decode workload also runs once untraced: ``untraced_decode_ms_p50`` is the median time of
its decode-only steps (host plus the wait for the device, ``LLMEngine.timing``: the step as the
engine runs it; under the profiler each short kernel is inflated, so the traced sums overstate
a step of many small kernels).

Each decode workload also reports its **byte floor**: the bytes a decode step must move (the
weights it reads: every non-expert parameter once, the routed experts its rows touch, expected
``E (1 - (1 - k/E)^R)`` per MoE layer for uniform routing; the recurrent states read and
written; the KV cache read at the workload's mean context; the LM head) at the copy bandwidth
measured in the same process, so ``device_ms_per_step`` and ``wall_ms_per_step`` are read
against it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import glob
import gzip
import json
import os
import pstats
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import add_engine_workload_args, bench_config, device_name, workload_engine
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


def step_thunks(trace_dir: str) -> list[dict]:
    """How the host ran each traced XLA:GPU executable: its top-level thunks in order
    (``command_buffer_N``: one CUDA graph launch; anything else: a thunk of its own, e.g. a
    ``cond.N`` outside the graphs, whose ``MemcpyD2H`` of the predicate makes the host wait
    for every kernel before it). One entry per distinct sequence, with how often it ran and
    the median host microseconds of each thunk."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
              if e.get("ph") == "X"]  # fmt: skip
    modules = [e for e in events if e["name"].endswith("XLA GPU module")]
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[(e["pid"], e["tid"])].append(e)
    runs = collections.defaultdict(list)
    for m in modules:
        end = m["ts"] + m.get("dur", 0.0)
        inside = sorted(
            (e for e in by_tid[(m["pid"], m["tid"])]
             if e is not m and m["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0.0) <= end),
            key=lambda e: (e["ts"], -e.get("dur", 0.0)),
        )  # fmt: skip
        top, until = [], -1.0
        for e in inside:  # direct children: not inside the previous child
            if e["ts"] >= until:
                top.append(e)
                until = e["ts"] + e.get("dur", 0.0)
        top = [e for e in top if not e["name"].startswith("Thunks::")]
        syncs = [
            t["name"] for t in top
            if any(c["name"].startswith("MemcpyD2H") and t["ts"] <= c["ts"] <= t["ts"] + t["dur"]
                   for c in inside)
        ]  # fmt: skip
        key = (m["name"], tuple(t["name"] for t in top), tuple(syncs))
        runs[key].append([t.get("dur", 0.0) for t in top])
    out = []
    for (module, names, syncs), durs in runs.items():
        med = np.median(np.asarray(durs), axis=0) if durs and durs[0] else []
        out.append({
            "module": module, "runs": len(durs), "host_syncs": list(syncs),
            "thunks": [{"name": n, "host_us": round(float(d))} for n, d in zip(names, med)],
        })  # fmt: skip
    return sorted(out, key=lambda r: -r["runs"])


# Kernel names by what they do, first match wins: XLA names its fusions after their root op
# and numbers them per layer (psum_59_0_fusion_1, sort_116_1__9), the Pallas kernels carry
# their own names.
KERNEL_KINDS = (
    ("collective", r"psum|all_reduce|all-reduce|all_gather|all-gather|nccl"),
    ("sort", r"^sort|RadixSort|radix_sort|topk|TopK"),
    ("moe_experts", r"^moe_"),
    ("delta_rule", r"gdn_|kda_|conv1d|conv_"),
    ("attention", r"attention|mla_"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|sm90_xmma|dot"),
    ("copy", r"^Memcpy|^memcpy|^Memset"),
)


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry a kernel's name falls under, or ``other`` (XLA's
    elementwise, reduction, scatter and gather fusions)."""
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")


def summarize(events: list[dict], top: int) -> dict:
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        total[e["name"]] += float(e.get("dur", 0.0))
        count[e["name"]] += 1
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, us in total.items():
        kind = kinds[kernel_kind(name)]
        kind[0] += us
        kind[1] += count[name]
    busy = sum(total.values())
    span = 0.0
    if events:
        span = max(e["ts"] + e.get("dur", 0.0) for e in events) - min(e["ts"] for e in events)
    return {
        "device_busy_us": round(busy),
        "device_span_us": round(span),  # first kernel start to last kernel end
        "kernels": len(events),
        # every kernel summed by kind: us and launches (the top list below leaves the tail out)
        "kinds": {k: {"us": round(us), "calls": n} for k, (us, n) in sorted(kinds.items())},
        "top": [
            {"name": n[:160], "us": round(us), "calls": count[n], "share": round(us / busy, 3)}
            for n, us in total.most_common(top)
        ],
    }


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB f32 copy (read + write), median of 5 unrolled programs of
    10 chained copies. An optimization barrier after each copy keeps XLA from fusing the chain
    into one pass (which read 6x the card's bandwidth in a first run)."""
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)

    @jax.jit
    def chain(x):
        for i in range(10):
            x = jax.lax.optimization_barrier(x * (1.0 + 1e-7 * (i + 1)))
        return x

    jax.block_until_ready(chain(x))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(x))
        times.append((time.perf_counter() - t0) / 10)
    return 2 * x.nbytes / float(np.median(times))


def decode_floor_bytes(model, cfg, rows: int, context: int) -> dict:
    """The bytes one decode step of ``rows`` rows at mean ``context`` tokens must move."""
    expert, other = 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        nbytes = leaf.size * leaf.dtype.itemsize
        if any("experts_" in str(getattr(k, "key", k)) for k in path):
            expert += nbytes
        else:
            other += nbytes
    embed = cfg.vocab_size * cfg.hidden_size * 2  # the embedding: only `rows` rows are read
    if not cfg.tie_word_embeddings:
        other -= embed
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** rows) / e if e else 0.0
    kinds = list(cfg.layer_types)
    n_linear = sum(t == "linear_attention" for t in kinds)
    n_attn = len(kinds) - n_linear
    state = 2 * rows * n_linear * cfg.linear_num_value_heads * cfg.linear_key_head_dim
    state *= cfg.linear_value_head_dim * 4
    kv = rows * context * n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    parts = {
        "weights_dense": other,
        "weights_experts_touched": int(expert * touched),
        "recurrent_state": state,
        "kv_read": kv,
    }
    parts["total"] = sum(parts.values())
    return parts


def _host_profile(profiler: cProfile.Profile, top: int) -> dict:
    """The functions of a cProfile run with the most own time and the most cumulative time
    (cProfile inflates Python calls; the native ones, XLA's launch, are one call each)."""
    stats = pstats.Stats(profiler)
    rows = [
        {"fn": f"{os.path.basename(f)}:{line}:{name}", "calls": nc, "own_s": round(tt, 4),
         "cum_s": round(ct, 4)}
        for (f, line, name), (_, nc, tt, ct, _) in stats.stats.items()
    ]  # fmt: skip
    return {
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "by_cum": sorted(rows, key=lambda r: -r["cum_s"])[:top],
    }


def _workload(
    engine: LLMEngine, phase: str, args, seed: int, rows: int = 0, record: list | None = None
):
    rng = np.random.default_rng(seed)
    if phase == "prefill":
        n, prompt, out = args.prefill_requests, args.prompt_len, 1
    else:
        n, prompt, out = rows, 32, args.output_len
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, 150000, prompt).tolist(), params))
    steps, start = 0, time.perf_counter()
    decode_ms = []  # each decode-only step's host + device-wait time (``LLMEngine.timing``)
    while engine.has_unfinished_requests():
        reported = engine.timing.steps
        engine.step()
        steps += 1
        if engine.timing.steps > reported:
            _, decode_only, host, device = engine.timing.last
            if decode_only:
                decode_ms.append((1e3 * host, 1e3 * device))
    if record is not None:
        record.extend(decode_ms)
    return steps, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_workload_args(p, layers=4, prefill_requests=8, output_len=32, cache_gib=4.0)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--decode-rows",
        default=None,
        help="comma-separated decode batch sizes (default: --decode-requests)",
    )
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="default: the engine's (on for one process on a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--dispatch-thread", action="store_true",
        help="the engine's --dispatch-thread: XLA's launch on a thread of its own, beside the "
        "host's scheduling and reporting",
    )  # fmt: skip
    p.add_argument(
        "--host-profile", action="store_true",
        help="run each untraced decode pass under cProfile: its top functions in the JSON",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows_list = [int(r) for r in (args.decode_rows or str(args.decode_requests)).split(",")]
    args.decode_requests = max(rows_list)
    engine, model = workload_engine(
        args, args.kernel_backend, args.tp, args.expert_parallel,
        async_scheduling=args.async_scheduling, dispatch_thread=args.dispatch_thread,
    )  # fmt: skip
    bandwidth = copy_bandwidth()
    results = {
        "device": device_name(),
        "jax": jax.__version__,
        "model": f"bench_config({args.layers} layers, {args.experts} experts), bf16",
        "kernel_backend": args.kernel_backend,
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.expert_parallel,
        "async_scheduling": engine.async_scheduling,
        "dispatch_thread": args.dispatch_thread,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
    }
    phases = [("prefill", 0)] + [(f"decode_B{r}", r) for r in rows_list]
    for phase, rows in phases:
        kind = "prefill" if rows == 0 else "decode"
        _workload(engine, kind, args, seed=0, rows=rows)  # compiles
        untraced: list = []  # the decode-only steps of a pass without the profiler
        host_profile = None
        if rows:
            launches, launch = engine.timing.launches, engine.timing.launch
            profiler = cProfile.Profile() if args.host_profile else None
            if profiler is not None:
                profiler.enable()
            _workload(engine, kind, args, seed=2, rows=rows, record=untraced)
            if profiler is not None:
                profiler.disable()
                host_profile = _host_profile(profiler, args.top)
            launches = engine.timing.launches - launches
            launch_ms = 1e3 * (engine.timing.launch - launch) / max(1, launches)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                steps, seconds = _workload(engine, kind, args, seed=1, rows=rows)
            events = device_events(d)
        res = summarize(events, args.top)
        res.update(steps=steps, wall_ms_per_step=round(1e3 * seconds / steps, 2))
        res["device_ms_per_step"] = round(res["device_busy_us"] / 1e3 / steps, 2)
        res["kernels_per_step"] = round(res["kernels"] / steps, 1)
        if rows:
            floor = decode_floor_bytes(model, bench_config(args.layers, args.experts), rows,
                                       32 + args.output_len // 2)  # fmt: skip
            res["floor_bytes"] = floor
            res["floor_ms"] = round(1e3 * floor["total"] / bandwidth, 3)
            res["wall_over_floor"] = round(res["wall_ms_per_step"] / res["floor_ms"], 2)
            res["device_over_floor"] = round(res["device_ms_per_step"] / res["floor_ms"], 2)
            if untraced:  # the tracer inflates short kernels: this is the step users see
                host, wait = np.asarray(untraced).T
                res["untraced_decode_steps"] = len(untraced)
                res["untraced_decode_ms_p50"] = round(float(np.median(host + wait)), 3)
                res["untraced_over_floor"] = round(
                    res["untraced_decode_ms_p50"] / res["floor_ms"], 2
                )
                # where it goes: the host's part (schedule, launch, report) and the wait for
                # the device; the launch (``runner.submit``) a step, over every step of the pass
                res["untraced_host_ms_p50"] = round(float(np.median(host)), 3)
                res["untraced_wait_ms_p50"] = round(float(np.median(wait)), 3)
                res["untraced_launch_ms_per_step"] = round(launch_ms, 3)
            if host_profile is not None:
                res["host_profile"] = host_profile
        results[phase] = res
        print(phase, json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
