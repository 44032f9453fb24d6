"""Speculative decoding in the scheduler, against the fake runner (``sched_helpers``).

The fake runner checks every verify row (its known token and drafts in the KV cache, ``src``
holding exactly the tokens before it, per-token checkpoint writes) and accepts drafts greedily
against the fake model; the next row's ``src`` check then proves that the slot rotation picked
the state after the accepted prefix.
"""

import numpy as np
import pytest
from sched_helpers import (
    FakeDrafter,
    FakeRunner,
    expected_output,
    make_request,
    make_scheduler,
    prompt,
    run_all,
    step,
)

from serving.core.speculative import NgramDrafter, SpeculativeConfig, ngram_propose


def _check_freed(s):
    s.cache.check_invariants()
    assert s.cache.kv.num_free == s.cache.kv.num - 1, "KV blocks leaked"
    assert s.cache.state.num_free == s.cache.state.num - 1, "state slots leaked"


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_rows_give_the_plain_outputs(caching, k):
    s = make_scheduler(caching=caching, num_spec=k, drafter=FakeDrafter(), num_kv_blocks=128)
    runner = FakeRunner(16)
    reqs = [make_request(f"r{i}", prompt(20 + 37 * i, 1000 * i), max_tokens=90) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    outs = run_all(s, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 90)
    m = s.stats().spec
    assert m.num_accepted_tokens > 0 and m.num_draft_tokens > m.num_accepted_tokens
    assert len(m.accepted_per_pos) == k and m.accepted_per_pos[k - 1] > 0
    assert any(o.spec for o in outs)
    # a step of short rows only (decode and verify rows) runs in a verify bucket, others not
    for o in outs:
        shape, lens = o.plan.shape, o.num_new_tokens
        assert shape.verify_only == (max(lens) <= k + 1 and sum(lens) > len(lens)), (shape, lens)
    assert any(o.plan.shape.verify_only for o in outs)
    # fewer steps than tokens: drafts were accepted
    assert len(outs) < 90 + 4
    _check_freed(s)


def test_verify_row_layout_and_slot_rotation():
    s = make_scheduler(caching=False, num_spec=3, num_state_slots=8)
    runner = FakeRunner(16)
    r = make_request("a", prompt(10), max_tokens=20)
    s.add_request(r)
    step(s, runner)  # prefill: one token
    true = expected_output(r.prompt_token_ids, 4)
    r.draft_token_ids = [true[1], true[2], true[3] + 1]  # the third one is wrong
    running = s.cache.alloc("a").running_slot
    out = s.schedule()
    assert out.num_new_tokens == [4] and out.plan.shape.num_spec == 3
    assert out.plan.shape.max_row_tokens == 4  # a verify bucket
    plan = out.plan
    assert plan.input_ids[:4].tolist() == [true[0], true[1], true[2], true[3] + 1]
    assert plan.src_slot[0] == plan.dst_slot[0] == running
    slots = out.spec[0].slots
    assert len(slots) == 3 and running not in slots
    assert plan.ckpt_offsets[0, :3].tolist() == [1, 2, 3]
    assert plan.ckpt_slots[0, :3].tolist() == slots
    assert plan.num_drafts[:1].tolist() == [3]
    assert plan.logits_indices[:4].tolist() == [0, 1, 2, 3]
    assert r.num_computed_tokens == 14
    (u,) = s.update(out, runner.execute(out))
    # d1, d2 accepted, d3 rejected: the target's own token replaces it
    assert u.new_token_ids == true[1:4]
    assert s.cache.alloc("a").running_slot == slots[2]  # the state after t, d1, d2
    assert r.num_computed_tokens == 13
    assert s.stats().spec.accepted_per_pos == [1, 1, 0]
    run_all(s, runner)
    assert r.output_token_ids == expected_output(r.prompt_token_ids, 20)
    _check_freed(s)


def test_drafts_capped_by_max_tokens_and_a_stop_inside_the_run_truncates():
    s = make_scheduler(caching=False, num_spec=4, drafter=FakeDrafter(wrong_every=10**6))
    runner = FakeRunner(16)
    r = make_request("a", prompt(10), max_tokens=3)
    s.add_request(r)
    step(s, runner)
    out, (u,) = step(s, runner)
    assert out.num_new_tokens == [2]  # k = max_tokens - 1 output - 1 = 1
    assert u.finished and u.finish_reason == "length" and len(r.output_token_ids) == 3
    true = expected_output(prompt(10), 8)
    s2 = make_scheduler(caching=False, num_spec=4, drafter=FakeDrafter(wrong_every=10**6))
    r2 = make_request("b", prompt(10), max_tokens=8, stop_token_ids=(true[2],))
    s2.add_request(r2)
    step(s2, runner)
    out, (u,) = step(s2, runner)
    assert out.num_new_tokens == [5]  # all 4 drafts verified
    assert u.new_token_ids == true[1:3] and u.finish_reason == "stop"
    _check_freed(s)
    _check_freed(s2)


def test_verify_rows_never_cross_a_checkpoint_boundary():
    """With caching, a row feeds no draft at or past the next boundary: boundaries are
    checkpointed at offset 1 of a row, by known tokens, and an identical follow-up hits them."""
    s = make_scheduler(caching=True, num_spec=5, drafter=FakeDrafter(wrong_every=10**6))
    runner = FakeRunner(16)
    r = make_request("a", prompt(50), max_tokens=100)
    s.add_request(r)
    outs = run_all(s, runner)
    for o in outs:
        for spec in o.spec.values():
            k = len(spec.slots)
            first = ((spec.start + 1) // 64 + 1) * 64
            assert spec.start + 1 + k <= first - 1, (spec.start, k)
    assert r.output_token_ids == expected_output(r.prompt_token_ids, 100)
    # the decode boundary 128 was checkpointed: a follow-up resumes there
    f = make_request("f", r.all_token_ids + prompt(5, 9000), max_tokens=2)
    s.add_request(f)
    run_all(s, runner)
    assert f.num_cached_tokens == 128
    assert f.output_token_ids == expected_output(f.prompt_token_ids, 2)


def test_short_kv_pool_drops_drafts_before_preempting():
    s = make_scheduler(caching=False, num_spec=4, drafter=FakeDrafter(), num_kv_blocks=3)
    runner = FakeRunner(16)
    r = make_request("a", prompt(28), max_tokens=4)
    s.add_request(r)
    run_all(s, runner)
    assert r.output_token_ids == expected_output(prompt(28), 4)
    assert s.stats().num_preemptions == 0
    _check_freed(s)


def test_no_drafts_for_token_tables_or_logprobs():
    s = make_scheduler(caching=False, num_spec=3, drafter=FakeDrafter())
    runner = FakeRunner(16)
    a = make_request("a", prompt(10), max_tokens=10, presence_penalty=0.5)
    b = make_request("b", prompt(12, 500), max_tokens=10, logprobs=2)
    s.add_request(a)
    s.add_request(b)
    outs = run_all(s, runner)
    assert not any(o.spec for o in outs)


def test_abort_with_a_verify_row_in_flight_frees_its_slots():
    s = make_scheduler(caching=True, num_spec=3, drafter=FakeDrafter(wrong_every=10**6))
    runner = FakeRunner(16)
    r = make_request("a", prompt(10), max_tokens=30)
    s.add_request(r)
    step(s, runner)
    out = s.schedule()
    assert out.spec
    sampled = runner.execute(out)
    s.finish_request("a")
    assert s.update(out, sampled) == []
    _check_freed(s)


def test_ngram_propose():
    toks = [1, 2, 3, 9, 8, 7, 1, 2, 3, 5, 1, 2, 3]
    # "1 2 3" last seen at 6: followed by 5, 1, 2
    assert ngram_propose(toks, 1, 3, 3) == [5, 1, 2]
    assert ngram_propose(toks, 1, 3, 10) == [5, 1, 2, 3]
    assert ngram_propose([4, 5, 6], 1, 3, 2) == []
    assert ngram_propose([4, 5, 4], 1, 3, 2) == [5, 4]
    assert ngram_propose([4, 5, 4], 2, 3, 2) == []
    assert ngram_propose([7], 1, 3, 2) == []
    assert NgramDrafter(1, 2).propose(make_request("x", [3, 1, 3]), 1) == [1]


def test_speculative_config_parse():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert cfg == SpeculativeConfig("ngram", 4, 1, 3)
    assert SpeculativeConfig.parse(None) is None
    cfg = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
    )  # fmt: skip
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    assert not cfg.device_drafts
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}').device_drafts
    for bad, msg in [
        ("{", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 1}', "not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
        ('{"method": "ngram"}', "needs"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unknown keys"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 3}', "prompt_lookup_min"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


def test_sampled_array_of_a_plain_step_still_works():
    """A step without verify rows in a speculating scheduler (decode-only) samples i32[S]."""
    s = make_scheduler(caching=False, num_spec=2)
    runner = FakeRunner(16)
    s.add_request(make_request("a", prompt(5), max_tokens=3))
    outs = run_all(s, runner)
    assert [o.plan.shape.num_spec for o in outs] == [2, 0, 0]


def _ngram_oracle(tokens, min_n, max_n, k):
    """Prompt lookup by brute force: for n from max_n down, the latest earlier window."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_propose_matches_brute_force_and_its_incremental_copy():
    rng = np.random.default_rng(0)
    for _ in range(400):
        vocab = int(rng.integers(2, 6))  # small vocabularies: many, overlapping matches
        toks = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 5))
        assert ngram_propose(toks, min_n, max_n, k) == _ngram_oracle(toks, min_n, max_n, k), (
            toks, min_n, max_n, k,
        )  # fmt: skip
    # the drafter's int32 copy of the request's tokens follows appends across steps
    req = make_request("r", [1, 2, 3, 1, 2])
    drafter = NgramDrafter(1, 3)
    for tok in [3, 7, 1, 2, 3] * 30:
        assert drafter.propose(req, 3) == _ngram_oracle(req.all_token_ids, 1, 3, 3)
        req.all_token_ids.append(tok)
    assert req.token_mirror.n == len(req.all_token_ids) - 1


@pytest.mark.parametrize("cap", [3, 5])
def test_no_row_speculates_while_the_batch_is_at_the_cap(cap):
    """disable_by_batch_size: steps that start with >= cap running requests verify nothing
    (plain decode buckets); as requests finish and the batch drops below it, rows speculate
    again. Outputs stay the plain ones either way."""
    s = make_scheduler(
        caching=False, num_spec=2, drafter=FakeDrafter(), num_kv_blocks=128,
        spec_disable_batch_size=cap,
    )  # fmt: skip
    runner = FakeRunner(16)
    reqs = [make_request(f"r{i}", prompt(20, 1000 * i), max_tokens=10 + 30 * i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    seen_full = seen_spec = False
    while s.has_unfinished_requests():
        running = len([r for r in s.running if not r.is_finished])
        out, _ = step(s, runner)
        if out is None:
            continue
        if running >= cap:
            assert not out.spec and not out.plan.shape.verify_only, running
            seen_full = True
        elif out.spec:
            seen_spec = True
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
    assert seen_full == (cap <= 4) and seen_spec
    _check_freed(s)


def test_disable_by_batch_size_is_checked():
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}'
    )
    assert cfg.disable_by_batch_size == 8
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            SpeculativeConfig("ngram", 2, disable_by_batch_size=bad)


def test_the_engine_passes_disable_by_batch_size_to_its_scheduler():
    from hyjax.assets import model_dir
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    spec = '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 3}'
    engine = LLMEngine(
        EngineArgs(model=model_dir(), speculative_config=spec, max_num_seqs=4,
                   max_num_batched_tokens=64, max_model_len=256, warmup=False, progress=False)
    )  # fmt: skip
    assert engine.sched_config.spec_disable_batch_size == 3
    assert engine.scheduler.cfg.spec_disable_batch_size == 3
