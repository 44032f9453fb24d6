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

Eviction is segmented LRU. A free checkpoint that has served a hit (``mark_hit``: a shared
prefix, a conversation resumed) waits in a second, *protected* queue, evicted only when the
first one (unhashed slots, then never-hit checkpoints, LRU) is empty; the protected queue holds
at most half the pool (its least recent entry moves back to the first queue). Plain LRU lost
the prefixes that serve every request: they are hit when requests arrive and then sit unused
while the running requests' prompt-end and decode-boundary checkpoints, each unique and freed
later, churn through the pool (``benchmarks.prefix_repetition`` with 512 tokens out: the first
requests after the first wave recomputed their 4096-token prefix).
"""

from __future__ import annotations

from serving.core.block_pool import NULL_ID, BlockPool, FreeQueue
from serving.core.kv_hash import BlockHash


class StatePool(BlockPool):
    """``BlockPool`` over state slots, plus the pending marks of unwritten checkpoints."""

    def __init__(self, num: int) -> None:
        super().__init__(num)
        self.pending = [False] * num
        self.hit = [False] * num  # a checkpoint that has served a hit since it was written
        self.protected = FreeQueue(num, empty=True)
        self.max_protected = max(1, (num - 1) // 2)

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.protected)

    def _pop_free(self) -> int:
        return (self.free_queue if len(self.free_queue) else self.protected).pop_head()

    def _unfree(self, i: int) -> None:
        (self.protected if i in self.protected else self.free_queue).remove(i)

    def _push_freed(self, i: int) -> None:
        if not (self.hit[i] and self.hash_of[i] is not None):
            super()._push_freed(i)
            return
        self.protected.push_tail(i)
        if len(self.protected) > self.max_protected:  # the least recent goes back to LRU
            self.free_queue.push_tail(self.protected.pop_head())

    def _is_free(self, i: int) -> bool:
        return i in self.free_queue or i in self.protected

    def _evict(self, i: int) -> None:
        super()._evict(i)
        self.hit[i] = False

    def mark_hit(self, slot: int) -> None:
        """``slot``'s checkpoint served a lookup hit: once free, it is evicted last."""
        assert self.hash_of[slot] is not None, slot
        self.hit[slot] = True

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
        assert len(self.protected) <= self.max_protected
        for s in self.protected:
            assert s not in self.free_queue and self.hit[s] and self.hash_of[s] is not None, s
        for s in range(1, self.num):
            if self.pending[s]:
                assert self.ref_cnt[s] > 0 and self.hash_of[s] is not None, s
