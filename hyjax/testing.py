"""Test helpers: tiny real Hugging Face checkpoints, and hand-built ragged batches.

``save_tiny_qwen3_next`` uses transformers + torch (the test extra) to write a genuine HF
checkpoint, with the parameters whose default values hide convention mistakes (norm weights,
``A_log``, ``dt_bias``) randomised.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from hyjax.batch import Batch


def tiny_qwen3_next_config(**overrides) -> dict:
    """A 4-layer Qwen3-Next with GVA ratio 3, GQA 2, Dk != Dv, a dense layer and conv K=4."""
    cfg = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        intermediate_size=24,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return cfg


def save_tiny_qwen3_next(
    path: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", **overrides
) -> dict:
    """Writes a random tiny Qwen3-Next with ``save_pretrained``; returns its config dict."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    hf_cfg = Qwen3NextConfig(**tiny_qwen3_next_config(**overrides))
    model = Qwen3NextForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(p + 0.3 * torch.randn_like(p))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(os.fspath(path))
    return hf_cfg.to_dict()


def tiny_kimi_linear_config(**overrides) -> dict:
    """A 4-layer Kimi-Linear: KDA, MLA, KDA, MLA; a dense layer 0, then MoE with 2 expert groups.

    Written the way the original checkpoint writes it (1-indexed ``linear_attn_config``);
    ``num_experts`` is given explicitly (transformers' own tester forgets it and gets 256).
    Dk = 16 for KDA, MLA with Dn = 16 != Dv = 12, rope dims 8 and a 16-wide latent.
    """
    cfg = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=4,
        linear_attn_config={
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        mla_use_nope=True,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=12,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
        moe_renormalize=True,
        num_expert_group=2,
        topk_group=1,
        intermediate_size=24,
        rms_norm_eps=1e-5,
        model_max_length=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return cfg


def save_tiny_kimi_linear(
    path: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", **overrides
) -> dict:
    """Writes a random tiny Kimi-Linear with ``save_pretrained`` (transformers >= 5.17).

    Randomises what defaults would hide: ``A_log``, ``dt_bias``, every norm weight and the
    routing bias ``e_score_correction_bias`` (a buffer, not a parameter).
    """
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    hf_cfg = KimiLinearConfig(**tiny_kimi_linear_config(**overrides))
    model = KimiLinearForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(os.fspath(path))
    return hf_cfg.to_dict()


# Long-memory gates: the per-token decay exp(-exp(A_log) * softplus(a + dt_bias)) of a
# linear-attention head. With A = exp(A_log) in U(0.05, 0.5) and dt_bias in U(-5, -2.5), at
# a = 0 the decay lies in [0.94, 0.9997] (median ~0.99): a state remembers hundreds of tokens,
# so a prefix hit that resumes from a wrong state changes the greedy tokens.
LONG_MEMORY_A = (0.05, 0.5)
LONG_MEMORY_DT_BIAS = (-5.0, -2.5)


def _numpy_init(cls, cfg, seed: int, *, long_memory: bool = False):
    """A random model filled from numpy on the host.

    XLA takes tens of seconds on CPU to compile the random initialisers of a whole model, eager
    or jitted; numpy fills the same shapes in milliseconds. Norm weights are ``1 + noise``,
    ``A_log`` is ``log U(1, 16)``, everything else a small normal. ``long_memory`` draws the
    gates so most heads decay by 0.9-0.999 a token (``LONG_MEMORY_*``) instead of forgetting
    their state within a few tokens, and gives the norms more spread (``1 + 0.3 * noise``).
    """
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        shape, name = var.get_value().shape, "/".join(map(str, path))
        if "norm" in name:
            value = 1.0 + (0.3 if long_memory else 0.1) * rng.normal(size=shape)
        elif path[-1] == "A_log":
            lo, hi = LONG_MEMORY_A if long_memory else (1.0, 16.0)
            value = np.log(rng.uniform(lo, hi, size=shape))
        elif path[-1] == "dt_bias" and long_memory:
            value = rng.uniform(*LONG_MEMORY_DT_BIAS, size=shape)
        elif "conv1d" in name or path[-1] == "dt_bias":
            value = 0.5 * rng.normal(size=shape)
        else:
            value = 0.1 * rng.normal(size=shape)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


KIMI_SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>")
KIMI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>' }}{% endif %}"
)


