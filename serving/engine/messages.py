"""Typed messages between the HTTP process and the engine process (plain Python, no jax).

The HTTP layer never touches the engine object: it puts :data:`ToEngine` messages on one
queue and reads lists of :data:`FromEngine` messages from another (one list per engine loop
iteration, so a step that advances 32 requests costs one pickle and one queue hop)::

    HTTP process                                   engine process
    EngineRequest(ids, params, id) ----------->    engine.add_request(request)
                                 <-------------    Accepted(id) | Rejected(id, message)
                                 <-------------    Delta(id, ...) per step, until finished
    AbortRequest(id)             ------------->    engine.abort_request (blocks, slot freed)
    GetStats(token)              ------------->    engine.metrics()
                                 <-------------    StatsReply(token, EngineStats)
    Shutdown()                   ------------->    aborts what is left, exits the loop
                                 <-------------    Ready(EngineInfo) | Failed(message) at start
"""

from __future__ import annotations

import dataclasses

from serving.core.request import EngineRequest

# ----------------------------------------------------------------------------- to the engine


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclasses.dataclass(frozen=True)
class GetStats:
    token: int


@dataclasses.dataclass(frozen=True)
class Shutdown:
    pass


ToEngine = EngineRequest | AbortRequest | GetStats | Shutdown

# --------------------------------------------------------------------------- from the engine


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the HTTP layer needs to know about the loaded engine."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_kv_blocks: int
    num_state_slots: int


@dataclasses.dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclasses.dataclass(frozen=True)
class Failed:
    """The engine could not start, or its process is going down; ``message`` says why."""

    message: str


@dataclasses.dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclasses.dataclass(frozen=True)
class Rejected:
    """``add_request`` refused the request. ``client_error``: a 400 (bad input), else a 500."""

    request_id: str
    message: str
    client_error: bool = True


@dataclasses.dataclass(frozen=True)
class Delta:
    """One step's progress of a request: new tokens and text, and whether it is done.

    ``finish_reason`` is "stop", "length", "abort" or "error"; then ``error`` says why and
    ``client_error`` whether the request itself was at fault (it can never fit the KV cache)
    rather than the engine (a failed step).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    client_error: bool = False
    # per new token, when asked: (token id, logprob, [(top id, logprob), ...])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # once, in a request's first delta, when asked: per prompt token (None for the first),
    # (token id, logprob, rank, [(top id, logprob), ...])
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]] | None] | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What ``LLMEngine.metrics()`` returns: a picklable snapshot for logs and ``/metrics``."""

    num_running: int
    num_waiting: int
    kv_usage: float
    state_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    kv_query_tokens: int
    kv_hit_tokens: int
    state_query_tokens: int
    state_hit_tokens: int
    effective_hit_tokens: int
    # speculative decoding (zeros when off): verify rows, drafts, accepted drafts in all and
    # at each draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # the engine's steps and where their seconds went (``LLMEngine.timing``): host (schedule,
    # launch, update, detokenize) and the wait for the device
    steps: int = 0
    step_host_seconds: float = 0.0
    step_device_seconds: float = 0.0
    # the server's engine loop around those steps: taking requests in, sending the deltas out
    loop_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class StatsReply:
    token: int
    stats: EngineStats


FromEngine = Ready | Failed | Accepted | Rejected | Delta | StatsReply
