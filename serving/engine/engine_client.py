"""The HTTP side of the engine process: spawn it, send it messages, route its replies.

No jax here: the engine runs in a child process (``serving.engine.engine_process.engine_main``,
started with the ``spawn`` method, so the child imports jax and the parent never does). A
reader thread blocks on the outbox and hands each message list to the event loop, which
routes deltas to per-request ``asyncio.Queue`` s and resolves the futures of pending adds and
stats queries. If the engine process dies, every waiter gets an error, ``alive`` turns
False (``/health`` then answers 503) and ``on_dead`` is called once (the server then exits
non-zero, so that its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator, Callable

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


class EngineStartError(RuntimeError):
    """The engine process failed to start (bad model directory, out of memory, ...)."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more can be served."""


class RequestRejected(ValueError):
    """``add_request`` refused the request; ``client_error`` tells a 400 from a 500."""

    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error


class PipeOutbox:
    """The engine process's replies to the HTTP process: one pipe, written by the engine loop
    itself (each message list pickled and sent in the calling thread), read by the client's
    reader thread.

    ``multiprocessing.Queue`` hands each message to a feeder thread that sends it later; in
    the engine process that thread must wait for the GIL, which the engine loop holds for its
    step's host work (the whole step, under async scheduling). Its messages then reached the
    HTTP side late and in bursts (``benchmarks.frontend_rate``). A send here costs the loop
    its pickling and write, ~10-50 us a step. A full pipe blocks the writer until the reader
    drains it (back pressure, where the queue would buffer without bound). Writers in the
    engine process (the loop; the multihost leader's exit path) take turns on a lock."""

    def __init__(self, ctx) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # to the engine process: the write end only
        return {"writer": self._writer}

    def __setstate__(self, state: dict) -> None:
        self._reader, self._writer, self._lock = None, state["writer"], threading.Lock()

    def put(self, item) -> None:
        with self._lock:
            self._writer.send(item)

    def get(self, block: bool = True, timeout: float | None = None):
        """The next message list; ``queue.Empty`` when none came within ``timeout``."""
        if not self._reader.poll(timeout if block else 0):
            raise queue.Empty
        return self._reader.recv()

    # ``multiprocessing.Queue``'s shutdown calls, for the code that ends either kind: a send
    # has already written its bytes, so there is no feeder thread to flush or abandon.
    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass

    def cancel_join_thread(self) -> None:
        pass


@dataclasses.dataclass
class _Pending:
    accepted: asyncio.Future
    deltas: asyncio.Queue


