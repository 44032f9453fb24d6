"""Scheduling: align-mode chunks, checkpoint writes, src/dst slots, plan contents, preemption.

Block size 16 and granularity G = 64 unless a test says otherwise; exact ids are pinned.
"""

import numpy as np
import pytest
from sched_helpers import (
    FakeRunner,
    expected_output,
    make_request,
    make_scheduler,
    prompt,
    run_all,
    step,
)


def chunks(outs, rid):
    return [o.num_new_tokens[o.request_ids.index(rid)] for o in outs if rid in o.request_ids]


@pytest.mark.parametrize(
    ("length", "budget", "expected"),
    [
        pytest.param(300, 128, [128, 128, 44], id="len=300_budget=128"),
        pytest.param(300, 100, [64, 64, 64, 64, 44], id="len=300_budget=100"),
        pytest.param(128, 128, [128], id="len=128_budget=128"),
        pytest.param(129, 128, [128, 1], id="len=129_budget=128"),
        pytest.param(50, 64, [50], id="len=50_budget=64"),
    ],
)
def test_prefill_chunks_end_on_multiples_of_G(length, budget, expected):
    s, runner = make_scheduler(budget=budget), FakeRunner(16)
    s.add_request(make_request("a", prompt(length), max_tokens=2))
    outs = run_all(s, runner)
    assert chunks(outs, "a") == [*expected, 1]  # then one decode
    assert [o.samples[0] for o in outs] == [False] * (len(expected) - 1) + [True, True]


def test_prefill_chunks_share_the_budget_with_decodes():
    s, runner = make_scheduler(budget=128), FakeRunner(16)
    s.add_request(make_request("d", prompt(10), max_tokens=20))
    step(s, runner)
    s.add_request(make_request("p", prompt(300, 5000)))
    out, _ = step(s, runner)
    assert out.request_ids == ["d", "p"] and out.num_new_tokens == [1, 64]  # 127 -> 64
    assert out.samples == [True, False]
    assert not out.plan.shape.decode_only


def test_a_waiting_request_waits_when_less_than_G_is_left_and_it_does_not_fit():
    s, runner = make_scheduler(budget=64), FakeRunner(16)
    for i in range(3):
        s.add_request(make_request(f"d{i}", prompt(10, 100 * i), max_tokens=10))
    step(s, runner)  # 3 prefills of 10
    s.add_request(make_request("long", prompt(100, 5000)))
    s.add_request(make_request("short", prompt(20, 6000)))
    out, _ = step(s, runner)
    assert out.request_ids == ["d0", "d1", "d2"]  # 61 left < 64 and 100 > 61: FCFS waits
    s.finish_request("long")
    out, _ = step(s, runner)
    assert out.request_ids == ["d0", "d1", "d2", "short"]


@pytest.mark.parametrize(
    ("length", "retention", "budget", "offsets"),
    [
        pytest.param(300, 0, 512, [256], id="R=0"),
        pytest.param(300, 64, 512, [64, 128, 192, 256], id="R=64"),
        pytest.param(300, 128, 512, [128, 256], id="R=128"),
        pytest.param(256, 0, 512, [192, 256], id="R=0_len=4G"),
        pytest.param(300, 64, 128, [64, 128], id="R=64_first-chunk-of-2"),
    ],
)
def test_checkpoint_writes_in_one_chunk(length, retention, budget, offsets):
    s = make_scheduler(retention=retention, budget=budget)
    s.add_request(make_request("a", prompt(length)))
    out = s.schedule()
    n = len(offsets)
    assert list(out.plan.ckpt_offsets[0, :n]) == offsets
    # slot 1 is a's running slot; checkpoints take the next ones in order
    assert list(out.plan.ckpt_slots[0, :n]) == list(range(2, 2 + n))
    assert not out.plan.ckpt_slots[0, n:].any()
    assert out.ckpt_written == list(range(2, 2 + n))


def test_prompt_end_checkpoint_is_written_by_the_chunk_that_reaches_it():
    s, runner = make_scheduler(budget=128), FakeRunner(16)
    s.add_request(make_request("a", prompt(300)))
    out1, _ = step(s, runner)
    out2, _ = step(s, runner)
    assert not out1.plan.ckpt_slots.any()
    assert out2.plan.ckpt_offsets[0, 0] == 128 and out2.plan.ckpt_slots[0, 0] == 2  # at 256


