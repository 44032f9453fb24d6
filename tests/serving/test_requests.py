"""Sampling parameter validation, add_request errors, stop conditions, finish_request."""

import numpy as np
import pytest
from sched_helpers import FakeRunner, make_request, make_scheduler, prompt, run_all, step

from serving.core.request import RequestStatus, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"temperature": -0.1}, "temperature=-0.1", id="temperature"),
        pytest.param({"temperature": float("nan")}, "temperature=nan", id="temperature-nan"),
        pytest.param({"top_p": 0.0}, "top_p=0.0", id="top_p-zero"),
        pytest.param({"top_p": 1.5}, "top_p=1.5", id="top_p-big"),
        pytest.param({"top_k": -2}, "top_k=-2", id="top_k"),
        pytest.param({"min_p": 1.5}, "min_p=1.5", id="min_p"),
        pytest.param({"max_tokens": 0}, "max_tokens=0", id="max_tokens"),
        pytest.param({"seed": -1}, "seed=-1", id="seed"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()


def test_top_k_minus_one_means_off():
    sp = SamplingParams(top_k=-1, stop="x")
    sp.validate()
    assert sp.top_k == 0 and sp.stop == ("x",)


def test_add_request_errors():
    s = make_scheduler(max_model_len=100)
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add_request(make_request("a", []))
    msg = (
        r"maximum context length is 100 tokens. However, you requested 110 tokens "
        r"\(90 in the prompt, 20 in the completion\)"
    )
    with pytest.raises(ValueError, match=msg):
        s.add_request(make_request("a", prompt(90), max_tokens=20))
    with pytest.raises(ValueError, match="your prompt has 100 tokens"):
        s.add_request(make_request("a", prompt(100), max_tokens=None))
    with pytest.raises(ValueError, match="top_p"):
        s.add_request(make_request("a", prompt(10), top_p=2.0))
    s.add_request(make_request("a", prompt(10)))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", prompt(10)))
    assert s.num_waiting == 1


def test_max_tokens_none_fills_the_context():
    s = make_scheduler(max_model_len=100)
    req = make_request("a", prompt(90), max_tokens=None)
    s.add_request(req)
    assert req.max_tokens == 10
    run_all(s, FakeRunner(16))
    assert len(req.output_token_ids) == 10 and req.finish_reason == "length"


def test_seeds_are_the_requests_or_random_uint32():
    s = make_scheduler()
    a, b = make_request("a", prompt(5), seed=2**32 + 7), make_request("b", prompt(5))
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out.plan.sampling.seeds.dtype == np.uint32
    assert out.plan.sampling.seeds[0] == 7 and out.plan.sampling.seeds[1] == b.seed


def run_one(eos=None, **params):
    s = make_scheduler()
    req = make_request("a", prompt(20), max_tokens=5, eos=eos, **params)
    s.add_request(req)
    updates = []
    runner = FakeRunner(16)
    while s.has_unfinished_requests():
        updates += step(s, runner)[1]
    return req, updates


def test_eos_stops_and_is_reported():
    ref, _ = run_one()
    first = ref.output_token_ids[0]
    req, updates = run_one(eos=first)
    assert req.output_token_ids == [first] and req.finish_reason == "stop"
    assert updates[-1].finished and updates[-1].new_token_ids == [first]
    req, _ = run_one(eos=first, ignore_eos=True)
    assert req.output_token_ids == ref.output_token_ids and req.finish_reason == "length"


def test_stop_token_ids_stop():
    ref, _ = run_one()
    req, _ = run_one(stop_token_ids=(ref.output_token_ids[2],))
    assert req.output_token_ids == ref.output_token_ids[:3] and req.finish_reason == "stop"


def test_finish_request_is_safe_for_any_state():
    s = make_scheduler(budget=128, max_num_seqs=2)
    runner = FakeRunner(16)
    s.add_request(make_request("run", prompt(10)))
    s.add_request(make_request("wait", prompt(200, 5000)))
    s.add_request(make_request("wait2", prompt(10, 9000)))
    out, _ = step(s, runner)
    assert out.request_ids == ["run", "wait"]  # wait: chunk [0, 64); wait2: no row left
    s.finish_request("wait2")
    s.finish_request("run")
    s.finish_request("run")  # twice
    s.finish_request("nobody")
    assert s.num_running == 1 and s.num_waiting == 0
    out = s.schedule()
    s.finish_request("wait")  # aborted while its step is in flight
    assert s.update(out, runner.execute(out)) == []
    assert not s.has_unfinished_requests()
    assert s.cache.kv.num_free == s.cache.kv.num - 1
    assert s.cache.state.num_free == s.cache.state.num - 1
    assert s.schedule() is None


def test_request_that_can_never_fit_errors_while_others_finish():
    s = make_scheduler(num_kv_blocks=9)  # 8 usable blocks = 128 tokens
    runner = FakeRunner(16)
    big = make_request("big", prompt(100), max_tokens=100)  # needs cdiv(199, 16) = 13 blocks
    ok = make_request("ok", prompt(50), max_tokens=20)
    s.add_request(ok)
    s.add_request(big)
    assert big.status is RequestStatus.FINISHED and big.finish_reason == "error"
    assert "13 KV blocks" in big.error
    out, updates = step(s, runner)
    assert out.request_ids == ["ok"]
    assert updates[0].request_id == "big" and updates[0].finish_reason == "error"
    assert updates[0].error == big.error
    run_all(s, runner)
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 20


def test_only_a_rejection_to_report_gives_a_plan_free_step():
    s = make_scheduler(num_kv_blocks=3)
    s.add_request(make_request("big", prompt(100)))
    assert s.has_unfinished_requests()
    out = s.schedule()
    assert out.plan is None and out.num_rows == 0
    (u,) = s.update(out, np.empty(0))
    assert u.finish_reason == "error" and not s.has_unfinished_requests()
