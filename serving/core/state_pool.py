"""The state slot pool: running slots and checkpoint slots of the linear-attention layers.

One slot holds, for every GDN layer, the conv window and the recurrent state. Slot 0 is NULL
(src 0 = zero state, dst 0 = no write). A slot is one of::

    running     private to one running request, unhashed; read and written every step
    checkpoint  the state after exactly p tokens (p % G == 0), keyed by the KV block hash of
                the prefix [0, p); shared, read-only, ref-counted, evictable in LRU order
    free        in the free queue (a free checkpoint still answers lookups until evicted)

A checkpoint is *pending* from the step that registers it until that step's ``update()``: its
kernels have not written it yet, so it must not serve a hit (the same-step rule). The step
holds a reference on it meanwhile, so it cannot be evicted before it is written.
"""

from __future__ import annotations

from serving.core.block_pool import NULL_ID, BlockPool
from serving.core.kv_hash import BlockHash


class StatePool(BlockPool):
    """``BlockPool`` over state slots, plus the pending marks of unwritten checkpoints."""

    def __init__(self, num: int) -> None:
        super().__init__(num)
        self.pending = [False] * num

    def allocate_running(self) -> int:
        """A private, unhashed slot with ref_cnt 1. Raises ValueError if none is free."""
        return self.allocate(1)[0]

    def allocate_checkpoint(self, h: BlockHash) -> int:
        """A new pending checkpoint for ``h`` with ref_cnt 1 (held by the writing step).

        ``h`` must not have an entry yet. Raises ValueError if no slot is free.
        """
        assert h not in self.table, "checkpoint already cached"
        (slot,) = self.allocate(1)
        ok = self.register(slot, h)
        assert ok
        self.pending[slot] = True
        return slot

    def lookup_ready(self, h: BlockHash) -> int | None:
        """The written checkpoint for ``h``, or None (absent or still pending)."""
        slot = self.table.get(h)
        if slot is None or self.pending[slot]:
            return None
        return slot

    def is_pending(self, slot: int) -> bool:
        return self.pending[slot]

    def mark_written(self, slots: list[int]) -> None:
        """Called at ``update()`` of the step that wrote ``slots``: they may now serve hits."""
        for s in slots:
            assert s != NULL_ID and self.pending[s] and self.ref_cnt[s] > 0, s
            self.pending[s] = False

    def check_invariants(self) -> None:
        super().check_invariants()
        for s in range(1, self.num):
            if self.pending[s]:
                assert self.ref_cnt[s] > 0 and self.hash_of[s] is not None, s
