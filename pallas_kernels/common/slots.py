"""The slot contract of every recurrent kernel (DESIGN.md §3) as one argument.

Per row (sequence) of a ragged step::

    src_slot      the slot its initial state is read from; 0 = a zero state, nothing read
    dst_slot      the slot its final state is written to;  0 = not written (padding)
    ckpt_offsets  up to M checkpoint writes: the state after ckpt_offsets[s, j] of the step's
    ckpt_slots    tokens goes to ckpt_slots[s, j] (slot 0 = no write)
    num_seqs      rows >= num_seqs are padding: nothing read, nothing written, output 0

The GDN, KDA and conv1d ops (reference and kernels alike) take a :class:`StateSlots`; under
tensor parallel it is replicated (one ``P()`` spec for the whole pytree), since every device
holds the same slots of its own pool shard.

The recurrent-state pool is float32 or bfloat16 (``--state-dtype``): the GDN / KDA ops compute
in float32 whatever the pool holds; a slot is read into float32 and written back rounded to
the pool's dtype (:func:`check_state_dtype`). A prefill also rounds the state it carries after
every :data:`ROUND_EVERY` tokens of a row, stored or not: the rounding points are then the same
however the scheduler chunks a prompt or where a prefix cache hit resumes it (a row starts on
a multiple of the checkpoint granularity, itself a multiple of 64), so with a bf16 pool the
tokens still do not depend on the chunking or on prefix caching (a float32 pool rounds
nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The recurrent-state pool dtypes every GDN / KDA op takes (the conv windows stay in the
# activations' dtype).
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# A prefill rounds its carried state to a bf16 pool's dtype after every this many tokens of a
# row: the kernels' chunk (16 or 64) divides it, so it falls on a chunk end.
ROUND_EVERY = 64


def check_state_dtype(state: jax.Array) -> None:
    """Raises ``ValueError`` unless ``state`` is a pool of one of :data:`STATE_DTYPES`."""
    if state.dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state.dtype} must be float32 or bfloat16")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateSlots:
    src_slot: jax.Array  # i32[S]
    dst_slot: jax.Array  # i32[S]
    ckpt_offsets: jax.Array  # i32[S, M]  decode: only offset 1 (after the one token) is meaningful
    ckpt_slots: jax.Array  # i32[S, M]
    num_seqs: jax.Array  # i32[]

    @property
    def num_rows(self) -> int:
        return self.src_slot.shape[0]

    def check(self, query_start_loc: jax.Array | None = None) -> None:
        """Raises ``ValueError`` naming the first array whose shape breaks the contract."""
        rows = self.num_rows
        if self.src_slot.shape != (rows,) or self.dst_slot.shape != (rows,):
            raise ValueError(
                f"src_slot {self.src_slot.shape} and dst_slot {self.dst_slot.shape} must be [S]"
            )
        if self.ckpt_offsets.ndim != 2 or self.ckpt_offsets.shape[0] != rows:
            raise ValueError(f"ckpt_offsets {self.ckpt_offsets.shape} must be [S={rows}, M]")
        if self.ckpt_slots.shape != self.ckpt_offsets.shape:
            raise ValueError(
                f"ckpt_slots {self.ckpt_slots.shape} must match "
                f"ckpt_offsets {self.ckpt_offsets.shape}"
            )
        if getattr(self.num_seqs, "shape", ()) != ():
            raise ValueError(f"num_seqs {self.num_seqs.shape} must be a scalar")
        if query_start_loc is not None and query_start_loc.shape != (rows + 1,):
            raise ValueError(f"query_start_loc {query_start_loc.shape} must be [S+1 = {rows + 1}]")

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """The five arrays in int32 as a kernel launch takes them, ``num_seqs`` as ``i32[1]``."""
        i32 = jnp.int32
        return (
            self.src_slot.astype(i32),
            self.dst_slot.astype(i32),
            self.ckpt_offsets.astype(i32),
            self.ckpt_slots.astype(i32),
            jnp.asarray(self.num_seqs, i32).reshape(1),
        )

    def flat(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """:meth:`arrays` with the checkpoint pairs flattened to ``i32[S * M]`` (pair ``m`` of
        row ``s`` at ``s * M + m``), as a TPU kernel's scalar prefetch (SMEM) takes them."""
        src, dst, ckpt_offsets, ckpt_slots, num_seqs = self.arrays()
        return src, dst, ckpt_offsets.reshape(-1), ckpt_slots.reshape(-1), num_seqs
