"""Structured outputs and enforced ``tool_choice`` with the real engine on the tiny random
model: whatever a random model samples at temperature 1, the grammar's bitmask (applied on
device) keeps every output inside the schema / regex / choice / tool-call format.

One ``hyjax serve`` for the module (``openai`` SDK), plus in-process engines for what the
HTTP layer cannot show (a constrained row beside a free one, async scheduling)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from hyjax.tiny import make_tiny_model
from serving.core.plan import SamplingArrays, mask_words
from serving.core.request import EngineRequest, SamplingParams
from serving.core.structured import StructuredOutput
from serving.worker.sampler import apply_token_mask
from tests.serving.server_helpers import ServerProcess
from tests.serving.test_chat_tools import TEMPLATE, write_tokenizer

SEEDS = 20
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris?"}]
SERVE = ["--max-num-seqs", "8", "--min-seq-bucket", "8", "--max-model-len", "1280",  # [:6]: sizes
         "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]  # fmt: skip
pytestmark = pytest.mark.skipif(
    os.environ.get("HYJAX_SKIP_SERVER") == "1", reason="no server subprocess"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "m"
    make_tiny_model(path, seed=1)
    write_tokenizer(path, TEMPLATE)  # a chat template that renders tools
    return str(path)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", *SERVE)
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        srv.stop()


def _finished(choices) -> None:
    # Every output ended because its grammar was complete (never cut by max_tokens).
    assert {c.finish_reason for c in choices} <= {"stop", "tool_calls"}, choices


def test_json_schema_outputs_validate_over_seeds(client):
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    # Two prompts x n = 10: 20 samples, each with its own seed (sample j: seed + j * stride).
    r = client.completions.create(model="m", prompt=["A person:", "Someone:"], max_tokens=400,
                                  n=SEEDS // 2, temperature=1.0, seed=7,
                                  extra_body={"response_format": rf})  # fmt: skip
    _finished(r.choices)
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in r.choices}) > SEEDS // 2  # sampled, not one forced string


def test_chat_parse_with_a_pydantic_model(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)
        ok: bool

    for seed in range(3):
        r = client.chat.completions.parse(model="m", messages=USER, response_format=Person,
                                          max_tokens=400, temperature=1.0, seed=seed)  # fmt: skip
        _finished(r.choices)
        assert isinstance(r.choices[0].message.parsed, Person)
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=400, seed=1,
                                       response_format={"type": "json_object"})  # fmt: skip
    _finished(r.choices)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choice(client):
    regex = r"(ab|cd)[0-9]{2,4}-[xyz]"
    r = client.completions.create(model="m", prompt="Code:", max_tokens=20, n=10, seed=3,
                                  extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    _finished(r.choices)
    assert all(re.fullmatch(regex, c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["yes", "no", "maybe so"]
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=20, n=10, seed=3,
                                       extra_body={"guided_choice": choices})  # fmt: skip
    _finished(r.choices)
    assert all(c.message.content in choices for c in r.choices)


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_enforced_tool_choice_always_parses(client, choice, stream):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                        "function": {"name": choice}}  # fmt: skip
    names = {"get_weather", "get_time"} if choice == "required" else {choice}
    kw = dict(model="m", messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=500,
              n=4, temperature=1.0, seed=11, parallel_tool_calls=choice != "required")  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kw)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            assert not c.message.content
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            _check_calls(calls, names)
            assert len(calls) == 1 or choice == "required"
        return
    got: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            out = got.setdefault(ch.index, {"calls": {}, "content": "", "finish": None})
            out["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                call = out["calls"].setdefault(tc.index, ["", ""])
                call[0] += tc.function.name or ""
                call[1] += tc.function.arguments or ""
            out["finish"] = ch.finish_reason or out["finish"]
    assert len(got) == 4
    for out in got.values():
        assert out["finish"] == "tool_calls" and not out["content"].strip(), out
        _check_calls([tuple(v) for v in out["calls"].values()], names)


@pytest.fixture(scope="module")
def coder_client(model_dir, tmp_path_factory):
    """A server with Qwen3-Coder's tool-call format and a reasoning parser."""
    args = [*SERVE[:6], "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "coder.log", *args)
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        srv.stop()


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_enforced_qwen3_coder_calls_always_parse(coder_client, choice):
    """Thinking off (the template closes the block): constrained from the first token, every
    sample is one Qwen3-Coder call that the parser reads and the tool's schema accepts."""
    tool_choice = choice if choice == "required" else {"type": "function",
                                                        "function": {"name": choice}}  # fmt: skip
    names = {"get_weather", "get_time"} if choice == "required" else {choice}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = coder_client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                             tool_choice=tool_choice, max_tokens=500, n=6,
                                             temperature=1.0, seed=5, extra_body=off,
                                             parallel_tool_calls=False)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert not c.message.content and not getattr(c.message, "reasoning_content", None)
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        _check_calls(calls, names)
        assert len(calls) == 1
    if choice == "required":
        assert {c.message.tool_calls[0].function.name for c in r.choices} == names


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}},
         "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
    ],
    ids=["schema", "regex", "grammar", "unknown_function"],
)  # fmt: skip
def test_bad_constraints_are_400_and_the_server_goes_on(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, max_tokens=5, **kw)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------------ in-process engine


