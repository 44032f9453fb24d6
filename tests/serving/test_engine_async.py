"""Async scheduling (``--async-scheduling``): the host schedules step N+1 while the device runs
step N, whose decode rows read their input token from step N's output on the device.

The engine tests run the tiny long-memory Qwen3-Next of ``test_engine.py``: async outputs must
be token-identical to sync ones (greedy and seeded sampling, prefix caching on and off, stop
ids, stop strings, ragged ``max_tokens``), the overlap must really happen (rows spliced on the
device), and every block and slot must come back; with ``--dispatch-thread`` (the steps launched
from a thread of their own) as well. The scheduler tests pin the bookkeeping of
a request that finishes while a later step still has its row.
"""

import threading

import numpy as np
import pytest

from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import run_waves
from tests.serving.sched_helpers import make_request, make_scheduler, prompt
from tests.serving.test_engine import BASE, workload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


@pytest.fixture(scope="module")
def engines(model_dir):
    """sync (caching off): the reference; async with caching on (its steps launched from the
    dispatch thread) and off (launched by the engine's thread)."""
    kw = dict(BASE, warmup=False)
    sync = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **kw))
    on = LLMEngine(EngineArgs(model=model_dir, async_scheduling=True, dispatch_thread=True, **kw))
    off = LLMEngine(
        EngineArgs(model=model_dir, async_scheduling=True, enable_prefix_caching=False, **kw)
    )
    for e in (on, off):
        _count_spliced(e)
    return sync, on, off


def _count_spliced(engine: LLMEngine) -> None:
    """Counts the tokens the engine's steps read from the previous step on the device, and
    records the threads that launched them."""
    engine.spliced, engine.launch_threads = 0, set()
    submit = engine.runner.submit

    def counting(plan, **kw):
        engine.spliced += len(kw.get("from_prev", ()))
        engine.launch_threads.add(threading.current_thread().name.split("_")[0])
        return submit(plan, **kw)

    engine.runner.submit = counting


def _assert_all_freed(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    m = engine.metrics()
    assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0
    engine.scheduler.cache.check_invariants()


def _tokens(outputs: dict) -> dict:
    return {n: (o.output_token_ids, o.finish_reason, o.text) for n, o in outputs.items()}


def test_async_is_token_identical_with_caching_on_and_off(engines):
    """The caching workload (two waves, hits, the same-step rule, a seeded sampled request)."""
    sync, on, off = engines
    want = _tokens(run_waves(sync, workload(seed=3)))
    for e in (on, off):
        spliced = e.spliced
        got = _tokens(run_waves(e, workload(seed=3)))
        assert got == want
        assert e.spliced - spliced > 100  # most decode tokens came from the device
        _assert_all_freed(e)
    assert on.metrics().effective_hit_tokens > 0
    assert on.launch_threads == {"hyjax-dispatch"} and off.launch_threads == {"MainThread"}
    for e in (on, off):  # every step's launch timed, on whichever thread ran it
        assert e.timing.launches >= e.timing.steps > 0 and e.timing.launch > 0


def test_only_decode_steps_run_ahead(engines):
    """A step with prefill tokens is reported before the next one is scheduled; decode steps
    keep one step in flight behind the one being reported."""
    _, _, e = engines
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    e.add_request(EngineRequest(list(range(3, 40)), params))
    in_flight = []
    while e.has_unfinished_requests():
        e.step()
        in_flight.append([out.plan.shape.decode_only for out, _ in e._in_flight])
    assert in_flight[0] == []  # the prefill step: reported, nothing dispatched after it
    assert in_flight[1] == [True]  # two decode steps dispatched, the older one reported
    assert in_flight[-1] == []
    _assert_all_freed(e)


def _stopping_workload(sync: LLMEngine) -> list:
    """Ragged prompts and max_tokens; requests that stop at a stop id or a stop string found
    in the sync run's own output (so they stop early, with a row already in the next step)."""
    rng = np.random.default_rng(11)
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 5, 17, 33, 64, 70, 90)]
    probe = {}
    for i, p in enumerate(prompts):
        probe[sync.add_request(EngineRequest(p, SamplingParams(max_tokens=30, **greedy)))] = i
    full = {probe[r]: o for r, o in sync.run_to_completion().items()}
    wave = []
    for i, p in enumerate(prompts):
        ids, text = full[i].output_token_ids, full[i].text
        wave.append((f"len_{i}", p, SamplingParams(max_tokens=1 + 3 * i, **greedy)))
        stop_id = SamplingParams(max_tokens=30, stop_token_ids=(ids[3 + i],), **greedy)
        wave.append((f"stop_id_{i}", p, stop_id))
        if len(text) > 8:
            stop = text[4 + i % 3 : 6 + i % 3]
            stop_str = SamplingParams(max_tokens=30, stop=(stop,), **greedy)
            wave.append((f"stop_str_{i}", p, stop_str))
        seeded = SamplingParams(max_tokens=12 + i, temperature=1.0, top_p=0.95, seed=100 + i)
        wave.append((f"seeded_{i}", p, seeded))
        wave.append((f"unseeded_{i}", p, SamplingParams(max_tokens=9, temperature=0.8)))
    return [wave]