def test_decode_boundary_checkpoint_replaces_the_previous_one():
    s, runner = make_scheduler(), FakeRunner(16)
    a = make_request("a", prompt(60), max_tokens=80)
    s.add_request(a)
    outs = run_all(s, runner)
    writes = [
        (o.plan.positions[0] + 1, o.plan.ckpt_offsets[0, 0], o.plan.ckpt_slots[0, 0])
        for o in outs
        if o.plan.ckpt_slots.any()
    ]
    assert writes == [(64, 1, 2), (128, 1, 3)]  # the decode steps fed positions 63 and 127
    st = s.cache.state
    assert st.ref_cnt[2] == 0 and st.ref_cnt[3] == 0  # released to the LRU at finish
    assert list(st.free_queue)[-2:] == [2, 3]  # 2 was released first (when 128 was written)


def test_latest_checkpoint_is_held_while_the_request_runs():
    s, runner = make_scheduler(), FakeRunner(16)
    s.add_request(make_request("a", prompt(60), max_tokens=80))
    while s.cache.metrics.checkpoints_written < 2:
        step(s, runner)  # includes update: the step's own references are dropped
    st = s.cache.state
    assert st.ref_cnt[3] == 1 and not st.pending[3]  # the checkpoint at 128, held by a
    assert st.ref_cnt[2] == 0 and 2 in st.free_queue  # the one at 64, released to the LRU
    assert st.lookup_ready(st.hash_of[2]) == 2  # but still cached


def test_src_dst_slots_across_steps():
    s, runner = make_scheduler(budget=64), FakeRunner(16)
    s.add_request(make_request("a", prompt(100)))
    out1, _ = step(s, runner)
    out2, _ = step(s, runner)
    out3, _ = step(s, runner)
    assert (out1.plan.src_slot[0], out1.plan.dst_slot[0]) == (0, 1)  # no hit: zero state
    assert (out2.plan.src_slot[0], out2.plan.dst_slot[0]) == (1, 1)
    assert (out3.plan.src_slot[0], out3.plan.dst_slot[0]) == (1, 1)
    assert out1.plan.ckpt_slots[0, 0] == 2 and out1.plan.ckpt_offsets[0, 0] == 64
    run_all(s, runner)
    s.add_request(make_request("b", prompt(100)))
    out, _ = step(s, runner)
    assert out.plan.src_slot[0] == 2 and out.plan.dst_slot[0] == 1  # read ckpt, own slot 1
    out, _ = step(s, runner)
    assert out.plan.src_slot[0] == out.plan.dst_slot[0] == 1


def test_plan_contents_for_a_mixed_step():
    s, runner = make_scheduler(budget=128), FakeRunner(16)
    s.add_request(make_request("a", prompt(20), max_tokens=8))
    step(s, runner)  # a: blocks 1, 2
    s.add_request(make_request("b", prompt(40, 5000)))
    out = s.schedule()  # a decodes at position 20; b prefills 40 into blocks 3, 4, 5
    p = out.plan
    assert p.shape.num_tokens == 64 and p.shape.num_seqs == 2
    assert list(p.query_start_loc) == [0, 1, 41]
    assert list(p.seq_lens) == [21, 40]
    assert int(p.num_seqs) == 2
    assert list(p.positions[:3]) == [20, 0, 1] and p.positions[40] == 39
    assert p.slot_mapping[0] == 2 * 16 + 4  # block 2, offset 4
    assert list(p.slot_mapping[1:41]) == [3 * 16 + i for i in range(40)]
    assert not p.slot_mapping[41:].any()
    assert list(p.block_tables[0, :3]) == [1, 2, 0] and list(p.block_tables[1, :4]) == [3, 4, 5, 0]
    assert list(p.logits_indices) == [0, 40]
    assert p.input_ids[1] == 5000 and p.input_ids[40] == 5039
    s.update(out, runner.execute(out))


def test_decode_only_steps_use_T_equal_to_S():
    s, runner = make_scheduler(max_num_seqs=8), FakeRunner(16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt(10, 100 * i)))
    step(s, runner)
    out, _ = step(s, runner)
    shape = out.plan.shape
    assert shape.decode_only and shape.num_tokens == shape.num_seqs == 4
    assert list(out.plan.query_start_loc) == [0, 1, 2, 3, 3]
    assert out.plan.sampling.top_p[3] == 1.0 and out.plan.seq_lens[3] == 0  # padding row


