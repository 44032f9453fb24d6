"""The continuous-batching scheduler (align mode): which tokens of which requests run next.

One engine step::

    out = scheduler.schedule()          # None: nothing to run
    sampled = runner.execute(out.plan)  # i32[S]
    updates = scheduler.update(out, sampled)

Each step fills a token budget: running requests first, in admission order (a decode takes 1
token, an unfinished prefill its next chunk), then waiting requests in FCFS order, each
admitted through a prefix-cache lookup. Prefill chunks obey align mode (G = granularity)::

    prompt P = 300, G = 64, budget 128 tokens a step, R = 0
    tokens     0       64      128     192     256    300
               |-------|-------|-------|-------|------|
    step 1     [==== chunk ====)                              ends on a multiple of G
    step 2                     [==== chunk ====)              ends on a multiple of G
    step 3                                     [=last=)       ends anywhere; samples a token
    ckpt                                       ^ 256 = (P-1)//G*G, written by step 2 at
                                                 offset 128 = q_len (an identical prompt hits)

Every chunk but a request's last starts and ends on a multiple of G; when less than G of
the budget is left and the rest does not fit, the request waits. Chunks are never split at
checkpoints: a row carries ``(offset, slot)`` pairs and the kernels write the state after
``offset`` of its tokens. A boundary ``p`` (``p % G == 0``) inside a row's tokens is
checkpointed when it is a multiple of R (R > 0), the prompt end ``(P-1)//G*G``, or the
request's latest boundary ``N//G*G >= P`` (N known tokens: the decode boundary just reached,
or the end of a resumed request's replay); the latest one replaces the request's previous one.

Same-step rule: a checkpoint registered by a step serves hits only after that step's
``update()``. A waiting request whose best checkpoint is still pending waits (FCFS: the queue
behind it waits too) instead of recomputing what the checkpoint will hold.

Decode rows: a step with ``decode_only`` writes at most one checkpoint per row, at offset 1
(the row's final state, also written to ``dst``).

Overlap: ``schedule()`` may run before the previous step's ``update()``. A request's
``num_computed_tokens`` advances when its tokens are scheduled, so a request whose sampled
token is still in flight has nothing to schedule and is skipped; one preempted meanwhile is
not admitted again before that token arrives (``awaiting_token``).

Async scheduling (``async_scheduling=True``): a running request whose only missing token is
the one the previous plan samples gets a decode row for it anyway, its input id read on
device from that step's output (``SchedulerOutput.from_prev``). Not when the host needs the
token's id to schedule the row (prefix caching and the row fills a KV block: its hash; a
structured-output row: its token mask comes from the grammar advanced past it), nor
when the pending token certainly ends the request (``max_tokens``, ``max_model_len``). A
request that finishes (EOS, stop, abort) while a later step still has its row keeps its
blocks and slot until that step's ``update``, which discards the row's token.

Prompt logprobs: a request that asks for them is scored in its prefill chunks (up to
``prompt_logprob_capacity`` positions a step, which caps its chunks). Its prefill reads no
cached prefix (a hit's positions ran in another request and left no logits), so every position
is computed; it still writes its blocks and checkpoints for others. A request preempted after
its prompt was scored resumes through the lookup like any other.

When the KV pool runs dry, the most recently admitted running request is preempted (by
recompute): its blocks and running slot are freed and it goes back to the front of the
waiting queue with every known token to prefill again, through the same lookup.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
from collections.abc import Iterator

import numpy as np

from serving.core.block_pool import NULL_ID
from serving.core.cache_manager import NO_HIT, CacheManager, CacheMetrics
from serving.core.config import LPM_WINDOW, CacheConfig, SchedulerConfig
from serving.core.plan import SamplingArrays
from serving.core.request import FinishReason, Request, RequestStatus
from serving.core.scheduler_output import RequestUpdate, SchedulerOutput, SpecRow, build_plan
from serving.core.speculative import Drafter, SpecMetrics

JUNCTION_LOOKAHEAD = 32  # waiting requests compared with each admitted one


def _common_prefix_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Leading blocks two requests share. Chained hashes: equal at j means equal below j."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logging and metrics endpoints."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests
    state_usage: float  # fraction of state slots held (running slots and held checkpoints)
    num_preemptions: int
    cache: CacheMetrics
    spec: SpecMetrics = dataclasses.field(default_factory=SpecMetrics)


class Scheduler:
    """FCFS continuous batching with chunked prefill, align-mode prefix caching, preemption.

    Args:
      sched_cfg: budgets and caching knobs.
      cache_cfg: pool sizes.
      rng_seed: seeds the generator of per-request sampling seeds (for requests without one).
      drafter: speculative decoding's host-side drafter (``sched_cfg.num_speculative_tokens``
        > 0): asked for drafts after every ``update`` that gives a request tokens.
    """

    def __init__(
        self,
        sched_cfg: SchedulerConfig,
        cache_cfg: CacheConfig,
        *,
        rng_seed: int | None = None,
        async_scheduling: bool = False,
        drafter: Drafter | None = None,
    ) -> None:
        self.cfg = sched_cfg
        self.drafter = drafter
        self.spec_metrics = SpecMetrics(accepted_per_pos=[0] * sched_cfg.num_speculative_tokens)
        self.cache = CacheManager(sched_cfg, cache_cfg)
        self.running: list[Request] = []  # admission order; finished ones dropped lazily
        self.waiting: collections.deque[Request] = collections.deque()
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._rejected: list[RequestUpdate] = []  # finished before running, not yet reported
        self._sampling = SamplingArrays.empty(sched_cfg.max_num_seqs)  # by table row
        self._rng = random.Random(rng_seed)
        self._arrivals = 0
        self.async_scheduling = async_scheduling
        self._last_plan_step = -1  # step id of the newest step with a plan
        # Per request id, over steps scheduled and not yet updated: rows, sampled tokens, and
        # (step id, row) of the newest sampling row.
        # Rows / sampled tokens of each request in steps not yet updated (absent: none). Plain
        # dicts: a Counter's missing-key and delete hooks are Python calls, twice a row a step.
        self._rows_in_flight: dict[str, int] = {}
        self._tokens_in_flight: dict[str, int] = {}
        self._sampling_row: dict[str, tuple[int, int]] = {}
        self._free_after: dict[str, Request] = {}  # finished, freed when their rows are done
        self._step_id = 0
        self._num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        """Queues ``req`` (mutates it: status, seed, max_tokens, block hashes).

        Raises ValueError for an unusable request (duplicate id, empty prompt, bad sampling
        parameters, prompt plus completion over ``max_model_len``). A request that could never
        fit the KV pool is accepted but finished at once with reason ``error`` (``req.error``
        says why); the next ``schedule``/``update`` reports it.
        """
        if req.request_id in self._requests or req.request_id in self._free_after:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        prompt_len = req.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty: at least one token is required")
        if min(req.prompt_token_ids) < 0:
            raise ValueError(f"prompt token ids must be >= 0, got {min(req.prompt_token_ids)}")
        req.sampling_params.validate()
        if req.sampling_params.prompt_logprobs is not None and not self.cfg.max_prompt_logprobs:
            raise ValueError("prompt_logprobs=... is off on this server (max_prompt_logprobs=0)")
        max_len = self.cfg.max_model_len
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - prompt_len
            if max_tokens < 1:
                raise ValueError(
                    f"This model's maximum context length is {max_len} tokens. However, your "
                    f"prompt has {prompt_len} tokens, which leaves no room for a completion."
                )
        if prompt_len + max_tokens > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "the completion."
            )
        req.max_tokens = max_tokens
        seed = req.sampling_params.seed
        req.seed = (seed if seed is not None else self._rng.getrandbits(32)) % 2**32
        req.arrival = self._arrivals
        self._arrivals += 1
        req.status = RequestStatus.WAITING

        # The last sampled token is never fed back, so it needs no KV slot.
        need = -(-(prompt_len + max_tokens - 1) // self.cfg.block_size)
        have = self.cache.kv.num - 1
        if need > have:
            req.error = (
                f"request needs {need} KV blocks for {prompt_len} prompt + {max_tokens} "
                f"completion tokens, but the KV cache only has {have} blocks of "
                f"{self.cfg.block_size} tokens"
            )
            self._set_finished(req, "error")
            self._rejected.append(self._report(req, [], "error"))
            return
        self.cache.hash_new_blocks(req)
        self._requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Finishes a request now (abort, or a stop string the engine found) and frees all it
        holds. A no-op for an unknown or already finished id. Its rows in a step that is
        scheduled but not yet updated are ignored by that ``update``."""
        req = self._requests.get(request_id)
        if req is None:
            return
        self._set_finished(req, reason)
        self._free(req)

    def has_unfinished_requests(self) -> bool:
        """Whether ``schedule`` has anything left to run or report."""
        return bool(self._requests or self._rejected or self._free_after)

    @property
    def num_running(self) -> int:
        return self.cache.num_running

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - self.cache.num_running

    @property
    def kv_usage(self) -> float:
        return self.cache.kv.usage

    @property
    def state_usage(self) -> float:
        return self.cache.state.usage

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            self.num_running,
            self.num_waiting,
            self.kv_usage,
            self.state_usage,
            self._num_preemptions,
            dataclasses.replace(self.cache.metrics),
            self.spec_metrics.copy(),
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput | None:
        """Picks this step's rows and builds its plan; None when there is nothing to do.

        Mutates: requests' ``num_computed_tokens`` (advanced to the end of their scheduled
        tokens), status and queues (admission, preemption), the pools (blocks and slots taken,
        blocks registered, checkpoints registered as pending until ``update``).
        """
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        cap = self.cfg.spec_disable_batch_size
        # past the cap, or without speculation, this step verifies nothing
        may_speculate = self.cfg.num_speculative_tokens > 0 and (not cap or len(self.running) < cap)
        b = _StepBuilder(self._step_id, plp_left=self.cfg.prompt_logprob_capacity)
        budget = self.cfg.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            ahead = self._ahead_row(req)
            n = 1 if ahead is not None else self._chunk_len(req, start, budget, b.plp_left)
            if n == 0:
                i += 1
                continue
            drafts = self._drafts(req, start, n, budget) if may_speculate else []
            while not self.cache.allocate_blocks(req, start + n + len(drafts)):
                if drafts:  # the pool is short: verify nothing rather than preempt
                    drafts = []
                    continue
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                alloc = self.cache.alloc(req.request_id)
                slot = alloc.running_slot
                self._add_row(b, req, start, n, src=slot, ahead=ahead, drafts=drafts, alloc=alloc)
                budget -= b.q_lens[-1]
                i += 1

        admits = budget > 0 and not preempted and self.cache.num_running < self.cfg.max_num_seqs
        lpm = self._lpm_order() if admits else None  # (no lookups in a step that admits none)
        for req in lpm if lpm is not None else self._fcfs_order():
            if budget <= 0 or preempted:
                break
            if req.status is not RequestStatus.WAITING:  # finished while queued
                self.waiting.remove(req)
                continue
            if req.awaiting_token:  # preempted while a step samples for it: keep order
                if lpm is not None:
                    continue
                break
            if self.cache.num_running >= self.cfg.max_num_seqs:
                break
            hit = NO_HIT if req.needs_prompt_logprobs else self.cache.lookup(req)
            if hit is None:  # its best checkpoint is written by a step not yet updated
                self.cache.metrics.deferred_same_step += 1
                if lpm is not None:  # the others need not wait for it
                    continue
                break
            n = self._chunk_len(req, hit.num_tokens, budget, b.plp_left)
            if n == 0 or not self.cache.can_admit(hit, hit.num_tokens + n):
                break
            if lpm is None:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            alloc, held = self.cache.admit(req, hit, hit.num_tokens + n)
            b.slots_held += held
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit.num_tokens
            req.junctions = self._junctions(req, hit.num_tokens, hit.kv_hit_tokens)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            self._sampling.set_row(alloc.row, req)
            self.running.append(req)
            self._add_row(b, req, hit.num_tokens, n, src=hit.ckpt_slot)
            budget -= n

        rejected, self._rejected = self._rejected, []
        if not b.requests:
            if not rejected:
                return None
            self._step_id += 1
            return SchedulerOutput(None, b.step_id, [], [], [], finished=rejected)
        plan = build_plan(
            self.cfg,
            self.cache.block_table,
            self._sampling,
            b.table_rows,
            b.starts,
            b.q_lens,
            b.input_ids,
            b.src,
            b.dst,
            b.ckpts,
            b.prompt_lp,
            b.drafts,
            b.next_ids,
        )
        self._fill_token_mask(plan, b)
        self._last_plan_step = b.step_id
        self._step_id += 1
        return SchedulerOutput(
            plan,
            b.step_id,
            b.requests,
            b.q_lens,
            b.samples,
            finished=rejected,
            ckpt_written=b.ckpt_written,
            slots_held=b.slots_held,
            from_prev=b.from_prev,
            prompt_logprobs=b.prompt_logprobs,
            spec=b.spec,
        )

    def update(
        self, output: SchedulerOutput, sampled: np.ndarray, drafts: np.ndarray | None = None
    ) -> list[RequestUpdate]:
        """Takes a step's sampled tokens (``i32[S]``, or ``i32[S, K + 1]`` in a step with
        verify rows: each row's tokens, then -1; row order; padding rows ignored), and, from a
        device-side drafter (MTP), each row's next drafts (``i32[S, K]``: drafted after the
        row's last new token; read for rows that sample and go on).

        Mutates: appends each sampling row's tokens to its request (a verify row's accepted
        drafts and the target's next token: its state and ``num_computed_tokens`` move back to
        the accepted prefix), finishes and frees requests that hit EOS, a stop token id,
        ``max_tokens`` or ``max_model_len`` (later tokens of the row are dropped), makes the
        step's checkpoints usable, and asks the drafter for the next drafts. Returns one
        ``RequestUpdate`` per request that got tokens or finished (rows of requests finished
        meanwhile, e.g. aborted, are skipped).
        """
        assert not output.updated, f"step {output.step_id} was already updated"
        output.updated = True
        self.cache.release_step(output.ckpt_written, output.slots_held)
        updates = list(output.finished)
        tokens = np.asarray(sampled).tolist()
        rows_in_flight, tokens_in_flight = self._rows_in_flight, self._tokens_in_flight
        block_size, specs, samples = self.cfg.block_size, output.spec, output.samples
        for s, req in enumerate(output.requests):
            rid = req.request_id
            row = tokens[s]
            if isinstance(row, list):  # a verify row's tokens, then -1
                run = list(itertools.takewhile(lambda t: t >= 0, row))
            else:
                run = [row] if row >= 0 else []
            spec = specs.get(s) if specs else None
            if spec is not None:
                self._accept(req, spec, len(run) - 1)
            left = rows_in_flight[rid] - 1
            if left:
                rows_in_flight[rid] = left
            else:
                del rows_in_flight[rid]
                if rid in self._free_after:
                    self.cache.free(self._free_after.pop(rid))
            if not samples[s]:
                continue
            left = tokens_in_flight[rid] - 1
            if left:
                tokens_in_flight[rid] = left
            else:
                del tokens_in_flight[rid]
                req.awaiting_token = False
                del self._sampling_row[rid]
            if req.is_finished:  # the token of a row scheduled before it finished: dropped
                continue
            assert run, f"row {s} ({rid}) sampled no token"
            new, reason = [], None
            blocks = len(req.all_token_ids) // block_size
            for tok in run:
                new.append(tok)
                req.output_token_ids.append(tok)
                req.all_token_ids.append(tok)
                reason = self._stop_reason(req, tok)
                if req.grammar is not None and not req.grammar.accept(tok):  # masked: never
                    req.error = f"sampled token {tok} breaks the grammar: {req.grammar.error}"
                    reason = "error"
                elif req.grammar is not None and reason is None and req.grammar.is_terminated:
                    reason = "stop"  # the output is complete: nothing but EOS may follow
                if reason is not None:  # a stop inside a verified run: the rest is dropped
                    break
            if len(req.all_token_ids) // block_size > blocks:
                self.cache.hash_new_blocks(req)
            req.draft_token_ids = []
            if reason is not None:
                self._set_finished(req, reason)
                self._free(req)
            elif drafts is not None:
                req.draft_token_ids = drafts[s].tolist()
            elif self.drafter is not None:
                req.draft_token_ids = self.drafter.propose(req, self.cfg.num_speculative_tokens)
            updates.append(self._report(req, new, reason))
        return updates

    def _accept(self, req: Request, spec: SpecRow, accepted: int) -> None:
        """A verify row's outcome: ``accepted`` of its drafts. The request's state becomes the
        per-token slot after them (``CacheManager.accept_spec``) and ``num_computed_tokens``
        moves back to the accepted prefix: the rejected drafts' K/V stays in their blocks (the
        request keeps the blocks) and is overwritten by later rows; no block or checkpoint
        was registered past the known tokens."""
        if not req.is_finished:
            self.spec_metrics.add(len(spec.slots), accepted)
        if self.cache.holds(req, spec.alloc):
            assert req.num_computed_tokens == spec.start + 1 + len(spec.slots), req.request_id
            req.num_computed_tokens = spec.start + 1 + accepted
        self.cache.accept_spec(req, spec.alloc, spec.slots, accepted)

    # ------------------------------------------------------------------ helpers

    def _chunk_len(self, req: Request, start: int, budget: int, plp_left: int = 0) -> int:
        """Tokens of ``req`` to compute from ``start`` within ``budget`` (align mode), and,
        for a request scoring its prompt, with at most ``plp_left`` positions to score."""
        remaining = req.num_tokens - start
        if req.needs_prompt_logprobs:
            scored = req.num_prompt_tokens - 1 - max(start, req.prompt_logprobs_next)
            if not (remaining <= budget and scored <= plp_left):
                budget = min(budget, plp_left)
        if remaining <= budget:
            return max(remaining, 0)
        g = self.cfg.granularity
        assert start % g == 0, f"a partial prefill chunk must start on a multiple of {g=}"
        return budget // g * g

    def _drafts(self, req: Request, start: int, n: int, budget: int) -> list[int]:
        """The drafts a decode row of ``req`` verifies this step (maybe none).

        Only a plain decode row (its one new token the last known one) speculates, and not a
        request whose sampling reads the token tables or reports logprobs (their per-position
        histories are not kept apart). ``k`` is capped by K, ``max_tokens`` and
        ``max_model_len`` (a verify row yields up to k + 1 tokens), the token budget, and,
        with prefix caching, the next checkpoint boundary: a row never feeds a draft at or
        past it, so a boundary is only ever reached at offset 1 of a row, by a known token::

            G = 64          62  63 | 64                 start = 62: boundary p = 64
            row k = 0       [t]                         (62 + 1 + k <= p - 1)
            next row            [t  d1 d2 ...]          boundary at offset 1: checkpointed
        """
        k_max = self.cfg.num_speculative_tokens
        drafts = req.draft_token_ids
        if not k_max or not drafts or n != 1 or start != req.num_tokens - 1:
            return []
        sp = req.sampling_params
        if sp.uses_token_tables or sp.logprobs is not None or req.grammar is not None:
            return []  # their processors / masks / logprobs see one position a step
        k = min(
            k_max,
            len(drafts),
            req.max_tokens - len(req.output_token_ids) - 1,
            self.cfg.max_model_len - start - 2,
            budget - 1,
        )
        if self.cfg.enable_prefix_caching:
            g = self.cfg.granularity
            k = min(k, ((start + 1) // g + 1) * g - start - 2)
        return drafts[: max(k, 0)]

    def _ahead_row(self, req: Request) -> int | None:
        """Async scheduling: the previous plan's row that samples ``req``'s one missing token,
        if ``req`` decodes it in this step without knowing its id; else None.

        ``req`` needs: exactly one token in flight, sampled by the newest plan (the runner
        splices that plan's output), everything else computed; a row that fills no KV block
        when prefix caching is on (registering it hashes the token); and room for another
        token after the pending one (else the pending one ends it by length).
        """
        rid = req.request_id
        if not self.async_scheduling or self._tokens_in_flight.get(rid) != 1:
            return None
        if req.grammar is not None:  # its mask needs the pending token: it waits for it
            return None
        if self.cfg.num_speculative_tokens:  # drafts come after update: verify rows instead
            return None
        step, row = self._sampling_row[rid]
        known = len(req.all_token_ids)
        if step != self._last_plan_step or req.num_computed_tokens != known:
            return None
        if self.cfg.enable_prefix_caching and (known + 1) % self.cfg.block_size == 0:
            return None
        if len(req.output_token_ids) + 1 >= req.max_tokens or known + 1 >= self.cfg.max_model_len:
            return None
        return row

    def _fill_token_mask(self, plan, b: _StepBuilder) -> None:
        """Structured outputs: the bitmask of each sampling row with a grammar, computed on
        the host from its matcher, which has taken every token before the sampled position
        (sync: ``update`` ran; async: ``_ahead_row`` never schedules a grammar row ahead of
        its pending token, so such a row decodes every other step). Rows without a grammar
        keep all bits set and are not read (``uses_grammar`` 0)."""
        rows = [
            (s, req.grammar)
            for s, req in enumerate(b.requests)
            if req.grammar is not None and b.samples[s]
        ]
        if not rows:
            return
        mask = np.full((plan.shape.num_seqs, rows[0][1].mask_words), -1, np.int32)
        for s, grammar in rows:
            grammar.fill_mask(mask[s])
        plan.token_mask = mask

    def _free(self, req: Request) -> None:
        """Frees finished ``req``'s blocks and slot now, or, with async scheduling, at the
        ``update`` of the last scheduled step with a row of it (that step still reads and
        writes them on the device while the host schedules the next one)."""
        if self.async_scheduling and req.request_id in self._rows_in_flight:
            self._free_after[req.request_id] = req
        else:
            self.cache.free(req)

    def _add_row(
        self,
        b: _StepBuilder,
        req: Request,
        start: int,
        n: int,
        src: int,
        ahead: int | None = None,
        drafts: list[int] = (),
        alloc=None,
    ) -> None:
        """Schedules tokens ``[start, start + n)`` of running ``req`` (blocks already held).
        ``ahead``: the previous plan's row that samples the one token ``[start, start + 1)``
        (async scheduling; its id is spliced in on device). ``drafts``: a decode row's draft
        tokens after them (a verify row; their blocks held too, per-token slots taken here
        or fewer drafts). ``alloc``: the request's allocation, if the caller has it."""
        if alloc is None:
            alloc = self.cache.alloc(req.request_id)
        end = start + n
        if self.cfg.enable_prefix_caching:
            if end // self.cfg.block_size > alloc.num_registered:  # a block got full
                self.cache.register_blocks(req, end)
            if end - end % self.cfg.granularity > start:  # crosses a boundary
                row = len(b.requests)
                for p, latest in self._checkpoint_positions(req, start, end):
                    slot = self.cache.add_checkpoint(req, p, latest)
                    if slot != NULL_ID:
                        b.ckpts.append((row, p - start, slot))
                        b.ckpt_written.append(slot)
                        b.slots_held.append(slot)
        b.requests.append(req)
        b.table_rows.append(alloc.row)
        b.starts.append(start)
        b.q_lens.append(n)
        if ahead is None:
            b.input_ids += req.all_token_ids[start:end]
        else:
            assert n == 1 and start == len(req.all_token_ids), (req.request_id, start, n)
            b.from_prev.append((len(b.input_ids), ahead))
            b.input_ids.append(0)  # a placeholder: the device reads the previous step's token
        if req.sampling_params.prompt_logprobs is not None:
            self._score_prompt(b, req, start, end, len(b.input_ids) - n)
        b.src.append(src)
        b.dst.append(alloc.running_slot)
        b.next_ids.append(req.all_token_ids[end] if end < len(req.all_token_ids) else -1)
        if drafts:
            slots = self.cache.allocate_spec_slots(len(drafts))
            drafts = list(drafts[: len(slots)])
        if drafts:
            row = len(b.requests) - 1
            b.ckpts += [(row, j + 1, slot) for j, slot in enumerate(slots)]
            b.input_ids += drafts
            b.q_lens[-1] += len(drafts)
            b.spec[row] = SpecRow(alloc, slots, start)
            req.draft_token_ids = []
            end += len(drafts)
        b.drafts.append(list(drafts))
        samples = end >= len(req.all_token_ids)
        b.samples.append(samples)
        req.num_computed_tokens = end
        rid = req.request_id
        self._rows_in_flight[rid] = self._rows_in_flight.get(rid, 0) + 1
        if samples:
            assert ahead is not None or not req.awaiting_token, rid
            req.awaiting_token = True
            self._tokens_in_flight[rid] = self._tokens_in_flight.get(rid, 0) + 1
            self._sampling_row[rid] = (b.step_id, len(b.requests) - 1)

    def _score_prompt(self, b: _StepBuilder, req: Request, start: int, end: int, base: int) -> None:
        """Prompt logprobs: the row's positions ``p`` in ``[start, end)`` not scored yet and
        below the prompt's last; the logits at token index ``base + p - start`` score token
        ``p + 1``::

            prompt      t0 t1 t2 t3 t4 t5        P = 6: positions 0..4 score t1..t5
            chunk 1     [t0 t1 t2 t3)            scores t1 t2 t3 t4 (positions 0..3)
            chunk 2                 [t4 t5)      scores t5 (position 4); 5 samples
        """
        if not req.needs_prompt_logprobs:
            return
        first = max(start, req.prompt_logprobs_next)
        last = min(end, req.num_prompt_tokens - 1)
        if first >= last:
            return
        assert last - first <= b.plp_left, (req.request_id, first, last, b.plp_left)
        b.prompt_logprobs.append((req.request_id, first, len(b.prompt_lp), last - first))
        ids = req.prompt_token_ids
        b.prompt_lp += [(base + p - start, ids[p + 1]) for p in range(first, last)]
        b.plp_left -= last - first
        req.prompt_logprobs_next = last

    def _checkpoint_positions(self, req: Request, start: int, end: int) -> list[tuple[int, bool]]:
        """Boundaries in ``(start, end]`` to checkpoint, each with "is the latest" flag.

        Retained: multiples of R, the prompt end, the request's latest boundary, and the
        shared-prefix junctions found at admission (``req.junctions``).
        """
        g, r = self.cfg.granularity, self.cfg.retention_interval
        first = (start // g + 1) * g
        if first > end:
            return []
        prompt_end = (req.num_prompt_tokens - 1) // g * g
        latest = req.num_tokens // g * g
        if latest < req.num_prompt_tokens:
            latest = -1
        out = []
        for p in range(first, end + 1, g):
            if p in (latest, prompt_end) or p in req.junctions or (r and p % r == 0):
                out.append((p, p == latest))
        assert len(out) <= self.cfg.max_ckpt, (out, self.cfg.max_ckpt)
        return out

    def _fcfs_order(self) -> Iterator[Request]:
        """The head of the waiting queue, as long as there is one (admission pops it)."""
        while self.waiting:
            yield self.waiting[0]

    def _lpm_order(self) -> list[Request] | None:
        """The waiting requests by longest cache hit, ties in arrival order (``lpm``), or
        None: arrival order (``fcfs``, or a queue past ``LPM_WINDOW``). A hit pending in a
        step not yet updated counts as none here (it is passed over at admission). Admission
        looks each request up again: an admission before it may have taken what this saw."""
        if self.cfg.scheduling_policy != "lpm" or len(self.waiting) > LPM_WINDOW:
            return None

        def hit_len(req: Request) -> int:
            if req.status is not RequestStatus.WAITING or req.needs_prompt_logprobs:
                return 0
            hit = self.cache.lookup(req)
            return hit.num_tokens if hit is not None else 0

        return sorted(self.waiting, key=hit_len, reverse=True)  # stable: ties keep arrival

    def _junctions(self, req: Request, hit: int, kv_hit: int) -> tuple[int, ...]:
        """Shared-prefix boundaries ``req``'s prefill should checkpoint (at most two).

        Checkpoints are written inside the chunk that crosses them, so they cost no split:

        - the KV prefix is cached past the state hit: another request computed it, so a
          third one is likely; checkpoint its last boundary (Marconi-style junction);
        - a waiting request shares a prefix with ``req`` (compared by chained block hashes,
          binary search over the first ``JUNCTION_LOOKAHEAD`` waiting requests): checkpoint
          where they branch, so it hits when admitted instead of recomputing the prefix.
        """
        if not self.cfg.enable_prefix_caching:
            return ()
        g, bs = self.cfg.granularity, self.cfg.block_size
        out = set()
        if kv_hit // g * g > hit:
            out.add(kv_hit // g * g)
        best = 0
        for other in itertools.islice(self.waiting, JUNCTION_LOOKAHEAD):
            if other.status is not RequestStatus.WAITING:
                continue
            common = _common_prefix_blocks(req.block_hashes, other.block_hashes) * bs
            best = max(best, min(common, other.num_tokens - 1, req.num_tokens) // g * g)
        if best > hit:
            out.add(best)
        return tuple(sorted(out))

    def _preempt(self, req: Request) -> None:
        self.cache.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(req)

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        sp = req.sampling_params
        if (not sp.ignore_eos and tok == req.eos_token_id) or tok in sp.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _set_finished(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._requests.pop(req.request_id, None)

    @staticmethod
    def _report(req: Request, tokens: list[int], reason: FinishReason | None) -> RequestUpdate:
        return RequestUpdate(
            req.request_id, tokens, reason is not None, reason, req.num_cached_tokens, req.error
        )


@dataclasses.dataclass
class _StepBuilder:
    """The rows of the step being scheduled, as flat lists for ``build_plan``."""

    step_id: int
    requests: list[Request] = dataclasses.field(default_factory=list)
    table_rows: list[int] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    q_lens: list[int] = dataclasses.field(default_factory=list)
    input_ids: list[int] = dataclasses.field(default_factory=list)
    src: list[int] = dataclasses.field(default_factory=list)
    dst: list[int] = dataclasses.field(default_factory=list)
    samples: list[bool] = dataclasses.field(default_factory=list)
    ckpts: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    ckpt_written: list[int] = dataclasses.field(default_factory=list)
    slots_held: list[int] = dataclasses.field(default_factory=list)
    from_prev: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    plp_left: int = 0  # prompt positions this step may still score
    prompt_lp: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (index, target)
    prompt_logprobs: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    drafts: list[list[int]] = dataclasses.field(default_factory=list)
    next_ids: list[int] = dataclasses.field(default_factory=list)  # -1: the row samples it
    spec: dict[int, SpecRow] = dataclasses.field(default_factory=dict)