def test_async_stops_and_lengths_are_exact(engines):
    sync, on, off = engines
    waves = _stopping_workload(sync)
    want = _tokens(run_waves(sync, waves))
    assert {r for _, r, _ in want.values()} >= {"stop", "length"}
    assert sum(n.startswith("stop_str") and v[1] == "stop" for n, v in want.items()) >= 3
    for e in (on, off):
        # The unseeded requests draw their seeds in arrival order: the same in every engine.
        e.scheduler._rng.seed(sync.args.seed)
        sync.scheduler._rng.seed(sync.args.seed)
        want = _tokens(run_waves(sync, waves))
        e.scheduler._rng.seed(sync.args.seed)
        got = _tokens(run_waves(e, waves))
        assert got == want
        _assert_all_freed(e)


def test_async_abort_mid_generation_frees_everything(engines):
    sync, on, off = engines
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (20, 45, 3)]
    for e in (on, off):
        ids = [e.add_request(EngineRequest(p, greedy)) for p in prompts]
        for _ in range(4):
            e.step()
        assert e._in_flight, "a step is in flight between engine steps"
        e.abort_request(ids[0])
        e.abort_request(ids[2])
        # Their rows in the step in flight still use their blocks and slots.
        assert e.scheduler.cache.num_running == 3
        final = e.run_to_completion()
        assert set(final) == {ids[1]}
        ref = sync.add_request(EngineRequest(prompts[1], greedy))
        assert final[ids[1]].output_token_ids == sync.run_to_completion()[ref].output_token_ids
        _assert_all_freed(e)


# ---------------------------------------------------------------- scheduler bookkeeping


def _async_scheduler(**kw):
    s = make_scheduler(**kw)
    s.async_scheduling = True
    return s


def test_a_row_scheduled_ahead_reads_the_previous_step_and_its_token_is_dropped():
    s = _async_scheduler(caching=False)
    s.add_request(make_request("x", prompt(5), max_tokens=10, stop_token_ids=(77,)))
    out0 = s.schedule()
    out1 = s.schedule()  # step 0 in flight: x's next row reads its token on the device
    assert out1.request_ids == ["x"] and out1.from_prev == [(0, 0)]
    assert out1.plan.input_ids[0] == 0 and out1.plan.seq_lens[0] == 6
    ups = s.update(out0, np.array([77], np.int32))  # x stops at step 0
    assert [(u.new_token_ids, u.finish_reason) for u in ups] == [([77], "stop")]
    assert s.cache.num_running == 1 and s.kv_usage > 0  # step 1 still uses them
    with pytest.raises(ValueError, match="already in use"):  # until its blocks are freed
        s.add_request(make_request("x", prompt(5)))
    assert s.has_unfinished_requests() and s.schedule() is None
    assert s.update(out1, np.array([5], np.int32)) == []  # the extra token is dropped
    assert s.cache.num_running == 0 and s.kv_usage == 0 and s.state_usage == 0
    assert not s.has_unfinished_requests()
    s.cache.check_invariants()


def test_an_abort_between_steps_frees_after_the_last_row():
    s = _async_scheduler(caching=False)
    s.add_request(make_request("x", prompt(5), max_tokens=10))
    out0 = s.schedule()
    out1 = s.schedule()
    s.update(out0, np.array([3], np.int32))
    out2 = s.schedule()
    assert out2.from_prev == [(0, 0)]
    s.finish_request("x")
    assert s.kv_usage > 0
    assert s.update(out1, np.array([4], np.int32)) == []
    assert s.kv_usage > 0  # step 2 still runs x's row
    assert s.update(out2, np.array([4], np.int32)) == []
    assert s.kv_usage == 0 and s.state_usage == 0 and not s.has_unfinished_requests()
    s.cache.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_no_row_ahead_when_the_host_needs_the_token_or_it_ends_the_request(caching):
    s = _async_scheduler(caching=caching, block_size=16)
    s.add_request(make_request("len", prompt(5), max_tokens=1))  # its first token ends it
    s.add_request(make_request("blk", prompt(15, 2000), max_tokens=10))  # token 16 fills a block
    s.schedule()
    out1 = s.schedule()
    assert out1 is None if caching else out1.request_ids == ["blk"]


def test_async_preemption_under_a_tiny_pool(model_dir):
    """test_engine.py's tiny pool (preemptions with caching on): async is token-identical to
    sync and gives every block and slot back."""
    tiny = dict(
        BASE,
        min_token_bucket=128,
        cache_bytes=45 * 4096 + 9 * 16896,
        num_checkpoint_slots=4,
        warmup=False,
    )
    sync = LLMEngine(EngineArgs(model=model_dir, **tiny))
    on = LLMEngine(EngineArgs(model=model_dir, async_scheduling=True, dispatch_thread=True, **tiny))
    _count_spliced(on)
    want = _tokens(run_waves(sync, workload(seed=1, max_tokens=80)))
    got = _tokens(run_waves(on, workload(seed=1, max_tokens=80)))
    assert got == want
    assert on.metrics().num_preemptions > 0 and on.spliced > 100
    _assert_all_freed(on)
