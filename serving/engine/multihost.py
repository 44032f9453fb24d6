"""``hyjax serve`` across processes (``jax.distributed``): the leader plans, followers mirror.

Every process holds a shard of the model, so every process must enter every jitted step (and
the collectives inside it) in the same order with the same plan. Requests reach one process
only, so only the leader (process 0) runs the HTTP server, the scheduler and the engine loop;
each step's :class:`~serving.core.plan.StepPlan` goes to the followers over a TCP side channel the
leader's engine process opens (by default on the coordinator's port + 1)::

    process 0 (leader)                               process I > 0 (follower)
    HTTP -> engine process: schedule()               run_follower(): no HTTP, no scheduler
             runner.execute(plan) --on_execute-->    recv plan
               send(plan) to every follower   ----->   runner.execute(plan)
               _step(...)  <==== collectives ====>     _step(...)
    SIGTERM: drain, Shutdown -> close()  -"bye"->   exit 0

Frames: ``!II`` (header length, body length), a JSON header, the raw bytes of the plan's
arrays (no pickle: a follower trusts the leader's numbers, never its code).

Idle: a follower blocks in ``recv`` without a timeout, which costs nothing and is right for as
long as the leader lives (TCP keep-alive notices a vanished host). A leader that exits closes
the socket: the follower sees end-of-stream (exit 1) or the shutdown frame (exit 0).

Failure: after the handshake followers never write, so the leader's watchdog thread sees a
readable follower socket only when that follower is gone (one that leaves because its engine
differs from the leader's writes why first, and the leader's message says so). A step would
then wait forever in a collective, so the watchdog reports the loss to the HTTP process
(``Failed``: ``/health`` turns 503, requests fail with the reason) and ends the engine process
at once (exit code 1). A step that fails on the leader does the same
(:class:`FatalStepErrors`): the followers may already be inside it. A follower whose step
fails exits 1, which the watchdog then sees.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from serving.core.plan import StepPlan, StepShape, TableInit

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600.0  # followers and leader load the model at the same time
HANDSHAKE_TIMEOUT_S = 30.0
_FRAME = struct.Struct("!II")


@dataclasses.dataclass(frozen=True)
class MultihostConfig:
    """Where this process sits in a multi-process ``hyjax serve``.

    Attributes:
      coordinator_address: ``HOST:PORT`` of process 0's ``jax.distributed`` coordinator.
      num_processes: processes in the job (one leader, the rest followers).
      process_id: this process (0 is the leader).
      plan_port: the leader's plan channel port (``None``: the coordinator's port + 1).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    plan_port: int | None = None

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator_address={self.coordinator_address!r} must be HOST:PORT")
        if self.num_processes < 2:
            raise ValueError(
                f"num_processes={self.num_processes} must be at least 2 for a multi-host serve"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})"
            )

    @property
    def leader_host(self) -> str:
        return self.coordinator_address.rpartition(":")[0].strip("[]")

    @property
    def channel_port(self) -> int:
        if self.plan_port is not None:
            return self.plan_port
        return int(self.coordinator_address.rpartition(":")[2]) + 1

    def initialize(self) -> None:
        """``jax.distributed.initialize`` for this process (blocks until all have joined)."""
        from hyjax.sharding import initialize_distributed

        initialize_distributed(self.coordinator_address, self.num_processes, self.process_id)


class FollowerLost(RuntimeError):
    """A follower went away: the collectives of the next step can never complete."""


# ------------------------------------------------------------------------------ frames


