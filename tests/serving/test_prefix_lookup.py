"""Align-mode hit lookup: hit = largest written checkpoint <= longest cached KV prefix.

Block size 16 and granularity G = 64 unless a test says otherwise.
"""

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


def serve(s, runner, req):
    s.add_request(req)
    run_all(s, runner)
    assert req.output_token_ids == expected_output(req.prompt_token_ids, req.max_tokens)
    return req


@pytest.mark.parametrize("length", [1, 15, 16, 63, 64, 65, 127, 128, 129, 200, 256, 300])
def test_exact_repeat_hits_the_last_boundary_below_the_last_token(length):
    s, runner = make_scheduler(), FakeRunner(16)
    serve(s, runner, make_request("a", prompt(length)))
    b = serve(s, runner, make_request("b", prompt(length)))
    assert b.num_cached_tokens == (length - 1) // 64 * 64
    m = s.cache.metrics
    assert m.effective_hit_tokens == b.num_cached_tokens
    assert m.kv_hit_tokens == (length - 1) // 16 * 16  # the KV hit is capped at length - 1


def test_shared_prefix_hits_the_prompt_end_checkpoint_of_the_first():
    s, runner = make_scheduler(), FakeRunner(16)
    a = serve(s, runner, make_request("a", prompt(128) + prompt(30, 5000)))
    b = serve(s, runner, make_request("b", prompt(128) + prompt(50, 7000)))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 128
    src = next(x for x in runner.reads if x[0] == "b")
    assert src[1] != 0 and src[2] == 128  # b's first step reads the checkpoint slot


@pytest.mark.parametrize(
    ("retention", "expected"),
    [pytest.param(0, 0, id="R=0-no-middle-checkpoint"), pytest.param(64, 128, id="R=64")],
)
def test_nested_prefix_needs_a_checkpoint_inside_it(retention, expected):
    s, runner = make_scheduler(retention=retention), FakeRunner(16)
    serve(s, runner, make_request("a", prompt(200)))
    b = serve(s, runner, make_request("b", prompt(150)))
    assert b.num_cached_tokens == expected
    m = s.cache.metrics
    assert m.kv_hit_tokens == 144  # KV hits either way; only the state decides
    assert m.effective_hit_tokens == expected
    assert m.state_hit_tokens == expected


def test_kv_hit_without_checkpoint_gives_zero_and_recomputes_into_fresh_blocks():
    s, runner = make_scheduler(), FakeRunner(16)
    serve(s, runner, make_request("a", prompt(60)))  # no boundary: no checkpoint at all
    s.add_request(make_request("b", prompt(60)))
    out = s.schedule()
    assert out.plan.src_slot[0] == 0 and out.num_new_tokens == [60]
    assert s.cache.metrics.kv_hit_tokens == 48 and s.cache.metrics.effective_hit_tokens == 0


def test_state_hit_without_kv_hit_is_counted_apart_from_the_effective_hit():
    s, runner = make_scheduler(num_kv_blocks=9), FakeRunner(16)  # 8 usable blocks
    serve(s, runner, make_request("a", prompt(100)))  # checkpoint at 64
    serve(s, runner, make_request("c", prompt(120, 5000)))  # evicts all of a's KV blocks
    b = serve(s, runner, make_request("b", prompt(100)))
    assert b.num_cached_tokens == 0
    m = s.cache.metrics
    assert (m.kv_query_tokens, m.kv_hit_tokens) == (320, 0)
    assert (m.state_query_tokens, m.state_hit_tokens, m.effective_hit_tokens) == (320, 64, 0)


def test_same_step_rule_defers_the_second_identical_prompt():
    s, runner = make_scheduler(), FakeRunner(16)
    a, b = make_request("a", prompt(100)), make_request("b", prompt(100))
    s.add_request(a)
    s.add_request(b)
    out1 = s.schedule()
    assert out1.request_ids == ["a"]  # b's best checkpoint (64) is pending in this step
    assert s.cache.metrics.deferred_same_step == 1
    out_overlap = s.schedule()  # scheduled before step 1 is updated: still pending
    assert out_overlap is None
    s.update(out1, runner.execute(out1))
    out2, _ = step(s, runner)
    assert out2.request_ids == ["a", "b"] and b.num_cached_tokens == 64
    assert out2.plan.src_slot[1] == out1.plan.ckpt_slots[0, 0]
    run_all(s, runner)
    assert b.output_token_ids == a.output_token_ids


