"""Which grammar engine for structured outputs: compile time of a schema and mask time per token.

Issue 21 asks to pick a well-kept engine by measurement: llguidance, xgrammar or outlines-core.
For each one that imports, this script

1. builds the engine's tokenizer view of a **~150k-token byte-level BPE vocabulary** (trained
   here with ``tokenizers`` on the Python standard library's sources: the hub is out of reach,
   and Qwen3-Next's vocabulary is 151k byte-level BPE tokens too);
2. compiles JSON schemas (a flat object, a tool-call schema with nested objects, arrays, enums
   and a pattern) and times it (cold: a fresh compiler each time);
3. walks a valid instance of each schema token by token, computing the allowed-token mask
   (a packed 32-bit bitmask, what the jitted sampler takes) before every token, and reports the
   median / p99 / max host time per mask;
4. checks that every token of the instance was allowed by the mask before it (an engine that
   masks the wrong tokens is fast for nothing).

It needs the engines installed (they are not the project's dependencies yet)::

    pip install llguidance xgrammar outlines-core   # xgrammar imports torch
    python -m benchmarks.grammar_engines --out benchmarks/results/grammar_engines_cpu.json

``--engines hyjax`` times llguidance through hyjax's own integration (what the scheduler
runs per constrained row and step)::

    python -m benchmarks.grammar_engines --engines hyjax \
        --out benchmarks/results/grammar_mask_hyjax_cpu_2core_epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
import traceback

import numpy as np

VOCAB = 150_000

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "score", "active"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search_docs", "run_python"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "filters": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "op": {"type": "string", "enum": ["eq", "lt", "gt"]},
                                "value": {"type": "string"},
                            },
                            "required": ["field", "op", "value"],
                            "additionalProperties": False,
                        },
                    },
                    "request_id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                },
                "required": ["query", "city", "unit", "days", "filters", "request_id"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

INSTANCES = {
    "flat": {"name": "Ada Lovelace", "age": 36, "score": 97.25, "active": True},
    "tool_call": {
        "name": "get_weather",
        "arguments": {
            "query": "weather for the next days, with rain probability",
            "city": "Zurich",
            "unit": "celsius",
            "days": 5,
            "filters": [
                {"field": "rain", "op": "gt", "value": "0.3"},
                {"field": "wind", "op": "lt", "value": "40"},
            ],
            "request_id": "deadbeef",
        },
    },
}


def train_tokenizer(cache: str):
    """A byte-level BPE of ``VOCAB`` tokens trained on the stdlib's sources (cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not os.path.exists(cache):
        files = []
        for root, _, names in os.walk(sysconfig.get_paths()["stdlib"]):
            files += [os.path.join(root, n) for n in names if n.endswith(".py")]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )

        def texts():
            for path in sorted(files):
                with open(path, encoding="utf-8", errors="ignore") as f:
                    yield f.read()

        tok.train_from_iterator(texts(), trainer)
        tok.save(cache)
    fast = PreTrainedTokenizerFast(tokenizer_file=cache, eos_token="<|endoftext|>")
    return fast


def _bitmask_allows(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def _summary(compile_s, mask_s, allowed):
    m = np.asarray(mask_s) * 1e3
    return {
        "compile_ms": 1e3 * compile_s,
        "tokens": len(mask_s),
        "mask_ms_median": float(np.median(m)),
        "mask_ms_p99": float(np.percentile(m, 99)),
        "mask_ms_max": float(m.max()),
        "mask_ms_first": float(m[0]),
        "every_token_allowed": allowed,
    }


def run_llguidance(hf_tok, schema, tokens):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    lltok = llguidance.hf.from_tokenizer(hf_tok)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lnp.allocate_token_bitmask(1, lltok.vocab_size)
    times, ok = [], True
    for t in tokens:
        t0 = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t0)
        ok &= _bitmask_allows(mask[0], t)
        matcher.consume_token(t)
    return _summary(compile_s, times, ok)


