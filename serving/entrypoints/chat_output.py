"""A chat choice's generated text as an assistant message: reasoning, content, tool calls.

The reasoning parser (if any) splits the text first; the tool parser (if any) then reads both
parts, so a call the model writes inside its reasoning is not lost: it becomes a call, and the
reasoning keeps only the text around it. Calls from the reasoning come before those from the
content, which is also the order they stream in. ``parse`` (a whole output) and
``feed``/``finish`` (deltas) give the same message for any split of the text.
"""

from __future__ import annotations

import dataclasses

from serving.entrypoints.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningStream,
    ThinkReasoningParser,
)
from serving.entrypoints.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallStream, ToolParser


@dataclasses.dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    """One choice's parser; stateful (``feed`` deltas in order, then ``finish``).

    Args:
        reasoning: The reasoning format, or None (all text is content).
        tools: The tool-call format (built with the request's tools), or None (no parsing).
        in_reasoning: The prompt left a reasoning block open.
        parallel_tool_calls: False keeps only the first call.
    """

    def __init__(
        self,
        reasoning: ThinkReasoningParser | None,
        tools: ToolParser | None,
        *,
        in_reasoning: bool = False,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = ReasoningStream(reasoning, in_reasoning) if reasoning else None
        self.tools_in_reasoning = ToolCallStream(tools) if tools else None
        self.tools_in_content = ToolCallStream(tools) if tools else None
        self.parallel_tool_calls = parallel_tool_calls
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            # Once the reasoning is closed, its held-back tail is decided.
            reasoning_done = final or not self.reasoning.in_reasoning
        else:
            reasoning, content, reasoning_done = "", text, True
        out = ChatDelta()
        parts = (
            (reasoning, self.tools_in_reasoning, reasoning_done),
            (content, self.tools_in_content, final),
        )
        for i, (part, stream, done) in enumerate(parts):
            if stream is None:
                text_part, calls = part, []
            else:
                text_part, calls = stream.feed(part, done)
            if not self.parallel_tool_calls:
                calls = calls[: max(0, 1 - self.num_calls)]
            self.num_calls += len(calls)
            if i == 0:
                out.reasoning += text_part
            else:
                out.content += text_part
            out.tool_calls += calls
        return out

    def finish(self) -> ChatDelta:
        return self.feed("", final=True)

    def parse(self, text: str) -> ChatDelta:
        out = self.feed(text)
        out += self.finish()
        return out


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """The server's parsing options (``--tool-call-parser``, ``--enable-auto-tool-choice``,
    ``--reasoning-parser``)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser={self.tool_call_parser!r} is not one of {sorted(TOOL_PARSERS)}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r} is not one of "
                f"{sorted(REASONING_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
