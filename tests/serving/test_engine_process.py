"""The engine loop against a fake engine, in a thread: message handling and failure paths."""

import dataclasses
import queue
import threading

import pytest

from serving.core.request import EngineRequest, SamplingParams
from serving.engine.engine_process import EngineLoop
from serving.engine.messages import (
    AbortRequest,
    Accepted,
    Delta,
    EngineStats,
    GetStats,
    Rejected,
    Shutdown,
    StatsReply,
)


@dataclasses.dataclass
class _Out:
    request_id: str
    prompt_token_ids: list
    delta_token_ids: list
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    error: str | None = None
    delta_logprobs: list | None = None
    prompt_logprobs: list | None = None


class FakeEngine:
    """Each request emits one token per step until it has ``max_tokens``; a prompt
    ``[666]`` makes ``add_request`` crash, ``[13]`` makes the next ``step`` crash."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.aborted: list[str] = []
        self.crash_step = False

    def add_request(self, request: EngineRequest) -> str:
        prompt = request.prompt
        if not prompt:
            raise ValueError("the prompt is empty")
        if prompt == [666]:
            raise RuntimeError("boom")
        if prompt == [13]:
            self.crash_step = True
        self.reqs[request.request_id] = [list(prompt), request.sampling_params.max_tokens, 0]
        return request.request_id

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        if self.crash_step:
            self.crash_step = False
            raise RuntimeError("device fell over")
        outs = []
        for rid, r in list(self.reqs.items()):
            r[2] += 1
            done = r[2] >= r[1]
            outs.append(_Out(rid, r[0], [7], "x", done, "length" if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def metrics(self):
        zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{**zeros, "num_running": len(self.reqs)})


@pytest.fixture
def loop():
    engine, inbox, outbox = FakeEngine(), queue.Queue(), queue.Queue()
    t = threading.Thread(target=EngineLoop(engine, inbox, outbox).run, daemon=True)
    t.start()
    yield engine, inbox, outbox
    inbox.put(Shutdown())
    t.join(5)
    assert not t.is_alive()


def _collect(outbox, until, timeout=5.0):
    got = []
    while not until(got):
        got.extend(outbox.get(timeout=timeout))
    return got


def _finished(rid):
    return lambda got: any(isinstance(m, Delta) and m.request_id == rid and m.finished for m in got)


def test_add_stream_finish(loop):
    engine, inbox, outbox = loop
    inbox.put(EngineRequest([1, 2, 3], SamplingParams(max_tokens=3), "a"))
    got = _collect(outbox, _finished("a"))
    assert isinstance(got[0], Accepted)
    deltas = [m for m in got if isinstance(m, Delta)]
    assert [d.text for d in deltas] == ["x"] * 3 and deltas[-1].finish_reason == "length"
    assert deltas[0].num_prompt_tokens == 3


def test_rejections_and_internal_errors(loop):
    engine, inbox, outbox = loop
    inbox.put(EngineRequest([], SamplingParams(), "bad"))
    inbox.put(EngineRequest([666], SamplingParams(), "crash"))
    inbox.put(EngineRequest([1], SamplingParams(max_tokens=2), "ok"))
    got = _collect(outbox, _finished("ok"))
    rej = {m.request_id: m for m in got if isinstance(m, Rejected)}
    assert rej["bad"].client_error and "empty" in rej["bad"].message
    assert not rej["crash"].client_error and "boom" in rej["crash"].message


def test_step_error_fails_live_requests_and_loop_goes_on(loop):
    engine, inbox, outbox = loop
    inbox.put(EngineRequest([1], SamplingParams(max_tokens=100), "a"))
    inbox.put(EngineRequest([13], SamplingParams(max_tokens=100), "b"))
    got = _collect(outbox, lambda g: _finished("a")(g) and _finished("b")(g))
    ends = [m for m in got if isinstance(m, Delta) and m.finished]
    assert {m.finish_reason for m in ends} == {"error"}
    assert all("device fell over" in m.error and not m.client_error for m in ends)
    assert sorted(engine.aborted) == ["a", "b"]
    inbox.put(EngineRequest([1], SamplingParams(max_tokens=1), "c"))  # still serving
    assert _collect(outbox, _finished("c"))


def test_abort_and_stats(loop):
    engine, inbox, outbox = loop
    inbox.put(EngineRequest([1], SamplingParams(max_tokens=10_000), "a"))
    _collect(outbox, lambda g: any(isinstance(m, Accepted) for m in g))
    inbox.put(AbortRequest("a"))
    inbox.put(AbortRequest("unknown"))  # ignored
    inbox.put(GetStats(7))
    got = _collect(outbox, lambda g: any(isinstance(m, StatsReply) for m in g))
    reply = next(m for m in got if isinstance(m, StatsReply))
    assert reply.token == 7 and reply.stats.num_running == 0
    assert engine.aborted == ["a"]


def test_the_outbox_is_written_by_the_sender_itself():
    """``PipeOutbox`` (the engine's replies to the HTTP process): ``put`` has sent the message
    when it returns, with no feeder thread to wait for the GIL (``multiprocessing.Queue``'s
    starts one and sends later), and the engine side unpickles the write end alone."""
    import multiprocessing

    from serving.engine.engine_client import EngineClient, PipeOutbox

    outbox = PipeOutbox(multiprocessing.get_context("spawn"))
    threads = threading.active_count()
    outbox.put([Accepted("a")])
    assert threading.active_count() == threads  # no thread started to send it
    assert outbox.get(block=False) == [Accepted("a")]  # already in the pipe
    with pytest.raises(queue.Empty):
        outbox.get(timeout=0.01)
    assert list(outbox.__getstate__()) == ["writer"]  # what Process() hands the engine
    assert isinstance(EngineClient({})._outbox, PipeOutbox)  # the one the server uses
