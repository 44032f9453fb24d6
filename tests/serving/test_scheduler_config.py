"""SchedulerConfig / CacheConfig validation and derived values; the memory planner; the
plan's arrays."""

import dataclasses

import numpy as np
import pytest

from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.memory_planner import plan_memory
from serving.core.plan import SamplingArrays, StepPlan, StepShape


@pytest.mark.parametrize(
    ("block_size", "expected"), [(16, 64), (32, 64), (64, 64), (128, 128), (48, 192)]
)
def test_default_granularity_is_lcm_of_64_and_block_size(block_size, expected):
    cfg = SchedulerConfig(block_size=block_size, max_num_batched_tokens=2048)
    assert cfg.granularity == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"checkpoint_interval": 96}, "checkpoint_interval=96", id="G-not-multiple"),
        pytest.param({"checkpoint_interval": 0}, "checkpoint_interval=0", id="G-zero"),
        pytest.param({"retention_interval": 32}, "retention_interval=32", id="R-not-multiple"),
        pytest.param({"retention_interval": -64}, "retention_interval=-64", id="R-negative"),
        pytest.param({"max_num_batched_tokens": 32}, "max_num_batched_tokens=32", id="budget<G"),
        pytest.param(
            {"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_seqs=512", id="seqs"
        ),
        pytest.param({"block_size": 0}, "block_size=0", id="block-size-zero"),
        pytest.param({"max_model_len": -1}, "max_model_len=-1", id="max-model-len"),
    ],
)
def test_invalid_scheduler_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_buckets_are_powers_of_two_with_the_cap_included():
    cfg = SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=200)
    assert cfg.token_buckets == (8, 16, 32, 64, 128, 200)
    assert cfg.seq_buckets == (1, 2, 4, 8, 16, 32, 48)
    assert cfg.max_blocks == 4096 // 16


@pytest.mark.parametrize(
    ("retention", "expected"), [(0, 4), (64, 2048 // 64 + 4), (192, -(-2048 // 192) + 4)]
)
def test_max_ckpt(retention, expected):
    assert SchedulerConfig(retention_interval=retention).max_ckpt == expected


def test_step_shape_picks_the_smallest_bucket():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100)
    assert cfg.step_shape(9, 3, False) == StepShape(16, 4, 256, 4, False, 256)
    assert cfg.step_shape(3, 3, True) == StepShape(4, 4, 256, 4, True)
    assert cfg.step_shape(100, 8, False).num_tokens == 100


@pytest.mark.parametrize("row_buckets", [True, False])
def test_step_shapes_cover_every_reachable_step(row_buckets):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, mixed_row_buckets=row_buckets)
    shapes = set(cfg.step_shapes())
    assert len(shapes) == len(cfg.step_shapes())
    for rows in range(1, 9):
        assert cfg.step_shape(rows, rows, True) in shapes
        for tokens in range(rows, 101):
            assert cfg.step_shape(tokens, rows, False) in shapes
    assert StepShape(8, 8, 256, 4, False, 256) in shapes  # 5..8 rows with 5..8 tokens
    assert not any(s.num_seqs > 8 for s in shapes if s.num_tokens == 4 and not s.decode_only)


@pytest.mark.parametrize("row_buckets", [True, False])
@pytest.mark.parametrize("k", [0, 2])
def test_min_seq_bucket_pads_small_steps_and_every_step_has_its_bucket(row_buckets, k):
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=100, mixed_row_buckets=row_buckets,
        min_seq_bucket=4, num_speculative_tokens=k, min_token_bucket=2,
    )  # fmt: skip
    shapes = cfg.step_shapes()
    assert len(set(shapes)) == len(shapes)
    assert cfg.seq_buckets == (4, 8)
    assert sorted(s.num_seqs for s in shapes if s.decode_only) == [4, 8]
    assert sorted(s.num_seqs for s in shapes if s.verify_only) == ([4, 8] if k else [])
    for rows in range(1, 9):
        assert cfg.step_shape(rows, rows, True).num_seqs == (4 if rows <= 4 else 8)
        assert cfg.step_shape(rows, rows, True) in shapes
        if k:
            verify = cfg.step_shape(rows * (k + 1), rows, False, verify=True)
            assert verify in shapes and verify.num_seqs == (4 if rows <= 4 else 8)
        for tokens in range(rows, 101):
            mixed = cfg.step_shape(tokens, rows, False)
            assert mixed in shapes and rows <= mixed.num_seqs <= mixed.num_tokens
    # a 2-token prefill step: its rows pad to the token bucket, not past it
    assert cfg.step_shape(2, 1, False).num_seqs <= cfg.step_shape(2, 1, False).num_tokens
    with pytest.raises(ValueError, match="min_seq_bucket"):
        SchedulerConfig(min_seq_bucket=0)


