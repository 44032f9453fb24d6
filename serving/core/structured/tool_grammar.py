"""Enforced ``tool_choice``: a Lark grammar (llguidance dialect) whose sentences are tool calls
in the format of the server's ``--tool-call-parser``, so the parser always reads them.

``tool_choice: "required"`` allows one or more calls of any of the tools (exactly one when
``parallel_tool_calls`` is false); a named function allows exactly one call of it. Each call's
arguments follow the tool's ``parameters`` JSON schema (``%json`` embeds it), and its name is
a constant, so a call of one tool never carries another's arguments::

    hermes / qwen3:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    kimi_k2:         <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                     <|tool_call_argument_begin|>{...}<|tool_call_end|>...
                     <|tool_calls_section_end|>   (the markers are special tokens)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# --tool-call-parser names whose format has a grammar here.
SUPPORTED_PARSERS = ("hermes", "qwen3", "kimi_k2")


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") or {}
    params = fn.get("parameters")
    return dict(params) if isinstance(params, Mapping) and params else {"type": "object"}


def _name(tool: Mapping[str, Any]) -> str:
    return (tool.get("function") or {}).get("name", "")


def _hermes_call(tool: Mapping[str, Any]) -> str:
    body = {
        "type": "object",
        "properties": {"name": {"const": _name(tool)}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return '"<tool_call>\\n" %json ' + json.dumps(body) + ' "\\n</tool_call>"'


def _kimi_call(tool: Mapping[str, Any]) -> str:
    # The call id is "functions.NAME:INDEX"; the name goes in as a JSON string literal.
    head = json.dumps(f"functions.{_name(tool)}:")
    return (
        f"<|tool_call_begin|> {head} /[0-9]+/ <|tool_call_argument_begin|> "
        f"%json {json.dumps(_parameters(tool))} <|tool_call_end|>"
    )


def tool_call_grammar(
    parser: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    function: str | None = None,
    parallel: bool = True,
) -> str:
    """The Lark grammar of calls of ``tools`` (only ``function`` when given) in ``parser``'s
    format; several calls when ``parallel`` and no ``function``.

    Raises ValueError (naming ``tool_choice``) for a parser without a grammar here or a
    ``function`` not among ``tools``.
    """
    if parser not in SUPPORTED_PARSERS:
        raise ValueError(
            f"tool_choice={'required' if function is None else function!r}: not enforced for "
            f"--tool-call-parser {parser} (enforced for {', '.join(SUPPORTED_PARSERS)})"
        )
    chosen = [t for t in tools if function is None or _name(t) == function]
    if not chosen:
        raise ValueError(f"tool_choice={function!r}: no such function in tools")
    many = parallel and function is None
    make = _kimi_call if parser == "kimi_k2" else _hermes_call
    lines = [f"call_{i}: {make(t)}" for i, t in enumerate(chosen)]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    if parser == "kimi_k2":
        calls = "call+" if many else "call"
        start = f"start: <|tool_calls_section_begin|> {calls} <|tool_calls_section_end|>"
    else:
        start = 'start: call ("\\n" call)*' if many else "start: call"
    return "\n".join([start, *lines]) + "\n"
