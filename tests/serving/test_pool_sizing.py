"""Pool sizing from a model's config and the flags, before any weights exist (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyjax.cache import cache_spec, kv_block_bytes, state_slot_bytes
from hyjax.models.qwen3_next.config import qwen3_next_80b_a3b
from hyjax.tiny import tiny_config
from serving.core.config import SchedulerConfig
from serving.worker.pool_sizing import size_pools

CFG = tiny_config(vocab_size=300)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


def test_cpu_default_holds_every_sequence_at_full_length_and_four_checkpoints_each():
    mem = size_pools(CFG, SCHED, jnp.float32)
    assert mem.num_checkpoint_slots == 4 * 4
    assert mem.num_state_slots == 1 + 4 + 16  # NULL, running, checkpoints
    # 1.25 x 4 sequences x 16 blocks of 16 tokens, the null block on top.
    assert mem.num_kv_blocks == 1 + int(1.25 * 4 * 16)
    assert mem.kv_block_bytes == kv_block_bytes(CFG, 16, jnp.float32)


def test_a_budget_is_split_with_a_tenth_for_checkpoints():
    slot = state_slot_bytes(CFG, jnp.bfloat16)
    budget = 200 * slot
    mem = size_pools(CFG, SCHED, jnp.bfloat16, cache_bytes=budget)
    assert mem.num_checkpoint_slots == 20
    assert mem.kv_bytes + mem.state_bytes <= budget
    assert mem.state_slot_bytes == slot


def test_a_budget_too_small_for_one_request_names_it():
    with pytest.raises(ValueError, match="max_model_len"):
        size_pools(CFG, SCHED, jnp.float32, cache_bytes=4096, num_checkpoint_slots=0)


def _split_slot_bytes(cfg, dtype, state_dtype):
    """(conv window bytes, recurrent state bytes) of one slot, summed over the layers."""
    spec = cache_spec(cfg)
    layers = spec.num_linear_layers
    conv = int(np.prod(spec.conv_shape)) * jnp.dtype(dtype).itemsize * layers
    ssm = int(np.prod(spec.ssm_shape)) * jnp.dtype(state_dtype).itemsize * layers
    return conv, ssm


@pytest.mark.parametrize("cfg", [CFG, qwen3_next_80b_a3b()], ids=["tiny", "qwen3_next_80b"])
def test_bf16_states_halve_the_state_bytes_of_a_slot(cfg):
    """``--state-dtype bfloat16``: the recurrent states take half; the conv windows stay in
    the model's dtype. At real shapes the states are nearly all of a slot (Qwen3-Next-80B:
    98 %), so a budget holds 1.96 times the slots."""
    conv, ssm = _split_slot_bytes(cfg, jnp.bfloat16, jnp.float32)
    assert state_slot_bytes(cfg, jnp.bfloat16) == conv + ssm
    assert state_slot_bytes(cfg, jnp.bfloat16, jnp.bfloat16) == conv + ssm // 2
    if cfg is not CFG:
        assert state_slot_bytes(cfg, jnp.bfloat16, jnp.bfloat16) < 0.52 * (conv + ssm)


def test_bf16_states_fit_more_checkpoints_in_the_same_budget():
    f32 = state_slot_bytes(CFG, jnp.bfloat16)
    bf16 = state_slot_bytes(CFG, jnp.bfloat16, jnp.bfloat16)
    budget = 400 * f32
    mem32 = size_pools(CFG, SCHED, jnp.bfloat16, cache_bytes=budget)
    mem16 = size_pools(CFG, SCHED, jnp.bfloat16, cache_bytes=budget, state_dtype="bfloat16")
    assert (mem32.state_slot_bytes, mem16.state_slot_bytes) == (f32, bf16)
    # A tenth of the budget for checkpoints: as many more as the slot is smaller.
    assert mem32.num_checkpoint_slots == 40
    assert mem16.num_checkpoint_slots == budget // 10 // bf16 > 40 * f32 // bf16 - 1
    assert mem16.kv_bytes + mem16.state_bytes <= budget
    # The CPU default sizes the same slots in fewer bytes.
    assert size_pools(CFG, SCHED, jnp.float32, state_dtype="bfloat16").state_slot_bytes == (
        state_slot_bytes(CFG, jnp.float32, jnp.bfloat16)
    )


def test_accelerator_default_leaves_the_sampler_token_tables_free(monkeypatch):
    """On an accelerator the pools get 90 % of the free memory less the sampler's token tables
    (allocated beside the pools, 10 bytes a row and vocabulary entry), and size_pools reserves
    them for this config's rows and vocabulary."""
    from serving.worker import pool_sizing
    from serving.worker.sampler import init_token_tables, token_table_bytes

    class Device:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 10_000_000_000, "bytes_in_use": 0}

    for rows, vocab in [(2, 300), (3, 1000)]:  # the tables' own bytes, per-row parts included
        tables = init_token_tables(rows, vocab)
        assert token_table_bytes(rows, vocab) == sum(x.nbytes for x in tables.values())
    got = pool_sizing.default_cache_bytes(SCHED, 1, 1, None, [Device()], reserved=12345)
    assert got == 9_000_000_000 - 12345
    seen = {}

    def fake(*args, reserved=0):
        seen["reserved"] = reserved
        return 10**8

    monkeypatch.setattr(pool_sizing, "default_cache_bytes", fake)
    pool_sizing.size_pools(CFG, SCHED, jnp.float32)
    assert seen["reserved"] == token_table_bytes(SCHED.max_num_seqs, CFG.vocab_size)


