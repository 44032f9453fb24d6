"""The KV block pool: exact ids, ref counts and eviction order."""

import pytest

from serving.core.block_pool import BlockPool, FreeQueue
from serving.core.state_pool import StatePool


def h(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def test_free_queue_order_and_unlink():
    q = FreeQueue(6)
    assert list(q) == [1, 2, 3, 4, 5] and len(q) == 5
    q.remove(3)
    q.push_head(3)
    q.remove(5)
    q.push_tail(5)
    assert list(q) == [3, 1, 2, 4, 5]
    assert q.pop_head() == 3 and 3 not in q and len(q) == 4


def test_allocate_from_head_and_null_block_never_handed_out():
    pool = BlockPool(6)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.ref_cnt == [0, 1, 1, 1, 0, 0]
    assert pool.allocate(2) == [4, 5]
    assert pool.num_free == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.check_invariants()


def test_unhashed_blocks_are_freed_to_the_head_and_reused_first():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.free(blocks)  # reverse walk: 3, 2, 1 each pushed to the head
    assert list(pool.free_queue) == [1, 2, 3, 4, 5]
    pool.check_invariants()


def test_hashed_blocks_go_to_the_tail_in_reverse_order_and_are_evicted_lru():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for b, name in zip(blocks, "abc", strict=True):
        assert pool.register(b, h(name))
    pool.free(blocks)  # the request's tail block is evicted before its head block
    assert list(pool.free_queue) == [4, 5, 3, 2, 1]
    assert pool.lookup(h("c")) == 3  # cached while free
    assert pool.allocate(3) == [4, 5, 3]  # 3 is evicted: it loses its hash
    assert pool.lookup(h("c")) is None and pool.lookup(h("b")) == 2
    pool.check_invariants()


def test_touch_revives_a_cached_block_and_shares_a_held_one():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.register(b, h("a"))
    pool.touch([b])  # a second holder
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    pool.free([b])
    assert list(pool.free_queue) == [2, 3, 1]
    pool.touch([pool.lookup(h("a"))])  # a hit revives it: out of the queue
    assert pool.ref_cnt[1] == 1 and list(pool.free_queue) == [2, 3]
    pool.check_invariants()


def test_register_keeps_the_first_entry():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    assert pool.register(b1, h("x"))
    assert not pool.register(b2, h("x"))  # duplicate content stays unhashed
    assert pool.lookup(h("x")) == b1 and pool.hash_of[b2] is None
    pool.free([b1, b2])  # b2 (unhashed) to the head, b1 (hashed) to the tail
    assert list(pool.free_queue) == [2, 3, 1]
    pool.check_invariants()


def test_state_pool_checkpoint_is_pending_until_marked_written():
    pool = StatePool(5)
    running = pool.allocate_running()
    slot = pool.allocate_checkpoint(h("p64"))
    assert (running, slot) == (1, 2)
    assert pool.lookup(h("p64")) == 2 and pool.lookup_ready(h("p64")) is None
    pool.mark_written([slot])
    assert pool.lookup_ready(h("p64")) == 2
    pool.free([slot])  # cached checkpoint: tail, still answers lookups
    pool.free([running])  # running slot: head, reused first
    assert list(pool.free_queue) == [1, 3, 4, 2]
    assert pool.lookup_ready(h("p64")) == 2
    pool.check_invariants()


def _written_checkpoint(pool: StatePool, name: str) -> int:
    slot = pool.allocate_checkpoint(h(name))
    pool.mark_written([slot])
    return slot


def test_state_pool_evicts_never_hit_checkpoints_before_hit_ones():
    # A shared prefix's checkpoint, hit and freed early, outlives the unique checkpoints freed
    # after it (plain LRU evicted it first: benchmarks.prefix_repetition's later requests
    # recomputed their prefix).
    pool = StatePool(6)
    prefix = _written_checkpoint(pool, "prefix")
    pool.touch([prefix])  # a request admitted on it
    pool.mark_hit(prefix)
    pool.free([prefix, prefix])  # the writer's and the hitter's references
    unique = [_written_checkpoint(pool, f"unique{i}") for i in range(3)]
    pool.free(unique)  # freed later than the prefix: more recent in plain LRU
    assert pool.num_free == 5
    fresh = pool.allocate(4)  # one unhashed slot, then the three unique checkpoints
    assert sorted(fresh) == sorted([5, *unique])
    assert pool.lookup_ready(h("prefix")) == prefix
    assert all(pool.lookup(h(f"unique{i}")) is None for i in range(3))
    pool.check_invariants()
    assert pool.allocate(1) == [prefix]  # nothing else left: the protected one goes last
    assert pool.lookup(h("prefix")) is None and not pool.hit[prefix]
    pool.check_invariants()


def test_state_pool_protects_at_most_half_the_pool():
    pool = StatePool(7)  # 6 slots: at most 3 protected
    slots = [_written_checkpoint(pool, f"p{i}") for i in range(5)]
    for s in slots:
        pool.mark_hit(s)
    pool.free(slots[::-1])  # free walks backwards: slots[0] is freed first
    assert list(pool.protected) == slots[2:]
    assert list(pool.free_queue) == [6, *slots[:2]]  # the least recent hit ones back in LRU
    pool.check_invariants()
    pool.touch([slots[3]])  # a hit revives a protected checkpoint
    assert slots[3] not in pool.protected and pool.ref_cnt[slots[3]] == 1
    pool.check_invariants()
