"""Random workloads against the scheduler, with up to two steps in flight.

After every rule: pool invariants hold, and every reference on a KV block or state slot has
exactly one owner (a running request, a request's latest checkpoint, or an in-flight step).
The fake runner checks every plan (KV contents, src state, checkpoint writes). At the end,
every request is finished, every output matches the fake model, and both pools are free.

A longer random soak: ``HYJAX_SCHED_EXAMPLES=3000 python -m pytest tests/serving -k stateful``.
"""

import collections
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_helpers import (
    FakeDrafter,
    FakeRunner,
    expected_output,
    make_request,
    make_scheduler,
    prompt,
)

from serving.core.request import RequestStatus

BASES = [prompt(300, 1000), prompt(300, 2000), prompt(40, 3000) + prompt(260, 4000)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([16, 32]),
        g_mult=st.sampled_from([1, 2]),
        r_mult=st.sampled_from([0, 1, 2]),
        max_num_seqs=st.integers(1, 4),
        budget_extra=st.integers(0, 100),
        num_kv_blocks=st.integers(6, 60),
        spare_slots=st.integers(0, 6),
        caching=st.sampled_from([True, True, True, False]),
        num_spec=st.sampled_from([0, 0, 1, 3]),
        async_sched=st.booleans(),
    )
    def setup(
        self,
        block_size,
        g_mult,
        r_mult,
        max_num_seqs,
        budget_extra,
        num_kv_blocks,
        spare_slots,
        caching,
        num_spec,
        async_sched,
    ):
        g = 64 * g_mult
        self.s = make_scheduler(
            block_size=block_size,
            granularity=g,
            retention=g * r_mult,
            max_num_seqs=max_num_seqs,
            budget=g + budget_extra,
            max_model_len=512,
            num_kv_blocks=num_kv_blocks,
            num_state_slots=1 + max_num_seqs + spare_slots,
            caching=caching,
            num_spec=num_spec,
            drafter=FakeDrafter() if num_spec else None,
            # async scheduling's ahead rows need the runner's splice, which the fake runner
            # does not play; with speculation there are none (verify rows instead)
            async_scheduling=async_sched and num_spec > 0,
        )
        self.runner = FakeRunner(block_size)
        self.inflight = collections.deque()
        self.requests = []

    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(1, 300),
        extra=st.integers(0, 40),
        max_tokens=st.integers(1, 60),
    )
    def add(self, base, cut, extra, max_tokens):
        tokens = BASES[base][:cut] + prompt(extra, 100_000 + 100 * len(self.requests))
        self.add_tokens(tokens, max_tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), extra=st.integers(0, 40), max_tokens=st.integers(1, 30))
    def add_follow_up(self, data, extra, max_tokens):
        """A next turn: an earlier request's tokens so far (maybe unfinished) plus more."""
        prev = data.draw(st.sampled_from(self.requests))
        tokens = prev.all_token_ids + prompt(extra, 200_000 + 100 * len(self.requests))
        if len(tokens) + max_tokens <= 512:
            self.add_tokens(tokens, max_tokens)

    def add_tokens(self, tokens, max_tokens):
        req = make_request(f"r{len(self.requests)}", tokens, max_tokens=max_tokens)
        self.s.add_request(req)
        self.requests.append(req)

    @precondition(lambda self: len(self.inflight) < 2)
    @rule()
    def schedule(self):
        out = self.s.schedule()
        if out is not None:
            sampled = self.runner.execute(out) if out.plan is not None else None
            self.inflight.append((out, sampled))

    @precondition(lambda self: self.inflight)
    @rule()
    def update(self):
        out, sampled = self.inflight.popleft()
        self.s.update(out, sampled if sampled is not None else [])

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish(self, data, reason):
        req = data.draw(st.sampled_from(self.requests))
        self.s.finish_request(req.request_id, reason)

    @invariant()
    def every_reference_has_one_owner(self):
        cache = self.s.cache
        cache.check_invariants()
        refs = [0] * cache.state.num
        for a in cache._allocs.values():
            refs[a.running_slot] += 1
            if a.latest_ckpt:
                refs[a.latest_ckpt] += 1
        for out, _ in self.inflight:
            for slot in out.slots_held:
                refs[slot] += 1
            for spec in out.spec.values():  # a verify row's per-token slots
                for slot in spec.slots:
                    refs[slot] += 1
        assert refs[1:] == cache.state.ref_cnt[1:], "a state slot reference has no owner"
        running = [r for r in self.s.running if r.status is RequestStatus.RUNNING]
        # async scheduling: a finished request keeps what it holds until its rows are done
        holders = [r.request_id for r in running] + list(self.s._free_after)
        assert sorted(holders) == sorted(cache._allocs)
        assert self.s.num_running + self.s.num_waiting == sum(
            not r.is_finished for r in self.requests
        )

    def teardown(self):
        if not hasattr(self, "s"):
            return
        while self.inflight:
            self.update()
        for _ in range(5000):
            if not self.s.has_unfinished_requests():
                break
            self.schedule()
            self.update()
            self.every_reference_has_one_owner()
        assert not self.s.has_unfinished_requests()
        cache = self.s.cache
        assert cache.kv.num_free == cache.kv.num - 1, "KV blocks leaked"
        assert cache.state.num_free == cache.state.num - 1, "state slots leaked"
        for req in self.requests:
            assert req.is_finished
            outs = req.output_token_ids
            assert outs == expected_output(req.prompt_token_ids, len(outs))
            if req.finish_reason == "length":
                assert len(outs) == req.max_tokens


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=int(os.environ.get("HYJAX_SCHED_EXAMPLES", 30)),
    stateful_step_count=50,
    deadline=None,
    derandomize="HYJAX_SCHED_EXAMPLES" not in os.environ,  # CI: the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
