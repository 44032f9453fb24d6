"""Streaming text out of generated ids: incremental detokenization and stop strings.

Plain Python (no jax, no numpy); the engine calls these once per sequence per step::

    stream = tokenizer.detokenizer(context_ids=prompt_ids[-4:])
    for token_id in generated:
        delta = stream.step(token_id)
        text += delta
        check = check_stop_strings(text, stop, num_new_chars=len(delta))
        send(text[sent : check.visible_len]); sent = check.visible_len
        if check.stopped: break
    text += stream.flush()  # at the end: whatever was held back
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_MAX_CONTEXT = 8  # prompt ids kept as a decoder's left context


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerStream:
    """Turns token ids, fed one (or a few) at a time, into text deltas.

    Byte-level tokens may end in the middle of a UTF-8 character, which decodes to U+FFFD
    until the rest arrives: trailing U+FFFD are held back. Decoders may also treat the first
    token specially (SentencePiece drops its leading space), so each decode keeps at least
    one earlier token as left context and the delta is the new part of that decode::

        ids:  | context | g0 g1 g2 g3 | g4 |
                        ^ start       ^ boundary   (both on character boundaries)
        text = decode(ids[start:]);  text[:emitted] is already accounted for

    When a step ends on a character boundary the window slides: ``start`` moves to the
    previous boundary and ``boundary`` to the end, so windows stay a few tokens long.

    Invariant: the concatenated deltas of ``step``/``extend`` plus ``flush`` equal
    ``decode(ids)`` with no context, or ``decode(context + ids)[len(decode(context)):]`` for
    the kept context (one that ends on a character boundary).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        """Starts a stream.

        Args:
            tokenizer: Anything with ``decode(ids, skip_special_tokens=...)``.
            context_ids: Ids decoded before the stream's own (a prompt); their text is never
                returned. Only the last few are kept, without any that end inside a character.
            skip_special_tokens: As in ``decode``.
        """
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A few ids of left context are all a decoder needs. A context that ends inside a
        # character (a token-id prompt cut in the middle of a UTF-8 sequence) would lend its
        # dangling bytes to the completion's first token, and the completion's text would
        # start with U+FFFD the completion never produced: such ids are dropped, so the text
        # is the decoding of the completion's own tokens.
        context = list(context_ids[-_MAX_CONTEXT:])
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        self._ids = context
        self._num_context = len(self._ids)
        self._start = 0
        self._boundary = len(self._ids)
        self._emitted = len(self._decode(self._ids).rstrip(_REPLACEMENT))

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far (context excluded)."""
        return self._ids[self._num_context :]

    def step(self, token_id: int) -> str:
        """Feeds one id; returns the text it completes (possibly empty). Mutates the stream."""
        return self.extend((token_id,))

    def extend(self, token_ids: Sequence[int]) -> str:
        """Feeds several ids (speculative decoding); returns the text they complete."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._start :])
        stable = len(text.rstrip(_REPLACEMENT))
        delta = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if stable == len(text):
            new_start, self._boundary = self._boundary, len(self._ids)
            if new_start > self._start:
                self._start = new_start
                self._emitted = len(self._decode(self._ids[new_start:]))
        return delta

    def flush(self) -> str:
        """Returns the held-back text (U+FFFD for bytes that never completed a character)."""
        text = self._decode(self._ids[self._start :])
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


@dataclasses.dataclass(frozen=True)
class StopCheck:
    """Where streamed text must stop or pause, from ``check_stop_strings``.

    Attributes:
        stop: The stop string found (the earliest one in the text), or None.
        visible_len: ``text[:visible_len]`` may be sent to the client. When stopped, the
            output is truncated there for good (before the stop string, or after it with
            ``include_stop``); otherwise it is ``len(text) - holdback``.
        holdback: Trailing characters that might be the start of a stop string, to be held
            back until more text arrives (0 when stopped).
    """

    stop: str | None
    visible_len: int
    holdback: int

    @property
    def stopped(self) -> bool:
        return self.stop is not None


def check_stop_strings(
    text: str,
    stop: Sequence[str],
    *,
    num_new_chars: int | None = None,
    include_stop: bool = False,
) -> StopCheck:
    """Looks for stop strings in generated text, as OpenAI's ``stop`` parameter means them.

    Args:
        text: All text generated so far.
        stop: Stop strings; empty ones are ignored.
        num_new_chars: How many characters at the end of ``text`` are new since the last
            check; only matches touching them are searched for. None searches everything.
        include_stop: Keep the stop string in the output (vLLM's ``include_stop_str_in_output``).

    Returns:
        The match (earliest start, longest on ties), or how much of the tail to hold back.
    """
    found: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        lo = 0 if num_new_chars is None else max(0, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, lo)
        if i >= 0 and (found is None or (i, -len(s)) < (found[0], -len(found[1]))):
            found = (i, s)
    if found is not None:
        i, s = found
        return StopCheck(stop=s, visible_len=i + len(s) if include_stop else i, holdback=0)
    holdback = max((_partial_match_len(text, s) for s in stop), default=0)
    return StopCheck(stop=None, visible_len=len(text) - holdback, holdback=holdback)


def _partial_match_len(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
