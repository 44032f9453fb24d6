"""Start-up op selection (``hyjax.ops.ops_for_model``): a kernel that cannot take a model's
shapes gives way to its reference op with one warning, Triton tiles clamp to the head dims
they can, and a float32 model's step traces IEEE-float32 matmuls unless TF32 is allowed."""

import functools
import logging

import jax
import jax.extend
import jax.numpy as jnp
import pytest

import hyjax.ops
from configs import kimi_linear_tiny, qwen3_next_tiny
from hyjax.models.qwen3_next import Qwen3NextForCausalLM
from hyjax.ops import (
    GPU_GDN_PREFILL,
    REFERENCE,
    backend_ops,
    matmul_precision,
    ops_for_model,
)
from pallas_kernels.gdn import fused_decode
from pallas_kernels.gdn import gpu as gdn_gpu
from serving.core.config import SchedulerConfig
from serving.core.plan import StepPlan
from serving.engine.llm_engine import EngineArgs
from serving.entrypoints.cli import build_parser, engine_kwargs
from serving.worker.pool_sizing import size_pools
from serving.worker.runner import ModelRunner, _step
from tests.pallas_kernels.ragged_cases import abstract_slots

GDN_OPS = {"gdn_prefill", "gdn_decode", "conv_gdn_decode", "gdn_multi_decode"}
ATTENTION_OPS = {"paged_attention", "paged_attention_decode"}


def _select(monkeypatch, caplog, cfg, platform="cuda", backend="pallas", **kw):
    """``ops_for_model`` on ``platform``; returns the ops and the ops it logged as replaced."""
    monkeypatch.setattr(hyjax.ops, "accelerator_platform", lambda: platform)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hyjax.ops"):
        ops = ops_for_model(backend, cfg, jnp.float32, **kw)
    logged = [r.getMessage().split(":")[0] for r in caplog.records]
    assert len(logged) == len(set(logged)), f"an op was logged twice: {logged}"
    return ops, set(logged)


def _replaced(ops, backend="pallas", platform="cuda") -> set[str]:
    base = backend_ops(backend, platform)
    fields = set(hyjax.ops.Ops.__dataclass_fields__) - {"matmul_precision"}
    return {f for f in fields if getattr(ops, f) is not getattr(base, f)}


def test_qwen3_next_odd_head_dims_take_the_reference_ops_on_gpu(monkeypatch, caplog):
    cfg = qwen3_next_tiny(linear_key_head_dim=24, linear_value_head_dim=40, head_dim=24)
    ops, logged = _select(monkeypatch, caplog, cfg)
    assert _replaced(ops) == logged == GDN_OPS | ATTENTION_OPS | {"moe_experts"}
    for field in logged:
        assert getattr(ops, field) is getattr(REFERENCE, field)
    gdn = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("gdn_prefill"))
    assert "key head dim 24" in gdn
    assert ops.moe_experts is REFERENCE.moe_experts  # F = 12: tiles of 4 are below MIN_TILE
    # The TPU kernels (and the interpreter running them) take every head dim as a whole block.
    ops, logged = _select(monkeypatch, caplog, cfg, platform="tpu")
    assert not logged and not _replaced(ops, platform="tpu")
    ops, logged = _select(monkeypatch, caplog, cfg, platform="cpu", backend="interpret")
    assert not logged and not _replaced(ops, "interpret")
    # The GPU kernels interpreted on CPU follow the GPU rules: their tiles are the same.
    ops, logged = _select(monkeypatch, caplog, cfg, platform="cpu", backend="interpret-gpu")
    assert _replaced(ops, "interpret-gpu") == logged == GDN_OPS | ATTENTION_OPS | {"moe_experts"}


def test_value_dim_tiles_clamp_and_small_tiles_fall_back(monkeypatch, caplog):
    # Dv = 24 tiles by 8: the GDN kernels stay (their lowering is checked below).
    moe32 = dict(moe_intermediate_size=32)
    ops, logged = _select(monkeypatch, caplog, qwen3_next_tiny(linear_value_head_dim=24, **moe32))
    assert not logged and not _replaced(ops)
    ops, logged = _select(monkeypatch, caplog, qwen3_next_tiny(linear_value_head_dim=12, **moe32))
    assert logged == GDN_OPS  # 4-column tiles are below MIN_TILE
    # MoE under TP: F = 32 / 4 = 8 per device has 8-wide tiles; expert parallel keeps F = 32.
    ops, logged = _select(monkeypatch, caplog, qwen3_next_tiny(**moe32), tp=4)
    assert logged == {"moe_experts"} and ops.moe_experts is REFERENCE.moe_experts
    _, logged = _select(monkeypatch, caplog, qwen3_next_tiny(**moe32), tp=4, expert_parallel=True)
    assert not logged


def test_kimi_linear_odd_dims_take_the_reference_ops_on_gpu(monkeypatch, caplog):
    ops, logged = _select(monkeypatch, caplog, kimi_linear_tiny(moe_intermediate_size=32))
    assert not logged and not _replaced(ops)
    cfg = kimi_linear_tiny(
        moe_intermediate_size=32,
        linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2,
                            "head_dim": 24, "short_conv_kernel_size": 4},
        kv_lora_rank=24,
    )  # fmt: skip
    ops, logged = _select(monkeypatch, caplog, cfg)
    kda = {"kda_prefill", "kda_decode", "conv_kda_decode", "kda_multi_decode"}
    assert _replaced(ops) == logged == kda | {"mla_prefill", "mla_decode"}


