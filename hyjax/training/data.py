"""The offline corpus (the running interpreter's standard library), its byte-level BPE
tokenizer, and deterministic batches.

Every machine with Python has its standard library's source, so the corpus needs no network.
Files are split into train / held-out by a hash of their path relative to the library root
(whole files, so no held-out text leaks into training through a shared file), and each file's
tokens are followed by ``<|endoftext|>``. Batches are random windows of the training stream
whose offsets depend only on ``(seed, step)``: a resumed run sees the same batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig

import numpy as np

from hyjax.tiny import SPECIAL_TOKENS

EOT = SPECIAL_TOKENS[0]  # "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Source files by split: ``(relative path, text)`` pairs in path order."""

    root: str
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]

    def num_bytes(self, split: str) -> int:
        return sum(len(t.encode()) for _, t in getattr(self, split))


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """Stable across machines and runs (md5 of the path, not Python's salted ``hash``)."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 100 < heldout_percent


def stdlib_corpus(root: str | None = None, *, heldout_percent: int = 3) -> Corpus:
    """All ``*.py`` files under the standard library (``site-packages`` excluded)."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory {root!r} does not exist")
    train, heldout = [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            if text.strip():
                (heldout if is_heldout(rel, heldout_percent) else train).append((rel, text))
    if not train or not heldout:
        raise ValueError(f"too few .py files under {root!r} for a train/held-out split")
    return Corpus(root=root, train=train, heldout=heldout)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space), special tokens at 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """``i32[N]``: each text's tokens followed by ``<|endoftext|>``."""
    eot = tok.token_to_id(EOT)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eot], np.int32))
    return np.concatenate(parts)


def token_byte_lengths(tok) -> np.ndarray:
    """``i64[vocab]``: UTF-8 bytes each token stands for (0 for special tokens), for
    bits-per-byte, which compares across tokenizers."""
    special = set(SPECIAL_TOKENS)
    out = np.zeros(tok.get_vocab_size(), np.int64)
    for piece, i in tok.get_vocab().items():
        # Byte-level BPE: one vocabulary character per byte.
        out[i] = 0 if piece in special else len(piece)
    return out


def train_batch(stream: np.ndarray, *, seed: int, step: int, batch: int, seq_len: int):
    """``i32[batch, seq_len + 1]`` random windows; the same ``(seed, step)`` gives the same."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def eval_windows(stream: np.ndarray, *, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping ``i32[n, seq_len + 1]`` windows from the start of the held-out stream
    (each predicts ``seq_len`` tokens; consecutive windows share one boundary token)."""
    n = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def unigram_nll(train_stream: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Mean NLL (nats) of ``targets`` under add-one-smoothed training token frequencies."""
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[targets.reshape(-1)].mean())


def chat_examples(files: list[tuple[str, str]], *, max_chars: int = 3000) -> list[str]:
    """ChatML documents made from documented functions: the user asks for the function by its
    signature and the first line of its docstring; the assistant answers with its source.

    They teach the model the chat template's turn structure (and to end a turn with
    ``<|im_end|>``) with nothing but the corpus itself.
    """
    import ast

    out = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):  # the test suite ships deliberately broken files
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("_") or node.end_lineno is None:
                continue
            doc = ast.get_docstring(node)
            summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            if len(summary) < 12:
                continue
            # Whole lines of the def (decorators excluded), dedented by the def's column.
            body = lines[node.lineno - 1 : node.end_lineno]
            col = node.col_offset
            src = "\n".join(ln[col:] if ln[:col].isspace() or not ln[:col] else ln for ln in body)
            if len(src) > max_chars:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            ask = f"Write a Python function `{node.name}({args})`: {summary}"
            out.append(
                f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
                f"```python\n{src}\n```<|im_end|>\n"
            )
    return out
