"""Splits the cache memory between the KV block pool and the state slot pool.

Pure arithmetic on byte counts (the runner measures them from the model's shapes)::

    total bytes
    |-- state pool: (1 NULL + max_num_seqs running + C checkpoint slots) * state_slot_bytes
    |-- KV pool:    (1 null + K blocks) * kv_block_bytes          <- everything left

C comes from the checkpoint budget: a number of slots, or a fraction of the total bytes.
"""

from __future__ import annotations

import dataclasses

from serving.config import CacheConfig


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Pool sizes learned at start-up (ids 0 included) and what they cost."""

    num_kv_blocks: int  # null block included
    num_state_slots: int  # NULL slot and running slots included
    num_checkpoint_slots: int
    kv_block_bytes: int
    state_slot_bytes: int
    block_size: int
    total_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_slot_bytes

    @property
    def kv_token_capacity(self) -> int:
        """Tokens the KV pool holds (null block excluded)."""
        return (self.num_kv_blocks - 1) * self.block_size

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.num_kv_blocks, self.num_state_slots)

    def describe(self) -> str:
        """One log line per pool."""
        gib = 1 << 30
        running = self.num_state_slots - 1 - self.num_checkpoint_slots
        return (
            f"KV cache: {self.num_kv_blocks - 1} blocks x {self.block_size} tokens "
            f"= {self.kv_token_capacity} tokens, {self.kv_bytes / gib:.2f} GiB "
            f"({self.kv_block_bytes} B/block)\n"
            f"state cache: {self.num_state_slots - 1} slots = {running} running + "
            f"{self.num_checkpoint_slots} checkpoints, {self.state_bytes / gib:.2f} GiB "
            f"({self.state_slot_bytes} B/slot)\n"
            f"used {(self.kv_bytes + self.state_bytes) / gib:.2f} of "
            f"{self.total_bytes / gib:.2f} GiB"
        )


def plan_memory(
    total_bytes: int,
    *,
    kv_block_bytes: int,
    state_slot_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    checkpoint_fraction: float = 0.1,
    num_checkpoint_slots: int | None = None,
) -> MemoryPlan:
    """Sizes both pools. Pure; raises ValueError when memory cannot serve one full request.

    Args:
      total_bytes: device bytes available to the caches.
      kv_block_bytes: one KV block of every full-attention layer (K and V).
      state_slot_bytes: one state slot of every linear-attention layer (conv window plus
        recurrent state).
      block_size: tokens per KV block.
      max_num_seqs: running requests, one running slot each.
      max_model_len: the KV pool must hold at least one request of this length.
      checkpoint_fraction: share of ``total_bytes`` for checkpoint slots (ignored when
        ``num_checkpoint_slots`` is given).
      num_checkpoint_slots: an exact number of checkpoint slots.
    """
    for name, v in [
        ("total_bytes", total_bytes),
        ("kv_block_bytes", kv_block_bytes),
        ("state_slot_bytes", state_slot_bytes),
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
    ]:
        if v < 1:
            raise ValueError(f"{name}={v} must be positive")
    if num_checkpoint_slots is None:
        if not 0 <= checkpoint_fraction < 1:
            raise ValueError(f"checkpoint_fraction={checkpoint_fraction} must be in [0, 1)")
        num_checkpoint_slots = int(total_bytes * checkpoint_fraction) // state_slot_bytes
    elif num_checkpoint_slots < 0:
        raise ValueError(f"num_checkpoint_slots={num_checkpoint_slots} must be >= 0")

    gib = 1 << 30
    running_bytes = (1 + max_num_seqs) * state_slot_bytes
    min_blocks = 1 + -(-max_model_len // block_size)
    min_kv_bytes = min_blocks * kv_block_bytes
    if running_bytes + min_kv_bytes > total_bytes:
        raise ValueError(
            f"{total_bytes / gib:.2f} GiB cannot hold {max_num_seqs=} running states "
            f"({running_bytes / gib:.2f} GiB) plus the KV cache of one request of "
            f"{max_model_len=} ({min_kv_bytes / gib:.2f} GiB): lower max_num_seqs or "
            "max_model_len, or free more device memory"
        )
    ckpt_bytes = num_checkpoint_slots * state_slot_bytes
    if running_bytes + ckpt_bytes + min_kv_bytes > total_bytes:
        raise ValueError(
            f"the checkpoint budget of {num_checkpoint_slots} slots ({ckpt_bytes / gib:.2f} GiB) "
            f"leaves less than one request of {max_model_len=} in the KV cache: "
            "lower the checkpoint budget"
        )
    num_kv_blocks = (total_bytes - running_bytes - ckpt_bytes) // kv_block_bytes
    return MemoryPlan(
        num_kv_blocks=num_kv_blocks,
        num_state_slots=1 + max_num_seqs + num_checkpoint_slots,
        num_checkpoint_slots=num_checkpoint_slots,
        kv_block_bytes=kv_block_bytes,
        state_slot_bytes=state_slot_bytes,
        block_size=block_size,
        total_bytes=total_bytes,
    )
