"""The embedded default model: loads through the normal loader, fits the size budget, is the
shipped architecture, predicts Python far better than chance, and ``hyjax generate`` uses it
when no ``--model`` is given."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from hyjax.assets import DEFAULT_MODEL, model_dir
from hyjax.config import FULL_ATTENTION, LINEAR_ATTENTION
from hyjax.loader import load_model
from hyjax.tokenizer import Tokenizer
from hyjax.training.dense import dense_forward

SNIPPET = '''import os


def read_text(path):
    """Return the contents of the file at path."""
    with open(path, encoding="utf-8") as f:
        return f.read()
'''


def test_shipped_files_and_size():
    path = model_dir()
    assert os.path.basename(path) == DEFAULT_MODEL
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert total <= 20 * 10**6, f"{total=} bytes"
    tok = Tokenizer.from_dir(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(SNIPPET)) == SNIPPET


def test_loads_through_the_loader_and_predicts_python():
    model, cfg = load_model(model_dir(), dtype="float32")
    assert cfg.num_hidden_layers >= 8
    assert cfg.layer_types.count(FULL_ATTENTION) >= 2
    assert cfg.layer_types.count(LINEAR_ATTENTION) >= 2 and cfg.num_experts > 1
    ids = Tokenizer.from_dir(model_dir()).encode(SNIPPET)
    logits, _ = jax.jit(dense_forward)(model, jnp.asarray([ids], jnp.int32))
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    nll = -float(np.mean(np.take_along_axis(np.asarray(logp), np.asarray(ids[1:])[:, None], 1)))
    # Chance is log(vocab) = 8.3 nats; the held-out mean is 1.7 (MODEL_CARD.md).
    assert nll < 3.0 < math.log(cfg.vocab_size), f"{nll=}"


def test_generate_without_model_uses_the_embedded_one():
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "generate", "--quiet",
           "--max-tokens", "12", "--prompt", "def read_text(path):"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("def read_text(path):")
    completion = proc.stdout[len("def read_text(path):") :]
    assert completion.strip(), proc.stdout
    assert "1 requests (0 rejected, 0 failed)" in proc.stderr
