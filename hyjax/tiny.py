"""A tiny random Qwen3-Next with a byte-level tokenizer, written in Hugging Face layout.

What ``hyjax make-tiny-model`` writes: a real checkpoint (loads in transformers too) that lets
the whole stack run anywhere, offline, in seconds. Its outputs are random text.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
from flax import nnx

from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from hyjax.saver import save_hf_checkpoint

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer():
    """A BPE tokenizer with the 256 byte symbols and no merges, plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def tiny_config(vocab_size: int) -> Qwen3NextConfig:
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "bos_token_id": None,
            "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>"),
            "torch_dtype": "float32",
        }
    )


def make_tiny_model(
    out_dir: str | os.PathLike, *, seed: int = 0, long_memory: bool = False, mtp: bool = False
) -> str:
    """Writes the tiny model and its tokenizer to ``out_dir``; returns the path.

    ``mtp``: with one multi-token prediction layer of random weights (``load_model(mtp=True)``).
    ``long_memory``: the Gated DeltaNet gates keep the state for hundreds of tokens (filled from
    numpy, :func:`hyjax.testing._numpy_init`): what prefix-caching tests need, since the default
    initialisation forgets the state within a few tokens and cannot show a wrong resumed state.
    """
    out_dir = os.fspath(out_dir)
    tok = byte_level_tokenizer()
    cfg = tiny_config(vocab_size=tok.get_vocab_size())
    if mtp:  # one random MTP layer (``mtp.*``), for the MTP drafter's tests
        cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    if long_memory:
        from hyjax.testing import _numpy_init

        model = _numpy_init(Qwen3NextForCausalLM, cfg, seed, long_memory=True)
    else:
        model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    save_hf_checkpoint(model, cfg, out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
            indent=2,
        )
    return out_dir
