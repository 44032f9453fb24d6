"""Rendering Hugging Face chat templates (Jinja) safely, the way transformers does.

Templates come from checkpoints, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` and only see plain JSON-like data (dicts, lists, str, numbers,
bools, None). The environment matches transformers' so the output is byte-identical:
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
tag that just renders its body, a ``tojson`` filter without HTML escaping, and the globals
``raise_exception(message)`` and ``strftime_now(format)``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates (Qwen3) read `reasoning_content`,
# gpt-oss ones `thinking`. The first one present fills in the other two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """There is no chat template, it does not compile, or it raised while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a template source in the sandbox (cached by source).

    Raises:
        ChatTemplateError: The source is not valid Jinja.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (``messages``, ``tools`` ...); a
    template that never reads ``tools`` cannot show tools to the model.

    Raises:
        ChatTemplateError: The source is not valid Jinja.
    """
    compile_chat_template(source)  # the same error for a broken source
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Renders one conversation.

    Args:
        source: The template source.
        messages: The conversation; each a mapping with at least ``role``. Keys whose value
            is None are dropped (templates test ``'tool_calls' in message``), and reasoning
            under any of its names is offered under all of them.
        add_generation_prompt: Passed to the template.
        tools: JSON-schema tool definitions, or None.
        documents: Retrieval documents, or None.
        **variables: More template variables (special tokens, ``enable_thinking`` ...).

    Returns:
        The rendered text.

    Raises:
        ChatTemplateError: The template does not compile or raised (``raise_exception``).
        TypeError: A message is not a mapping.
    """
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=[_normalize_message(m) for m in messages],
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


def _normalize_message(message: Any) -> dict[str, Any]:
    message = _plain(message)
    if not isinstance(message, dict):
        raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _plain(value: Any) -> Any:
    """A copy made of JSON types only, so the template can reach no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    raise TypeError(f"chat template data must be JSON-like, got {type(value).__name__}")
