"""Shared pieces of the benchmark scripts: a Qwen3-Next-shaped random model, device info."""

from __future__ import annotations

import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from pallas_kernels.common.slots import StateSlots


def bench_config(num_layers: int = 8, num_experts: int = 64) -> Qwen3NextConfig:
    """Qwen3-Next-80B-A3B's layer shapes (GDN 16/32 heads x 128, attention 16/2 x 256, MoE
    top-10 of 512-wide experts), with fewer layers and experts so it fits one GPU quickly."""
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "num_hidden_layers": num_layers,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10_000_000,
            "num_experts": num_experts,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "max_position_embeddings": 262144,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
        }
    )


def random_model(cfg: Qwen3NextConfig, seed: int = 0):
    """Builds the model directly on the device (jit-initialised, bf16)."""

    @nnx.jit
    def build():
        return Qwen3NextForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))

    return build()


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def copy_bandwidth(num_bytes: int = 2**30, *, iters: int = 10, repeats: int = 5) -> float:
    """Device copy bandwidth in bytes / s: read + write of ``num_bytes`` of float32, one jitted
    program of ``iters`` chained elementwise passes, the array donated and returned.

    Unrolled with an optimization barrier after each pass (XLA would otherwise fuse the chain
    into one pass), not a ``fori_loop``, whose every trip syncs with the host on a GPU. On an
    H200 (2026-11-29) the two ways read the same within their spread (3.95 / 3.92, 3.81 / 3.97
    and 4.02 / 4.03 TB/s in three processes, BENCHMARKS.md): a 1 GiB pass is long beside a
    round trip."""
    x = jnp.ones((max(num_bytes // 4, 1),), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def chain(x):
        for i in range(iters):
            x = jax.lax.optimization_barrier(x * (1.0 + 1e-7 * (i + 1)))
        return x

    x = jax.block_until_ready(chain(x))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(chain(x))
        times.append((time.perf_counter() - t0) / iters)
    return 2 * x.nbytes / float(np.median(times))


def fanout_bandwidth(
    writes: int, num_bytes: int = 2**28, *, iters: int = 10, repeats: int = 5
) -> float:
    """Bytes / s of a pass that reads ``num_bytes`` of float32 once and writes it ``writes``
    times (``(1 + writes) x num_bytes`` a pass): the floor of a kernel whose traffic is
    mostly stores, as the k-token decode's (one state read, k + 1 written), which a copy's
    1:1 mix need not predict. Chained and unrolled as :func:`copy_bandwidth`, each pass's
    ``[writes, N]`` result kept (an optimization barrier), its last row the next pass's
    input."""
    x = jnp.ones((max(num_bytes // 4, 1),), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def chain(x):
        acc = jnp.zeros((), jnp.float32)
        for i in range(iters):
            y = jax.lax.optimization_barrier(
                jnp.broadcast_to(x * (1.0 + 1e-7 * (i + 1)), (writes, *x.shape))
            )
            acc = acc + y[0, 0]
            x = y[-1]
        return x, acc

    x, _ = jax.block_until_ready(chain(x))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x, _ = jax.block_until_ready(chain(x))
        times.append((time.perf_counter() - t0) / iters)
    return (1 + writes) * x.nbytes / float(np.median(times))


def distinct_copies(operands, n: int) -> tuple:
    """``n`` copies of ``operands`` (a pytree of arrays), each array its own buffer: the
    operands of a timed program's ``n`` calls. With one set shared by every call, XLA computes
    what a call does not derive from its chained argument once for all of them (common
    subexpression elimination: the delta-rule prefill's intra launch, which does not read the
    state, ran once in ten chained calls, 2026-11-29), and the figure is not a call's."""
    return tuple(jax.tree.map(jnp.copy, operands) for _ in range(n))


def time_chained(fn, args, iters: int, repeats: int = 3) -> float:
    """Median seconds per call of ``fn(*args)``: one jitted program of ``iters`` chained calls.

    Unrolled, not a ``fori_loop``: on a GPU every loop trip is a host round trip (~10 us) that
    would be counted as the kernel's. Each call's output feeds the next call's first argument
    (times zero), so XLA can neither drop nor reorder the calls; that link is one small
    elementwise op per call (a sum first when the output's shape differs). Each call reads its
    own copy of the other arguments (:func:`distinct_copies`).
    """
    x, rest = args[0], distinct_copies(args[1:], iters)

    def link(x, out):
        if out.shape != x.shape:
            out = jnp.sum(out.astype(jnp.float32))
        return x + (out * 0).astype(x.dtype)

    @jax.jit
    def loop(x, rest):
        for i in range(iters):
            x = link(x, fn(x, *rest[i]))
        return x

    jax.block_until_ready(loop(x, rest))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x, rest))
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def device_trace(run) -> dict:
    """The device's kernels while ``run()`` runs once under ``jax.profiler.trace``
    (:func:`benchmarks.step_profile.summarize`): their busy time, the span from the first
    kernel's start to the last one's end (busy below span: the device waited between them),
    and the kernels by name. Empty kernel lists on a host without device events (a CPU)."""
    import tempfile

    from benchmarks.step_profile import device_events, summarize

    for _ in range(2):  # a process's first trace recorded no device events (H200, 2026-11-29)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                run()
            summary = summarize(device_events(d), top=16)  # (XLA's fusions too)
        if summary["kernels"] or jax.default_backend() == "cpu":
            break
    return summary


def stateful_chain(step, iters: int):
    """:func:`time_stateful`'s program: ``chain(state, operand_sets, acc) -> (state, acc)``,
    call ``i`` of ``step`` on ``operand_sets[i]``, its outputs summed into ``acc``. The state
    and ``acc`` are donated, so every buffer the program writes stays where the last run left
    it: a new output buffer a run moves an allocation that XLA's CUDA graph (the whole program,
    one command buffer) then re-records before its launch (on an H200 the 1x4096 prefill's
    launch took ~1 ms of host before the device started, a third of its ten calls' kernels,
    2026-11-30); a kernel timed from a CUDA graph (FLA's) pays nothing of that."""

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def chain(state, operand_sets, acc):
        acc = acc * 0
        for i in range(iters):
            state, out = step(state, *operand_sets[i])
            for leaf in jax.tree_util.tree_leaves(out):
                acc = acc + leaf.reshape(-1)[0].astype(jnp.float32)
        return state, acc

    return chain


# Programs launched back to back a measurement (:func:`time_stateful`). XLA runs a jitted
# program as one CUDA graph whose launch takes the host ~0.7-0.9 ms before the device starts
# (the 245-kernel 1x4096 prefill chain on an H200, 2026-11-30: 0.38 ms a call alone, 0.28 with
# five back to back); in a run of several the next launch overlaps the last one's kernels, as
# an async engine's steps do and as FLA's graph replays (:func:`torch_graph_ms`) are timed.
RUNS = 5


def time_stateful(
    step, state, operands, *, iters: int, repeats: int = 3, trace: dict | None = None,
    runs: int = RUNS,
) -> float:  # fmt: skip
    """Median seconds of one ``state, out = step(state, *operands)`` on a donated state.

    One jitted program of ``iters`` calls, unrolled (an XLA while loop syncs with the host on
    every trip on a GPU), the state passed from call to call, and every call's outputs
    consumed: one element of each is summed into a returned scalar, so XLA cannot delete a
    kernel whose output is otherwise unused (a custom call is never partly computed). Each
    call reads its own copy of the operands (:func:`distinct_copies`), so a part that does not
    read the state is computed in every call, not once.

    ``runs`` (:data:`RUNS`) programs are launched back to back a measurement, so the host's
    launch of a program (its CUDA graph) overlaps the device's work on the last one.

    ``trace``: a dict filled with :func:`device_trace` of one more run of the program after
    the timing (what the device ran in the timed figure, and whether it waited between its
    kernels).
    """

    chain = stateful_chain(step, iters)
    operands = distinct_copies(operands, iters)
    state, acc = chain(state, operands, jnp.zeros((), jnp.float32))  # compile + warm up
    jax.block_until_ready((state, acc))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(runs):
            state, acc = chain(state, operands, acc)
        jax.block_until_ready((state, acc))
        times.append((time.perf_counter() - t0) / (iters * runs))
    if trace is not None:

        def run():
            nonlocal state, acc
            state, acc = chain(state, operands, acc)
            jax.block_until_ready((state, acc))

        trace.update(device_trace(run))
    return float(np.median(times))


def prefill_batch(batch, seq_len, max_ckpt=2, ckpt_every=None, short_rows: int = 0):
    """``batch`` sequences of ``seq_len`` tokens for a prefill kernel: ``(query_start_loc,
    slots, num_slots)``; slots 1..B are src (even rows; odd rows start from zeros) and dst,
    and with ``ckpt_every`` each row checkpoints at its multiples (up to ``max_ckpt``) into
    slots of its own. ``short_rows`` more rows of one token each after them (a mixed step's
    decode rows; ``batch * seq_len + short_rows`` tokens in all), slots as the others'."""
    s = batch + short_rows
    lens = jnp.asarray([seq_len] * batch + [1] * short_rows, jnp.int32)
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens)]).astype(jnp.int32)
    src = jnp.where(jnp.arange(s) % 2 == 0, 1 + jnp.arange(s), 0).astype(jnp.int32)
    dst = (1 + jnp.arange(s)).astype(jnp.int32)
    ck_off = jnp.zeros((s, max_ckpt), jnp.int32)
    ck_slot = jnp.zeros((s, max_ckpt), jnp.int32)
    if ckpt_every:
        offs = jnp.arange(1, max_ckpt + 1, dtype=jnp.int32) * ckpt_every
        ck_off = jnp.where(offs[None, :] <= lens[:, None], offs[None, :], 0)
        slots = s + 1 + jnp.arange(s * max_ckpt, dtype=jnp.int32).reshape(s, max_ckpt)
        ck_slot = jnp.where(ck_off > 0, slots, 0)
    num_slots = 1 + s + s * max_ckpt
    return qsl, StateSlots(src, dst, ck_off, ck_slot, jnp.int32(s)), num_slots


def guarded_entries(summary: dict, out: str | None, only: tuple[str, ...] | None = None):
    """A benchmark's ``guarded(name, fn)``: ``summary[name] = fn()`` (a failure recorded as
    ``{"failed": ...}`` and the run going on), printed as one line, and ``summary`` rewritten
    to ``out`` after every entry, so a run cut short keeps its numbers. With ``only`` (name
    prefixes), entries named otherwise are skipped."""

    def guarded(name, fn):
        if only and not name.startswith(only):
            return
        try:
            summary[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep going, report the failure
            summary[name] = {"failed": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        print(name, json.dumps(summary[name]), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(summary, f, indent=2)

    return guarded


def write_summary(summary: dict, out: str | None) -> None:
    """A benchmark's results printed and, with ``out``, written there as JSON."""
    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def err_ratio(got, want) -> float:
    """FLA's error ratio: ``rms(got - want) / rms(want)``, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want**2)), 1e-30))


def sweep_launches(kernel, intra, operands, make_pool, *, intra_sweep, serial_variants,
                   time_fn) -> dict:  # fmt: skip
    """A delta-rule prefill's two launches tuned apart on ``operands = (acts, qsl, slots)``:
    ``intra(warps, stages)`` (a :func:`time_stateful` step running the intra launch alone) timed
    at each of ``intra_sweep``, then the whole ``kernel(*acts, pool, qsl, slots)`` at each of
    ``serial_variants`` (name -> its keyword arguments), its output and state checked against
    the default's (a variant that miscompiles shows; one that does not compile is a result).
    ``make_pool()`` makes a fresh state pool (each timing donates its own); ``time_fn`` is the
    script's :func:`time_stateful`."""
    acts, qsl, slots = operands
    want_o, want_s = jax.jit(kernel)(*acts, make_pool(), qsl, slots)
    n = int(qsl[-1])
    out = {"tokens": n}
    for nw, ns in intra_sweep:
        t = time_fn(intra(nw, ns), make_pool(), operands, iters=10)
        out[f"intra_w{nw}_s{ns}_ms"] = 1e3 * t

    def whole(st, acts, qsl, slots, fn):
        o, st = fn(*acts, st, qsl, slots)
        return st, o

    for name, tuning in serial_variants.items():
        fn = functools.partial(kernel, **tuning)
        try:
            o, st = jax.jit(fn)(*acts, make_pool(), qsl, slots)
            errs = (err_ratio(o, want_o), err_ratio(st, want_s))
            t = time_fn(functools.partial(whole, fn=fn), make_pool(), operands, iters=10)
            out[name] = {"ms": 1e3 * t, "Mtok_per_s": n / t / 1e6, "err_vs_default": errs}
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
            out[name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, out[name], flush=True)
    return out


def torch_graph_ms(torch, fn, iters: int, runs: int = RUNS) -> tuple[float, str]:
    """Device ms per call of a torch ``fn``: ``iters`` calls replayed from one CUDA graph (no
    Python launch overhead, like the jitted chains of :func:`time_stateful`), ``runs`` replays
    back to back between the two events, and the mode (``"cuda_graph"``; ``"eager"``,
    back-to-back calls, if the capture fails)."""
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run, mode = graph.replay, "cuda_graph"
    except Exception:  # noqa: BLE001 - fall back to eager timing, and say so
        torch.cuda.synchronize()

        def run():
            for _ in range(iters):
                fn()

        mode = "eager"
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):  # back to back, as time_stateful's programs
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * runs), mode


def add_engine_workload_args(p, *, layers: int, prefill_requests: int, output_len: int,
                             cache_gib: float) -> None:  # fmt: skip
    """The engine benchmarks' shared flags: model size, the prefill and decode workloads."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--prefill-requests", type=int, default=prefill_requests)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--cache-gib", type=float, default=cache_gib)


def workload_engine(args, backend: str, tp: int = 1, expert_parallel: bool = False, **engine_kw):
    """A random bench model and an engine sized for ``add_engine_workload_args``'s workloads
    (prefix caching off: every prompt is computed; buckets compiled as they are met)."""
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    cfg = bench_config(args.layers, args.experts)
    model = random_model(cfg)
    engine = LLMEngine(
        EngineArgs(
            model=".",
            max_num_seqs=max(args.decode_requests, args.prefill_requests),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.prompt_len + args.output_len + 64,
            kernel_backend=backend,
            min_token_bucket=args.max_num_batched_tokens // 4,
            cache_bytes=int(args.cache_gib * 2**30),
            enable_prefix_caching=False,
            warmup=False,
            progress=False,
            tensor_parallel_size=tp,
            enable_expert_parallel=expert_parallel,
            **engine_kw,
        ),
        preloaded=(model, cfg),
    )
    return engine, model