def test_sampling_parameters_reach_the_plan_rows():
    s = make_scheduler()
    s.add_request(make_request("a", prompt(5), temperature=0.7, top_p=0.9, top_k=5, min_p=0.1))
    s.add_request(make_request("b", prompt(5), top_k=-1))
    p = s.schedule().plan.sampling
    np.testing.assert_allclose(p.temperature[:2], [0.7, 0.0])
    np.testing.assert_allclose(p.top_p[:2], [0.9, 1.0])
    assert list(p.top_k[:2]) == [5, 0]
    np.testing.assert_allclose(p.min_p[:2], [0.1, 0.0])


def test_no_checkpoint_without_a_spare_state_slot():
    s, runner = make_scheduler(max_num_seqs=2, num_state_slots=3), FakeRunner(16)
    a = make_request("a", prompt(200), max_tokens=10)
    s.add_request(a)
    run_all(s, runner)
    m = s.cache.metrics
    assert m.checkpoints_written == 0 and m.checkpoints_skipped_no_slot > 0
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 10)


def test_preemption_under_a_tiny_kv_pool_resumes_through_the_lookup():
    # 8 usable blocks; each request needs up to cdiv(48 + 40 - 1, 16) = 6.
    s, runner = make_scheduler(num_kv_blocks=9), FakeRunner(16)
    a = make_request("a", prompt(48), max_tokens=40)
    b = make_request("b", prompt(48, 5000), max_tokens=40)
    s.add_request(a)
    s.add_request(b)
    outs = run_all(s, runner)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert s.stats().num_preemptions == b.num_preemptions
    for r in (a, b):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 40)
    # After its preemption b replays prompt + outputs: one step with more than 1 token that
    # starts at b's hit and ends at its known tokens, then it samples its next output.
    replays = [o for o in outs[1:] if "b" in o.request_ids and o.num_new_tokens[-1] > 1]
    assert replays and replays[0].samples[-1]
    assert s.cache.kv.num_free == 8 and s.cache.state.num_free == s.cache.state.num - 1


def test_preempted_request_hits_its_own_decode_checkpoint_when_resumed():
    # 13 usable blocks. b writes its decode checkpoint at 64, is preempted when it needs a 6th
    # block (at position 80), and a's last block evicts only b's block [64, 80).
    s, runner = make_scheduler(num_kv_blocks=14), FakeRunner(16)
    a = make_request("a", prompt(100), max_tokens=30)
    b = make_request("b", prompt(60, 5000), max_tokens=40)
    s.add_request(a)
    s.add_request(b)
    outs = run_all(s, runner)
    assert b.num_preemptions == 1
    (resumed,) = [o for o in outs[1:] if o.request_ids == ["b"] and o.num_new_tokens[0] > 1]
    p = resumed.plan
    assert p.seq_lens[0] - p.query_start_loc[1] == 64  # starts at its hit
    assert p.seq_lens[0] == 81 and resumed.samples == [
        True
    ]  # replays [64, 81): prompt + 21 outputs
    assert p.src_slot[0] == 4 and p.dst_slot[0] == 1
    assert s.cache.metrics.effective_hit_tokens == 64
    assert b.num_cached_tokens == 0  # the hit at first schedule
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 40)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 30)


def test_max_num_seqs_limits_rows():
    s, runner = make_scheduler(max_num_seqs=2), FakeRunner(16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt(10, 100 * i)))
    out, _ = step(s, runner)
    assert out.request_ids == ["r0", "r1"] and s.num_waiting == 1
    run_all(s, runner)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_many_requests_with_shared_prefixes_match_the_uncached_outputs(policy):
    rng = np.random.default_rng(0)
    bases = [prompt(int(n), 1000 * k) for k, n in enumerate(rng.integers(40, 300, 4))]
    reqs = []
    for i in range(24):
        base = bases[int(rng.integers(0, 4))]
        cut = int(rng.integers(1, len(base) + 1))
        extra = prompt(int(rng.integers(0, 40)), 50_000 + 100 * i)
        reqs.append((f"r{i}", base[:cut] + extra, int(rng.integers(1, 30))))
    results = {}
    for caching in (True, False):
        s = make_scheduler(
            max_num_seqs=6, budget=192, num_kv_blocks=80, caching=caching,
            scheduling_policy=policy,
        )  # fmt: skip
        runner = FakeRunner(16)
        live = [make_request(rid, toks, max_tokens=mt) for rid, toks, mt in reqs]
        for r in live:
            s.add_request(r)
        run_all(s, runner)
        results[caching] = [r.output_token_ids for r in live]
        assert s.cache.kv.num_free == 79
    assert results[True] == results[False]


