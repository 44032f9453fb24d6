"""The tokenizer a serving engine uses: text to ids, ids to text, chat prompts.

``Tokenizer.from_dir(path)`` reads a Hugging Face checkpoint directory and never executes
code from it (no ``trust_remote_code``):

- ``tokenizer.json`` (Qwen3-Next) is loaded with the ``tokenizers`` library as is;
- otherwise a tiktoken rank file (Kimi-Linear's ``tiktoken.model``) is converted into an
  equivalent byte-level BPE (``tiktoken_to_backend``), with Kimi's pre-tokenizer pattern and
  the special tokens listed in ``tokenizer_config.json``'s ``added_tokens_decoder``;
- ``tokenizer_config.json`` gives the special tokens, ``add_bos_token`` and the chat template
  (``chat_template.jinja`` wins when both exist; ``additional_chat_templates/*.jinja`` add
  named ones);
- ``generation_config.json`` and ``config.json`` add their ``eos_token_id`` to the stop set.

Streaming helpers (``DetokenizerStream``, ``check_stop_strings``) live in
``hyjax.detokenizer``; chat template rendering in ``hyjax.chat_template``. Both are
re-exported here. This module does not import jax.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from hyjax.chat_template import ChatTemplateError, render_chat_template
from hyjax.detokenizer import DetokenizerStream, StopCheck, check_stop_strings

__all__ = [
    "ChatTemplateError",
    "DetokenizerStream",
    "KIMI_PRETOKENIZE_PATTERN",
    "StopCheck",
    "Tokenizer",
    "TokenizerFilesError",
    "check_stop_strings",
    "load_tiktoken_ranks",
    "tiktoken_to_backend",
]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
TIKTOKEN_FILE = "tiktoken.model"
# Where eos ids other than the tokenizer's own eos token come from, in the order read.
MODEL_CONFIG_FILES = ("generation_config.json", "config.json")
# The special-token attributes of tokenizer_config.json that chat templates can read.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Kimi's pre-tokenizer (tokenization_kimi.py's pat_str, also Kimi-K2's): cl100k/o200k-style
# word splitting, except that runs of Han characters form their own pieces (Han is removed
# from the letter classes by the `&&[^\p{Han}]` intersections, which Oniguruma supports).
KIMI_PRETOKENIZE_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        # Words with an optional leading non-letter: Title/UPPER then lower-case letters ...
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        # ... or upper-case letters then optional lower-case ones, with English contractions.
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# tokenization_kimi.py reserves this many ids after the ranks for control tokens; the ids
# that added_tokens_decoder does not name are `<|reserved_token_{id}|>`.
TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS = 256


class TokenizerFilesError(FileNotFoundError):
    """A checkpoint directory lacks the files a tokenizer is built from."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what the checkpoint's configs say about it.

    Attributes:
        backend: The underlying ``tokenizers.Tokenizer`` (Rust, thread-safe for encode/decode).
        special_tokens: ``{"bos_token": "<s>", "eos_token": ...}`` for the attributes that are set.
        eos_token_ids: Every id that ends generation (tokenizer eos plus the model configs').
        chat_templates: Named chat templates; the unnamed one is ``"default"``.
        add_bos_token: Whether ``encode(..., add_special_tokens=True)`` prepends bos.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_templates = dict(chat_templates or {})
        self.add_bos_token = add_bos_token
        # A special token missing from the vocabulary keeps its string (templates may print
        # it) but has no id.
        eos = self._special_id("eos_token")
        self.eos_token_ids = frozenset(extra_eos_token_ids) | ({eos} if eos is not None else set())

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads the tokenizer of a Hugging Face checkpoint directory (no remote code).

        Args:
            path: The checkpoint directory.

        Returns:
            The tokenizer.

        Raises:
            TokenizerFilesError: The directory is missing, or holds neither ``tokenizer.json``
                nor a tiktoken file.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerFilesError(f"tokenizer directory {str(directory)!r} does not exist")
        config = _read_json(directory / TOKENIZER_CONFIG) or {}
        added_tokens = _added_tokens(config.get("added_tokens_decoder") or {})
        tiktoken_files = [directory / TIKTOKEN_FILE, *sorted(directory.glob("*.tiktoken"))]
        if (directory / TOKENIZER_JSON).is_file():
            backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_JSON))
            _add_missing_tokens(backend, added_tokens)
        elif tiktoken_file := next((f for f in tiktoken_files if f.is_file()), None):
            backend = tiktoken_to_backend(load_tiktoken_ranks(tiktoken_file), added_tokens)
        else:
            raise TokenizerFilesError(
                f"no tokenizer found in {str(directory)!r}: looked for {TOKENIZER_JSON!r}, "
                f"{TIKTOKEN_FILE!r} and '*.tiktoken' (with {TOKENIZER_CONFIG!r} beside it)"
            )

        special_tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            if (token := _token_content(config.get(key))) is not None:
                special_tokens[key] = token
        extra_eos = []
        for name in MODEL_CONFIG_FILES:
            model_config = _read_json(directory / name) or {}
            for section in (model_config, model_config.get("text_config") or {}):
                extra_eos += _as_id_list(section.get("eos_token_id"))
        return cls(
            backend,
            special_tokens=special_tokens,
            extra_eos_token_ids=extra_eos,
            chat_templates=_chat_templates(directory, config),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    # ---------------------------------------------------------------------------------------
    # Vocabulary
    # ---------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(hf_tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token`` from tokenizer_config.json, or None when it names none."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the tokenizer's own ``eos_token`` (one of ``eos_token_ids``), or None."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of ``pad_token``, or None."""
        return self._special_id("pad_token")

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (byte-level form for BPE tokens), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, or None when out of range."""
        return self.backend.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    # ---------------------------------------------------------------------------------------
    # Text <-> ids
    # ---------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encodes text; special-token strings in it become their ids.

        Args:
            text: The text.
            add_special_tokens: Apply the tokenizer's post-processor and, when
                ``add_bos_token`` is set, make sure the ids start with bos.

        Returns:
            The token ids.
        """
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes ids to text (no clean-up of spaces before punctuation).

        Args:
            ids: Token ids.
            skip_special_tokens: Drop special tokens (``<|im_end|>`` ...) from the text.

        Returns:
            The text; incomplete UTF-8 sequences decode to U+FFFD. Ids the tokenizer does not
            have (a model's padded vocabulary rows, random weights under another model's
            tokenizer) decode to nothing.
        """
        n = self._num_ids
        ids = [i for i in ids if 0 <= i < n]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _num_ids(self) -> int:  # decode's bound, read once (the backend's count is a call)
        return self.vocab_size

    def detokenizer(
        self, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> DetokenizerStream:
        """A fresh ``DetokenizerStream`` for one generated sequence.

        Args:
            context_ids: The last few prompt ids, so the first generated token decodes as it
                would after the prompt (its leading space kept, for example).
            skip_special_tokens: As in ``decode``.

        Returns:
            The stream; feed it generated ids with ``step``.
        """
        return DetokenizerStream(self, context_ids, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------------------
    # Chat
    # ---------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None."""
        return self.chat_templates.get("default")

    def chat_template_source(
        self, chat_template: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The template source ``apply_chat_template`` renders with these arguments.

        Raises:
            ChatTemplateError: No template is available.
        """
        if chat_template in self.chat_templates:
            return self.chat_templates[chat_template]
        if chat_template is not None:
            return chat_template
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        available = sorted(self.chat_templates)
        raise ChatTemplateError(
            "this tokenizer has no chat template"
            + (f" named 'default' (available: {available})" if available else "")
            + "; pass chat_template=..."
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to the prompt text with the checkpoint's chat template.

        Output is identical to transformers' ``apply_chat_template(..., tokenize=False)``.
        Encode it with ``add_special_tokens=False``: templates write their own bos.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``; keys whose value is None
                are dropped.
            add_generation_prompt: Append the header that opens an assistant turn.
            tools: JSON-schema tool definitions, or None. With tools, a template named
                ``"tool_use"`` is preferred when the checkpoint has one.
            chat_template: The name of one of ``chat_templates``, or a template source;
                None picks the default.
            **kwargs: Extra template variables (``enable_thinking=False`` ...); they override
                the special tokens of the same name.

        Returns:
            The rendered prompt.

        Raises:
            ChatTemplateError: No template is available, or the template raised.
        """
        source = self.chat_template_source(chat_template, tools=tools)
        return render_chat_template(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**self.special_tokens, **kwargs},
        )


# -------------------------------------------------------------------------------------------
# tiktoken -> byte-level BPE
# -------------------------------------------------------------------------------------------


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Reads a tiktoken rank file: one ``base64(token_bytes) rank`` pair per line.

    Args:
        path: The file (Kimi's ``tiktoken.model``).

    Returns:
        ``{token_bytes: rank}``.

    Raises:
        ValueError: A line is malformed.
    """
    ranks = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: expected 'base64 rank', got {line!r}") from e
    return ranks


def _bytes_to_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte ``b`` is written as the character ``table[b]``.

    Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, DEL,
    NBSP, soft hyphen) are moved to U+0100 upwards, in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, shifted = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return table


def tiktoken_to_backend(
    ranks: Mapping[bytes, int],
    added_tokens: Mapping[int, AddedToken] | None = None,
    *,
    pattern: str = KIMI_PRETOKENIZE_PATTERN,
    num_reserved_special_tokens: int = TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS,
) -> tokenizers.Tokenizer:
    """Builds a byte-level BPE ``tokenizers.Tokenizer`` that encodes exactly as tiktoken does.

    tiktoken merges, inside each pre-tokenized piece, the adjacent pair whose concatenation
    has the lowest rank, leftmost first, and emits a piece that is itself a token whole. So the
    merge list is every split ``(a, b)`` of every token ``a + b`` with both halves in the
    vocabulary, ordered by the rank of ``a + b`` (splits of one token can never compete, so
    their order is immaterial), and the BPE model checks whole pieces first
    (``ignore_merges``).

    Args:
        ranks: ``{token_bytes: rank}``; must contain all 256 single bytes.
        added_tokens: ``{id: AddedToken}`` for the ids after the ranks. Unnamed ids up to
            ``len(ranks) + num_reserved_special_tokens`` are filled with
            ``<|reserved_token_{id}|>`` so that every id lands where the model expects it.
        pattern: The pre-tokenizer regex (Oniguruma syntax).
        num_reserved_special_tokens: Size of the reserved id block after the ranks.

    Returns:
        The tokenizer (no normalizer, no post-processor).

    Raises:
        ValueError: Single bytes are missing, or the special ids clash with the ranks.
    """
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"tiktoken ranks lack {len(missing)} single bytes, e.g. {missing[:4]}")
    table = _bytes_to_chars()

    def chars(token: bytes) -> str:
        return "".join(table[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left_rank, right_rank = ranks.get(token[:i]), ranks.get(token[i:])
            if left_rank is not None and right_rank is not None:
                merges.append((rank, left_rank, right_rank, token[:i], token[i:]))
    merges.sort()
    bpe = models.BPE(
        vocab={chars(token): rank for token, rank in ranks.items()},
        merges=[(chars(left), chars(right)) for *_, left, right in merges],
        ignore_merges=True,
    )
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()

    first_special = max(ranks.values()) + 1
    specials = dict(added_tokens or {})
    if specials and min(specials) < first_special:
        raise ValueError(f"added token id {min(specials)} overlaps the tiktoken ranks")
    last = max([first_special + num_reserved_special_tokens - 1, *specials])
    for token_id in range(first_special, last + 1):
        if token_id not in specials:
            specials[token_id] = AddedToken(
                f"<|reserved_token_{token_id}|>", special=True, normalized=False
            )
    _add_missing_tokens(backend, specials)
    return backend


# -------------------------------------------------------------------------------------------
# Config files
# -------------------------------------------------------------------------------------------


def _add_missing_tokens(backend: tokenizers.Tokenizer, added: Mapping[int, AddedToken]) -> None:
    """Adds, in id order, the added tokens the backend lacks, checking each lands on its id.

    Mutates ``backend``. Tokens it already has are left alone (tokenizer.json is the
    authority on them).

    Raises:
        ValueError: A token would get a different id than the config says.
    """
    for token_id in sorted(added):
        token = added[token_id]
        if backend.token_to_id(token.content) is not None:
            continue
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        got = backend.token_to_id(token.content)
        if got != token_id:
            raise ValueError(
                f"added token {token.content!r} should have id {token_id} but got {got}: "
                "added_tokens_decoder ids must follow the vocabulary without gaps"
            )


def _added_tokens(decoder: Mapping[str, Any]) -> dict[int, AddedToken]:
    """``added_tokens_decoder`` of tokenizer_config.json as ``{id: AddedToken}``."""
    out = {}
    for key, spec in decoder.items():
        spec = {"content": spec} if isinstance(spec, str) else spec
        out[int(key)] = AddedToken(
            spec["content"],
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", False),
            special=spec.get("special", True),
        )
    return out


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates, later sources winning.

    tokenizer_config's ``chat_template`` (a string, or a list of ``{"name", "template"}``),
    then ``chat_template.jinja`` (the default), then ``additional_chat_templates/<name>.jinja``
    (as transformers v5 saves them).
    """
    templates = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        templates.update({item["name"]: item["template"] for item in value})
    elif value is not None:
        raise ValueError(f"chat_template in {directory / TOKENIZER_CONFIG} is a {type(value)}")
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        templates["default"] = template_file.read_text(encoding="utf-8")
    for named_file in sorted((directory / ADDITIONAL_CHAT_TEMPLATES_DIR).glob("*.jinja")):
        templates[named_file.stem] = named_file.read_text(encoding="utf-8")
    return templates


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry {value!r}")


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` of a model config: None, an int, or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(model_dir: str, *, dummy: bool = False) -> Tokenizer | None:
    """The model directory's tokenizer; with random weights (``--load-format dummy``) and no
    tokenizer there, the embedded model's, its vocabulary covered up to the model's
    ``vocab_size`` (:func:`cover_vocab`; the text is as random as the weights). None: token-id
    prompts only.
    The engine and the server's front end both take theirs from here, so they agree."""
    log = logging.getLogger(__name__)
    try:
        return Tokenizer.from_dir(model_dir)
    except TokenizerFilesError:
        if not dummy:
            log.warning("no tokenizer in %s: only token-id prompts are accepted", model_dir)
            return None
    from hyjax.assets import model_dir as embedded_dir

    log.info("no tokenizer in %s: random weights use the embedded model's tokenizer", model_dir)
    tokenizer = Tokenizer.from_dir(embedded_dir())
    config = _read_json(Path(model_dir) / "config.json") or {}
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        cover_vocab(tokenizer, vocab)
    return tokenizer


def cover_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Gives every id up to ``vocab_size`` a text: ``" t{id}"``, an added (not special) token
    for each id past the tokenizer's vocabulary. For random weights with a smaller tokenizer
    (the embedded one's 4096 ids against a 152k-id model): their generated ids then stream
    text as a real model's do, one chunk a token, where they would decode to nothing and a
    client would see a chunk every few dozen tokens."""
    have = tokenizer.vocab_size
    if vocab_size > have:
        tokenizer.backend.add_tokens(
            [AddedToken(f" t{i}", normalized=False, special=False) for i in range(have, vocab_size)]
        )
