"""The verify-shaped step (speculative decoding) against the one-token decode step.

At Qwen3-Next-80B-A3B's layer shapes (``benchmarks.common.bench_config``: 8 layers, 6 GDN +
2 gated attention, 64 experts, bf16, random weights) one ``ModelRunner`` times, for each row
count R and draft count K, the scheduler's own plans (``build_plan``) of three steps:

- ``decode``: R rows of one token (a decode bucket);
- ``verify``: R rows of K + 1 tokens (the last token and K drafts, a state checkpoint after
  each) in the verify bucket: the GDN layers run the k-token decode kernels;
- ``mixed``: the same rows in the prefill-shaped bucket through the chunked prefill, as
  before verify buckets (``--no-verify-buckets``).

Every row sits at ``--context`` tokens of context in its own KV blocks and state slots. A step
is timed as the engine runs it without async scheduling: ``runner.execute`` (pack, one
transfer, the jitted step, fetch), median of ``--iters`` after two warm runs (the first
compiles). A verify step that yields ``a`` tokens a row on average (the acceptance length)
beats plain decoding by ``a / (verify_ms / decode_ms)``; the script prints that speed-up for
the acceptance lengths of ``--acceptance`` (default: the embedded model's MTP drafter on an
H200, 1.64 / 2.19 / 2.42 at K = 1 / 2 / 3, BENCHMARKS.md) and the break-even acceptance
``verify_ms / decode_ms``. The MTP drafter's own passes are not in these steps (the bench
model has no MTP layer): with the n-gram drafter the verify step is the whole step.

GPU (one H100 / H200; ~10 minutes, most of it compiling 3 x 3 x 3 buckets)::

    python -m benchmarks.verify_step --layers 8 --rows 16,64,256 --ks 1,2,3 \\
        --out benchmarks/results/verify_step_h200.json

CPU dry run (tiny sizes, a minute)::

    python -m benchmarks.verify_step --tiny --rows 2,4 --ks 1,2 --context 40 --iters 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench_config, device_name, random_model
from hyjax.cache import kv_block_bytes, state_slot_bytes
from serving.core.config import SchedulerConfig
from serving.core.memory_planner import MemoryPlan
from serving.core.plan import SamplingArrays, StepPlan
from serving.core.scheduler_output import build_plan
from serving.worker.runner import ModelRunner

# Mean acceptance length (tokens a verify row yields) by K: the embedded model's MTP drafter
# (benchmarks/spec_decode.py on an H200).
EMBEDDED_ACCEPTANCE = {1: 1.64, 2: 2.19, 3: 2.42}
BLOCK_SIZE = 16


def tiny_bench_config():
    """A few-MB Qwen3-Next (the tests' tiny config) for a CPU dry run of this script."""
    from hyjax.tiny import tiny_config

    return tiny_config(vocab_size=512)


@dataclasses.dataclass
class Rows:
    """R rows' host-side tables: each row its own KV blocks, running slot and K spec slots."""

    block_table: np.ndarray  # i32[R, max_blocks]
    running: np.ndarray  # i32[R]   slots 1..R
    spec: np.ndarray  # i32[R, K_max]   slots R+1..


def make_rows(sched: SchedulerConfig, rows: int, k_max: int) -> Rows:
    per_row = sched.max_blocks
    table = np.zeros((sched.max_num_seqs, per_row), np.int32)
    table[:rows] = 1 + np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    running = 1 + np.arange(rows, dtype=np.int32)
    spec = 1 + rows + np.arange(rows * k_max, dtype=np.int32).reshape(rows, max(k_max, 1))
    return Rows(table, running, spec)


def step_plan(sched: SchedulerConfig, rows: Rows, n: int, k: int, context: int, seed: int):
    """The scheduler's plan of ``n`` rows at ``context`` tokens, each verifying ``k`` drafts
    (``k = 0``: a plain decode row)."""
    rng = np.random.default_rng(seed)
    q = k + 1
    ids = rng.integers(3, 1000, n * q).tolist()
    ckpts = [(r, j + 1, int(rows.spec[r, j])) for r in range(n) for j in range(k)]
    drafts = [ids[r * q + 1 : (r + 1) * q] for r in range(n)]
    running = rows.running[:n].tolist()
    return build_plan(
        sched, rows.block_table, SamplingArrays.empty(sched.max_num_seqs), list(range(n)),
        [context] * n, [q] * n, ids, running, running, ckpts, (), drafts, [-1] * n,
    )  # fmt: skip


def time_plan(runner: ModelRunner, plan: StepPlan, iters: int) -> float:
    """Median wall seconds of ``runner.execute(plan)`` after two warm runs."""
    for _ in range(2):
        runner.execute(plan)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model (CPU dry run)")
    p.add_argument("--rows", default="16,64,256")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--context", type=int, default=1024, help="tokens before each row's step")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument(
        "--acceptance",
        default=",".join(f"{k}:{a}" for k, a in EMBEDDED_ACCEPTANCE.items()),
        help="K:acceptance-length pairs the speed-up is printed for",
    )
    p.add_argument(
        "--no-mixed", action="store_true", help="skip the mixed bucket (one compile less a K)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    acceptance = {int(k): float(a) for k, a in (kv.split(":") for kv in args.acceptance.split(","))}
    r_max, k_max = max(row_counts), max(ks)

    cfg = tiny_bench_config() if args.tiny else bench_config(args.layers, args.experts)
    model = random_model(cfg)
    max_len = args.context + k_max + 2
    base = SchedulerConfig(
        max_num_seqs=r_max,
        max_num_batched_tokens=max(r_max * (k_max + 1), 64),
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        num_speculative_tokens=k_max,
    )
    blocks = 1 + r_max * base.max_blocks
    slots = 1 + r_max * (k_max + 1)
    kv_b = kv_block_bytes(cfg, BLOCK_SIZE, jnp.bfloat16)
    slot_b = state_slot_bytes(cfg, jnp.bfloat16, "float32")
    memory = MemoryPlan(
        num_kv_blocks=blocks, num_state_slots=slots, num_checkpoint_slots=slots - 1 - r_max,
        kv_block_bytes=kv_b, state_slot_bytes=slot_b, block_size=BLOCK_SIZE,
        total_bytes=blocks * kv_b + slots * slot_b,
    )  # fmt: skip
    runner = ModelRunner(model, cfg, base, memory=memory, kernel_backend=args.kernel_backend)
    results = {
        "benchmark": "verify_step",
        "device": device_name(),
        "jax": jax.__version__,
        "model": "tiny"
        if args.tiny
        else f"bench_config({args.layers} layers, {args.experts} experts), bf16",
        "kernel_backend": args.kernel_backend,
        "context": args.context,
        "acceptance": acceptance,
        "steps": [],
    }
    for n in row_counts:
        rows = make_rows(base, n, k_max)
        decode = time_plan(runner, step_plan(base, rows, n, 0, args.context, 0), args.iters)
        for k in ks:
            sched = dataclasses.replace(base, num_speculative_tokens=k)
            verify_plan = step_plan(sched, rows, n, k, args.context, k)
            assert verify_plan.shape.verify_only, verify_plan.shape
            old = dataclasses.replace(sched, verify_buckets=False)
            mixed_plan = step_plan(old, rows, n, k, args.context, k)
            assert not mixed_plan.shape.verify_only, mixed_plan.shape
            verify = time_plan(runner, verify_plan, args.iters)
            mixed = float("nan") if args.no_mixed else time_plan(runner, mixed_plan, args.iters)
            res = {
                "rows": n,
                "k": k,
                "verify_bucket": [verify_plan.shape.num_tokens, verify_plan.shape.num_seqs],
                "mixed_bucket": [mixed_plan.shape.num_tokens, mixed_plan.shape.num_seqs],
                "decode_ms": round(decode * 1e3, 3),
                "verify_ms": round(verify * 1e3, 3),
                "mixed_ms": round(mixed * 1e3, 3),
                "verify_over_decode": round(verify / decode, 3),
                "mixed_over_decode": round(mixed / decode, 3),
                # acceptance length at which speculation breaks even with plain decoding
                "break_even_acceptance": round(verify / decode, 3),
            }
            a = acceptance.get(k)
            if a is not None:
                res["speedup_at_acceptance"] = round(a * decode / verify, 3)
                res["mixed_speedup_at_acceptance"] = round(a * decode / mixed, 3)
            results["steps"].append(res)
            print(json.dumps(res), flush=True)
    print(_table(results["steps"], acceptance))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


def _table(steps: list[dict], acceptance: dict[int, float]) -> str:
    head = "rows  K  decode_ms  verify_ms  mixed_ms  verify/decode  accept  speed-up (mixed)"
    lines = [head]
    for s in steps:
        a = acceptance.get(s["k"])
        up = f"{s['speedup_at_acceptance']:.2f}x ({s['mixed_speedup_at_acceptance']:.2f}x)"
        lines.append(
            f"{s['rows']:>4} {s['k']:>2} {s['decode_ms']:>10.3f} {s['verify_ms']:>10.3f} "
            f"{s['mixed_ms']:>9.3f} {s['verify_over_decode']:>14.3f} "
            f"{a if a is not None else '-':>7}  {up if a is not None else '-'}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