def test_exact_block_ids_and_eviction_order():
    s, runner = make_scheduler(num_kv_blocks=12), FakeRunner(16)
    a = make_request("a", prompt(40), max_tokens=1)
    s.add_request(a)
    out, _ = step(s, runner)
    assert list(out.plan.block_tables[0, :4]) == [1, 2, 3, 0]
    # a finished: block 3 (partial, unhashed) goes to the head; 2 then 1 (hashed) to the tail.
    assert list(s.cache.kv.free_queue) == [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 1]
    b = make_request("b", prompt(20, 5000), max_tokens=1)
    s.add_request(b)
    out, _ = step(s, runner)
    assert list(out.plan.block_tables[0, :3]) == [3, 4, 0]
    assert list(s.cache.kv.free_queue) == [4, 5, 6, 7, 8, 9, 10, 11, 2, 1, 3]
    # c repeats a's prompt: 32 KV tokens hit but no checkpoint exists below 40, so c computes
    # everything into fresh blocks; its full blocks duplicate a's hashes and stay unhashed.
    s.add_request(make_request("c", prompt(40), max_tokens=1))
    out, _ = step(s, runner)
    assert list(out.plan.block_tables[0, :4]) == [4, 5, 6, 0] and out.plan.src_slot[0] == 0
    assert s.cache.kv.lookup(a.block_hashes[0]) == 1
    assert list(s.cache.kv.free_queue) == [4, 5, 6, 7, 8, 9, 10, 11, 2, 1, 3]
    # Filling the pool takes unhashed blocks first, then evicts the least recently freed.
    s.add_request(make_request("d", prompt(144, 7000), max_tokens=1))  # 9 blocks
    out, _ = step(s, runner)
    assert list(out.plan.block_tables[0, :9]) == [4, 5, 6, 7, 8, 9, 10, 11, 2]
    assert s.cache.kv.lookup(a.block_hashes[1]) is None  # a's block 2: evicted
    assert s.cache.kv.lookup(a.block_hashes[0]) == 1  # a's block 1: still cached
    assert s.cache.kv.lookup(b.block_hashes[0]) == 3  # b's block 3: still cached


def test_overlap_preempted_request_waits_for_its_in_flight_token():
    # Steps scheduled before the previous one is updated (the engine's overlap). 19 usable
    # blocks: x holds 7, p (a 200-token prefill) 8, q 2 and awaits the token of step 2.
    s, runner = make_scheduler(budget=160, num_kv_blocks=20), FakeRunner(16)
    x = make_request("x", prompt(100), max_tokens=10)
    s.add_request(x)
    step(s, runner)
    p = make_request("p", prompt(200, 5000), max_tokens=1)
    q = make_request("q", prompt(20, 9000), max_tokens=2)
    s.add_request(p)
    s.add_request(q)
    out2 = s.schedule()
    assert out2.request_ids == ["x", "p", "q"] and out2.num_new_tokens == [1, 128, 20]
    sampled2 = runner.execute(out2)
    # p's last 72 tokens need 5 blocks: preempting q frees 2, so p preempts itself too and
    # nothing can run until step 2's tokens arrive.
    assert s.schedule() is None
    assert q.num_preemptions == 1 and p.num_preemptions == 1 and q.awaiting_token
    out3 = s.schedule()  # p is admitted again; q waits for its in-flight token, not resampled
    assert out3.request_ids == ["p"]
    sampled3 = runner.execute(out3)
    s.update(out2, sampled2)
    s.update(out3, sampled3)
    assert len(q.output_token_ids) == 1 and not q.awaiting_token
    run_all(s, runner)
    for r, n in ((x, 10), (p, 1), (q, 2)):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, n), r.request_id


