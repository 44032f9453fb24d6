"""The one-row steps with and without the pool-copy fix, one process, same engine::

    python -m benchmarks.one_row_step --out benchmarks/results/one_row_step_cpu.json

Before the fix, XLA turned the one-row state gather into a dynamic slice fused into its
consumers and copied every layer's state pool to update it in place. The baseline puts the
plain gather back (``pool[src_slot]``, patched into the reference ops that read slots) and
recompiles; both variants run the same steps on the same engine. Each timed step returns its
sampled tokens to the host (``ModelRunner.execute``), so nothing is left unrun. The floor is the
bytes a one-row step must read (every weight once; the row's state slot read and written) at
the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.conv1d.reference as conv_ref
import pallas_kernels.gdn.reference as gdn_ref
import pallas_kernels.kda.reference as kda_ref
from benchmarks.cold_start import _cpu_name


def _plain_read_slots(pool, src_slot):
    """``read_slots`` as it was: a one-row gather XLA may fold into its consumers."""
    gathered = pool[src_slot]
    mask = (src_slot > 0).reshape((-1,) + (1,) * (pool.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros_like(gathered))


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a jitted copy (read + write) of ``nbytes``."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def time_steps(runner, shapes, repeats: int) -> dict:
    from serving.core.plan import StepPlan
    from serving.worker.runner import _step

    out = {}
    for name, shape in shapes.items():
        plan = StepPlan.empty(shape)
        runner.execute(plan)  # compile
        compiled = _step.lower(*runner.step_args(plan)).compile()
        times = [_timed(lambda p=plan: runner.execute(p)) for _ in range(repeats)]
        out[name] = {
            "median_ms": round(float(np.median(times)) * 1e3, 2),
            "min_ms": round(min(times) * 1e3, 2),
            "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    ns = p.parse_args()

    from serving.core.plan import StepShape
    from serving.engine.engine_args import resolve_model
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=resolve_model(None), dtype="float32", warmup=False,
                                  progress=False, compilation_cache_dir=None))  # fmt: skip
    runner = engine.runner
    cfg = runner.sched_cfg
    shapes = {
        "decode_1_row": StepShape(1, 1, cfg.max_blocks, cfg.max_ckpt, True),
        "decode_2_rows": StepShape(2, 2, cfg.max_blocks, cfg.max_ckpt, True),
    }
    fixed = time_steps(runner, shapes, ns.repeats)
    jax.clear_caches()
    saved = [(m, m.read_slots) for m in (gdn_ref, kda_ref, conv_ref)]
    for m, _ in saved:
        m.read_slots = _plain_read_slots
    try:
        baseline = time_steps(runner, shapes, ns.repeats)
    finally:
        for m, fn in saved:
            m.read_slots = fn
    weights = sum(x.nbytes for x in jax.tree.leaves(runner._state_leaves))
    slot = runner.memory.state_slot_bytes
    bw = copy_bandwidth()
    floor_bytes = weights + 2 * slot
    report = {
        "cpu": _cpu_name(),
        "model": "embedded qwen3-next-pystdlib-tiny, float32",
        "fixed": fixed,
        "baseline_plain_gather": baseline,
        "copy_bandwidth_gb_s": round(bw / 1e9, 2),
        "floor_bytes": floor_bytes,
        "floor_ms_one_row": round(floor_bytes / bw * 1e3, 3),
    }
    print(json.dumps(report, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