def test_identical_prompts_without_a_checkpoint_run_in_the_same_step():
    s, runner = make_scheduler(), FakeRunner(16)
    s.add_request(make_request("a", prompt(50)))
    s.add_request(make_request("b", prompt(50)))
    out, _ = step(s, runner)
    assert out.request_ids == ["a", "b"] and list(out.plan.src_slot[:2]) == [0, 0]


@pytest.mark.parametrize(
    ("block_size", "granularity", "length", "hit"),
    [
        pytest.param(16, 128, 200, 128, id="B=16_G=128"),
        pytest.param(16, 128, 128, 0, id="B=16_G=128_len=G"),
        pytest.param(128, None, 300, 256, id="B=128_G=128"),
        pytest.param(32, 64, 97, 64, id="B=32_G=64"),
    ],
)
def test_granularity_variants(block_size, granularity, length, hit):
    s = make_scheduler(block_size=block_size, granularity=granularity, num_kv_blocks=256)
    runner = FakeRunner(block_size)
    serve(s, runner, make_request("a", prompt(length)))
    b = serve(s, runner, make_request("b", prompt(length)))
    assert b.num_cached_tokens == hit


def test_cache_salt_isolates_prefixes():
    s, runner = make_scheduler(), FakeRunner(16)
    a = make_request("a", prompt(100))
    a.cache_salt = "alice"
    serve(s, runner, a)
    b = make_request("b", prompt(100))
    b.cache_salt = "bob"
    c = make_request("c", prompt(100))
    c.cache_salt = "alice"
    assert serve(s, runner, b).num_cached_tokens == 0
    assert serve(s, runner, c).num_cached_tokens == 64


def test_multi_turn_follow_up_hits_the_latest_decode_checkpoint():
    s, runner = make_scheduler(), FakeRunner(16)
    a = serve(s, runner, make_request("a", prompt(60), max_tokens=80))  # 140 tokens, 139 fed
    turn2 = a.all_token_ids + prompt(20, 9000)
    b = serve(s, runner, make_request("b", turn2))
    assert b.num_cached_tokens == 128  # the decode boundary at 128, not the prompt's 0


def test_caching_disabled_never_hits_or_checkpoints():
    s, runner = make_scheduler(caching=False), FakeRunner(16)
    serve(s, runner, make_request("a", prompt(200)))
    b = serve(s, runner, make_request("b", prompt(200)))
    assert b.num_cached_tokens == 0
    assert s.cache.metrics.checkpoints_written == 0 and not s.cache.kv.table


def test_shared_prefix_junction_is_checkpointed_by_the_second_request():
    """a's checkpoints sit past the shared prefix; b finds KV to 144 but no state, so b's
    prefill writes the junction 128 inside its chunk, and c hits it."""
    s, runner = make_scheduler(), FakeRunner(16)
    shared = prompt(150)
    a = serve(s, runner, make_request("a", shared + prompt(100, 5000)))
    b = serve(s, runner, make_request("b", shared + prompt(40, 7000)))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert b.junctions == (128,)
    c = serve(s, runner, make_request("c", shared + prompt(60, 9000)))
    assert c.num_cached_tokens == 128
    assert s.cache.metrics.effective_hit_tokens == 128


def test_no_junction_when_the_state_hit_reaches_the_kv_hit():
    s, runner = make_scheduler(), FakeRunner(16)
    serve(s, runner, make_request("a", prompt(128) + prompt(30, 5000)))
    b = serve(s, runner, make_request("b", prompt(128) + prompt(50, 7000)))
    assert b.num_cached_tokens == 128 and b.junctions == ()


def test_waiting_requests_that_share_a_prefix_get_it_checkpointed_by_the_first():
    """Three requests with a 200-token shared prefix arrive together; the first one's prefill
    checkpoints 192 (where the waiting ones branch), so only it computes the prefix."""
    s, runner = make_scheduler(budget=256), FakeRunner(16)
    shared = prompt(200)
    reqs = [make_request(x, shared + prompt(30, 5000 + 100 * i)) for i, x in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    run_all(s, runner)
    a, b, c = reqs
    assert 192 in a.junctions
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == c.num_cached_tokens == 192
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