def run_hyjax(hf_tok, schema, tokens):
    """llguidance through hyjax's integration (``serving.core.structured.grammar``): the server's
    ``GrammarCompiler`` over a ``hyjax.tokenizer.Tokenizer`` of the same vocabulary, the
    scheduler's per-row ``fill_mask`` into a step mask row, then ``accept``."""
    from hyjax.tokenizer import Tokenizer
    from serving.core.plan import mask_words
    from serving.core.structured import StructuredOutput
    from serving.core.structured.grammar import GrammarCompiler

    tok = Tokenizer(hf_tok.backend_tokenizer, special_tokens={"eos_token": "<|endoftext|>"})
    compiler = GrammarCompiler(tok, len(hf_tok), [hf_tok.eos_token_id])
    _ = compiler.ll_tokenizer  # the vocabulary view, built once a server (not a compile's cost)
    t0 = time.perf_counter()
    matcher = compiler.compile(StructuredOutput("json", json.dumps(schema)))
    compile_s = time.perf_counter() - t0
    mask = np.zeros((1, mask_words(len(hf_tok))), np.int32)
    times, ok = [], True
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_mask(mask[0])
        times.append(time.perf_counter() - t0)
        ok &= _bitmask_allows(mask[0], t)
        ok &= matcher.accept(t)
    return _summary(compile_s, times, ok)


def run_xgrammar(hf_tok, schema, tokens):
    import xgrammar as xg

    info = xg.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
    t0 = time.perf_counter()
    compiled = xg.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
    )
    compile_s = time.perf_counter() - t0
    matcher = xg.GrammarMatcher(compiled)
    mask = xg.allocate_token_bitmask(1, info.vocab_size)
    times, ok = [], True
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        ok &= _bitmask_allows(mask.numpy()[0], t)
        matcher.accept_token(t)
    return _summary(compile_s, times, ok)


def run_outlines(hf_tok, schema, tokens):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf_tok.eos_token_id
    byte_decoder = _byte_decoder()
    vocab: dict[str, list[int]] = {}
    for tok, i in hf_tok.get_vocab().items():
        if i == eos:
            continue
        text = bytes(byte_decoder[c] for c in tok).decode("utf-8", errors="replace")
        vocab.setdefault(text, []).append(i)
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema), r"")
    index = oc.Index(regex, oc.Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - t0
    guide = oc.Guide(index)
    words = (len(hf_tok) + 31) // 32
    mask = np.zeros(words, np.int32)
    times, ok = [], True
    for t in tokens:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        times.append(time.perf_counter() - t0)
        ok &= _bitmask_allows(mask, t)
        if t == eos:  # outlines-core ends in a final state; it does not advance on EOS
            ok &= guide.is_finished()
            break
        guide.advance(t)
    return _summary(compile_s, times, ok)


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet back to bytes (GPT-2's printable remapping)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


ENGINES = {
    "llguidance": run_llguidance,
    "xgrammar": run_xgrammar,
    "outlines_core": run_outlines,
    "hyjax": run_hyjax,  # llguidance as the server drives it
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tokenizer-cache", default="/tmp/hyjax_bpe150k.json")
    p.add_argument("--engines", default=",".join(ENGINES))
    args = p.parse_args()
    t0 = time.perf_counter()
    tok = train_tokenizer(args.tokenizer_cache)
    summary = {
        "vocab_size": len(tok),
        "tokenizer_build_s": time.perf_counter() - t0,
        "cpu": os.uname().machine,
        "cpu_count": os.cpu_count(),
    }
    for engine in args.engines.split(","):
        try:
            import importlib.metadata as md

            dist = "llguidance" if engine == "hyjax" else engine.replace("_", "-")
            summary[f"{engine}_version"] = md.version(dist)
        except Exception:  # noqa: BLE001 - report what is installed
            summary[f"{engine}_version"] = None
        for name, schema in SCHEMAS.items():
            text = json.dumps(INSTANCES[name], separators=(",", ":"))
            tokens = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            key = f"{engine}_{name}"
            try:
                summary[key] = ENGINES[engine](tok, schema, tokens)
            except Exception as e:  # noqa: BLE001 - keep going, report the failure
                summary[key] = {"failed": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
            print(key, json.dumps(summary[key]), flush=True)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
