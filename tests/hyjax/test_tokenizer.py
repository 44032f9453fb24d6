"""Tests for hyjax.tokenizer: loading, encode/decode parity with transformers, streaming
detokenization, stop strings, chat templates and the tiktoken (Kimi) conversion."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import regex
from tokenizers import AddedToken, Regex, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hyjax.tokenizer import (
    KIMI_PRETOKENIZE_PATTERN,
    ChatTemplateError,
    DetokenizerStream,
    Tokenizer,
    TokenizerFilesError,
    check_stop_strings,
    load_tiktoken_ranks,
    tiktoken_to_backend,
)
from tests.hyjax.tokenizer_fixtures import (
    CHATML_TEMPLATE,
    KIMI_SPECIAL_TOKENS,
    build_tiny_tiktoken,
    build_tiny_tokenizer,
    tiny_tiktoken_ranks,
    train_tiny_metaspace_bpe,
)

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "Café naïve façade — crème brûlée, Ångström.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 😀🎉 👍🏽 ❤️ 🇯🇵 rocket🚀end",
    "mixed 中文English混合 text 123456 $5.00\n\n\tdef f(x):\n    return x",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


# -------------------------------------------------------------------------------------------
# Loading, encode / decode
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(tok, hf_tok, text, add_special_tokens):
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf_tok.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_vocab_and_special_ids(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == len(tok) == 603
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == hf_tok.eos_token_id == im_end
    assert tok.eos_token_ids == {im_end, endoftext}
    assert tok.pad_token_id == hf_tok.pad_token_id == endoftext
    assert tok.bos_token_id is None and hf_tok.bos_token_id is None
    assert tok.id_to_token(im_end) == "<|im_end|>"


def test_eos_ids_from_every_source(tmp_path):
    d = build_tiny_tokenizer(
        tmp_path, generation_config=False, config_overrides={"eos_token": "<|im_start|>"}
    )
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [5, 6]}}))
    tok = Tokenizer.from_dir(d)
    assert tok.special_tokens["eos_token"] == "<|im_start|>"  # the plain string form
    assert tok.eos_token_ids == {tok.token_to_id("<|im_start|>"), 5, 6}


def test_add_bos_token(tmp_path):
    d = build_tiny_tokenizer(
        tmp_path, config_overrides={"add_bos_token": True, "bos_token": "<|endoftext|>"}
    )
    tok = Tokenizer.from_dir(d)
    bos = tok.bos_token_id
    assert bos == tok.token_to_id("<|endoftext|>")
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [bos, *plain]
    assert tok.encode("<|endoftext|>Hello") == [bos, *plain]  # never doubled


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(TokenizerFilesError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerFilesError) as info:
        Tokenizer.from_dir(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "tokenizer.json" in message and "tiktoken.model" in message


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    """A model whose vocabulary is larger than its tokenizer's (random weights under the
    embedded tokenizer, ``--load-format dummy``) emits ids the tokenizer lacks: no crash, and
    no text for them, in one decode and in a stream."""
    ids = tok.encode("hello world", add_special_tokens=False)
    past = [tok.vocab_size, tok.vocab_size + 12345]
    mixed = ids[:1] + past + ids[1:]
    assert tok.decode(mixed) == tok.decode(ids)
    stream = tok.detokenizer()
    assert "".join(stream.step(i) for i in mixed) + stream.flush() == tok.decode(ids)


def test_no_jax_import():
    code = "import sys, hyjax.tokenizer; assert 'jax' not in sys.modules, 'jax imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# -------------------------------------------------------------------------------------------
# Streaming detokenization
# -------------------------------------------------------------------------------------------


def _stream(tok, ids, context=(), chunk=1):
    stream = DetokenizerStream(tok, context)
    deltas = [stream.extend(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert stream.token_ids == list(ids)
    return deltas, stream.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids, chunk=chunk)
    assert "".join(deltas) == tok.decode(ids)
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_split_characters(tok):
    ids = tok.encode("a😀b")
    assert len(ids) > 3, "the emoji must span several byte-level tokens"
    deltas, _ = _stream(tok, ids)
    assert deltas[0] == "a" and deltas[-1] == "b"
    assert deltas.count("😀") == 1 and deltas.count("") == len(ids) - 3


def test_stream_with_prompt_context(tok):
    prompt, completion = tok.encode("Say hello"), tok.encode(" world 東京 🚀!")
    deltas, _ = _stream(tok, completion, context=prompt[-2:])
    assert "".join(deltas) == " world 東京 🚀!"


def test_prompt_cut_inside_a_character_lends_no_bytes(tok):
    """A token-id prompt that ends inside a UTF-8 sequence: the completion's text is the
    decoding of the completion's tokens only, not the prompt's dangling bytes as U+FFFD."""
    emoji = tok.encode("😀")
    assert len(emoji) > 1 and tok.decode(emoji[:1]).endswith("\ufffd")
    prompt = tok.encode("Hello ") + emoji[:1]  # cut inside the emoji's four bytes
    completion = tok.encode(" world 東京")
    deltas, rest = _stream(tok, completion, context=prompt)
    assert "".join(deltas) + rest == " world 東京" == tok.decode(completion)
    # The completion's own dangling bytes (a continuation byte first) are its text.
    deltas, rest = _stream(tok, emoji[1:] + completion, context=prompt)
    assert "".join(deltas) + rest == tok.decode(emoji[1:] + completion)


def test_stream_flushes_incomplete_bytes(tok):
    lone_byte = tok.token_to_id("\u00f0")  # byte 0xF0 (an emoji's first byte) stands for itself
    ids = [*tok.encode("ok"), lone_byte]
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) == "ok" and deltas[-1] == "" and rest == "\ufffd"
    assert "".join(deltas) + rest == tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS[:6])
def test_stream_metaspace_byte_fallback(text):
    # A SentencePiece-style tokenizer: decode() drops the first token's leading space, and
    # CJK/emoji come out as <0xNN> byte tokens.
    backend = train_tiny_metaspace_bpe()
    tok = Tokenizer(backend)
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # After a prompt, the first token keeps its space.
    prompt = tok.encode("Say")
    deltas, _ = _stream(tok, ids, context=prompt)
    full = tok.decode(prompt + ids)
    assert "".join(deltas) == full[len(tok.decode(prompt)) :]


# -------------------------------------------------------------------------------------------
# Stop strings
# -------------------------------------------------------------------------------------------


def test_check_stop_strings_unit():
    check = check_stop_strings("The answer is 42. Done", ["Done", "is 4"])
    assert (check.stopped, check.stop, check.visible_len) == (True, "is 4", len("The answer "))
    check = check_stop_strings("abc STOP def", ["STOP"], include_stop=True)
    assert check.visible_len == len("abc STOP")
    check = check_stop_strings("abc ST", ["STOP", "", "xyz"])
    assert (check.stopped, check.holdback, check.visible_len) == (False, 2, 4)
    check = check_stop_strings("abc", ["never"])
    assert (check.stopped, check.holdback, check.visible_len) == (False, 0, 3)
    # Only matches touching the newest characters are looked for.
    assert not check_stop_strings("STOP and more", ["STOP"], num_new_chars=5).stopped
    assert check_stop_strings("xx STOP", ["STOP"], num_new_chars=1).stopped
    # Ties go to the longest stop string at the earliest position.
    assert check_stop_strings("a<end>", ["<e", "<end>"], include_stop=True).stop == "<end>"


def _stream_with_stops(tok, text, stop):
    """The engine's loop: detokenize, check stops, send what is safe. Returns (sent, stop)."""
    stream, generated, sent, chunks = tok.detokenizer(), "", 0, []
    for token_id in tok.encode(text):
        delta = stream.step(token_id)
        generated += delta
        check = check_stop_strings(generated, stop, num_new_chars=len(delta))
        chunks.append(generated[sent : check.visible_len])
        sent = check.visible_len
        if check.stopped:
            return chunks, check.stop
    generated += stream.flush()
    chunks.append(generated[sent:])
    return chunks, None


