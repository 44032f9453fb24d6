"""A pool of ref-counted, hash-addressable ids with an LRU free queue (the KV block pool).

Id 0 is the null id: never handed out, freed, hashed or ref-counted. Every other id is either
held (``ref_cnt > 0``) or sits in the free queue, cached (it still has a hash, so a lookup can
revive it) or not::

    free queue (eviction order, head first)
    head -> [unhashed: reused first] ... [hashed, least recently freed] ... [most recent] <- tail

- ``allocate(n)`` pops from the head; a popped id that still has a hash loses it (eviction).
- ``touch(ids)`` on a cache hit takes cached ids out of the queue and bumps their ref counts.
- ``free(ids)`` walks ``ids`` in reverse (a request's tail is evicted before its head); an id
  reaching 0 goes to the tail if hashed (LRU order), to the head otherwise.

Every operation is O(1) per id; nothing scans the pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from serving.core.kv_hash import BlockHash

NULL_ID = 0


class FreeQueue:
    """A doubly linked list over ids ``1..n-1`` kept in two int lists: O(1) unlink/push/pop."""

    def __init__(self, n: int, *, empty: bool = False) -> None:
        # Sentinel index n links head and tail: next[n] is the head, prev[n] the tail.
        self._n = n
        self._next = [-1] * (n + 1)
        self._prev = [-1] * (n + 1)
        order = [n, n] if empty else [n, *range(1, n), n]
        for a, b in itertools.pairwise(order):
            self._next[a] = b
            self._prev[b] = a
        self._in = [i != NULL_ID and not empty for i in range(n)]
        self._size = 0 if empty else n - 1

    def __len__(self) -> int:
        return self._size

    def __contains__(self, i: int) -> bool:
        return self._in[i]

    def __iter__(self):
        """Head to tail (for tests and debugging; O(size))."""
        i = self._next[self._n]
        while i != self._n:
            yield i
            i = self._next[i]

    def _link(self, i: int, prev: int, nxt: int) -> None:
        self._prev[i], self._next[i] = prev, nxt
        self._next[prev] = i
        self._prev[nxt] = i
        self._in[i] = True
        self._size += 1

    def push_tail(self, i: int) -> None:
        assert not self._in[i] and i != NULL_ID, i
        self._link(i, self._prev[self._n], self._n)

    def push_head(self, i: int) -> None:
        assert not self._in[i] and i != NULL_ID, i
        self._link(i, self._n, self._next[self._n])

    def remove(self, i: int) -> None:
        assert self._in[i], i
        p, nx = self._prev[i], self._next[i]
        self._next[p] = nx
        self._prev[nx] = p
        self._in[i] = False
        self._size -= 1

    def pop_head(self) -> int:
        assert self._size > 0, "free queue is empty"
        i = self._next[self._n]
        self.remove(i)
        return i


class BlockPool:
    """Ref-counted ids ``1..num-1`` with a ``hash -> id`` table and an LRU free queue.

    The KV pool uses it as is; ``StatePool`` extends it for checkpoint slots.
    """

    def __init__(self, num: int) -> None:
        assert num >= 2, num
        self.num = num
        self.ref_cnt = [0] * num
        self.hash_of: list[BlockHash | None] = [None] * num
        self.table: dict[BlockHash, int] = {}
        self.free_queue = FreeQueue(num)

    @property
    def num_free(self) -> int:
        """Ids that ``allocate`` can hand out now (unhashed plus evictable cached ones)."""
        return len(self.free_queue)

    # The free queue's three operations, which ``StatePool`` refines (a second queue).

    def _pop_free(self) -> int:
        return self.free_queue.pop_head()

    def _unfree(self, i: int) -> None:
        self.free_queue.remove(i)

    def _push_freed(self, i: int) -> None:
        if self.hash_of[i] is None:
            self.free_queue.push_head(i)
        else:
            self.free_queue.push_tail(i)

    def _is_free(self, i: int) -> bool:
        return i in self.free_queue

    @property
    def usage(self) -> float:
        """Fraction of the non-null ids held (ref_cnt > 0)."""
        return 1.0 - self.num_free / (self.num - 1)

    def lookup(self, h: BlockHash) -> int | None:
        """The cached id for ``h``, held or evictable, or None. Mutates nothing."""
        return self.table.get(h)

    def allocate(self, n: int) -> list[int]:
        """Pops ``n`` ids from the head of the free queue, evicting their hashes; ref_cnt = 1.

        Raises ValueError if fewer than ``n`` are free (check ``num_free`` first).
        """
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} ids: only {self.num_free} free")
        out = []
        for _ in range(n):
            i = self._pop_free()
            self._evict(i)
            assert self.ref_cnt[i] == 0, (i, self.ref_cnt[i])
            self.ref_cnt[i] = 1
            out.append(i)
        return out

    def touch(self, ids: Iterable[int]) -> None:
        """Takes a reference on each id (a cache hit): cached free ids leave the free queue."""
        for i in ids:
            assert i != NULL_ID
            if self.ref_cnt[i] == 0:
                self._unfree(i)
            self.ref_cnt[i] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drops one reference on each id, walking ``ids`` backwards.

        An id reaching 0 joins the free queue: at the tail if hashed (still a cache entry, LRU),
        at the head if not (it can never serve a hit, so it is reused first).
        """
        for i in reversed(ids):
            assert i != NULL_ID and self.ref_cnt[i] > 0, (i, self.ref_cnt[i])
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self._push_freed(i)

    def register(self, i: int, h: BlockHash) -> bool:
        """Makes held id ``i`` the cache entry for ``h``.

        Returns False (and changes nothing) if ``h`` already has an entry or ``i`` already
        has a hash: the first entry wins, the duplicate stays unhashed and is recycled first.
        """
        assert i != NULL_ID and self.ref_cnt[i] > 0, (i, self.ref_cnt[i])
        if h in self.table or self.hash_of[i] is not None:
            return False
        self.table[h] = i
        self.hash_of[i] = h
        return True

    def _evict(self, i: int) -> None:
        h = self.hash_of[i]
        if h is not None:
            assert self.table[h] == i
            del self.table[h]
            self.hash_of[i] = None

    def check_invariants(self) -> None:
        """O(pool) consistency check for tests: ref counts, queue membership, hash table."""
        assert self.ref_cnt[NULL_ID] == 0 and not self._is_free(NULL_ID)
        assert self.hash_of[NULL_ID] is None
        in_queue = list(self.free_queue)
        assert len(in_queue) == len(set(in_queue)) == len(self.free_queue)
        for i in range(1, self.num):
            assert self.ref_cnt[i] >= 0, (i, self.ref_cnt[i])
            assert (self.ref_cnt[i] == 0) == self._is_free(i), (i, self.ref_cnt[i])
        for h, i in self.table.items():
            assert self.hash_of[i] == h
        assert sum(h is not None for h in self.hash_of) == len(self.table)