def _engine(model_dir, **kw):
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    args = dict(max_num_seqs=4, min_seq_bucket=4, max_num_batched_tokens=64, max_model_len=640,
                warmup=False)  # fmt: skip
    return LLMEngine(EngineArgs(model=model_dir, **{**args, **kw}))


def _run(engine, jobs: list[tuple[str, SamplingParams]]) -> list[list[int]]:
    ids = [engine.add_request(EngineRequest(p, sp)) for p, sp in jobs]
    out = engine.run_to_completion()
    return [out[i].output_token_ids for i in ids]


JSON = StructuredOutput("json", json.dumps(SCHEMA), param="response_format")


def test_constrained_rows_beside_free_ones_and_under_async_scheduling(model_dir):
    """A free row's tokens are those of a run without the constrained one in its steps, and
    async scheduling (grammar rows wait for their token) samples exactly the sync tokens."""
    free = ("Once upon", SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True))
    constrained = [("A person:", SamplingParams(max_tokens=400, seed=s, structured=JSON))
                   for s in range(3)]  # fmt: skip
    sync = _engine(model_dir)
    (alone,) = _run(sync, [free])
    mixed = _run(sync, [free, *constrained])
    assert mixed[0] == alone
    for toks in mixed[1:]:
        text = sync.tokenizer.decode(toks)
        jsonschema.validate(json.loads(text), SCHEMA)
    async_ = _engine(model_dir, async_scheduling=True)
    assert _run(async_, [free, *constrained]) == mixed


def test_mask_applies_only_to_grammar_rows():
    """The sampler's bitmask against a numpy expansion, rows with and without a grammar."""
    rng = np.random.default_rng(0)
    s, v = 3, 77
    logits = rng.normal(size=(s, v)).astype(np.float32)
    allowed = rng.random((s, v)) < 0.3
    words = np.zeros((s, mask_words(v) * 32), bool)
    words[:, :v] = allowed
    mask = np.packbits(words, axis=1, bitorder="little").view(np.int32)
    uses = np.array([1, 0, 1], np.int32)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(uses), jnp.asarray(mask)))
    want = np.where(allowed & (uses[:, None] > 0) | (uses[:, None] == 0), logits, -np.inf)
    np.testing.assert_array_equal(got, want)
    none = apply_token_mask(jnp.asarray(logits), jnp.zeros(s, jnp.int32), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(none), logits)
    assert SamplingArrays.empty(2).uses_grammar.tolist() == [0, 0]


def test_grammar_after_the_reasoning_end_under_sync_and_async(model_dir):
    """``start_after`` (a reasoning model thinking first): the tokens before the end marker
    are free (a random model writes anything, not the ``{`` the schema needs first), the ones
    after it follow the schema; async scheduling samples exactly the sync tokens. The marker
    is one token here, made likely by a ``logit_bias``, as ``</think>`` is in Qwen3's
    vocabulary (EOS is kept out of the reasoning by another)."""
    sync = _engine(model_dir)
    (end,) = sync.tokenizer.encode("|", False)
    spec = dataclasses.replace(JSON, start_after=(end,))
    bias = {end: 2.0, sync.eos_token_ids[0]: -100.0}
    jobs = [("A person:", SamplingParams(max_tokens=400, temperature=1.0, seed=s, structured=spec,
                                         logit_bias=bias))
            for s in range(8)]  # fmt: skip
    outs = _run(sync, jobs)
    reasoned = 0
    for toks in outs:
        i = toks.index(end)
        reasoned += i > 0 and sync.tokenizer.decode(toks[:1]).strip() not in ("", "{")
        jsonschema.validate(json.loads(sync.tokenizer.decode(toks[i + 1 :])), SCHEMA)
    assert reasoned >= 6, outs  # free text came first
    async_ = _engine(model_dir, async_scheduling=True)
    assert _run(async_, jobs) == outs
