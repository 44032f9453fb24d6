"""Tools and reasoning on /v1/chat/completions through the ``openai`` client.

A random tiny model writes no tool calls, so most tests serve the app in process over a fake
engine that answers every request with canned text (in several deltas) and records the
prompt it got: the request checks, the template rendering, and the response building are the
server's own. One test starts a real ``hyjax serve`` with the flags and checks that the tools
reach the prompt."""

from __future__ import annotations

import asyncio
import json
import os

import openai
import pytest
from fastapi.testclient import TestClient

from hyjax.tiny import CHATML, byte_level_tokenizer, make_tiny_model
from hyjax.tokenizer import Tokenizer
from serving.engine.messages import Delta
from serving.entrypoints.chat_output import ChatParsing
from tests.serving.server_helpers import ServerProcess

# A Qwen3 thinking-2507-style template, small enough for a 256-token byte-level context:
# tools in the system turn, calls and tool results in the history, and a generation prompt
# that opens <think> (closed at once when enable_thinking is false).
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [WEATHER]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>")  # fmt: skip
OUTPUT = "I should call the tool.\n</think>\n\nChecking. " + CALL
PARSING = ChatParsing("hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")


def write_tokenizer(path, template: str) -> Tokenizer:
    path.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


class FakeEngine:
    """Answers each request with ``output`` in pieces of ``piece`` characters."""

    alive, info, last_stats = True, None, None

    def __init__(self, tokenizer: Tokenizer, output: str, piece: int = 5) -> None:
        self.tokenizer, self.output, self.piece = tokenizer, output, piece
        self.prompts: list[str] = []
        self.requests: list = []

    def attach(self, loop) -> None: ...

    def close(self) -> None: ...

    def abort(self, request_id: str) -> None: ...

    async def add(self, request, queue):
        self.prompts.append(self.tokenizer.decode(request.prompt, skip_special_tokens=False))
        self.requests.append(request)
        pieces = [self.output[i : i + self.piece] for i in range(0, len(self.output), self.piece)]

        async def run():
            for k, text in enumerate(pieces):
                await asyncio.sleep(0)
                last = k == len(pieces) - 1
                reason = "stop" if last else None
                d = Delta(request.request_id, [0], text, last, reason, len(request.prompt), 0)
                queue.put_nowait(d)

        asyncio.get_running_loop().create_task(run())
        return queue


@pytest.fixture
def serve(tmp_path):
    """``serve(output, parsing, template)`` -> (openai client, fake engine)."""
    from serving.entrypoints import server as srv

    opened = []

    def start(output: str = OUTPUT, parsing: ChatParsing = PARSING, template: str = TEMPLATE):
        tok = write_tokenizer(tmp_path / f"tok{len(opened)}", template)
        engine = FakeEngine(tok, output)
        state = srv.ServerState(engine, "m", "/m", tokenizer=tok, chat_parsing=parsing)  # type: ignore[arg-type]
        http = TestClient(srv.build_app(state), base_url="http://testserver/v1")
        http.__enter__()
        opened.append(http)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                               max_retries=0)  # fmt: skip
        return client, engine

    yield start
    for http in opened:
        http.__exit__(None, None, None)