def _encode(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    body = b""
    if arrays:
        header = dict(header, arrays=[(k, v.dtype.str, v.shape) for k, v in arrays.items()])
        body = b"".join(np.ascontiguousarray(v).tobytes() for v in arrays.values())
    head = json.dumps(header).encode()
    return _FRAME.pack(len(head), len(body)) + head + body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None if the peer closed the connection first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_frame(
    sock: socket.socket, max_bytes: int | None = None
) -> tuple[dict, dict[str, np.ndarray]] | None:
    """The next frame's header and arrays, or None at end-of-stream. Raises ValueError for a
    frame longer than ``max_bytes`` (a stranger's bytes read as a length)."""
    sizes = _recv_exact(sock, _FRAME.size)
    if sizes is None:
        return None
    head_len, body_len = _FRAME.unpack(sizes)
    if max_bytes is not None and head_len + body_len > max_bytes:
        raise ValueError(f"a {head_len + body_len}-byte frame exceeds {max_bytes=}")
    raw = _recv_exact(sock, head_len + body_len)
    if raw is None:
        return None
    header = json.loads(raw[:head_len])
    arrays, offset = {}, head_len
    for name, dtype, shape in header.pop("arrays", []):
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        arrays[name] = np.frombuffer(raw, dt, count=n // dt.itemsize, offset=offset).reshape(shape)
        offset += n
    return header, arrays


def encode_plan(plan: StepPlan) -> bytes:
    header = {"kind": "plan", "shape": dataclasses.asdict(plan.shape)}
    # The token tables' rows to start (plain numbers): every process's tables must agree.
    inits = plan.sampling.table_inits
    if inits:
        header["table_inits"] = [[r, *dataclasses.astuple(i)] for r, i in inits.items()]
    return _encode(header, plan.arrays())


def decode_plan(header: dict, arrays: dict[str, np.ndarray]) -> StepPlan:
    plan = StepPlan.from_arrays(StepShape(**header["shape"]), arrays)
    for row, ids, prompt_len, stop, bias, bad_seqs in header.get("table_inits", ()):
        bias = tuple((int(t), float(b)) for t, b in bias)
        bad = tuple(tuple(int(t) for t in w) for w in bad_seqs)
        init = TableInit(tuple(ids), int(prompt_len), tuple(stop), bias, bad)
        plan.sampling.table_inits[int(row)] = init
    return plan


def engine_signature(engine) -> dict:
    """What must agree between processes for their steps to be the same program."""
    mem = engine.runner.memory
    return {
        "num_kv_blocks": mem.num_kv_blocks,
        "num_state_slots": mem.num_state_slots,
        "step_shapes": [dataclasses.asdict(s) for s in engine.sched_config.step_shapes()],
    }


def signature_mismatch(mine: dict, leader: dict) -> str | None:
    """Each field in which this process's engine differs from the leader's, with both values,
    or None when they agree. The pools agree by construction (:func:`smallest_cache_bytes`);
    this is the safety net for flags that differ between processes."""
    diff = [
        f"{k}: {mine[k]} here, {leader.get(k, '(missing)')} on the leader"
        for k in mine
        if mine[k] != leader.get(k)
    ]
    return "; ".join(diff) or None


# ------------------------------------------------------------------------------ leader


class PlanBroadcaster:
    """The leader's end of the plan channel: accepts the followers, then sends each plan.

    Args:
      config: the job's layout (this process must be 0).
      on_lost: called once, from the watchdog thread, with a message when a follower is gone.
    """

    def __init__(self, config: MultihostConfig, on_lost: Callable[[str], None]) -> None:
        self.config = config
        self.on_lost = on_lost
        self.followers: dict[int, socket.socket] = {}
        self._closing = False
        self._lock = threading.Lock()
        # Bound before jax.distributed starts, so followers that come up first find the port.
        self._server = socket.create_server(("", config.channel_port), reuse_port=False)
        self._server.listen(config.num_processes)

    def accept(self, signature: dict, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Waits for every follower's hello, sends each the leader's engine signature, and
        starts the watchdog. Raises TimeoutError naming the processes that never came."""
        deadline = time.monotonic() + timeout
        want = set(range(1, self.config.num_processes))
        while want - set(self.followers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(want - set(self.followers))
                raise TimeoutError(
                    f"followers {missing} did not connect to the plan channel on port "
                    f"{self.config.channel_port} within {timeout:.0f} s"
                )
            self._server.settimeout(left)
            try:
                conn, addr = self._server.accept()
            except TimeoutError:
                continue
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                frame = _recv_frame(conn, max_bytes=1 << 16)
                pid = frame[0].get("process_id") if frame else None
            except (OSError, ValueError, KeyError, AttributeError) as e:  # not a follower
                frame, pid = repr(e), None
            if pid not in want or pid in self.followers:
                log.warning("plan channel: unexpected hello %r from %s", frame, addr)
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.sendall(_encode({"kind": "hello", **signature}))
            self.followers[pid] = conn
            log.info("plan channel: follower %d connected from %s", pid, addr[0])
        self._server.close()
        threading.Thread(target=self._watch, name="hyjax-follower-watchdog", daemon=True).start()

    def send(self, plan: StepPlan) -> None:
        """Ships ``plan`` to every follower (before the leader runs it). Raises FollowerLost."""
        frame = encode_plan(plan)
        with self._lock:
            for pid, conn in self.followers.items():
                try:
                    conn.sendall(frame)
                except OSError as e:
                    raise FollowerLost(f"follower process {pid} is gone ({e})") from None

    def close(self) -> None:
        """Tells every follower to exit (they answer by closing); idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for pid, conn in self.followers.items():
                try:
                    conn.sendall(_encode({"kind": "shutdown"}))
                    conn.shutdown(socket.SHUT_WR)
                except OSError as e:
                    log.warning("plan channel: follower %d already gone (%s)", pid, e)
        for conn in self.followers.values():  # wait for their goodbye, briefly
            conn.settimeout(5.0)
            try:
                conn.recv(1)
            except OSError:
                pass
            conn.close()
        self._server.close()

    def _watch(self) -> None:
        """Followers never write after their hello: a readable socket means one is gone."""
        by_fd = {conn.fileno(): pid for pid, conn in self.followers.items()}
        conns = list(self.followers.values())
        while not self._closing:
            try:
                ready, _, _ = select.select(conns, [], [], 1.0)
            except (OSError, ValueError):  # closed under us: close() is running
                return
            if ready and not self._closing:
                pid = by_fd.get(ready[0].fileno(), "?")
                why = _farewell(ready[0])
                self.on_lost(
                    f"follower process {pid} of {self.config.num_processes} left the "
                    f"multi-host job{why}; every step needs all processes, so the engine stops"
                )
                return


def _farewell(conn: socket.socket) -> str:
    """The reason a leaving follower wrote (its only frame after the hello), as a suffix for
    the leader's message; empty when it just vanished."""
    conn.settimeout(1.0)
    try:
        frame = _recv_frame(conn, max_bytes=1 << 16)
    except (OSError, ValueError):
        return ""
    if frame is None or frame[0].get("kind") != "error":
        return ""
    return f" ({frame[0].get('reason')})"


def start_leader(engine_kwargs: dict, config: MultihostConfig, on_lost: Callable[[str], None]):
    """Process 0's engine: joins the job, builds the engine, waits for the followers, then
    compiles every bucket with the followers mirroring. Returns ``(engine, broadcaster)``."""
    broadcaster = PlanBroadcaster(config, on_lost)
    try:
        config.initialize()
        from serving.engine.llm_engine import EngineArgs, LLMEngine

        args = EngineArgs(**dict(engine_kwargs, warmup=False))
        engine = LLMEngine(args)
        broadcaster.accept(engine_signature(engine))
        engine.runner.on_execute = broadcaster.send
        if engine_kwargs.get("warmup", True):
            engine.runner.warmup(progress=args.progress)
    except BaseException:
        broadcaster.close()
        raise
    return engine, broadcaster


class FatalStepErrors:
    """The leader's engine as its loop sees it: a failed step ends the job instead of failing
    only the live requests (as on one process), because the followers may already be inside
    that step's collectives and would wait there for a leader that moved on."""

    def __init__(self, engine, on_lost: Callable[[str], None]) -> None:
        self._engine = engine
        self._on_lost = on_lost

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        try:
            return self._engine.step()
        except Exception as e:
            log.exception("the leader's step failed")
            self._on_lost(f"the leader's step failed ({e!r}); the followers cannot go on")
            raise


def exit_on_lost(outbox, failed_message) -> Callable[[str], None]:
    """The leader's ``on_lost``: tell the HTTP process why, then end the engine process now
    (its main thread may be blocked in a collective that can never finish)."""

    def lost(reason: str) -> None:
        log.error("%s", reason)
        try:
            outbox.put([failed_message(reason)])
            outbox.close()
            flush = threading.Thread(target=outbox.join_thread, daemon=True)
            flush.start()
            flush.join(2.0)
        finally:
            os._exit(1)

    return lost


# ------------------------------------------------------------------------------ follower


def _connect(config: MultihostConfig, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    addr = (config.leader_host, config.channel_port)
    while True:
        try:
            sock = socket.create_connection(addr, timeout=5.0)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"could not reach the leader's plan channel {addr}: {e}"
                ) from None
            time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def run_follower(
    engine_kwargs: dict, config: MultihostConfig, connect_timeout: float = CONNECT_TIMEOUT_S
) -> int:
    """Process I > 0: joins the job, builds the same engine, then runs the leader's plans until
    it says shutdown (returns 0) or disappears (returns 1)."""
    config.initialize()
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(**dict(engine_kwargs, warmup=False)))
    sock = _connect(config, connect_timeout)
    sock.sendall(_encode({"kind": "hello", "process_id": config.process_id}))
    sock.settimeout(connect_timeout)  # the leader accepts once its own engine is built
    hello = _recv_frame(sock)
    if hello is None or hello[0].get("kind") != "hello":
        log.error("the leader closed the plan channel during the handshake")
        return 1
    diff = signature_mismatch(engine_signature(engine), hello[0])
    if diff is not None:
        reason = (f"process {config.process_id}'s engine differs from the leader's ({diff}): "
                  "give every process the same model and engine flags")  # fmt: skip
        log.error("%s", reason)
        sock.sendall(_encode({"kind": "error", "reason": reason}))  # for the leader's log
        sock.close()
        return 1
    sock.settimeout(None)  # idle: wait for the next plan as long as the leader lives
    log.info("follower %d: mirroring the leader's steps", config.process_id)
    steps = 0
    while True:
        frame = _recv_frame(sock)
        if frame is None:
            log.error("the leader closed the plan channel without a shutdown: exiting")
            return 1
        header, arrays = frame
        if header["kind"] == "shutdown":
            log.info("follower %d: shutdown after %d steps", config.process_id, steps)
            sock.close()
            return 0
        engine.runner.execute(decode_plan(header, arrays))
        steps += 1
