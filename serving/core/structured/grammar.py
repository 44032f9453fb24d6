"""llguidance behind two small types: ``GrammarCompiler`` (one a server: the model's
vocabulary as llguidance sees it) and ``GrammarMatcher`` (one a request: where its output is
in the grammar, and which tokens may come next).

The vocabulary: ``hyjax.tokenizer.Tokenizer`` wraps a ``tokenizers`` backend (a Hugging Face
``tokenizer.json``, or Kimi's tiktoken ranks converted to one), which llguidance reads as its
JSON text: every token's bytes (special tokens apart, as llguidance marks them) and the EOS
ids, all of the model's (the engine's stop set). ``n_vocab`` is the model's logits width,
which may exceed the tokenizer's: the extra ids are never allowed. Building it walks the
whole vocabulary (about a second at 150k), so it happens once, at the first constrained
request.

The mask: llguidance writes, per request and step, a packed bitmask ``i32[ceil(V / 32)]``,
token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is set. The sampler expands it on
device (``serving.worker.sampler.apply_token_mask``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance as llg
import numpy as np

from hyjax.tokenizer import Tokenizer
from serving.core.plan import mask_words
from serving.core.structured.spec import StructuredOutput


def _lark_literal(text: str) -> str:
    # A JSON string literal reads as the same string in llguidance's Lark.
    return json.dumps(text)


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not validated: ``GrammarCompiler.compile`` does).

    Raises ValueError for a schema that is not JSON.
    """
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec.value)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(_lark_literal(c) for c in choices)
        )
    return llg.LLMatcher.grammar_from_lark(spec.value)


class GrammarMatcher:
    """One request's grammar state (host only; the scheduler drives it, see
    ``serving.core.request.Grammar``).

    ``start_after`` (a reasoning model thinking first): until the sampled tokens end with
    these ids the matcher is not started: every token is allowed and taken without touching
    llguidance; the grammar constrains from the token after them::

        output:  <think> I should ... </think> {"name": ...}
                 |-- free (all bits) ---------|-- masked by the grammar --
                                     ^ the sampled tail equals start_after
    """

    __slots__ = ("_m", "mask_words", "_start_after", "_tail")

    def __init__(
        self, matcher: llg.LLMatcher, vocab_size: int, start_after: Sequence[int] = ()
    ) -> None:
        self._m = matcher
        self.mask_words = mask_words(vocab_size)
        self._start_after = tuple(start_after)
        self._tail: list[int] = []  # the last len(start_after) sampled tokens, while waiting

    @property
    def started(self) -> bool:
        """Whether the grammar constrains the next token (the reasoning has ended)."""
        return not self._start_after

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the allowed next tokens into ``out`` (i32[ceil(V / 32)], C-contiguous):
        all of them before the grammar has started."""
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"], out
        if not self.started:
            out.fill(-1)
            return
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        """Advances past ``token``; False (and ``error`` set) when the grammar forbids it.
        Before the grammar has started: watches for the end of the reasoning instead."""
        if not self.started:
            end = self._start_after
            self._tail.append(token)
            del self._tail[: -len(end)]
            if tuple(self._tail) == end:
                self._start_after, self._tail = (), []
            return True
        return self._m.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """Nothing may follow (EOS consumed, or the grammar cannot go on): the output is done."""
        return self.started and self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.started and self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles requests' ``StructuredOutput`` into matchers over one model's vocabulary.

    Args:
      tokenizer: the model's tokenizer.
      vocab_size: the model's logits width (``>= len(tokenizer)``).
      eos_token_ids: every id that ends a request (allowed where the grammar may end).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll: llg.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """llguidance's view of the vocabulary (built at the first call)."""
        with self._lock:
            if self._ll is None:
                self._ll = llg.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._ll

    def compile(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar.

        Raises ValueError ``"{param}={kind}: {why}"`` (an invalid schema, regex or grammar).
        """
        try:
            text = grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"{spec.param}={spec.kind}: {_first_line(e)}") from None
        m = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"{spec.param}={spec.kind}: {_first_line(m.get_error())}")
        return GrammarMatcher(m, self.vocab_size, spec.start_after)


def _first_line(e: object) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return " ".join(lines[:3]) if lines else "invalid grammar"