def test_gdn_gpu_kernels_lower_to_triton_with_clamped_value_tiles():
    """Dv = 24 (not a power of two): every Triton tensor of the kernels must still be one, or
    the Pallas Triton lowering raises; Dk = 24 does raise."""
    sd = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    hk, hv, dk, dv, n, rows = 1, 2, 16, 24, 64, 2
    gates = [sd((hv,), f32)] * 2
    slots = abstract_slots(rows, 1)
    pool = sd((4, hv, dv, dk), f32)
    prefill = [sd((n, hk, dk), f32)] * 2 + [sd((n, hv, dv), f32)] + [sd((n, hv), f32)] * 2
    decode = [sd((rows, hk, dk), f32)] * 2 + [sd((rows, hv, dv), f32)] + [sd((rows, hv), f32)] * 2
    c = 2 * hk * dk + hv * dv
    calls = [
        (functools.partial(gdn_gpu.gdn_prefill, three_launches=three),
         (*prefill, *gates, pool, sd((rows + 1,), i32), slots)) for three in (False, True)
    ] + [
        (gdn_gpu.gdn_decode, (*decode, *gates, pool, slots)),
    ] + [
        (functools.partial(fn, num_k_heads=hk),
         (sd((rows, c), f32), sd((c, 4), f32), sd((4, 3, c), f32), sd((rows, hv), f32),
          sd((rows, hv), f32), *gates, pool, slots))
        for fn in (functools.partial(fused_decode.conv_gdn_decode, min_rows=0),
                   hyjax.ops.GRID["conv_gdn_decode"].cell("gpu", hyjax.ops._compiled))  # engine
    ]  # fmt: skip
    for fn, args in calls:
        assert "triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert gdn_gpu.unsupported_reason(dk, dv) is None
    assert "key head dim 24" in gdn_gpu.unsupported_reason(24, dv)


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in ``jaxpr`` and its sub-jaxprs (kernels included)."""
    out = [e.params["precision"] for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        out += _dot_precisions(sub)
    return out


IEEE = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def test_gpu_gdn_prefill_dots_follow_the_step_precision():
    """The GPU prefill pins no precision: IEEE under "highest" (float32 serving), the Triton
    default (TF32 for f32 operands) otherwise."""
    sd = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    hk, hv, d, n, rows = 1, 1, 16, 64, 1
    args = (
        *[sd((n, hk, d), f32)] * 2, sd((n, hv, d), f32), *[sd((n, hv), f32)] * 2,
        *[sd((hv,), f32)] * 2, sd((2, hv, d, d), f32), sd((rows + 1,), i32),
        abstract_slots(rows, 1),
    )  # fmt: skip
    with jax.default_matmul_precision(matmul_precision(jnp.float32)):
        ieee = _dot_precisions(jax.make_jaxpr(GPU_GDN_PREFILL)(*args).jaxpr)
    default = _dot_precisions(jax.make_jaxpr(GPU_GDN_PREFILL)(*args).jaxpr)
    assert ieee and all(p == IEEE for p in ieee)
    assert default and all(p is None for p in default)


@pytest.fixture(scope="module")
def tiny_model():
    from hyjax.testing import _numpy_init

    cfg = qwen3_next_tiny()
    return _numpy_init(Qwen3NextForCausalLM, cfg, 0), cfg


@pytest.mark.parametrize("allow_tf32", [False, True], ids=["ieee", "tf32"])
def test_float32_step_traces_ieee_matmuls_unless_tf32_allowed(tiny_model, allow_tf32):
    model, cfg = tiny_model
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    memory = size_pools(cfg, sched, model.dtype, cache_bytes=2**22, num_checkpoint_slots=2)
    runner = ModelRunner(model, cfg, sched, memory=memory, kernel_backend="reference",
                         allow_tf32=allow_tf32)  # fmt: skip
    shape = sched.step_shapes()[-1]
    precisions = _dot_precisions(_step.trace(*runner.step_args(StepPlan.empty(shape))).jaxpr.jaxpr)
    assert len(precisions) > 10  # the projections, lm_head, the reference recurrences
    if allow_tf32:
        assert None in precisions  # the projections keep the platform default
    else:
        assert all(p == IEEE for p in precisions), set(precisions)
    assert matmul_precision(jnp.bfloat16) is None  # 16-bit models are unaffected


def test_allow_tf32_flag_reaches_engine_args():
    p = build_parser()
    ns = p.parse_args(["generate", "--prompt", "x", "--allow-tf32"])
    assert EngineArgs(**engine_kwargs(ns)).allow_tf32 is True
    ns = p.parse_args(["serve"])
    assert EngineArgs(**engine_kwargs(ns)).allow_tf32 is False


def test_cli_kernel_backends_are_table_backends():
    """Every ``--kernel-backend`` choice is ``auto`` or a backend of the op table."""
    choices = EngineArgs.__dataclass_fields__["kernel_backend"].metadata["argparse"]["choices"]
    assert set(choices) - {"auto"} <= set(hyjax.ops.BACKENDS)
    for name in choices:
        hyjax.ops.resolve_backend(name)
