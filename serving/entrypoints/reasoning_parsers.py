"""Reasoning in generated text: ``<think>...</think>`` goes to ``reasoning_content``.

Qwen3 and Kimi thinking models write ``<think>`` reasoning ``</think>`` then the answer.
Some chat templates open ``<think>`` in the prompt itself (Qwen3 thinking-2507, and the
``enable_thinking=False`` form closes it there too: ``<think>\\n\\n</think>\\n\\n``), so where
the output starts is read from the rendered prompt (``starts_in_reasoning``)::

    prompt ... <think>\\n | I should ... </think>\\n\\nThe answer
                         |-- reasoning --|        |-- content --
    prompt ... assistant\\n | <think> I should ... </think>\\n\\nThe answer
    prompt ... assistant\\n | The answer              (no <think>: all content)

Output that never closes its reasoning (cut by max_tokens) is all reasoning. The newlines
the template writes after ``</think>`` are dropped from the content. ``ReasoningStream``
splits deltas the same way, holding back a tail that may be the start of a tag.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ThinkReasoningParser:
    """The ``<think>...</think>`` format (``--reasoning-parser qwen3`` / ``kimi``)."""

    start: str = "<think>"
    end: str = "</think>"

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the prompt leaves a reasoning block open (its last ``<think>`` unclosed)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def may_reason(self, prompt: str, template_kwargs: dict | None) -> bool:
        """Whether the output may start with reasoning: thinking is not switched off
        (``enable_thinking=False``) and the prompt does not end with a closed block (the
        ``<think>\\n\\n</think>`` a template writes for no thinking)."""
        if (template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        return not prompt.rstrip().endswith(self.end)

    def parse(self, text: str, in_reasoning: bool) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        stream = ReasoningStream(self, in_reasoning)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return r1 + r2, c1 + c2


REASONING_PARSERS: dict[str, ThinkReasoningParser] = {
    "qwen3": ThinkReasoningParser(),
    "kimi": ThinkReasoningParser(),
}

# States of a ReasoningStream.
_BEFORE = "before"  # at the output's start: a <think> may open (leading whitespace allowed)
_REASONING = "reasoning"
_AFTER_END = "after_end"  # just after </think>: newlines are dropped
_CONTENT = "content"


class ReasoningStream:
    """Splits text deltas into (reasoning, content) deltas."""

    def __init__(self, parser: ThinkReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.state = _REASONING if in_reasoning else _BEFORE
        self.pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning, content = [], []
        while text:
            if self.state == _BEFORE:
                stripped = text.lstrip()
                if stripped.startswith(self.parser.start):
                    self.state = _REASONING
                    text = stripped[len(self.parser.start) :]
                elif not final and self.parser.start.startswith(stripped):
                    self.pending = text  # blank, or a possible start of <think>
                    break
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING:
                i = text.find(self.parser.end)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(self.parser.end) :]
                    self.state = _AFTER_END
                    continue
                keep = 0 if final else _partial_suffix(text, self.parser.end)
                reasoning.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            elif self.state == _AFTER_END:
                text = text.lstrip("\n")
                if text:
                    self.state = _CONTENT
            else:
                content.append(text)
                break
        assert not (final and self.pending)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)

    @property
    def in_reasoning(self) -> bool:
        """Whether reasoning may still come (it has not been closed, or not started yet)."""
        return self.state in (_BEFORE, _REASONING)


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
