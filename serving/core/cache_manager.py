"""The cache manager: the KV block pool and the state slot pool, tied by align-mode lookups.

Token, block and checkpoint arithmetic (B = block_size = 16, G = granularity = 64)::

    tokens       0               64              128             192      N-1
                 |---------------|---------------|---------------|--------|
    KV blocks    [b0 ][b1 ][b2 ][b3 ][b4 ][b5 ][b6 ][b7 ][b8 ][b9 ][b10][b11][b12 (partial)
    hashes        h0   h1   h2   h3   h4   h5   h6   h7   h8   h9   h10  h11  (full blocks only)
    checkpoints                  ^ state after 64  ^ after 128       ^ after 192
                                   keyed by h3       keyed by h7       keyed by h11

    kv_hit    = k*B for the longest run h0..h_{k-1} cached in the KV pool, k*B <= N - 1
                (the last token is always computed: its logits are sampled)
    state_hit = largest p <= N - 1, p % G == 0, whose checkpoint h_{p/B-1} is written
    hit       = largest p <= kv_hit with a written checkpoint; KV blocks past p are not used

A request then holds: the KV blocks ``[0, p/B)`` of the hit (touched, shared) followed by its
own blocks, one private running slot, and at most one "latest boundary" checkpoint reference
(so the newest decode checkpoint survives until a follow-up turn can hit it). Its first step
reads the hit checkpoint (``src``) and writes the running slot (``dst``); the step holds a
reference on that checkpoint, and on every checkpoint it writes, until its ``update()``.

State slot reserve: checkpoint slots never take the slots that running requests may need, so
``num_free_slots >= max_num_seqs - num_running`` holds after every operation and admitting a
request always finds a running slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.core.block_pool import NULL_ID, BlockPool
from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.kv_hash import extend_block_hashes
from serving.core.request import Request
from serving.core.state_pool import StatePool


@dataclasses.dataclass
class CacheMetrics:
    """Prefix-cache counters, in tokens, summed over admissions (resumes included)."""

    kv_query_tokens: int = 0  # known tokens of every admitted request
    kv_hit_tokens: int = 0  # longest cached KV prefix (capped at num_tokens - 1)
    state_query_tokens: int = 0
    state_hit_tokens: int = 0  # largest written checkpoint <= num_tokens - 1
    effective_hit_tokens: int = 0  # tokens whose computation was really skipped
    checkpoints_written: int = 0
    checkpoints_skipped_no_slot: int = 0
    deferred_same_step: int = 0  # admissions delayed because the best checkpoint was pending


@dataclasses.dataclass(frozen=True)
class Hit:
    """The result of a lookup: reuse ``num_tokens`` tokens (a multiple of G, maybe 0)."""

    num_tokens: int
    kv_blocks: tuple[int, ...]  # the first num_tokens / B cached blocks
    ckpt_slot: int  # NULL_ID when num_tokens == 0
    kv_hit_tokens: int
    state_hit_tokens: int


NO_HIT = Hit(0, (), NULL_ID, 0, 0)


@dataclasses.dataclass
class _Alloc:
    """What one running request holds."""

    row: int  # row of the persistent block table
    running_slot: int
    block_ids: list[int]
    num_registered: int  # blocks [0, num_registered) handed to the hash table (or tried)
    latest_ckpt: int = NULL_ID  # the request's reference on its newest boundary checkpoint


class CacheManager:
    """Owns both pools and what each running request holds in them."""

    def __init__(self, sched_cfg: SchedulerConfig, cache_cfg: CacheConfig) -> None:
        if cache_cfg.num_state_slots < sched_cfg.max_num_seqs + 1:
            raise ValueError(
                f"num_state_slots={cache_cfg.num_state_slots} must be at least "
                f"max_num_seqs + 1 = {sched_cfg.max_num_seqs + 1} (one running slot per "
                "request plus the NULL slot)"
            )
        self.cfg = sched_cfg
        self.block_size = sched_cfg.block_size
        self.granularity = sched_cfg.granularity
        self.caching = sched_cfg.enable_prefix_caching
        self.kv = BlockPool(cache_cfg.num_kv_blocks)
        self.state = StatePool(cache_cfg.num_state_slots)
        self.metrics = CacheMetrics()
        # Block table rows of running requests; rows are recycled, zeroed when released.
        self.block_table = np.zeros((sched_cfg.max_num_seqs, sched_cfg.max_blocks), np.int32)
        self._free_rows = list(range(sched_cfg.max_num_seqs - 1, -1, -1))
        self._allocs: dict[str, _Alloc] = {}

    # ---------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        return len(self._allocs)

    def alloc(self, request_id: str) -> _Alloc:
        return self._allocs[request_id]

    def holds(self, req: Request, alloc: _Alloc) -> bool:
        """Whether ``req`` still holds ``alloc`` (not freed or preempted since)."""
        return self._allocs.get(req.request_id) is alloc

    def spare_state_slots(self) -> int:
        """Free slots beyond those reserved for requests that could still be admitted."""
        return self.state.num_free - (self.cfg.max_num_seqs - len(self._allocs))

    # ---------------------------------------------------------------- hashing and lookup

    def hash_new_blocks(self, req: Request) -> None:
        """Extends ``req.block_hashes`` over its newly full blocks (no-op without caching)."""
        if self.caching:
            extend_block_hashes(
                req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt
            )

    def lookup(self, req: Request) -> Hit | None:
        """Align-mode hit for ``req`` over all its known tokens. Mutates nothing.

        Returns None when the best usable checkpoint is still pending (written by a step that
        has not been updated): the request should wait a step rather than recompute it.
        """
        if not self.caching:
            return NO_HIT
        cap = req.num_tokens - 1
        bs, g, hashes = self.block_size, self.granularity, req.block_hashes
        kv_blocks = []
        for j in range(cap // bs):
            b = self.kv.lookup(hashes[j])
            if b is None:
                break
            kv_blocks.append(b)
        kv_hit = len(kv_blocks) * bs
        state_hit = 0
        for p in range(cap // g * g, 0, -g):
            slot = self.state.lookup(hashes[p // bs - 1])
            if slot is None:
                continue
            pending = self.state.is_pending(slot)
            if not pending and not state_hit:
                state_hit = p
            if p > kv_hit:
                continue
            if pending:
                return None
            if self.state.ref_cnt[slot] == 0 and self.spare_state_slots() < 1:
                break  # reviving it would eat a running request's reserved slot
            return Hit(p, tuple(kv_blocks[: p // bs]), slot, kv_hit, state_hit)
        return Hit(0, (), NULL_ID, kv_hit, state_hit)

    # ---------------------------------------------------------------- allocation

    def can_admit(self, hit: Hit, end: int) -> bool:
        """Whether a request with ``hit`` can take tokens ``[0, end)`` now. Mutates nothing."""
        if len(self._allocs) >= self.cfg.max_num_seqs:
            return False
        revived = sum(self.kv.ref_cnt[b] == 0 for b in hit.kv_blocks)
        new = -(-end // self.block_size) - len(hit.kv_blocks)
        return self.kv.num_free >= revived + new

    def admit(self, req: Request, hit: Hit, end: int) -> tuple[_Alloc, list[int]]:
        """Gives ``req`` a running slot, the hit blocks and new blocks up to token ``end``.

        Takes a reference on the hit checkpoint for the caller's step (returned in the list of
        step-held slots: release it with ``release_step``). Counts the lookup in the metrics.
        """
        assert req.request_id not in self._allocs and self.can_admit(hit, end)
        revived = hit.ckpt_slot != NULL_ID and self.state.ref_cnt[hit.ckpt_slot] == 0
        assert self.spare_state_slots() >= revived, "reviving the checkpoint breaks the reserve"
        self.kv.touch(hit.kv_blocks)
        step_held = []
        if hit.ckpt_slot != NULL_ID:
            self.state.touch([hit.ckpt_slot])
            self.state.mark_hit(hit.ckpt_slot)
            step_held.append(hit.ckpt_slot)
        slot = self.state.allocate_running()
        nb = len(hit.kv_blocks)
        a = _Alloc(self._free_rows.pop(), slot, list(hit.kv_blocks), num_registered=nb)
        self.block_table[a.row, :nb] = hit.kv_blocks
        self._allocs[req.request_id] = a
        ok = self.allocate_blocks(req, end)
        assert ok
        m = self.metrics
        m.kv_query_tokens += req.num_tokens
        m.state_query_tokens += req.num_tokens
        m.kv_hit_tokens += hit.kv_hit_tokens
        m.state_hit_tokens += hit.state_hit_tokens
        m.effective_hit_tokens += hit.num_tokens
        return a, step_held

    def allocate_blocks(self, req: Request, end: int) -> bool:
        """Gives ``req`` the KV blocks for tokens ``[0, end)``; False (no change) if short."""
        a = self._allocs[req.request_id]
        need = -(-end // self.block_size) - len(a.block_ids)
        if need <= 0:
            return True
        if need > self.kv.num_free:
            return False
        new = self.kv.allocate(need)
        n = len(a.block_ids)
        self.block_table[a.row, n : n + need] = new
        a.block_ids.extend(new)
        return True

    def register_blocks(self, req: Request, end: int) -> None:
        """Enters ``req``'s full blocks below token ``end`` into the KV hash table.

        Called when their tokens are scheduled: attention writes a step's K/V before reading,
        so another request may hit them in the same step.
        """
        if not self.caching:
            return
        a = self._allocs[req.request_id]
        full = end // self.block_size
        for j in range(a.num_registered, full):
            self.kv.register(a.block_ids[j], req.block_hashes[j])
        a.num_registered = max(a.num_registered, full)

    def add_checkpoint(self, req: Request, p: int, latest: bool) -> int:
        """A slot for the kernel to write the state after ``p`` tokens of ``req``, or 0.

        0 when the checkpoint is already cached (or pending) or no spare slot exists. A new
        slot is pending with one reference held by the scheduling step. With ``latest``, the
        request also holds the checkpoint (new or cached) and drops its previous one.
        """
        assert p % self.granularity == 0 and p > 0
        h = req.block_hashes[p // self.block_size - 1]
        slot = self.state.lookup(h)
        if slot is not None:
            if latest:
                self._hold_latest(req, slot)
            return NULL_ID
        if self.spare_state_slots() < 1:
            self.metrics.checkpoints_skipped_no_slot += 1
            return NULL_ID
        slot = self.state.allocate_checkpoint(h)
        self.metrics.checkpoints_written += 1
        if latest:
            self._hold_latest(req, slot)
        return slot

    def _hold_latest(self, req: Request, slot: int) -> None:
        a = self._allocs[req.request_id]
        if a.latest_ckpt == slot:
            return
        if self.state.ref_cnt[slot] == 0 and self.spare_state_slots() < 1:
            return
        self.state.touch([slot])
        if a.latest_ckpt != NULL_ID:
            self.state.free([a.latest_ckpt])
        a.latest_ckpt = slot

    # ---------------------------------------------------------------- speculative decoding

    def allocate_spec_slots(self, k: int) -> list[int]:
        """Up to ``k`` private slots for a verify row's per-token states (fewer when the
        spare slots run short; never a running request's reserve). The scheduling step holds
        them until :meth:`accept_spec`."""
        n = min(k, max(self.spare_state_slots(), 0))
        return self.state.allocate(n) if n else []

    def accept_spec(self, req: Request, alloc: _Alloc, slots: list[int], accepted: int) -> None:
        """At the verify step's ``update``: the request's state is now the one after its
        ``accepted`` drafts, and the step's per-token slots go back. No state is copied: slot
        ``slots[j]`` holds the state after ``j + 1`` of the row's tokens and ``dst`` (the
        running slot) the state after all ``k + 1``, so ownership rotates::

            row tokens     t  d1 d2 d3          k = 3, src = dst = R
            written        P1 P2 P3 R           state after 1, 2, 3, 4 tokens
            accepted = 1   running <- P2; R, P1, P3 freed
            accepted = 3   running stays R; P1, P2, P3 freed

        ``alloc`` is what the request held when the row was scheduled: if it is freed or
        preempted since, every slot just goes back.
        """
        assert 0 <= accepted <= len(slots)
        if not self.holds(req, alloc) or accepted == len(slots):
            self.state.free(slots)
            return
        keep = slots[accepted]
        self.state.free([alloc.running_slot] + [s for s in slots if s != keep])
        alloc.running_slot = keep

    # ---------------------------------------------------------------- freeing

    def release_step(self, written: list[int], held: list[int]) -> None:
        """At a step's ``update()``: its checkpoints become usable; its references drop."""
        self.state.mark_written(written)
        self.state.free(held)

    def free(self, req: Request) -> None:
        """Frees everything ``req`` holds: KV blocks (reverse order), running slot, latest
        checkpoint reference, block table row. Cached blocks and checkpoints stay evictable.
        No-op if it holds nothing."""
        a = self._allocs.pop(req.request_id, None)
        if a is None:
            return
        self.kv.free(a.block_ids)
        self.state.free([a.running_slot])
        if a.latest_ckpt != NULL_ID:
            self.state.free([a.latest_ckpt])
        self.block_table[a.row, : len(a.block_ids)] = 0
        self._free_rows.append(a.row)

    def check_invariants(self) -> None:
        """O(pool) check for tests: pool invariants, and every reference has one owner."""
        self.kv.check_invariants()
        self.state.check_invariants()
        assert self.spare_state_slots() >= 0
        kv_refs = [0] * self.kv.num
        for a in self._allocs.values():
            for b in a.block_ids:
                kv_refs[b] += 1
            row = self.block_table[a.row]
            assert list(row[: len(a.block_ids)]) == a.block_ids
            assert not row[len(a.block_ids) :].any()
        assert kv_refs[1:] == self.kv.ref_cnt[1:], "a KV block reference has no owner"
        rows = {a.row for a in self._allocs.values()}
        assert len(rows) == len(self._allocs) and not rows & set(self._free_rows)
