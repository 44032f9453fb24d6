"""What a request's output must match, as plain data: the API's constraint fields read into
one ``StructuredOutput`` (no llguidance here; ``serving.core.structured.grammar`` compiles it).

Where each API field lands::

    response_format {"type": "json_object"}                  -> json_object
    response_format {"type": "json_schema", "json_schema": {"schema": S}}   -> json S
    structured_outputs {"json": S} / guided_json              -> json S
    structured_outputs {"regex": R} / guided_regex            -> regex R
    structured_outputs {"choice": [..]} / guided_choice       -> choice
    structured_outputs {"grammar": G} / guided_grammar        -> grammar (Lark / llguidance)
    tool_choice "required" / {"function": ...}                -> grammar (tool_grammar.py)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Literal

Kind = Literal["json_object", "json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output.

    ``value``: the JSON schema as JSON text (``json``), the regex, the choices as a JSON list
    of strings (``choice``), the Lark grammar (``grammar``), empty for ``json_object``.
    ``param``: the API field it came from, named in the 400 a compile error turns into.
    ``start_after``: token ids that end a reasoning block (a reasoning model thinking first):
    the output is free until its tokens end with them, and constrained from the next token
    on; empty: constrained from the first token.
    """

    kind: Kind
    value: str = ""
    param: str = "structured_outputs"
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.param}={self.kind!r}: not one of {', '.join(KINDS)}")
        object.__setattr__(self, "start_after", tuple(int(t) for t in self.start_after))


def from_response_format(rf: Mapping[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``)."""
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ValueError(
                'response_format=json_schema: expected {"json_schema": {"name": ..., '
                '"schema": {...}}}'
            )
        schema = spec.get("schema", {})  # none given: any JSON value
        return StructuredOutput("json", json.dumps(schema), param="response_format")
    raise ValueError(f"response_format={kind!r}: expected text, json_object or json_schema")


def from_fields(
    structured_outputs: Mapping[str, Any] | None,
    guided: Mapping[str, Any],
) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` extra (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``), or its older ``guided_*`` fields (``guided`` maps ``json`` ... to their
    values, None when unset). At most one constraint."""
    found: list[tuple[str, str, Any]] = []  # (param, key, value)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, Mapping):
            raise ValueError("structured_outputs=...: expected an object")
        for key, value in structured_outputs.items():
            if value is None or value is False:
                continue
            if key not in ("json", "regex", "choice", "grammar", "json_object"):
                raise ValueError(
                    f"structured_outputs={key!r}: supported keys are json, regex, choice, "
                    "grammar and json_object"
                )
            found.append(("structured_outputs", key, value))
    found += [(f"guided_{k}", k, v) for k, v in guided.items() if v is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"{p}.{k}" if p == "structured_outputs" else p for p, k, _ in found)
        raise ValueError(f"{found[0][0]}={names}: give one constraint at most")
    param, key, value = found[0]
    if key == "json_object":
        return StructuredOutput("json_object", param=param)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{param}=json: not valid JSON: {e}") from None
        if not isinstance(value, Mapping | bool):
            raise ValueError(f"{param}=json: a JSON schema is an object")
        return StructuredOutput("json", json.dumps(value), param=param)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(f"{param}=choice: expected a list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value), param=param)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{param}={key}: expected a non-empty string")
    return StructuredOutput(key, value, param=param)