def test_stop_string_spanning_two_tokens(tok):
    text = "Hello world. Hello again."
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:3] == ["Hello", " world", "."], "the stop string must span two tokens"
    chunks, stop = _stream_with_stops(tok, text, ["world.", "nothing"])
    assert stop == "world."
    assert "".join(chunks) == "Hello "
    assert "world" not in "".join(chunks)  # held back while it could still become the stop


def test_stop_string_that_never_appears(tok):
    text = "Hello world 😀 東京"
    chunks, stop = _stream_with_stops(tok, text, ["worlds", "Hello there"])
    assert stop is None
    assert "".join(chunks) == text


# -------------------------------------------------------------------------------------------
# Chat templates
# -------------------------------------------------------------------------------------------

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "東京はどこ? 😀"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "easy", "tool_calls": None},
        {"role": "user", "content": "And <3+3> & 'more'?"},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich <CH>"}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, name, add_generation_prompt):
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"
    )
    messages = CONVERSATIONS[name]
    for extra in ({}, {"enable_thinking": False}):
        ours = tok.apply_chat_template(messages, add_generation_prompt, **extra)
        theirs = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        assert ours == theirs


def test_chat_template_output_text(tok):
    prompt = tok.apply_chat_template(CONVERSATIONS["system_user"])
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n東京はどこ? 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.encode(prompt, add_special_tokens=False)[:1] == [tok.token_to_id("<|im_start|>")]


TOOLS_TEMPLATE = (
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{% for m in messages %}{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}\n"
    "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"
)


