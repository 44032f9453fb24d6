"""How large the pools are: the bytes one KV block and one state slot take for a model, the
budget (free device memory, or on CPU what the flags need), and the split between the two
pools (:func:`serving.core.memory_planner.plan_memory`). The engine calls :func:`size_pools` before
it builds the runner, which then allocates what the plan says.

Needs a model's config and dtype, never its weights.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from hyjax.cache import kv_block_bytes, pool_limits, state_slot_bytes
from hyjax.config import ModelConfig
from hyjax.sharding import ShardingPlan
from serving.core.config import SchedulerConfig
from serving.core.memory_planner import MemoryPlan, plan_memory
from serving.worker.cuda_memory import cuda_free_bytes
from serving.worker.sampler import token_table_bytes

log = logging.getLogger(__name__)


def size_pools(
    cfg: ModelConfig,
    sched_cfg: SchedulerConfig,
    dtype: jnp.dtype,
    *,
    cache_bytes: int | None = None,
    num_checkpoint_slots: int | None = None,
    sharding: ShardingPlan | None = None,
    state_dtype: str | jnp.dtype = "float32",
    mtp_layers: int = 0,
) -> MemoryPlan:
    """The pool sizes for ``cfg`` in ``dtype`` under ``sched_cfg``'s flags.

    Args:
      cache_bytes: bytes for both pools (per device under ``sharding``); ``None`` asks the
        device (90 % of what is free) or, on CPU, sizes the pools for ``max_num_seqs``
        full-length requests plus a quarter for cached prefixes.
      num_checkpoint_slots: state slots kept for checkpoints; ``None``: a tenth of the memory,
        or four a sequence on CPU without ``cache_bytes``.
      sharding: tensor / expert parallel plan: the pools are split by head, and the bytes are
        a device's share.
      state_dtype: the recurrent states' dtype (``--state-dtype``): bfloat16 halves their
        bytes, so about twice the slots fit the same budget.
      mtp_layers: the MTP drafter's layers (``--speculative-config`` method ``mtp``): each
        keeps a KV pool of the target's block geometry, one more attention layer a block.

    In a multi-process job every process must call this (it is a collective): all size their
    pools from the smallest budget and the fewest checkpoint slots any of them planned.
    """
    if sharding is not None:
        assert not mtp_layers, "the MTP drafter with tensor parallelism"
        kv_bytes, slot_bytes = sharding.pool_bytes(sched_cfg.block_size, dtype, state_dtype)
        kv_split, slot_split = sharding.pool_splits()
        max_blocks, max_slots = pool_limits(
            sharding.cache_config(), sched_cfg.block_size, kv_split=kv_split, slot_split=slot_split
        )
    else:
        kv_bytes = kv_block_bytes(cfg, sched_cfg.block_size, dtype)
        num_attention = cfg.cache_spec.num_attention_layers
        if not num_attention:  # the prefix cache is keyed by KV blocks
            raise ValueError(
                f"{cfg.model_type} with {cfg.num_hidden_layers} layers has no attention layer: "
                "the engine's pools need at least one (its KV blocks key the prefix cache)"
            )
        kv_bytes += kv_bytes // num_attention * mtp_layers
        slot_bytes = state_slot_bytes(cfg, dtype, state_dtype)
        max_blocks, max_slots = pool_limits(cfg, sched_cfg.block_size)
    if cache_bytes is None:
        devices = list(sharding.mesh.devices.flat) if sharding else jax.local_devices()[:1]
        # This process measures its own devices only (another host's have no stats here).
        devices = [d for d in devices if d.process_index == jax.process_index()]
        cache_bytes = default_cache_bytes(
            sched_cfg, kv_bytes, slot_bytes, num_checkpoint_slots, devices,
            reserved=token_table_bytes(sched_cfg.max_num_seqs, cfg.vocab_size),
        )  # fmt: skip
        if jax.devices()[0].platform == "cpu":  # the verify rows' slots (below) on top
            spec_slots = sched_cfg.num_speculative_tokens * sched_cfg.max_num_seqs
            cache_bytes += spec_slots * slot_bytes
        if jax.devices()[0].platform == "cpu" and num_checkpoint_slots is None:
            num_checkpoint_slots = 4 * sched_cfg.max_num_seqs
    if num_checkpoint_slots is not None and sched_cfg.num_speculative_tokens:
        # Verify rows take their per-token states (K a running request, for one step) from
        # the slots beyond the running ones: K a sequence more, so checkpoints keep theirs.
        num_checkpoint_slots += sched_cfg.num_speculative_tokens * sched_cfg.max_num_seqs
    if jax.process_count() > 1:
        from serving.worker.distributed import smallest_cache_bytes

        cache_bytes = smallest_cache_bytes(cache_bytes)
    plan = functools.partial(
        plan_memory,
        cache_bytes,
        kv_block_bytes=kv_bytes,
        state_slot_bytes=slot_bytes,
        block_size=sched_cfg.block_size,
        max_num_seqs=sched_cfg.max_num_seqs,
        max_model_len=sched_cfg.max_model_len,
        max_kv_blocks=max_blocks,
        max_state_slots=max_slots,
    )
    memory = plan(num_checkpoint_slots=num_checkpoint_slots)
    if jax.process_count() > 1:
        # The same budget, but defaults may still differ by process (flags given to one): all
        # take the fewest checkpoint slots, which fits every plan's state cap.
        from serving.worker.distributed import fewest_checkpoint_slots

        fewest = fewest_checkpoint_slots(memory.num_checkpoint_slots)
        if fewest != memory.num_checkpoint_slots:
            memory = plan(num_checkpoint_slots=fewest)
    return memory


def default_cache_bytes(
    sched_cfg: SchedulerConfig,
    kv_bytes: int,
    slot_bytes: int,
    num_checkpoint_slots: int | None,
    devices: list,
    *,
    reserved: int = 0,
) -> int:
    """Bytes for the pools on each of ``devices``: on accelerators 90 % of the least free
    memory (the allocator's limit less its use, or the CUDA driver's free bytes where the
    allocator reports no limit), less ``reserved`` (what the runner allocates beside the
    pools: the sampler's token tables)."""
    free = []
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        elif (driver_free := cuda_free_bytes(device)) is not None:
            # XLA's VMM allocator (which --xla_gpu_command_buffer_update_mode=SKIP_TEMP
            # switches to) reports no statistics: ask the CUDA driver
            log.info("%s: no allocator limit; %.1f GB free per the CUDA driver", device,
                     driver_free / 1e9)  # fmt: skip
            free.append(driver_free)
        elif device.platform != "cpu":
            # no limit and no driver to ask: the pools get the small CPU-style size below
            log.warning(
                "%s reports no memory limit (its allocator's stats: %s): the KV and state pools "
                "are sized for the running sequences only, with little room for cached "
                "prefixes; set the pools' size with --cache-bytes",
                device, sorted(stats or ()),
            )  # fmt: skip
    if free:
        return int(min(free) * 0.9) - reserved
    # CPU: every sequence at full length plus 25 % for cached prefixes, the running slots, and
    # the checkpoint slots (given, or four per sequence).
    ckpt = num_checkpoint_slots if num_checkpoint_slots is not None else 4 * sched_cfg.max_num_seqs
    blocks = 1.25 * sched_cfg.max_num_seqs * sched_cfg.max_blocks + 1
    return int(blocks * kv_bytes + (sched_cfg.max_num_seqs + 1 + ckpt) * slot_bytes)
