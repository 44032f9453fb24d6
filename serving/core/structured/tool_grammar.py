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
    qwen3_coder:     <tool_call>\n<function=f>\n<parameter=p>\nVALUE\n</parameter>\n
                     </function>\n</tool_call>

Qwen3-Coder's values are bare text, typed by the parser from the property's schema, so each
value's grammar is what the parser turns back into a valid value: a string's is text without
``<`` (it cannot close its tag early) within the schema's length bounds, an enum of strings its
literals, a value of one other JSON type (integer, number, boolean, object, array) its JSON
(``%json`` of the property's schema). The schema's required properties come, in its order,
with the optional ones in between where the model wants them; a tool without properties takes
any parameters as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# --tool-call-parser names whose format has a grammar here.
SUPPORTED_PARSERS = ("hermes", "qwen3", "qwen3_coder", "kimi_k2")


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


# A text value (one or more lines, no "<"), closed by its tag: one lexeme, so the newline
# before "</parameter>" is not read as part of the value.
_TEXT_CLOSE = r"[^<]{%s,%s}\n<\/parameter>\n"


def _coder_value(schema: Any) -> str:
    """The Lark of one Qwen3-Coder parameter's value followed by ``\\n</parameter>\\n``."""
    close = ' "\\n</parameter>\\n"'
    if not isinstance(schema, Mapping):
        schema = {}
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if options and all(isinstance(o, str) and "<" not in o for o in options):
        return "(" + " | ".join(json.dumps(o) for o in options) + ")" + close
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if len(kinds) == 1 and kinds[0] in ("integer", "number", "boolean", "object", "array"):
        return "%json " + json.dumps(schema) + close
    lo = schema.get("minLength", 0) if "string" in kinds else 0
    hi = schema.get("maxLength", "") if "string" in kinds else ""
    return "/" + _TEXT_CLOSE % (int(lo), hi if hi == "" else int(hi)) + "/"


def _coder_call(tool: Mapping[str, Any], i: int) -> list[str]:
    """Rules ``call_{i}`` (and its parameters') of one Qwen3-Coder call of ``tool``."""
    params = _parameters(tool)
    props = params.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = set(params.get("required") or ())
    rules, body = [], []
    for j, (key, schema) in enumerate(props.items()):
        head = json.dumps(f"<parameter={key}>\n")
        rules.append(f"p_{i}_{j}: {head} {_coder_value(schema)}")
        body.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
    if not props:  # any parameters, as text
        rules.append(f'p_{i}_any: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {_coder_value({})}')
        body.append(f"p_{i}_any*")
    head = json.dumps(f"<tool_call>\n<function={_name(tool)}>\n")
    tail = json.dumps("</function>\n</tool_call>")
    return [f"call_{i}: {head} {' '.join(body)} {tail}", *rules]


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
    if parser == "qwen3_coder":
        lines = [rule for i, t in enumerate(chosen) for rule in _coder_call(t, i)]
    else:
        make = _kimi_call if parser == "kimi_k2" else _hermes_call
        lines = [f"call_{i}: {make(t)}" for i, t in enumerate(chosen)]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    if parser == "kimi_k2":
        calls = "call+" if many else "call"
        start = f"start: <|tool_calls_section_begin|> {calls} <|tool_calls_section_end|>"
    else:
        start = 'start: call ("\\n" call)*' if many else "start: call"
    return "\n".join([start, *lines]) + "\n"
