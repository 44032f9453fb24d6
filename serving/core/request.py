"""Requests and their sampling parameters (plain Python): ``EngineRequest`` as a request enters
the engine, ``Request`` as the scheduler tracks it."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np

    from serving.core.structured.spec import StructuredOutput

MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
# Multi-token bad words: the sampler's per-row table holds this many, each this long at most.
MAX_BAD_WORD_SEQUENCES = 16
MAX_BAD_WORD_TOKENS = 8

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again: holds no KV block or slot
    RUNNING = "running"  # holds a running state slot and its KV blocks
    FINISHED = "finished"  # freed; ``finish_reason`` says why


@dataclasses.dataclass
class SamplingParams:
    """How a request's tokens are sampled and when it stops.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 is off; ``top_p`` 1 is off; ``min_p`` 0
    is off. ``max_tokens=None`` means "up to the model's context length" (the scheduler fills
    it in). ``stop`` strings are only carried: the engine detokenizes and checks them, then calls
    ``Scheduler.finish_request``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the sampled token's logprob and this many top ones
    # Penalties, as OpenAI (presence, frequency: over the generated tokens) and vLLM
    # (repetition: over prompt and generated tokens, logits > 0 divided, < 0 multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many are generated
    bad_words_token_ids: tuple[int, ...] = ()  # banned tokens (single-token bad words)
    # The output must match this (JSON schema, regex, choice, grammar): the engine compiles
    # it into the request's ``Request.grammar``.
    structured: StructuredOutput | None = None
    # Multi-token bad words: the last token of each is banned where the tokens generated just
    # before it equal the rest (vLLM's semantics: the prompt is not looked at).
    bad_word_sequences: tuple[tuple[int, ...], ...] = ()
    # Report each prompt token's logprob (given the tokens before it) and this many top ones.
    prompt_logprobs: int | None = None
    # Keep special tokens in the output text (Kimi's tool-call section markers are special).
    skip_special_tokens: bool = True

    @property
    def uses_token_tables(self) -> bool:
        """Whether the sampler reads this request's row of the runner's token tables
        (counts for the penalties and ``min_tokens``, the dense bias for ``logit_bias`` and
        bad words)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.bad_words_token_ids
            or self.bad_word_sequences
        )

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError naming the field whose token id is not in ``[0, vocab_size)``."""
        for name, ids in (
            ("logit_bias", tuple(self.logit_bias or ())),
            ("stop_token_ids", self.stop_token_ids),
            ("bad_words", self.bad_words_token_ids),
            ("bad_words", tuple(t for w in self.bad_word_sequences for t in w)),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"{name}={t}: token id not in [0, {vocab_size})")

    def validate(self) -> None:
        """Raises ValueError naming the first bad field. Normalises ``top_k=-1`` to 0."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 or -1 = off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs={self.logprobs} must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} must be in [0, 20]")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias={len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS}"
                )
            for tok, bias in self.logit_bias.items():
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias={{{tok}: {bias}}}: a bias must be in [-100, 100]")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.bad_words_token_ids = tuple(self.bad_words_token_ids)
        self.bad_word_sequences = tuple(tuple(w) for w in self.bad_word_sequences)
        if any(len(w) < 2 for w in self.bad_word_sequences):
            raise ValueError("bad_words: a bad word sequence has at least two tokens")
        if len(self.bad_word_sequences) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(
                f"bad_words={len(self.bad_word_sequences)} multi-token variants: at most "
                f"{MAX_BAD_WORD_SEQUENCES}"
            )
        if any(len(w) > MAX_BAD_WORD_TOKENS for w in self.bad_word_sequences):
            raise ValueError(f"bad_words: a bad word is at most {MAX_BAD_WORD_TOKENS} tokens")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Grammar(Protocol):
    """A request's grammar state, as the scheduler drives it (host only;
    ``serving.core.structured.grammar.GrammarMatcher``): before a step that samples for the request,
    ``fill_mask`` writes the tokens it may sample; ``accept`` then takes the sampled one."""

    mask_words: int  # int32 words of the bitmask (ceil(V / 32))

    def fill_mask(self, out: np.ndarray) -> None: ...  # i32[mask_words]

    def accept(self, token: int) -> bool: ...  # False: the grammar forbids it

    @property
    def is_terminated(self) -> bool: ...  # nothing may follow: the output is complete

    @property
    def error(self) -> str | None: ...


_request_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One generation request as it enters: built once where it arrives (an HTTP handler, a
    row of ``hyjax generate``, ``LLM.generate``), then passed unchanged through the engine
    client, the queue to the engine process and ``LLMEngine.add_request``, which makes the
    scheduler's :class:`Request` of it (``Request.from_engine_request``).

    A new per-request field is a field here and in ``Request``, and a line in
    ``from_engine_request`` (the OpenAI fields reach it in ``protocol.to_engine_request``).
    """

    prompt: str | Sequence[int]  # text (the engine tokenizes it) or token ids
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_request_ids)}")
    # The request reuses cached prefixes (KV blocks and states) only of requests with the same
    # salt; None is a salt of its own (the unsalted requests').
    cache_salt: str | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first bad field (the sampling parameters are checked
        by the scheduler, which also fills in their defaults)."""
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt={salt!r} must be a non-empty string")


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. The scheduler mutates everything below the first four fields.

    ``all_token_ids`` is the prompt followed by the outputs so far; ``block_hashes[j]`` is the
    chained hash of its full KV block ``j`` (kept up to date by the scheduler as tokens arrive).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    cache_salt: str | None = None

    arrival: int = -1
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    all_token_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = -1  # effective prefix hit at first schedule; -1 = not yet
    num_preemptions: int = 0
    awaiting_token: bool = False  # a scheduled step samples its next token
    junctions: tuple[int, ...] = ()  # shared-prefix boundaries to checkpoint in prefill
    seed: int = 0  # uint32 actually used (the params' seed or a random one)
    max_tokens: int = 0  # resolved: the params' max_tokens, or what max_model_len leaves
    grammar: Grammar | None = None  # compiled from ``sampling_params.structured`` by the engine
    # Prompt logprobs: the next prompt position whose logits score the token after it; they
    # are done at ``num_prompt_tokens - 1`` (the last position's logits sample the output).
    prompt_logprobs_next: int = 0
    # Speculative decoding: tokens a drafter proposes after the known ones (the next decode
    # row verifies them); replaced after every step that gives the request tokens.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    # The n-gram drafter's numpy copy of ``all_token_ids`` (speculative.TokenArray), kept
    # up to date by the drafter itself; freed with the request.
    token_mirror: Any = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_engine_request(
        cls,
        request: EngineRequest,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
    ) -> Request:
        """The scheduler's request for ``request``, with what the engine resolved: the prompt
        as token ids, the sampling parameters with the model's other EOS ids as stop ids."""
        return cls(
            request.request_id,
            prompt_token_ids,
            sampling_params,
            eos_token_id,
            cache_salt=request.cache_salt,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs."""
        return len(self.all_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position still has to be scored (``prompt_logprobs``)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.prompt_logprobs_next < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
