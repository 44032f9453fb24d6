"""Kimi-Linear's checkpoint names: each tensor of the original checkpoint and its parameter."""

from __future__ import annotations

import re

from hyjax.config import FULL_ATTENTION
from hyjax.models.family import Target
from hyjax.models.kimi_linear.config import KimiLinearConfig

# Kept in float32 whatever the model's dtype, as the checkpoint keeps them.
FLOAT32_PARAMS = ("A_log", "dt_bias", "router", "e_score_correction_bias")

# Kimi's expert names: w1 = gate, w3 = up, w2 = down.
_EXPERTS = (("w1", "experts_gate"), ("w3", "experts_up"), ("w2", "experts_down"))


def targets(cfg: KimiLinearConfig) -> dict[str, Target]:
    """Checkpoint name -> parameter for Kimi-Linear, in the original checkpoint's names.

    transformers (>= 5.17) saves these names too, except that it may write the dense first
    layer as ``block_sparse_moe.{gate,up,down}_proj``: :func:`checkpoint_name` maps that back.
    """
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(("embed_tokens",), "copy"),
        "model.norm.weight": Target(("norm", "weight"), "copy"),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target(("lm_head", "weight"), "t")
    for i, kind in enumerate(cfg.layer_types):
        p, L = f"model.layers.{i}.", ("layers", i)
        a = L + ("self_attn",)
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + f"{n}.weight"] = Target(L + (n, "weight"), "copy")
        if kind == FULL_ATTENTION:
            linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
            norms = ["kv_a_layernorm"]
            if cfg.q_lora_rank is None:
                linears.append("q_proj")
            else:
                linears += ["q_a_proj", "q_b_proj"]
                norms.append("q_a_layernorm")
            for n in linears:
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "t")
            for n in norms:
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "copy")
        else:
            for n in ("q", "k", "v", "f_a", "f_b", "b", "g_a", "g_b", "o"):
                t[p + f"self_attn.{n}_proj.weight"] = Target(a + (f"{n}_proj", "weight"), "t")
            for n in ("q", "k", "v"):
                t[p + f"self_attn.{n}_conv1d.weight"] = Target(a + (f"{n}_conv1d",), "conv")
            t[p + "self_attn.A_log"] = Target(a + ("A_log",), "flat", stored_shape=(1, 1, -1, 1))
            t[p + "self_attn.dt_bias"] = Target(a + ("dt_bias",), "copy")
            t[p + "self_attn.o_norm.weight"] = Target(a + ("o_norm", "weight"), "copy")
        m = L + ("mlp",)
        if cfg.is_moe_layer(i):
            q = p + "block_sparse_moe."
            t[q + "gate.weight"] = Target(m + ("router",), "t")
            t[q + "gate.e_score_correction_bias"] = Target(m + ("e_score_correction_bias",), "copy")
            if cfg.num_shared_experts:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    t[q + f"shared_experts.{n}.weight"] = Target(
                        m + ("shared_experts", n, "weight"), "t"
                    )
            for e in range(cfg.num_experts):
                for n, dst in _EXPERTS:
                    t[q + f"experts.{e}.{n}.weight"] = Target(m + (dst,), "t", expert=e)
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.{n}.weight"] = Target(m + (n, "weight"), "t")
    return t


_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.)")


def checkpoint_name(name: str) -> str:
    """A dense layer saved under ``block_sparse_moe.*`` (transformers) is ``mlp.*``."""
    return _DENSE_ALIAS.sub(r"\1.mlp.\2", name)
