"""Speculative decoding on the host: its configuration, the drafter interface, the n-gram
drafter, and the acceptance counters. Plain Python and numpy (no jax).

A *drafter* proposes up to K tokens that may follow a decoding request's known tokens; the
scheduler turns the request's next decode row into a *verify row* of ``1 + k`` tokens (the
last sampled token and the drafts), the step samples the target model at every position, and
``Scheduler.update`` takes the accepted prefix plus the target's own next token::

    known      ... t_n                       (t_n sampled, not yet fed)
    drafts              d1 d2 d3             (k = 3)
    verify row [t_n d1 d2 d3]                positions n .. n+3, logits at each
    target          y0 y1 y2 y3              y_j: the target's token after the row's token j
    accept     d1 == y0? d2 == y1? ...       greedy; sampled rows: rejection sampling
    tokens     d1 .. d_a, then y_a (or the rejection's residual draw): a + 1 new tokens

Drafters plug in through :class:`Drafter` and the ``METHODS`` table: host-side ones (n-gram)
propose after each ``update``; a device-side one (MTP: ``METHODS`` holds None for it,
``SpeculativeConfig.device_drafts``) drafts inside the jitted step, which returns the drafts
with the step's tokens, and ``Scheduler.update`` stores them the same way
(``Request.draft_token_ids``).

The MTP drafter (``serving/worker/runner.py`` ``_mtp_drafts``) keeps its KV in a pool per MTP
layer beside the target's, in the same block ids: the MTP entry of position ``t`` is written
by the step that computes ``t``, from the target's hidden state at ``t`` and the token at
``t + 1`` (the next prompt token of a prefill chunk, the token sampled at ``t``, or, in a
verify row, the next draft: rewritten by a later step where the draft was rejected). Prefix
caching therefore shares it with the target's blocks, exactly but for one position::

    writer A   ... x_{h-2} x_{h-1} | a_h ...     hit of h tokens (a checkpoint boundary)
    reader B   ... x_{h-2} x_{h-1} | b_h ...     block hashes cover tokens < h only
    MTP entry at h - 1 = f(hidden_{h-1}, a_h): B's would use b_h

B reads A's entry at ``h - 1`` (B never computes ``h - 1``; rebuilding it would need the
target's hidden state there). Only where B branches from A exactly at ``h`` (a junction
checkpoint at a branch point, a decode checkpoint) do the two differ; the entry is read by
B's drafts only, so B's tokens are unchanged (greedy output is the same with caching on and
off) and at worst some drafts are rejected.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from serving.core.request import Request


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``{"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_min": m, "prompt_lookup_max": M, "disable_by_batch_size": N}``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # vLLM's key: no row speculates in a step that starts with at least this many running
    # requests (a verify step of many rows costs more than its accepted drafts give back:
    # BENCHMARKS.md, the verify step at 256 rows). None: always speculate.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method={self.method!r} is not supported (one of {sorted(METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens={k!r} must be a positive integer")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"disable_by_batch_size={n!r} must be a positive integer or null")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )

    @property
    def device_drafts(self) -> bool:
        """The drafts come from the runner's step (a model-side drafter), not the host."""
        return METHODS[self.method] is None

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict, or itself; None stays None.

        Raises ValueError for bad JSON, unknown keys or values.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        d = dict(value)
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown} (known: {sorted(names)})"
            )
        return cls(**d)


class Drafter(Protocol):
    """Proposes draft tokens for decoding requests (host side)."""

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens likely to follow ``req.all_token_ids``; may be empty."""
        ...


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) are
    searched earlier in the request's tokens (prompt and output); the tokens that followed
    the most recent earlier match are the drafts::

        tokens   a b c x y z ... a b c | ?        n = 3: "a b c" seen at 0
        drafts                           x y z    (up to K)
    """

    min_n: int
    max_n: int

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        mirror = req.token_mirror
        if mirror is None:
            mirror = req.token_mirror = TokenArray()
        return ngram_propose(mirror.sync(req.all_token_ids), self.min_n, self.max_n, max_tokens)


class TokenArray:
    """An int32 numpy copy of an append-only token list (a request's ``all_token_ids``),
    extended by the tokens added since the last :meth:`sync`: a step costs O(new tokens), where
    converting the whole list costs O(context) (~0.2 ms a row at 4k tokens, every step)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(0, np.int32)
        self.n = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        m = len(tokens)
        if m < self.n:  # the list shrank: not append-only after all, copy it again
            self.n = 0
        if m > self.buf.size:
            grown = np.empty(max(m, 2 * self.buf.size, 64), np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if m > self.n:
            self.buf[self.n : m] = tokens[self.n : m]
        self.n = m
        return self.buf[:m]


def ngram_propose(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` (or fewer) tokens after the most recent earlier occurrence of the longest
    suffix of ``tokens`` (a list or 1-D array) of ``min_n..max_n`` tokens; ``[]`` when none
    occurs.

    One pass over the context finds the earlier positions holding the last token; each further
    suffix token only filters those candidates (match ends), so a step costs one vectorized
    compare over the context, not one per suffix length.
    """
    a = np.asarray(tokens)
    n_tok = a.shape[0]
    if k < 1 or n_tok < min_n + 1 or max_n < 1:
        return []
    # ends[i]: an earlier position (before the last token, so a token follows it) where the
    # last ``length`` tokens of the context also end
    ends = np.flatnonzero(a[: n_tok - 1] == a[n_tok - 1])
    length = 1
    while ends.size and length < min(max_n, n_tok - 1):
        room = ends[ends >= length]  # a token before the match to compare
        longer = room[a[room - length] == a[n_tok - 1 - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if not ends.size or length < min_n:
        return []
    start = int(ends[-1]) + 1
    return a[start : start + k].tolist()


def _ngram(cfg: SpeculativeConfig) -> Drafter:
    return NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)


# method -> the host drafter it builds; None: the runner drafts on device (the model's MTP
# layers, hyjax.models.qwen3_next.mtp, loaded with the model).
METHODS: dict[str, Callable[[SpeculativeConfig], Drafter] | None] = {"ngram": _ngram, "mtp": None}


def make_drafter(cfg: SpeculativeConfig) -> Drafter | None:
    factory = METHODS[cfg.method]
    return factory(cfg) if factory is not None else None


@dataclasses.dataclass
class SpecMetrics:
    """Acceptance counters (vLLM's names): over verify rows since start-up."""

    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of them accepted
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # [K]

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row yields on average: 1 + accepted drafts per row (1 = nothing
        accepted; K + 1 = every draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecMetrics:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))


def describe(metrics: SpecMetrics, per_pos: Iterable[int] | None = None) -> str:
    rate = metrics.num_accepted_tokens / max(metrics.num_draft_tokens, 1)
    pos = ", ".join(str(n) for n in (per_pos or metrics.accepted_per_pos))
    return (
        f"speculative: {metrics.num_drafts} verify rows, {metrics.num_draft_tokens} drafts, "
        f"{metrics.num_accepted_tokens} accepted ({rate:.0%}), mean acceptance length "
        f"{metrics.mean_acceptance_length:.2f}, accepted per position [{pos}]"
    )