def test_without_mixed_row_buckets_a_token_count_is_one_bucket():
    kw = dict(max_num_seqs=32, max_num_batched_tokens=512)
    rows = SchedulerConfig(**kw, mixed_row_buckets=False)
    assert (
        rows.step_shape(9, 1, False)
        == rows.step_shape(16, 16, False)
        == StepShape(16, 16, 256, 4, False, 256)
    )
    assert rows.step_shape(300, 2, False).num_seqs == 32  # min(T, max_num_seqs)
    assert rows.step_shape(3, 3, True) == StepShape(4, 4, 256, 4, True)  # decode: as before
    # 6 decode + 7 mixed buckets, against 6 + 39 with row buckets.
    assert (len(rows.step_shapes()), len(SchedulerConfig(**kw).step_shapes())) == (13, 45)


@pytest.mark.parametrize("k", [1, 3])
def test_verify_buckets_only_with_speculation_one_per_row_bucket(k):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=100)
    assert not any(s.verify_only for s in SchedulerConfig(**kw).step_shapes())
    spec = SchedulerConfig(**kw, num_speculative_tokens=k)
    shapes = spec.step_shapes()
    verify = [s for s in shapes if s.verify_only]
    assert [(s.num_tokens, s.num_seqs) for s in verify] == [(r * (k + 1), r) for r in (1, 2, 4, 8)]
    for s in verify:  # K + 1 logits a row, no prompt scoring, the chunked kernels' marker
        assert (s.max_row_tokens, s.num_spec, s.max_prompt_logprobs) == (k + 1, k, 0)
        assert not s.decode_only
    off = SchedulerConfig(**kw, num_speculative_tokens=k, verify_buckets=False)
    assert len(off.step_shapes()) == len(shapes) - 4 and not off.verify_shapes
    # every step whose rows have at most K + 1 tokens has its bucket among them
    for rows in range(1, 9):
        for tokens in range(rows + 1, rows * (k + 1) + 1):
            assert spec.is_verify_step(-(-tokens // rows), False, False)
            assert spec.step_shape(tokens, rows, False, verify=True) in shapes
    # not verify-shaped: decode-only steps, longer rows, prompt scoring, or the flag off
    assert not spec.is_verify_step(1, True, False)
    assert not spec.is_verify_step(k + 2, False, False)
    assert not spec.is_verify_step(2, False, True)
    assert not off.is_verify_step(2, False, False)


def test_verify_bucket_tokens_are_capped_by_the_budget():
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64, num_speculative_tokens=3)
    assert cfg.step_shape(40, 20, False, verify=True) == StepShape(64, 32, 256, 7, False, 0, 3, 4)
    assert cfg.step_shape(5, 2, False, verify=True).num_tokens == 8


def test_plan_arrays_are_one_flat_namespace_and_round_trip():
    """The sampling arrays travel beside the plan's own under their own names (the packed
    buffer, the multi-host frames): no name may be both."""
    plan = StepPlan.empty(StepShape(8, 2, 4, 1, False))
    plan.sampling.seeds[:] = [2**32 - 1, 5]
    arrays = plan.arrays()
    n_plan = len(dataclasses.fields(StepPlan)) - 3  # shape, sampling, token_mask (own transfer)
    assert len(arrays) == n_plan + len(dataclasses.fields(SamplingArrays))
    back = StepPlan.from_arrays(plan.shape, arrays)
    assert back.sampling.seeds.tolist() == [2**32 - 1, 5]
    assert all(np.array_equal(back.arrays()[k], v) for k, v in arrays.items())


def test_cache_config_needs_a_real_block_and_slot():
    with pytest.raises(ValueError, match="num_kv_blocks=1"):
        CacheConfig(1, 4)
    with pytest.raises(ValueError, match="num_state_slots=1"):
        CacheConfig(4, 1)


MiB = 1 << 20


def test_memory_plan_reserves_running_slots_and_checkpoints_then_gives_kv_the_rest():
    plan = plan_memory(
        1000 * MiB,
        kv_block_bytes=MiB,
        state_slot_bytes=2 * MiB,
        block_size=16,
        max_num_seqs=10,
        max_model_len=1024,
        num_checkpoint_slots=40,
    )
    assert plan.num_state_slots == 1 + 10 + 40
    assert plan.num_kv_blocks == 1000 - 51 * 2
    assert plan.kv_bytes + plan.state_bytes <= 1000 * MiB
    assert plan.cache_config() == CacheConfig(898, 51)
    text = plan.describe()
    assert "897 blocks" in text and "10 running + 40 checkpoints" in text


def test_memory_plan_checkpoint_fraction():
    plan = plan_memory(
        1000 * MiB,
        kv_block_bytes=MiB,
        state_slot_bytes=MiB,
        block_size=16,
        max_num_seqs=10,
        max_model_len=1024,
        checkpoint_fraction=0.25,
    )
    assert plan.num_checkpoint_slots == 250
    assert plan.num_kv_blocks == 1000 - 261


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"max_num_seqs": 1000}, "max_num_seqs=1000", id="running-slots"),
        pytest.param({"max_model_len": 1 << 20}, "max_model_len=1048576", id="one-request"),
        pytest.param({"num_checkpoint_slots": 90}, "checkpoint budget", id="ckpt-budget"),
        pytest.param({"checkpoint_fraction": 1.0}, "checkpoint_fraction=1.0", id="fraction"),
    ],
)
def test_memory_plan_errors(kwargs, message):
    args = dict(
        kv_block_bytes=MiB, state_slot_bytes=MiB, block_size=16, max_num_seqs=4, max_model_len=256
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_memory(100 * MiB, **args)


def test_memory_plan_caps_each_pool_and_says_what_is_left():
    args = dict(kv_block_bytes=MiB, state_slot_bytes=MiB, block_size=16, max_model_len=256)
    plan = plan_memory(
        1000 * MiB, max_num_seqs=4, checkpoint_fraction=0.5, max_kv_blocks=300,
        max_state_slots=105, **args,
    )  # fmt: skip
    assert plan.num_kv_blocks == 300
    assert plan.num_state_slots == 105 and plan.num_checkpoint_slots == 100  # 500 wanted
    assert plan.unused_bytes == (1000 - 300 - 105) * MiB
    text = plan.describe()
    assert "KV pool capped at 300 blocks" in text and "checkpoint slots capped at 100" in text
    assert "0.58 GiB left unused" in text  # 595 MiB
    free = plan_memory(1000 * MiB, max_num_seqs=4, max_kv_blocks=10_000, **args)
    assert not free.capped and "unused" not in free.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"max_state_slots": 4}, "max_num_seqs=4 running states", id="running"),
        pytest.param(
            {"max_state_slots": 10, "num_checkpoint_slots": 6}, "state pool's cap", id="ckpt"
        ),
        pytest.param({"max_kv_blocks": 16}, "max_model_len=256 needs 17 KV blocks", id="kv"),
    ],
)
def test_memory_plan_cap_errors(kwargs, message):
    args = dict(
        kv_block_bytes=MiB, state_slot_bytes=MiB, block_size=16, max_num_seqs=4, max_model_len=256
    )
    with pytest.raises(ValueError, match=message):
        plan_memory(100 * MiB, **args, **kwargs)


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("split", [1, 2])
def test_pool_limits_bound_every_pool_array(preset, split):
    """The largest pools pool_limits allows fit the element cap; one entry more would not."""
    import jax
    import jax.numpy as jnp

    from configs import PRESETS
    from hyjax.cache import init_caches, pool_limits

    cfg, cap = PRESETS[preset](), 100_000
    blocks, slots = pool_limits(cfg, 16, kv_split=split, slot_split=split, max_elements=cap)
    for n_blocks, n_slots, fits in [(blocks, slots, True), (blocks + 1, slots + 1, False)]:
        shapes = jax.eval_shape(
            lambda n_blocks=n_blocks, n_slots=n_slots: init_caches(
                cfg, num_blocks=n_blocks, block_size=16, num_slots=n_slots, dtype=jnp.bfloat16
            )
        )
        kv = max(x.size for layer in shapes.kv for x in layer) // split
        state = max(x.size for x in shapes.conv + shapes.ssm) // split
        assert (kv <= cap) == fits and (state <= cap) == fits, (n_blocks, n_slots, kv, state)
