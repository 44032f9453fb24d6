"""What one forward pass of a model reads: a flat ragged batch on the paged and slotted caches.

Field names match :class:`serving.core.plan.StepPlan` (DESIGN.md §5), so the runner builds a
``Batch`` straight from the plan's arrays. ``decode_only`` is static (part of the bucket), and
so is ``max_row_tokens``: a pytree metadata field, part of the batch's tree structure, which
a verify-shaped step sets (every row at most that many tokens: the k-token decode kernels).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common.slots import StateSlots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]
    query_start_loc: jax.Array  # i32[S+1]
    seq_lens: jax.Array  # i32[S]
    num_seqs: jax.Array  # i32[]
    block_tables: jax.Array  # i32[S, max_blocks]
    src_slot: jax.Array  # i32[S]
    dst_slot: jax.Array  # i32[S]
    ckpt_offsets: jax.Array  # i32[S, max_ckpt]
    ckpt_slots: jax.Array  # i32[S, max_ckpt]
    logits_indices: jax.Array  # i32[S]
    # Static: every live row has at most this many tokens (a verify step, K + 1); 0: no bound.
    max_row_tokens: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def slots(self) -> StateSlots:
        """The linear-attention layers' slot arguments (DESIGN.md §3) as one pytree."""
        return StateSlots(
            self.src_slot, self.dst_slot, self.ckpt_offsets, self.ckpt_slots, self.num_seqs
        )

    @classmethod
    def from_arrays(
        cls, arrays: dict[str, np.ndarray | jax.Array], *, max_row_tokens: int = 0
    ) -> Batch:
        """Picks this batch's fields out of a larger dict (e.g. a plan with sampling fields)."""
        fields = (f.name for f in dataclasses.fields(cls) if not f.metadata.get("static"))
        return cls(**{n: jnp.asarray(arrays[n]) for n in fields}, max_row_tokens=max_row_tokens)