def make_tiny_kimi_linear_model(
    out_dir: str | os.PathLike, *, seed: int = 0, long_memory: bool = False
) -> str:
    """Writes a random tiny Kimi-Linear with Kimi's tokenizer layout; returns the path.

    The tokenizer is a ``tiktoken.model`` rank file (the 256 single bytes, no merges) plus
    ``tokenizer_config.json`` naming the special tokens after the ranks and the reserved
    block (256 of them, as Kimi reserves), and no ``tokenizer.json``: what the engine must
    load for a real Kimi checkpoint. Its outputs are random text. ``long_memory``: KDA gates
    that keep the state for hundreds of tokens (see :func:`_numpy_init`).
    """
    import base64
    import json

    from hyjax.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
    from hyjax.saver import save_hf_checkpoint
    from hyjax.tokenizer import TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    vocab = 256 + TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS
    cfg = KimiLinearConfig.from_hf(
        {
            "model_type": "kimi_linear",
            "torch_dtype": "float32",
            **tiny_kimi_linear_config(
                vocab_size=vocab,
                hidden_size=64,
                bos_token_id=256,
                eos_token_id=257,
                # Two layers (KDA + dense MLP, MLA + MoE): half the compile time of four.
                num_hidden_layers=2,
                linear_attn_config={
                    "full_attn_layers": [2],
                    "kda_layers": [1],
                    "num_heads": 2,
                    "head_dim": 16,
                    "short_conv_kernel_size": 4,
                },
            ),
        }
    )
    model = _numpy_init(KimiLinearForCausalLM, cfg, seed, long_memory=long_memory)
    save_hf_checkpoint(model, cfg, out_dir)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        f.writelines(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    specials = {256 + i: t for i, t in enumerate(KIMI_SPECIAL_TOKENS)}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "pad_token": "[EOS]",
                "added_tokens_decoder": {
                    str(i): {"content": t, "special": True, "normalized": False}
                    for i, t in specials.items()
                },
            },
            f,
            indent=2,
        )
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(KIMI_CHAT_TEMPLATE)
    return out_dir


def hf_logits(path: str | os.PathLike, token_ids: Sequence[int]) -> np.ndarray:
    """The transformers forward of a saved checkpoint over one sequence: f32[T, vocab].

    It runs in float64, so the oracle carries no float32 rounding of its own (transformers'
    float32 chunked delta rule alone differs from its float64 result by ~1.5e-4 here).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.fspath(path), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float().numpy()


@dataclasses.dataclass
class SeqChunk:
    """One row of a hand-built batch: new tokens of a sequence on top of ``num_cached``."""

    token_ids: Sequence[int]
    num_cached: int
    blocks: Sequence[int]
    src_slot: int = 0
    dst_slot: int = 0
    ckpts: Sequence[tuple[int, int]] = ()  # (offset, slot)
    all_logits: bool = False  # tests: logits of every new token, not just the last


def make_batch(
    rows: Sequence[SeqChunk],
    *,
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    max_blocks: int,
    max_ckpt: int = 2,
    num_logits: int | None = None,
) -> tuple[Batch, list[list[int]]]:
    """Packs rows into a padded :class:`Batch`; returns it and each row's logits indices.

    ``logits_indices`` holds ``num_seqs`` entries (as the engine's), or more when rows ask for
    all their logits (``num_logits`` fixes that capacity, so steps share one compiled shape);
    the returned per-row lists index the logits the model returns.
    """
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    qsl = np.zeros(num_seqs + 1, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    src = np.zeros(num_seqs, np.int32)
    dst = np.zeros(num_seqs, np.int32)
    ck_off = np.zeros((num_seqs, max_ckpt), np.int32)
    ck_slot = np.zeros((num_seqs, max_ckpt), np.int32)
    logits_rows: list[list[int]] = []
    t = 0
    for s, row in enumerate(rows):
        n = len(row.token_ids)
        p = np.arange(row.num_cached, row.num_cached + n)
        ids[t : t + n] = row.token_ids
        pos[t : t + n] = p
        blocks = np.asarray(row.blocks)
        slot_mapping[t : t + n] = blocks[p // block_size] * block_size + p % block_size
        tables[s, : len(blocks)] = blocks
        seq_lens[s] = row.num_cached + n
        src[s], dst[s] = row.src_slot, row.dst_slot
        for j, (off, sl) in enumerate(row.ckpts):
            ck_off[s, j], ck_slot[s, j] = off, sl
        logits_rows.append(list(range(t, t + n)) if row.all_logits else [t + n - 1])
        t += n
        qsl[s + 1] = t
    qsl[len(rows) + 1 :] = t
    flat = [i for r in logits_rows for i in r]
    capacity = num_logits if num_logits is not None else max(num_seqs, len(flat))
    if capacity < len(flat):
        raise ValueError(f"num_logits={capacity} is less than the {len(flat)} logits asked for")
    logits_idx = np.zeros(capacity, np.int32)
    logits_idx[: len(flat)] = flat
    batch = Batch.from_arrays(
        dict(
            input_ids=ids,
            positions=pos,
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_seqs=np.int32(len(rows)),
            block_tables=tables,
            src_slot=src,
            dst_slot=dst,
            ckpt_offsets=ck_off,
            ckpt_slots=ck_slot,
            logits_indices=logits_idx,
        )
    )
    out, k = [], 0
    for r in logits_rows:
        out.append(list(range(k, k + len(r))))
        k += len(r)
    return batch, out
