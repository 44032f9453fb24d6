"""Does a compiled step copy a whole pool? One run on any platform::

    python -m benchmarks.pool_copies --kernel-backend auto --out report.json

For both families (the tiny long-memory models of ``hyjax.testing``), decode and 64-token
prefill steps of 1, 2 and 8 rows are compiled with the chosen kernels; the report lists, per
step, the copies in the optimized HLO as large as a pool (under any reshape) and the step's
temporary bytes. ``tests/serving/test_step_hlo.py`` asserts none on CPU with the reference ops;
this checks the kernels' paths (Pallas ``input_output_aliases``, the GPU's own scatters).
Exits 1 if any step copies a pool.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile

import jax


def pool_copies(runner, shape) -> tuple[list[str], int]:
    from serving.core.plan import StepPlan
    from serving.worker.runner import _step

    compiled = _step.lower(*runner.step_args(StepPlan.empty(shape))).compile()
    sizes = {math.prod(x.shape) for x in jax.tree.leaves(runner.caches)}
    copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", compiled.as_text())
    big = [c for c in copies if math.prod(int(d) for d in c.split(",") if d) in sizes]
    ma = compiled.memory_analysis()
    return big, int(ma.temp_size_in_bytes) if ma is not None else -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--out", default=None)
    ns = p.parse_args()

    from hyjax.testing import make_tiny_kimi_linear_model
    from hyjax.tiny import make_tiny_model
    from serving.core.plan import StepShape
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    report: dict = {"device": str(jax.devices()[0]), "backend": ns.kernel_backend, "steps": []}
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family, make in [("qwen3_next", make_tiny_model),
                             ("kimi_linear", make_tiny_kimi_linear_model)]:  # fmt: skip
            path = make(f"{tmp}/{family}", seed=3, long_memory=True)
            args = EngineArgs(
                model=path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                min_token_bucket=64, max_model_len=256, warmup=False, progress=False,
                kernel_backend=ns.kernel_backend, compilation_cache_dir=None,
            )  # fmt: skip
            runner = LLMEngine(args).runner
            cfg = runner.sched_cfg
            for decode_only in (True, False):
                for rows in (1, 2, 8):
                    tokens = rows if decode_only else 64
                    shape = StepShape(tokens, rows, cfg.max_blocks, cfg.max_ckpt, decode_only)
                    copies, temp = pool_copies(runner, shape)
                    bad += bool(copies)
                    report["steps"].append(dict(
                        family=family, decode_only=decode_only, rows=rows, tokens=tokens,
                        pool_copies=copies, temp_bytes=temp,
                    ))  # fmt: skip
    report["ok"] = bad == 0
    print(json.dumps(report, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if bad == 0 else 1)


if __name__ == "__main__":
    main()