def accumulate(stream) -> dict:
    """A streamed message put together the way the OpenAI SDK does (calls by index)."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            out["content"] += d.content or ""
            for tc in d.tool_calls or ():
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "args": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["args"] += (tc.function.arguments or "") if tc.function else ""
            out["finish"] = ch.finish_reason or out["finish"]
    return out


def test_tool_call_and_reasoning(serve):
    client, engine = serve()
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    assert json.dumps(WEATHER) in engine.prompts[0]  # rendered through the template
    assert engine.prompts[0].endswith("<|im_start|>assistant\n<think>\n")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should call the tool.\n"
    assert choice.message.content == "Checking. "
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_equals_non_streamed(serve):
    client, _ = serve()
    full = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    got = accumulate(client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                                    stream=True))  # fmt: skip
    m = full.choices[0].message
    assert got["reasoning"] == m.reasoning_content and got["content"] == m.content
    assert [(c["name"], c["args"]) for c in got["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in m.tool_calls
    ]
    assert all(c["id"] for c in got["calls"].values())
    assert got["finish"] == "tool_calls"


def test_the_sdk_stream_helper_accumulates_the_calls(serve):
    client, _ = serve()
    with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"


def test_thinking_off_and_no_tools(serve):
    client, engine = serve(output="Hello there")
    r = client.chat.completions.create(
        model="m", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert engine.prompts[0].endswith("<think>\n\n</think>\n\n")
    assert "<tools>" not in engine.prompts[0]
    m = r.choices[0].message
    assert m.content == "Hello there" and m.tool_calls is None
    assert getattr(m, "reasoning_content", None) is None
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "parser,output",
    [
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                        "</parameter>\n</function>\n</tool_call>"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                    "<|tool_calls_section_end|>"),
    ],
)  # fmt: skip
def test_other_formats(serve, parser, output):
    client, engine = serve(output=output, parsing=ChatParsing(parser, enable_auto_tool_choice=True))
    m = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0].message
    assert m.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Kimi's markers are special tokens: a request with tools keeps them in its text.
    assert engine.requests[-1].sampling_params.skip_special_tokens == (parser != "kimi_k2")
    client.chat.completions.create(model="m", messages=USER)  # no tools: the default
    assert engine.requests[-1].sampling_params.skip_special_tokens


def test_history_with_calls_and_results(serve):
    client, engine = serve(output="It is sunny.")
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert CALL in engine.prompts[0]  # arguments reach the template as a mapping
    assert "<tool_response>\nsunny\n</tool_response>" in engine.prompts[0]
    assert r.choices[0].message.reasoning_content == "It is sunny."  # never closed: reasoning


def test_required_and_named_send_the_grammar_of_the_calls(serve):
    """``required`` / a named tool reach the engine as the grammar of the calls (decoding
    enforces it: test_structured_outputs.py). With thinking on (the prompt opens ``<think>``)
    the grammar starts after the reasoning's end marker, and the reasoning stays reasoning;
    with thinking off it starts at once and the output is read as content and calls."""
    on = {}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for thinking, output in ((on, "I will call it.\n</think>\n\n" + CALL), (off, CALL)):
        client, engine = serve(output=output)
        marker = tuple(engine.tokenizer.encode("</think>", False))
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                               tool_choice=choice, extra_body=thinking)  # fmt: skip
            spec = engine.requests[-1].sampling_params.structured
            assert spec.kind == "grammar" and spec.param == "tool_choice"
            assert "<tool_call>" in spec.value and '"const": "get_weather"' in spec.value
            assert spec.start_after == (marker if thinking is on else ())
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            assert r.choices[0].finish_reason == "tool_calls"
            reasoning = getattr(r.choices[0].message, "reasoning_content", None)
            assert reasoning == ("I will call it.\n" if thinking is on else None)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                       tool_choice="required",
                                       response_format={"type": "json_object"})  # fmt: skip
    client, engine = serve(output=QWEN3_CODER_CALL, parsing=ChatParsing("qwen3_coder"))
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                       tool_choice="required")  # fmt: skip
    spec = engine.requests[-1].sampling_params.structured
    assert "<function=get_weather>" in spec.value and spec.start_after == ()
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"


def test_json_schema_after_the_reasoning(serve):
    """A ``response_format`` with a reasoning parser: thinking on, the grammar starts after
    ``</think>`` and the reasoning goes to ``reasoning_content``, the JSON to ``content``
    (streamed the same); thinking off (the template closes the block), it starts at once."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    client, engine = serve(output='Let me see.\n</think>\n\n{"a": 1}')
    marker = tuple(engine.tokenizer.encode("</think>", False))
    r = client.chat.completions.create(model="m", messages=USER, response_format=rf)
    assert engine.requests[-1].sampling_params.structured.start_after == marker
    m = r.choices[0].message
    assert m.reasoning_content == "Let me see.\n" and json.loads(m.content) == {"a": 1}
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="m", messages=USER, response_format=rf,
                                                stream=True):  # fmt: skip
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, json.loads(content)) == ("Let me see.\n", {"a": 1})
    client, engine = serve(output='{"a": 1}')
    r = client.chat.completions.create(model="m", messages=USER, response_format=rf,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": False}})  # fmt: skip
    assert engine.requests[-1].sampling_params.structured.start_after == ()
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    client, engine = serve(output='{"a": 1}', parsing=ChatParsing("hermes"))  # no reasoning
    r = client.chat.completions.create(model="m", messages=USER, response_format=rf)
    assert engine.requests[-1].sampling_params.structured.start_after == ()
    assert json.loads(r.choices[0].message.content) == {"a": 1}


def test_tool_choice_none_leaves_calls_as_text(serve):
    client, _ = serve(output="</think>" + CALL)
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None


BAD = [
    ("unknown_function", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
     "tool_choice"),
    ("choice_without_tools", {"tool_choice": "required"}, "tool_choice"),
    ("bad_choice_string", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool_message_unknown_id", {"messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "x"}]}, "messages"),
    ("tool_message_without_call", {"messages": USER + [
        {"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, "messages"),
    ("tool_without_name", {"tools": [{"type": "function", "function": {}}]}, "tools"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400_and_the_server_goes_on(serve, body, param):
    client, _ = serve()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", **{"messages": USER, **body})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content


def test_template_without_tools_is_400(serve):
    client, _ = serve(template=CHATML)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]


def test_auto_needs_the_server_flag(serve):
    client, _ = serve(parsing=ChatParsing("hermes"))
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    client, _ = serve(parsing=ChatParsing())
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(
            model="m", messages=USER, tools=TOOLS, tool_choice="required"
        )


# ------------------------------------------------------------------------------ real server


@pytest.mark.skipif(os.environ.get("HYJAX_SKIP_SERVER") == "1", reason="no server subprocess")
def test_real_server_renders_tools(tmp_path):
    """``hyjax serve`` with the flags: a request with tools is accepted and its prompt (by
    the token count, one byte a token) is the template's rendering with the tools."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=1)
    tok = write_tokenizer(tmp_path / "tiny", TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f"}}]
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")  # fmt: skip
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=3)
        want = tok.encode(tok.apply_chat_template(USER, tools=tools), add_special_tokens=False)
        assert r.usage.prompt_tokens == len(want)
        assert r.choices[0].finish_reason in ("stop", "length")
        # No visible text is lost: at most 3 tokens, split between reasoning and content.
        m = r.choices[0].message
        assert isinstance(m.content, str) or m.content is None
    finally:
        srv.stop()
