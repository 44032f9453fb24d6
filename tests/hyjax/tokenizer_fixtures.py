"""Tiny tokenizers written to disk in Hugging Face layout, for tests that need no model hub.

``build_tiny_tokenizer(tmp_path)`` trains a byte-level BPE (Qwen-like: ChatML special tokens
after the learned vocabulary, ``<|im_end|>`` as eos) on a few KB of text written here, and
saves ``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` and
``generation_config.json``. ``build_tiny_tiktoken(tmp_path)`` writes the Kimi layout instead:
a ``tiktoken.model`` rank file plus ``tokenizer_config.json`` with ``added_tokens_decoder``.

Both are importable from other tests::

    from tests.hyjax.tokenizer_fixtures import build_tiny_tokenizer
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A Qwen-style ChatML template (written for these tests): optional system prompt, a
# reasoning_content block for assistant turns, and an optional generation prompt.
# (``tool_calls`` tested for a value, not only defined: transformers 5.17 hands the template a
# message's ``tool_calls: None`` as it is, 5.24 drops it; the reference render failed on 5.17)
CHATML_TEMPLATE = """\
{%- if messages and messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- if message['role'] not in ['user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' and message.reasoning_content is defined %}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message['content'] }}
{%- if message.tool_calls is defined and message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n' + call | tojson + '\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.",
    "A serving engine schedules requests, allocates cache blocks, and streams tokens back "
    "to the client as soon as they are sampled. Each step runs prefill and decode together.",
    "Linear attention keeps a fixed-size recurrent state per layer, while full attention "
    "layers keep a key and value cache that grows with the sequence length.",
    "Café, naïve, façade, jalapeño, Zürich, São Paulo, crème brûlée, déjà vu, Ångström.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다。我们喜欢写代码。",
    "Emoji time: 😀 😂 🎉 🚀 👍🏽 ❤️ 🇯🇵 — rockets 🚀🚀 and parties 🎉 everywhere.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    "Numbers: 0 1 2 3 42 1234 3.14159 2.71828 -17 +8 100% $5.00 #1 @user <tag> [x] {y}",
    "Hello world! Hello there, world. Hello again; the world says hello back to you.",
)
TRAINING_TEXT = "\n".join(_PARAGRAPHS * 4)


def train_tiny_bpe(vocab_size: int = 600) -> Tokenizer:
    """Trains a byte-level BPE on ``TRAINING_TEXT``; special tokens come after the vocab.

    Args:
        vocab_size: Size of the learned vocabulary (256 bytes plus merges).

    Returns:
        A ``tokenizers.Tokenizer`` with ByteLevel pre-tokenizer and decoder and the ChatML
        special tokens ``SPECIAL_TOKENS`` appended as added tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_PARAGRAPHS * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def train_tiny_metaspace_bpe(vocab_size: int = 400) -> Tokenizer:
    """Trains a SentencePiece-style (Llama 2) BPE: ``▁`` for spaces, byte fallback.

    Only the 60 most frequent characters get their own token, so CJK and emoji fall back to
    ``<0xNN>`` byte tokens. The decoder drops the first token's leading space: the
    "prefix convention" a streaming detokenizer must keep from eating spaces.

    Returns:
        A ``tokenizers.Tokenizer`` (no special tokens).
    """
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=60, special_tokens=["<unk>"], show_progress=False
    )
    tok.train_from_iterator(_PARAGRAPHS * 4, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


def _added_tokens_decoder(tok: Tokenizer, contents: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for content in contents:
        out[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return out


def build_tiny_tokenizer(
    out_dir: str | Path,
    *,
    chat_template: str | list[dict[str, str]] | None = CHATML_TEMPLATE,
    template_file: bool = False,
    config_overrides: dict[str, Any] | None = None,
    generation_config: bool = True,
) -> Path:
    """Writes a tiny Qwen-like tokenizer checkpoint directory.

    Args:
        out_dir: Directory to create (parents too) and fill.
        chat_template: Stored in ``tokenizer_config.json`` (a string or a list of named
            templates), or ``None`` for no template.
        template_file: Write the template to ``chat_template.jinja`` instead of the config.
        config_overrides: Keys merged last into ``tokenizer_config.json``.
        generation_config: Also write ``generation_config.json`` (eos = im_end + endoftext).

    Returns:
        ``out_dir`` as a ``Path``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_bpe()
    tok.save(str(out / "tokenizer.json"))
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        # The AddedToken dict form, as older transformers versions save it.
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "added_tokens_decoder": _added_tokens_decoder(tok, SPECIAL_TOKENS),
    }
    if chat_template is not None:
        if template_file:
            assert isinstance(chat_template, str)
            (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        else:
            config["chat_template"] = chat_template
    config.update(config_overrides or {})
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "config.json", {"model_type": "tiny", "eos_token_id": endoftext})
    if generation_config:
        _write_json(out / "generation_config.json", {"eos_token_id": [im_end, endoftext]})
    return out


# ------------------------------------------------------------------------------------------
# tiktoken layout (Kimi-Linear)
# ------------------------------------------------------------------------------------------

KIMI_SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>")


def tiny_tiktoken_ranks(vocab_size: int = 600) -> dict[bytes, int]:
    """Ranks for a tiktoken file: the tiny BPE's learned vocabulary, as raw bytes.

    Returns:
        ``{token_bytes: rank}``, ranks ``0 .. n - 1`` in the trained BPE's id order (bytes first,
        then merges in the order they were learned), so every multi-byte token is reachable by
        merging two lower-ranked tokens, as in a real tiktoken vocabulary.
    """
    tok = train_tiny_bpe(vocab_size)
    byte_of = {_byte_char(b): b for b in range(256)}
    ranks = {}
    for piece, idx in sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda x: x[1]):
        ranks[bytes(byte_of[c] for c in piece)] = idx
    assert sorted(ranks.values()) == list(range(len(ranks)))
    return ranks


def _byte_char(b: int) -> str:
    # GPT-2's table: printable latin-1 bytes map to themselves, the other 68 bytes to 256 + k.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def build_tiny_tiktoken(
    out_dir: str | Path,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    ranks: dict[bytes, int] | None = None,
) -> Path:
    """Writes a Kimi-style tokenizer directory: ``tiktoken.model`` + ``tokenizer_config.json``.

    Special tokens sit right after the ranks (``[BOS]`` = n, ``[EOS]`` = n + 1, ...), with a
    gap at n + 5 .. n + 9 that a loader must fill with reserved tokens, and one more token at
    n + 10 (``<|im_middle|>``).

    Args:
        out_dir: Directory to create and fill.
        chat_template: Written to ``chat_template.jinja`` (as Kimi-Linear ships it), or None.
        ranks: The ``{token_bytes: rank}`` table; defaults to ``tiny_tiktoken_ranks()``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = tiny_tiktoken_ranks() if ranks is None else ranks
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=_rank)]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="utf-8")
    n = len(ranks)
    specials = {n + i: content for i, content in enumerate(KIMI_SPECIAL_TOKENS)}
    specials[n + 10] = "<|im_middle|>"
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[EOS]",
        "added_tokens_decoder": {
            str(i): {"content": c, "special": True, "normalized": False}
            for i, c in specials.items()
        },
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": n + 2})
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return out


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
