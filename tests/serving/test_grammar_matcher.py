"""The grammar matcher on the tiny byte-level vocabulary, without a model: random walks through
its masks (what any model could sample) always give outputs the parsers read, and a grammar
that starts after the reasoning leaves the output free until the end marker."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from serving.core.structured import StructuredOutput, tool_call_grammar
from serving.core.structured.grammar import GrammarCompiler
from serving.entrypoints.tool_parsers import TOOL_PARSERS
from tests.serving.test_chat_tools import TEMPLATE, write_tokenizer
from tests.serving.test_structured_outputs import SCHEMA, TOOLS

VOCAB = 259  # the tiny model's: 256 bytes and 3 special tokens


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [tok.encode("<|im_end|>", False)[0]])


def _allowed(m) -> np.ndarray:
    mask = np.zeros(m.mask_words, np.int32)
    m.fill_mask(mask)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB])


def _walk(m, rng, prefer: list[int], limit: int = 3000) -> list[int]:
    """Samples allowed tokens until the grammar is complete; tokens of ``prefer`` (those that
    close things) are taken more often, so a walk ends in a few hundred steps."""
    out = []
    while not m.is_terminated and len(out) < limit:
        allowed = _allowed(m)
        closing = np.intersect1d(allowed, prefer)
        pick = closing if len(closing) and rng.random() < 0.3 else allowed
        t = int(rng.choice(pick))
        assert m.accept(t), m.error
        out.append(t)
    assert m.is_terminated, "the walk did not end"
    return out


@pytest.mark.parametrize("function", [None, "get_weather", "get_time"])
def test_qwen3_coder_calls_always_parse(tok, compiler, function):
    text = tool_call_grammar("qwen3_coder", TOOLS, function=function)
    parser = TOOL_PARSERS["qwen3_coder"](TOOLS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    prefer = tok.encode("\n</>", False) + tok.encode("<|im_end|>", False)
    names = set()
    for seed in range(12):
        m = compiler.compile(StructuredOutput("grammar", text, param="tool_choice"))
        out = tok.decode(_walk(m, np.random.default_rng(seed), prefer))
        rest, calls = parser.parse(out)
        assert calls and not rest.strip(), out
        assert function is None or len(calls) == 1
        for c in calls:
            assert function in (None, c.name), out
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
            names.add(c.name)
    assert names == ({"get_weather", "get_time"} if function is None else {function})


def test_qwen3_coder_optional_and_free_parameters(tok, compiler):
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "required": ["n"], "properties": {
                "s": {"type": "string", "maxLength": 3}, "n": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object", "properties": {
                    "k": {"type": "integer"}}, "required": ["k"], "additionalProperties": False},
            }}}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    parser = TOOL_PARSERS["qwen3_coder"](tools)
    prefer = tok.encode("\n</>}", False) + tok.encode("<|im_end|>", False)
    seen = set()
    for seed in range(16):
        for function in ("f", "g"):
            text = tool_call_grammar("qwen3_coder", tools, function=function)
            m = compiler.compile(StructuredOutput("grammar", text, param="tool_choice"))
            out = tok.decode(_walk(m, np.random.default_rng(seed), prefer))
            _, (call,) = parser.parse(out)
            args = json.loads(call.arguments)
            if function == "f":
                jsonschema.validate(args, tools[0]["function"]["parameters"])
                seen |= set(args)
            else:
                assert all(isinstance(v, str) for v in args.values()), args
    assert seen == {"s", "n", "b", "o"}  # each optional parameter shows up in some walk


def test_grammar_starts_after_the_reasoning_end(tok, compiler):
    end = tuple(tok.encode("</think>", False))
    assert len(end) > 1  # several tokens here (one special token in Qwen3's vocabulary)
    spec = StructuredOutput("json", json.dumps(SCHEMA), start_after=end)
    m = compiler.compile(spec)
    reasoning = tok.encode("Hmm </thin> </think", False) + tok.encode("<|im_start|>", False)
    for t in reasoning:  # every token allowed (a partial end marker does not start it)
        assert not m.started and len(_allowed(m)) == VOCAB
        assert m.accept(t) and not m.is_terminated
    for t in end:
        assert not m.started and len(_allowed(m)) == VOCAB
        assert m.accept(t)
    assert m.started and len(_allowed(m)) < VOCAB
    prefer = tok.encode('"}],0', False)
    out = tok.decode(_walk(m, np.random.default_rng(0), prefer))
    jsonschema.validate(json.loads(out), SCHEMA)
    at_once = compiler.compile(StructuredOutput("json", json.dumps(SCHEMA)))
    assert at_once.started and tok.decode(_allowed(at_once).tolist()).strip() == "{"