def test_an_accelerator_without_a_memory_limit_is_named(caplog):
    """XLA's VMM allocator (the command-buffer update modes) reports no ``bytes_limit``: the
    pools fall back to the CPU-style size, and the log says so and names the flag."""
    from serving.worker import pool_sizing

    class Device:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_in_use": 5}

        def __str__(self):
            return "cuda:0"

    with caplog.at_level("WARNING", logger=pool_sizing.__name__):
        got = pool_sizing.default_cache_bytes(SCHED, 1, 1, None, [Device()])
    assert got > 0
    (record,) = [r for r in caplog.records if "no memory limit" in r.getMessage()]
    assert "cuda:0" in record.getMessage() and "--cache-bytes" in record.getMessage()
    assert "bytes_in_use" in record.getMessage()


def test_a_model_without_attention_layers_is_named():
    """A linear-attention-only model (the 80B's first layer alone) has no KV block to size:
    a clear error, not a division by zero."""
    from benchmarks.common import bench_config

    cfg = bench_config(1, 16)
    assert cfg.cache_spec.num_attention_layers == 0
    with pytest.raises(ValueError, match="1 layers has no attention layer"):
        size_pools(cfg, SCHED, jnp.float32)


def test_an_allocator_without_stats_takes_the_cuda_drivers_free_bytes(monkeypatch, caplog):
    """XLA's VMM allocator returns no stats at all (``memory_stats()`` is None): the pools
    get 90 % of what the CUDA driver reports free, and nothing is warned."""
    from serving.worker import pool_sizing

    class Device:
        platform = "gpu"

        def memory_stats(self):
            return None

    monkeypatch.setattr(pool_sizing, "cuda_free_bytes", lambda d: 2_000_000_000)
    with caplog.at_level("WARNING", logger=pool_sizing.__name__):
        got = pool_sizing.default_cache_bytes(SCHED, 1, 1, None, [Device()], reserved=10)
    assert got == 1_800_000_000 - 10
    assert not caplog.records


class _FakeDriver:
    """``libcuda``'s five calls: records them, answers ``free`` bytes for ordinal 3 only."""

    def __init__(self, free: int):
        self.free, self.calls = free, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuDeviceGet":
                args[0]._obj.value = 7 if args[1] == 3 else -1
                return 0 if args[1] == 3 else 101  # CUDA_ERROR_INVALID_DEVICE
            if name == "cuMemGetInfo_v2":
                args[0]._obj.value, args[1]._obj.value = self.free, 2 * self.free
            return 0

        return call


def test_the_driver_reads_free_bytes_in_the_devices_primary_context(monkeypatch):
    """The ordinal is the device's local hardware id; the context is pushed, popped and
    released around the query; an unknown ordinal gives None; CPU devices and devices without
    an id never reach the driver."""
    from serving.worker import cuda_memory

    fake = _FakeDriver(123_456)
    monkeypatch.setattr(cuda_memory, "_driver", lambda: fake)

    class Gpu:
        platform = "gpu"

        def __init__(self, hid):
            self.local_hardware_id = hid

    assert cuda_memory.cuda_free_bytes(Gpu(3)) == 123_456
    assert fake.calls == [
        "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuMemGetInfo_v2",
        "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2",
    ]  # fmt: skip
    assert cuda_memory.cuda_free_bytes(Gpu(0)) is None
    fake.calls.clear()
    assert cuda_memory.cuda_free_bytes(jax.devices("cpu")[0]) is None

    class NoId:
        platform = "gpu"

    assert cuda_memory.cuda_free_bytes(NoId()) is None
    assert fake.calls == []