class EngineClient:
    """Owns the engine process and speaks :mod:`serving.engine.messages` with it.

    Use: ``client.start()`` (blocks until the engine is ready), then inside the event loop
    ``client.attach()``; ``async for delta in client.generate(...)``; ``client.close()``.
    """

    def __init__(self, engine_kwargs: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = PipeOutbox(ctx)
        self._proc = ctx.Process(
            target=_engine_main,
            args=(engine_kwargs, self._inbox, self._outbox, logging.getLogger().level),
            name="hyjax-engine",
            daemon=True,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, _Pending] = {}
        self._stats: dict[int, asyncio.Future] = {}
        # The newest stats the engine sent: what /metrics shows while a step (a compile of a
        # new shape, say) keeps the engine from answering.
        self.last_stats: EngineStats | None = None
        self._tokens = itertools.count()
        self._reader: threading.Thread | None = None
        self._closing = False
        self.dead_reason: str | None = None
        self.info: EngineInfo | None = None
        # Called once, on the event loop, when the engine dies other than by ``close()``.
        self.on_dead: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float | None = None) -> EngineInfo:
        """Spawns the engine process and blocks until it is ready (compilation included)."""
        self._proc.start()
        while True:
            try:
                msgs = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineStartError(
                        f"the engine process exited with code {self._proc.exitcode}"
                    ) from None
                if timeout is not None:
                    timeout -= 1.0
                    if timeout <= 0:
                        self._proc.kill()
                        raise EngineStartError("the engine did not start in time") from None
                continue
            for m in msgs:
                if isinstance(m, Failed):
                    self._proc.join(timeout=10)
                    raise EngineStartError(m.message)
                if isinstance(m, Ready):
                    self.info = m.info
                    return m.info

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts routing the engine's messages into ``loop`` (default: the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="hyjax-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Asks the engine to abort what is left and exit; kills it if it does not."""
        self._closing = True
        if self._proc.is_alive():
            self._inbox.put(Shutdown())
            self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not exit: killing it")
            self._proc.kill()
            self._proc.join(5)
        self._inbox.cancel_join_thread()
        self._outbox.cancel_join_thread()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        """Adds a request and yields its deltas until the finished one.

        Raises ``RequestRejected`` (before the first delta) when the engine refuses it, and
        ``EngineDeadError`` if the engine goes away. Closing the iterator early (a client
        that disconnected, a cancelled task) aborts the request, which frees its blocks and
        slot.
        """
        deltas = await self.add(request)
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request.request_id)

    async def add(
        self, request: EngineRequest, deltas: asyncio.Queue | None = None
    ) -> asyncio.Queue:
        """Sends ``request`` and waits for ``Accepted`` (raises ``RequestRejected``).

        Returns the queue the request's ``Delta`` s arrive on (``deltas``, which several
        requests may share, or a new one); an ``EngineDeadError`` instance arrives there if
        the engine dies. The last delta of a request has ``finished`` set; then the client
        forgets it. Until then, call ``abort`` to stop it.
        """
        self._check_alive()
        assert self._loop is not None, "attach() first"
        p = _Pending(self._loop.create_future(), deltas if deltas is not None else asyncio.Queue())
        rid = request.request_id
        self._pending[rid] = p
        self._inbox.put(request)
        try:
            await p.accepted
        except BaseException:
            if p.accepted.cancelled():
                self.abort(rid)  # cancelled while waiting: the engine may take it still
            self._pending.pop(rid, None)
            raise
        return p.deltas

    def abort(self, request_id: str) -> None:
        """Aborts a request (a no-op for one that already finished)."""
        if self._pending.pop(request_id, None) is not None and self.alive:
            self._inbox.put(AbortRequest(request_id))

    def abort_all(self) -> int:
        """Aborts every request in flight; each one's queue gets a last delta with reason
        "abort", so whoever streams it ends cleanly. Returns how many were aborted."""
        pending = list(self._pending.items())
        for rid, p in pending:
            self.abort(rid)
            if p.accepted.done():
                p.deltas.put_nowait(Delta(rid, [], "", True, "abort", 0, 0))
            else:
                p.accepted.set_exception(EngineDeadError("the server is shutting down"))
        return len(pending)

    async def stats(self) -> EngineStats:
        """The engine's metrics right now (queued behind the current step)."""
        self._check_alive()
        assert self._loop is not None, "attach() first"
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._stats[token] = fut
        self._inbox.put(GetStats(token))
        try:
            return await fut
        finally:
            self._stats.pop(token, None)

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")

    # ------------------------------------------------------------------ routing

    def _read(self) -> None:
        """Reader thread: blocks on the outbox, hands message lists to the event loop."""
        assert self._loop is not None
        while True:
            try:
                msgs = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._route, msgs)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                return
        reason = (
            "the engine process stopped"
            if self._closing
            else (f"the engine process died (exit code {self._proc.exitcode})")
        )
        if not self._closing:
            log.error(reason)
        with contextlib.suppress(RuntimeError):  # the event loop may be closed already
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _route(self, msgs: list) -> None:
        for m in msgs:
            if isinstance(m, Delta):
                p = self._pending.get(m.request_id)
                if p is not None:
                    if m.finished:
                        del self._pending[m.request_id]
                    p.deltas.put_nowait(m)
            elif isinstance(m, Accepted):
                p = self._pending.get(m.request_id)
                if p is not None and not p.accepted.done():
                    p.accepted.set_result(None)
            elif isinstance(m, Rejected):
                p = self._pending.get(m.request_id)
                if p is not None and not p.accepted.done():
                    p.accepted.set_exception(RequestRejected(m.message, m.client_error))
            elif isinstance(m, StatsReply):
                self.last_stats = m.stats
                fut = self._stats.get(m.token)
                if fut is not None and not fut.done():
                    fut.set_result(m.stats)
            elif isinstance(m, Failed):
                self._fail_all(m.message)

    def _fail_all(self, reason: str) -> None:
        first = self.dead_reason is None
        self.dead_reason = reason
        err = EngineDeadError(reason)
        for p in self._pending.values():
            if not p.accepted.done():
                p.accepted.set_exception(err)
            else:
                p.deltas.put_nowait(err)
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(err)
        if first and not self._closing and self.on_dead is not None:
            self.on_dead(reason)


def _engine_main(engine_kwargs: dict, inbox, outbox, log_level: int) -> None:
    # Imported in the child only: serving.engine.engine_process pulls in nothing heavy itself,
    # but keeping the import here makes the parent's module graph obviously jax-free.
    from serving.engine.engine_process import engine_main

    engine_main(engine_kwargs, inbox, outbox, log_level)
