"""The compiled step updates the donated pools in place: no step copies a whole pool.

A copy of a pool per step costs its bytes twice over (read and written) and as much again in
temporaries; the step's bytes should be the rows it touches. XLA inserts such copies when it
cannot order every read of the old pool before the write of the new one (a one-row gather
turned into a dynamic slice fused into the ops that consume it, say), so the check is on the
optimized HLO of the shapes where that happened: one row, decode and prefill, both families.
"""

import math
import re

import jax
import pytest

from hyjax.testing import make_tiny_kimi_linear_model
from hyjax.tiny import make_tiny_model
from serving.core.plan import StepPlan, StepShape
from serving.engine.llm_engine import EngineArgs, LLMEngine
from serving.worker.runner import _step

SMALL = dict(
    max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=128,
    warmup=False, progress=False, kernel_backend="reference",
)  # fmt: skip

MAKERS = {"qwen3_next": make_tiny_model, "kimi_linear": make_tiny_kimi_linear_model}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def runner(request, tmp_path_factory):
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param), seed=3)
    return LLMEngine(EngineArgs(model=path, **SMALL)).runner


def _pool_copies(runner, shape) -> list[str]:
    """The copies in the step's optimized HLO as large as a pool (under any reshape)."""
    hlo = _step.lower(*runner.step_args(StepPlan.empty(shape))).compile().as_text()
    sizes = {math.prod(x.shape) for x in jax.tree.leaves(runner.caches)}
    copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
    return [c for c in copies if math.prod(int(d) for d in c.split(",") if d) in sizes]


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("rows", [1, 2])
def test_no_step_copies_a_pool(runner, rows, decode_only):
    cfg = runner.sched_cfg
    shape = StepShape(rows if decode_only else 64, rows, cfg.max_blocks, cfg.max_ckpt, decode_only)
    assert _pool_copies(runner, shape) == []
