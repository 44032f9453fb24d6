"""Splits the cache memory between the KV block pool and the state slot pool.

Pure arithmetic on byte counts (the runner measures them from the model's shapes)::

    total bytes
    |-- state pool: (1 NULL + max_num_seqs running + C checkpoint slots) * state_slot_bytes
    |-- KV pool:    (1 null + K blocks) * kv_block_bytes          <- everything left

C comes from the checkpoint budget: a number of slots, or a fraction of the total bytes.
Either pool may be capped in entries (``max_kv_blocks``, ``max_state_slots``: one pool array
must stay below 2**31 elements for the GPU kernels' 32-bit offsets, see
:func:`hyjax.cache.pool_limits`); bytes a cap leaves over stay free and the plan says so.
"""

from __future__ import annotations

import dataclasses

from serving.core.config import CacheConfig


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
    capped: str = ""  # what a pool cap cut (empty: nothing), for the log

    @property
    def unused_bytes(self) -> int:
        return self.total_bytes - self.kv_bytes - self.state_bytes

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
        cap = (
            f"\n{self.capped}: {self.unused_bytes / gib:.2f} GiB left unused" if self.capped else ""
        )
        return (
            f"KV cache: {self.num_kv_blocks - 1} blocks x {self.block_size} tokens "
            f"= {self.kv_token_capacity} tokens, {self.kv_bytes / gib:.2f} GiB "
            f"({self.kv_block_bytes} B/block)\n"
            f"state cache: {self.num_state_slots - 1} slots = {running} running + "
            f"{self.num_checkpoint_slots} checkpoints, {self.state_bytes / gib:.2f} GiB "
            f"({self.state_slot_bytes} B/slot)\n"
            f"used {(self.kv_bytes + self.state_bytes) / gib:.2f} of "
            f"{self.total_bytes / gib:.2f} GiB" + cap
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
    max_kv_blocks: int | None = None,
    max_state_slots: int | None = None,
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
      max_kv_blocks: at most this many KV blocks (null included), whatever the memory.
      max_state_slots: at most this many state slots (NULL included); a checkpoint budget
        given as a fraction shrinks to fit, an exact one past it is an error.
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
    explicit_checkpoints = num_checkpoint_slots is not None
    if num_checkpoint_slots is None:
        if not 0 <= checkpoint_fraction < 1:
            raise ValueError(f"checkpoint_fraction={checkpoint_fraction} must be in [0, 1)")
        num_checkpoint_slots = int(total_bytes * checkpoint_fraction) // state_slot_bytes
    elif num_checkpoint_slots < 0:
        raise ValueError(f"num_checkpoint_slots={num_checkpoint_slots} must be >= 0")

    gib = 1 << 30
    capped = []
    min_blocks = 1 + -(-max_model_len // block_size)
    if max_state_slots is not None:
        if 1 + max_num_seqs > max_state_slots:
            raise ValueError(
                f"{max_num_seqs=} running states need {1 + max_num_seqs} state slots; one "
                f"state pool array holds at most {max_state_slots} (2**31 elements): lower "
                "max_num_seqs or split the state heads over more devices"
            )
        room = max_state_slots - 1 - max_num_seqs
        if num_checkpoint_slots > room:
            if explicit_checkpoints:
                raise ValueError(
                    f"the checkpoint budget of {num_checkpoint_slots} slots passes the state "
                    f"pool's cap of {max_state_slots} slots (2**31 elements per array): lower "
                    "the checkpoint budget"
                )
            capped.append(f"checkpoint slots capped at {room} (2**31 elements per pool array)")
            num_checkpoint_slots = room
    if max_kv_blocks is not None and min_blocks > max_kv_blocks:
        raise ValueError(
            f"{max_model_len=} needs {min_blocks} KV blocks; one KV pool array holds at most "
            f"{max_kv_blocks} (2**31 elements): lower max_model_len or split the kv heads over "
            "more devices"
        )
    running_bytes = (1 + max_num_seqs) * state_slot_bytes
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
    if max_kv_blocks is not None and num_kv_blocks > max_kv_blocks:
        capped.append(f"KV pool capped at {max_kv_blocks} blocks (2**31 elements per pool array)")
        num_kv_blocks = max_kv_blocks
    return MemoryPlan(
        num_kv_blocks=num_kv_blocks,
        num_state_slots=1 + max_num_seqs + num_checkpoint_slots,
        num_checkpoint_slots=num_checkpoint_slots,
        kv_block_bytes=kv_block_bytes,
        state_slot_bytes=state_slot_bytes,
        block_size=block_size,
        total_bytes=total_bytes,
        capped="; ".join(capped),
    )
