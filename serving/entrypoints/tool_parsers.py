"""Tool calls in generated text: the formats models are trained to emit, parsed into OpenAI
``tool_calls``.

Every format here is a delimited block (``<tool_call>...</tool_call>``, Kimi's tool-call
section), so one scanner serves them all: a parser says where a block starts and ends and how
to read its inside. The scanner splits text into plain text and blocks; a block that does not
read as calls (malformed JSON, an unknown shape) stays in the text, so nothing the model wrote
is lost. Streaming feeds the same scanner: ``ToolCallStream`` emits the text before the first
block that is not finished, holding back a tail that may be the start of a block tag, and
emits each call once its block is closed, so the streamed result equals the non-streamed one
for any split of the text into deltas::

    text:   Sure.<tool_call>{"name": "f", ...}</tool_call> and <tool_c
            |---- text ----|------- block (a call) -------|-text-|held|

A parser is one small class in ``TOOL_PARSERS``; ``--tool-call-parser NAME`` picks it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object as a string (as OpenAI sends it)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser:
    """A block format: ``start`` opens a block, ``end`` closes it, ``read`` parses its body.

    Subclasses set ``start`` and ``end`` and implement ``read``.
    """

    start: str
    end: str

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = _schemas(tools)

    def read(self, body: str) -> list[ToolCall] | None:
        """The calls in a block's body (between ``start`` and ``end``); None if it is not
        well-formed, so the block is kept as text."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> tuple[list[str | list[ToolCall]], int]:
        """Splits ``text`` into text pieces and call lists.

        Returns:
            (pieces, consumed): ``text[:consumed]`` is fully decided; the rest is an open block
            or a possible start of one (held back), or empty. With ``final`` all is consumed:
            an unclosed block is text.
        """
        pieces: list[str | list[ToolCall]] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                keep = 0 if final else _partial_suffix(text, self.start, pos)
                if len(text) - keep > pos:
                    pieces.append(text[pos : len(text) - keep])
                return pieces, len(text) - keep
            if i > pos:
                pieces.append(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j < 0:
                if final:
                    pieces.append(text[i:])
                    return pieces, len(text)
                return pieces, i
            stop = j + len(self.end)
            calls = self.read(text[i + len(self.start) : j])
            pieces.append(calls if calls else text[i:stop])
            pos = stop

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(text outside the calls, the calls) of a whole output."""
        pieces, _ = self.scan(text, final=True)
        return _join(pieces)


class HermesToolParser(ToolParser):
    """Hermes / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    start, end = "<tool_call>", "</tool_call>"

    def read(self, body: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments already encoded
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML-like calls, parameter values typed by the tool's JSON schema::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
    """

    start, end = "<tool_call>", "</tool_call>"

    def read(self, body: str) -> list[ToolCall] | None:
        functions = list(_FUNCTION.finditer(body))
        if not functions or _FUNCTION.sub("", body).strip():
            return None
        calls = []
        for f in functions:
            name = f.group(1).strip()
            props = self.schemas.get(name, {}).get("properties", {})
            args = {}
            for p in _PARAMETER.finditer(f.group(2)):
                key = p.group(1).strip()
                args[key] = _typed(_strip_newline(p.group(2)), props.get(key, {}))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.DOTALL,
)


class KimiK2ToolParser(ToolParser):
    """Kimi K2 / Kimi-Linear: one section holding several calls, each id'd
    ``functions.NAME:IDX``::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
        {"x": 1}<|tool_call_end|><|tool_calls_section_end|>

    A section with any malformed call stays text whole.
    """

    start, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def read(self, body: str) -> list[ToolCall] | None:
        matches = list(_KIMI_CALL.finditer(body))
        if not matches or _KIMI_CALL.sub("", body).strip():
            return None
        calls = []
        for m in matches:
            call_id = m.group(1)
            name = call_id.split(":", 1)[0].removeprefix("functions.")
            try:
                args = json.loads(m.group(2))
            except ValueError:
                return None
            if not name or not isinstance(args, dict):
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), id=call_id))
        return calls


# Parsers whose call markers are special tokens of the model's tokenizer: a request with tools
# keeps special tokens in its text (vLLM's Kimi parser does the same), else the markers vanish.
KEEPS_SPECIAL_TOKENS = frozenset({"kimi_k2"})

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "kimi_k2": KimiK2ToolParser,
}


class ToolCallStream:
    """Incremental parsing: ``feed`` text deltas, then ``finish``; each returns the new text
    and the newly completed calls. Their concatenation equals ``parser.parse(whole text)``."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not decided yet: an open block or a possible tag start

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += delta
        pieces, consumed = self.parser.scan(self.pending, final)
        self.pending = self.pending[consumed:]
        return _join(pieces)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self.feed("", final=True)


# ------------------------------------------------------------------------------ helpers


def _join(pieces: list[str | list[ToolCall]]) -> tuple[str, list[ToolCall]]:
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = [c for p in pieces if not isinstance(p, str) for c in p]
    return text, calls


def _partial_suffix(text: str, tag: str, pos: int) -> int:
    """The length of the longest suffix of ``text[pos:]`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text) - pos), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, Mapping) else {}
    return out


def _strip_newline(value: str) -> str:
    """The template writes a value between newlines; only those two are dropped."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed(value: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's text as the JSON type its schema names; the text itself when it does
    not convert (or the schema names no type)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kind if isinstance(kind, list) else [kind]
    text = value.strip()
    if text.lower() == "null" and "string" not in kinds:
        return None
    for k in kinds:
        if k == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if k == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(number) if number.is_integer() and "." not in text else number
        if k == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if k in ("object", "array"):
            try:
                return json.loads(text)
            except ValueError:
                continue
    return value