def test_named_templates_tools_and_tojson(tmp_path, tok):
    d = build_tiny_tokenizer(
        tmp_path,
        chat_template=[
            {"name": "default", "template": CHATML_TEMPLATE},
            {"name": "tool_use", "template": TOOLS_TEMPLATE},
        ],
    )
    named = Tokenizer.from_dir(d)
    assert named.chat_template == CHATML_TEMPLATE
    messages = CONVERSATIONS["multi_turn"]
    tools = [{"name": "f", "description": "<ü> & 'x'", "parameters": {"type": "object"}}]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend,
        chat_template={"default": CHATML_TEMPLATE, "tool_use": TOOLS_TEMPLATE},
        eos_token="<|im_end|>",
    )
    ours = named.apply_chat_template(messages, tools=tools)
    assert ours == hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '"description": "<ü> & \'x\'"' in ours  # no HTML escaping, no ASCII escaping
    # trim_blocks ate the newlines after the tags; {% break %} stopped after two messages.
    assert ours.endswith("\nsystem: You are helpful.user: What is 2+2?<|im_end|>")
    assert named.apply_chat_template(messages, chat_template="default") == (
        tok.apply_chat_template(messages)
    )


def test_chat_template_files(tmp_path):
    d = build_tiny_tokenizer(tmp_path, chat_template="{{ messages[0].content }}!")
    (d / "chat_template.jinja").write_text("{{ bos_token }}file: {{ messages[0].content }}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "terse.jinja").write_text("{{ messages | length }}")
    tok = Tokenizer.from_dir(d)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "file: x"  # bos_token is unset: renders empty
    assert tok.apply_chat_template(messages, chat_template="terse") == "1"


def test_chat_template_errors(tmp_path, tok):
    no_template = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="Unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([], chat_template="{% if %}")
    # The sandbox: no mutation of inputs, no reaching into Python internals.
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{{ messages.__class__.__mro__ }}")


# -------------------------------------------------------------------------------------------
# tiktoken (Kimi-Linear layout)
# -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_ranks() -> dict[bytes, int]:
    return tiny_tiktoken_ranks()


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, kimi_ranks) -> Tokenizer:
    return Tokenizer.from_dir(
        build_tiny_tiktoken(tmp_path_factory.mktemp("kimi"), ranks=kimi_ranks)
    )


def _reference_tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm, written out: regex pieces, then lowest-rank merges, leftmost first."""
    ids = []
    for piece in regex.findall("(?V1)" + KIMI_PRETOKENIZE_PATTERN, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        if piece.encode("utf-8") in ranks:
            parts = [piece.encode("utf-8")]
        while len(parts) > 1:
            pairs = [
                (ranks[a + b], i)
                for i, (a, b) in enumerate(zip(parts, parts[1:]))
                if a + b in ranks
            ]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_kimi_pretokenizer_splits_han_runs():
    split = pre_tokenizers.Split(Regex(KIMI_PRETOKENIZE_PATTERN), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("中文English混合 I'm 12345 HELLO's\n\n x")]
    assert pieces == ["中文", "English", "混合", " I'm", " ", "123", "45", " HELLO's", "\n\n", " x"]


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_kimi_encode_matches_reference(kimi, kimi_ranks, text):
    ids = kimi.encode(text)
    assert ids == _reference_tiktoken_encode(text, kimi_ranks)
    assert kimi.decode(ids) == text
    deltas, rest = _stream(kimi, ids)
    assert "".join(deltas) + rest == text


def test_kimi_encode_random_text_matches_reference(kimi, kimi_ranks):
    rng = random.Random(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ'.,!?0123456789\n\t") + list("éü東京の😀🎉")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert kimi.encode(text) == _reference_tiktoken_encode(text, kimi_ranks), text


def test_kimi_special_tokens(kimi, kimi_ranks):
    n = len(kimi_ranks)
    for i, content in enumerate(KIMI_SPECIAL_TOKENS):
        assert kimi.token_to_id(content) == n + i
    assert kimi.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5  # the filled gap
    assert kimi.token_to_id("<|im_middle|>") == n + 10
    assert kimi.vocab_size == n + 256
    assert kimi.bos_token_id == n and kimi.eos_token_id == n + 1
    assert kimi.eos_token_ids == {n + 1, n + 2}  # [EOS] + generation_config's <|im_end|>
    text = "[BOS]<|im_user|>user<|im_middle|>中文 hi<|im_end|>"
    ids = kimi.encode(text)
    assert ids[:2] == [n, n + 3] and ids[-1] == n + 2
    assert kimi.decode(ids, skip_special_tokens=False) == text
    assert kimi.decode(ids) == "user中文 hi"
    prompt = kimi.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiktoken_errors(tmp_path, kimi_ranks):
    bad = tmp_path / "tiktoken.model"
    bad.write_text("aGk= 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2"):
        load_tiktoken_ranks(bad)
    with pytest.raises(ValueError, match="single bytes"):
        tiktoken_to_backend({b"a": 0})
    with pytest.raises(ValueError, match="overlaps"):
        tiktoken_to_backend(kimi_ranks, {3: AddedToken("[X]", special=True)})
