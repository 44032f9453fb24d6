"""The engine's own process: a loop that drains messages, steps the engine, reports deltas.

``engine_main`` is the target of the process ``serving.engine.engine_client`` spawns; it
builds the :class:`~serving.engine.llm_engine.LLMEngine` (this is where jax is imported: only
inside that process) and runs :class:`EngineLoop`, which only needs an object with the engine's
methods, so tests drive it in a thread with a fake engine::

    while not shut down:
        messages = inbox.get(...)          # block only while idle
        add / abort / stats / shutdown     # replies collected in `out`
        if engine.has_unfinished_requests():
            out += [Delta(...) for o in engine.step()]
        outbox.put(out)                    # one message list per iteration

A failing ``add_request`` rejects that request; a failing ``step`` finishes every live request
with reason "error" (their blocks and slots are released) and the loop goes on serving.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from serving.core.request import EngineRequest
from serving.engine.messages import (
    AbortRequest,
    Accepted,
    Delta,
    EngineInfo,
    EngineStats,
    Failed,
    GetStats,
    Ready,
    Rejected,
    Shutdown,
    StatsReply,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the inbox before checking its parent
PARENT_CHECK_S = 1.0


class _Queue(Protocol):
    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...
    def put(self, item: Any) -> None: ...


class EngineLoop:
    """Runs an engine against an inbox of ``ToEngine`` and an outbox of ``list[FromEngine]``.

    Args:
        engine: An ``LLMEngine`` (or anything with ``add_request``, ``abort_request``,
            ``step``, ``has_unfinished_requests`` and ``metrics``).
        inbox: Where ``EngineRequest``, ``AbortRequest``, ``GetStats`` and ``Shutdown``
            arrive.
        outbox: Where the loop puts one list of replies and deltas per iteration.
        parent_alive: Polled about once a second; the loop exits when it returns False (the
            HTTP process died without saying goodbye).
    """

    def __init__(
        self,
        engine: Any,
        inbox: _Queue,
        outbox: _Queue,
        parent_alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.parent_alive = parent_alive
        self.live: set[str] = set()  # accepted, not yet finished or aborted
        self._stop = False
        # seconds of the iterations that stepped, outside ``engine.step`` (``loop_seconds``)
        self.loop_seconds = 0.0

    def run(self) -> None:
        last_check = time.monotonic()
        while not self._stop:
            out: list = []
            idle = not self.engine.has_unfinished_requests()
            t0 = time.perf_counter()
            for msg in self._drain(block=idle):
                self._handle(msg, out)
            t1 = time.perf_counter()
            stepped = not self._stop and self.engine.has_unfinished_requests()
            if stepped:
                self._step(out)
            t2 = time.perf_counter()
            if out:
                self.outbox.put(out)
            if stepped:  # the drain counts unless it waited for work (idle)
                self.loop_seconds += (time.perf_counter() - t2) + (0.0 if idle else t1 - t0)
            now = time.monotonic()
            if now - last_check > PARENT_CHECK_S:
                last_check = now
                if not self.parent_alive():
                    log.warning("the HTTP process is gone: stopping the engine")
                    return

    def _drain(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self.inbox.get(block=block, timeout=IDLE_WAIT_S if block else None))
            while True:
                msgs.append(self.inbox.get(block=False))
        except queue.Empty:
            pass
        return msgs

    def _handle(self, msg: Any, out: list) -> None:
        if isinstance(msg, EngineRequest):
            rid = msg.request_id
            try:
                self.engine.add_request(msg)
            except ValueError as e:
                out.append(Rejected(rid, str(e), client_error=True))
            except Exception as e:  # an engine bug must not take the server down
                log.exception("add_request(%s) failed", rid)
                self._safe_abort(rid)
                out.append(Rejected(rid, f"internal error: {e!r}", client_error=False))
            else:
                self.live.add(rid)
                out.append(Accepted(rid))
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.live:
                self.live.discard(msg.request_id)
                self._safe_abort(msg.request_id)
        elif isinstance(msg, GetStats):
            stats = self.engine.metrics()
            if isinstance(stats, EngineStats):
                stats = dataclasses.replace(stats, loop_seconds=self.loop_seconds)
            out.append(StatsReply(msg.token, stats))
        elif isinstance(msg, Shutdown):
            for rid in sorted(self.live):
                self._safe_abort(rid)
                out.append(Delta(rid, [], "", True, "abort", 0, 0))
            self.live.clear()
            self._stop = True
        else:
            log.error("unknown message %r", msg)

    def _step(self, out: list) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; finishing %d live requests", len(self.live))
            for rid in sorted(self.live):
                self._safe_abort(rid)
                out.append(Delta(rid, [], "", True, "error", 0, 0, error=f"engine error: {e!r}"))
            self.live.clear()
            return
        for o in outputs:
            if o.request_id not in self.live:  # aborted meanwhile
                continue
            if o.finished:
                self.live.discard(o.request_id)
            out.append(
                Delta(
                    o.request_id,
                    list(o.delta_token_ids),
                    o.delta_text,
                    o.finished,
                    o.finish_reason,
                    len(o.prompt_token_ids),
                    o.num_cached_tokens,
                    error=o.error,
                    client_error=o.error is not None,
                    logprobs=[(t.token_id, t.logprob, t.top) for t in o.delta_logprobs]
                    if o.delta_logprobs
                    else None,
                    prompt_logprobs=[
                        None if e is None else (e.token_id, e.logprob, e.rank, e.top)
                        for e in o.prompt_logprobs
                    ]
                    if o.prompt_logprobs is not None
                    else None,
                )
            )

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("abort_request(%s) failed", rid)


def engine_info(engine: Any) -> EngineInfo:
    mem = engine.runner.memory
    return EngineInfo(
        max_model_len=engine.sched_config.max_model_len,
        vocab_size=engine.vocab_size,
        max_num_seqs=engine.sched_config.max_num_seqs,
        num_kv_blocks=mem.num_kv_blocks,
        num_state_slots=mem.num_state_slots,
    )


def engine_main(
    engine_kwargs: dict, inbox: _Queue, outbox: _Queue, log_level: int = logging.INFO
) -> None:
    """The engine process: builds the engine, says Ready (or Failed), runs the loop.

    Args:
        engine_kwargs: ``EngineArgs`` fields.
        inbox: The ``ToEngine`` queue.
        outbox: The ``list[FromEngine]`` queue.
        log_level: The HTTP process's (a spawned process starts with no logging set up).
    """
    # The HTTP process owns shutdown (drain, then Shutdown); a Ctrl-C or a SIGTERM sent to the
    # whole process group must not kill the engine under requests that are finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from serving.engine.logs import setup_logging

    setup_logging(quiet=log_level > logging.INFO)
    engine_kwargs = dict(engine_kwargs)
    multihost = engine_kwargs.pop("multihost", None)  # MultihostConfig fields: process 0
    broadcaster = None
    try:
        if multihost is not None:
            from serving.engine import multihost as mh

            lost = mh.exit_on_lost(outbox, Failed)
            engine, broadcaster = mh.start_leader(
                engine_kwargs, mh.MultihostConfig(**multihost), lost
            )
        else:
            from serving.engine.llm_engine import EngineArgs, LLMEngine

            engine = LLMEngine(EngineArgs(**engine_kwargs))
    except BaseException as e:  # noqa: BLE001  (report any start-up failure, then exit)
        log.exception("engine start-up failed")
        outbox.put([Failed(f"{type(e).__name__}: {e}")])
        return
    outbox.put([Ready(engine_info(engine))])
    parent = multiprocessing.parent_process()
    if broadcaster is not None:
        engine = mh.FatalStepErrors(engine, lost)
    try:
        EngineLoop(
            engine, inbox, outbox, parent_alive=parent.is_alive if parent else lambda: True
        ).run()
    finally:
        if broadcaster is not None:  # the followers exit too
            broadcaster.close()
        runner = getattr(engine, "runner", None)
        if runner is not None:  # exit now, not after the buckets left to warm up
            runner.stop_background_warmup()
    log.info("engine loop stopped")
