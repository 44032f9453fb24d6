"""Pool sizing from a model's config and the flags, before any weights exist (CPU)."""

import jax.numpy as jnp
import pytest

from hyjax.cache import kv_block_bytes, state_slot_bytes
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
