"""Tool-call and reasoning parsers: each format whole, several calls, malformed blocks kept as
text, and streaming at every split point giving the non-streamed result."""

from __future__ import annotations

import json

import pytest

from serving.entrypoints.chat_output import ChatOutputParser, ChatParsing
from serving.entrypoints.reasoning_parsers import REASONING_PARSERS
from serving.entrypoints.tool_parsers import TOOL_PARSERS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "celsius": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "where": {"type": "object"},
                    "tags": {"type": "array"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]

HERMES_ONE = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # noqa: E501
HERMES_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
CODER_ONE = (
    "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\ntrue\n</parameter>\n"
    '<parameter=ratio>\n0.5\n</parameter>\n<parameter=where>\n{"lat": 1}\n</parameter>\n'
    '<parameter=tags>\n["a"]\n</parameter>\n</function>\n</tool_call>'
)
CODER_TWO = (
    "<tool_call>\n<function=now>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>"
)
KIMI_TWO = (
    "I will call two tools.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Rome"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed]


def test_hermes_one_call():
    text, got = TOOL_PARSERS["hermes"](TOOLS).parse(HERMES_ONE)
    assert text == "Let me check.\n"
    assert calls(got) == [("get_weather", {"city": "Paris"})]
    assert got[0].id.startswith("call_") and got[0].to_openai()["type"] == "function"


def test_hermes_several_calls():
    text, got = TOOL_PARSERS["qwen3"](TOOLS).parse(HERMES_TWO)
    assert text == "\n"
    assert calls(got) == [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    assert got[0].id != got[1].id


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # a brace missing
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n["f"]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',  # never closed
    ],
)
def test_hermes_malformed_is_content(bad):
    text, got = TOOL_PARSERS["hermes"](TOOLS).parse("a " + bad + " b")
    assert got == [] and text == "a " + bad + " b"


def test_hermes_arguments_given_as_a_string():
    out = '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    _, got = TOOL_PARSERS["hermes"](TOOLS).parse(out)
    assert calls(got) == [("now", {"tz": "UTC"})]


def test_qwen3_coder_types_by_schema():
    text, got = TOOL_PARSERS["qwen3_coder"](TOOLS).parse(CODER_ONE)
    assert text == "Sure.\n"
    args = {"city": "New York", "days": 3, "celsius": True, "ratio": 0.5}
    args |= {"where": {"lat": 1}, "tags": ["a"]}
    assert calls(got) == [("get_weather", args)]


def test_qwen3_coder_several_calls_and_unconvertible_value():
    text, got = TOOL_PARSERS["qwen3_coder"](TOOLS).parse(CODER_TWO)
    assert text == "\n"
    # "many" is no integer: kept as the text the model wrote.
    assert calls(got) == [("now", {}), ("get_weather", {"city": "Oslo", "days": "many"})]


def test_qwen3_coder_malformed_is_content():
    bad = "<tool_call>\n<function=now>\n<parameter=x>1</parameter>\n</tool_call>"  # no </function>
    text, got = TOOL_PARSERS["qwen3_coder"](TOOLS).parse(bad)
    assert got == [] and text == bad


def test_kimi_k2_several_calls_keep_their_ids():
    text, got = TOOL_PARSERS["kimi_k2"](TOOLS).parse(KIMI_TWO)
    assert text == "I will call two tools."
    assert calls(got) == [("get_weather", {"city": "Rome"}), ("now", {})]
    assert [c.id for c in got] == ["functions.get_weather:0", "functions.now:1"]


def test_kimi_k2_malformed_section_is_content():
    bad = KIMI_TWO.replace('{"city": "Rome"}', '{"city": Rome}')
    text, got = TOOL_PARSERS["kimi_k2"](TOOLS).parse(bad)
    assert got == [] and text == bad


# ------------------------------------------------------------------------------ reasoning

R = REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize(
    "out,in_reasoning,want",
    [
        ("<think>\nhmm\n</think>\n\nHello", False, ("\nhmm\n", "Hello")),
        ("hmm</think>\n\nHello", True, ("hmm", "Hello")),  # the prompt opened <think>
        ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),
        ("<think>cut short", False, ("cut short", "")),
        ("still thinking", True, ("still thinking", "")),
        ("Hello", False, ("", "Hello")),
        ("\n<thin", False, ("", "\n<thin")),
    ],
)
def test_reasoning_split(out, in_reasoning, want):
    assert R.parse(out, in_reasoning) == want


def test_prompt_state():
    assert R.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not R.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not R.starts_in_reasoning("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------ streaming


def whole(parser_name, text, reasoning=False, in_reasoning=False):
    tools = TOOL_PARSERS[parser_name](TOOLS) if parser_name else None
    return ChatOutputParser(REASONING_PARSERS["qwen3"] if reasoning else None, tools,
                            in_reasoning=in_reasoning)  # fmt: skip


def summary(d):
    return d.reasoning, d.content, [(c.name, c.arguments) for c in d.tool_calls]


SAMPLES = [
    ("hermes", "Hi " + HERMES_TWO + " bye <tool", False, False),
    ("hermes", HERMES_ONE.replace('"Paris"}}', '"Paris"}') + " x", False, False),  # malformed
    ("qwen3_coder", CODER_ONE + "\ndone", False, False),
    ("kimi_k2", KIMI_TWO + " ok", False, False),
    # A call inside the reasoning is not lost; reasoning opened by the prompt.
    ("hermes", "plan " + HERMES_ONE + "</think>\n\nThe answer " + HERMES_TWO, True, True),
    (None, "<think>a</think>\n\nb</think>", True, False),
]


@pytest.mark.parametrize("name,text,reasoning,in_reasoning", SAMPLES,
                         ids=[f"{s[0]}_{i}" for i, s in enumerate(SAMPLES)])  # fmt: skip
def test_streaming_at_every_split_equals_whole(name, text, reasoning, in_reasoning):
    want = summary(whole(name, text, reasoning, in_reasoning).parse(text))
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):  # three pieces: every first split, some seconds
            p = whole(name, text, reasoning, in_reasoning)
            got = p.feed(text[:i])
            got += p.feed(text[i:j])
            got += p.feed(text[j:])
            got += p.finish()
            assert summary(got) == want, (i, j)


def test_streaming_holds_back_a_possible_tag_and_emits_calls_when_closed():
    p = whole("hermes", "")
    assert summary(p.feed("Hi <tool_")) == ("", "Hi ", [])
    assert summary(p.feed('call>{"name": "now", "arguments": {}}')) == ("", "", [])
    assert summary(p.feed("</tool_call>")) == ("", "", [("now", "{}")])
    assert summary(p.feed("<to")) == ("", "", [])
    assert summary(p.finish()) == ("", "<to", [])


def test_reasoning_and_calls_in_both_parts():
    text = "plan " + HERMES_ONE + "</think>\n\nThe answer " + HERMES_TWO
    got = whole("hermes", text, reasoning=True, in_reasoning=True).parse(text)
    assert got.reasoning == "plan Let me check.\n"
    assert got.content == "The answer \n"
    assert [c.name for c in got.tool_calls] == ["get_weather", "get_weather", "now"]


def test_parallel_tool_calls_false_keeps_the_first():
    p = ChatOutputParser(None, TOOL_PARSERS["hermes"](TOOLS), parallel_tool_calls=False)
    assert [c.name for c in p.parse(HERMES_TWO).tool_calls] == ["get_weather"]


def test_chat_parsing_checks_names():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatParsing(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatParsing(reasoning_parser="nope")
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ChatParsing(enable_auto_tool_choice=True)