def test_a_shared_prefix_checkpoint_outlives_the_unique_ones_freed_after_it():
    # Requests on one 64-token prefix, then requests whose prompt-end and decode-boundary
    # checkpoints (unique, freed later) churn through the state slots: the next request on the
    # prefix still hits it (segmented LRU; plain LRU evicted the prefix's checkpoint first).
    s, runner = make_scheduler(num_state_slots=10, num_kv_blocks=200), FakeRunner(16)
    base = prompt(64)
    for i in range(2):
        s.add_request(make_request(f"p{i}", base + prompt(8, 5000 + 100 * i)))
        run_all(s, runner)
    assert s.cache.metrics.effective_hit_tokens == 64  # p1 hit p0's checkpoint
    for i in range(12):
        s.add_request(make_request(f"u{i}", prompt(72, 9000 + 100 * i), max_tokens=24))
    run_all(s, runner)
    assert s.cache.metrics.checkpoints_written > 10  # the state slots turned over
    late = make_request("late", base + prompt(8, 7000))
    s.add_request(late)
    run_all(s, runner)
    assert late.num_cached_tokens == 64
    assert late.output_token_ids == expected_output(late.prompt_token_ids, 4)
    s.cache.check_invariants()


def _admissions(policy: str, budget: int, prompts: list[tuple[str, list[int]]], steps: int):
    """The rows of the first ``steps`` steps, ``[(request id, new tokens), ...]`` each, and
    the scheduler (run on to the end: every output must be the uncached model's)."""
    s, runner = (
        make_scheduler(budget=budget, max_num_seqs=6, scheduling_policy=policy),
        FakeRunner(16),
    )
    reqs = [make_request(rid, toks, max_tokens=3) for rid, toks in prompts]
    for r in reqs:
        s.add_request(r)
    rows = [list(zip(o.request_ids, o.num_new_tokens)) for o in run_all(s, runner)]
    for r, (_, toks) in zip(reqs, prompts):
        assert r.output_token_ids == expected_output(toks, 3), r.request_id
    return rows[:steps], s


def test_lpm_admits_cache_hits_before_a_prefix_that_does_not_fit():
    """Two prefixes, their requests interleaved. b1 computes its 64-token prefix: it cannot
    start while a0 runs (a chunk must end on G = 64), and in arrival order it holds a2 and a4
    back for 3 steps although their 8 tokens fit; longest prefix match admits them as soon as
    a0's checkpoint lands."""
    A, B = prompt(64, 1000), prompt(64, 5000)
    prompts = [(rid, base + prompt(8, 90_000 + 100 * i))
               for i, (rid, base) in enumerate(zip(["a0", "b1", "a2", "b3", "a4", "b5"],
                                                   [A, B, A, B, A, B]))]  # fmt: skip
    fcfs, _ = _admissions("fcfs", 64, prompts, 2)
    lpm, _ = _admissions("lpm", 64, prompts, 2)
    assert fcfs == [[("a0", 64)], [("a0", 8)]]
    assert lpm == [[("a0", 64)], [("a0", 8), ("a2", 8), ("a4", 8)]]


def test_lpm_passes_over_a_request_whose_checkpoint_is_being_written():
    """a1 hits a0's prefix, whose checkpoint a0's first step writes: a1 waits for it (no
    recomputing), and under lpm c2, which shares nothing, starts beside a0 instead of waiting
    behind a1."""
    A = prompt(64, 1000)
    prompts = [
        ("a0", A + prompt(8, 90_000)),
        ("a1", A + prompt(8, 90_100)),
        ("c2", prompt(16, 7000)),
    ]
    fcfs, s_fcfs = _admissions("fcfs", 96, prompts, 2)
    lpm, s_lpm = _admissions("lpm", 96, prompts, 2)
    assert fcfs[0] == [("a0", 72)] and ("a1", 8) in fcfs[1]
    assert lpm[0] == [("a0", 72), ("c2", 16)] and ("a1", 8) in lpm[1]
    assert s_fcfs.cache.metrics.deferred_same_step == s_lpm.cache.metrics.deferred_same_step == 1


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy 'priority' must be one of fcfs, lpm"):
        make_scheduler(scheduling_policy="priority")
