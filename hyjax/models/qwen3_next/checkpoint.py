"""Qwen3-Next's checkpoint names: each tensor of a Hugging Face checkpoint and its parameter."""

from __future__ import annotations

from hyjax.config import FULL_ATTENTION
from hyjax.models.family import Target
from hyjax.models.qwen3_next.config import Qwen3NextConfig

# Kept in float32 whatever the model's dtype, as the checkpoint keeps them.
FLOAT32_PARAMS = ("A_log", "dt_bias")


def targets(cfg: Qwen3NextConfig) -> dict[str, Target]:
    """Checkpoint name -> parameter, for every tensor a Qwen3-Next checkpoint must hold.

    Experts appear per expert (``experts.{e}.gate_proj.weight``); the fused transformers-5 form
    (``experts.gate_up_proj``) is accepted too, see :func:`hyjax.loader.fused_expert_targets`.
    The ``mtp.*`` tensors are listed when the config builds MTP layers (``num_mtp_layers``).
    """
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(("embed_tokens",), "copy"),
        "model.norm.weight": Target(("norm", "weight"), "copy"),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target(("lm_head", "weight"), "t")
    for i, kind in enumerate(cfg.layer_types):
        t |= _layer_targets(cfg, f"model.layers.{i}.", ("layers", i), kind, cfg.is_moe_layer(i))
    if cfg.num_mtp_layers:
        t |= mtp_targets(cfg)
    return t


def mtp_targets(cfg: Qwen3NextConfig) -> dict[str, Target]:
    """The multi-token prediction layers' tensors (``mtp.*``, :mod:`.mtp`): two pre-fc norms,
    ``fc``, full-attention decoder layers under ``mtp.layers.{j}``, and a final norm."""
    t = {"mtp.fc.weight": Target(("mtp", "fc", "weight"), "t")}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{n}.weight"] = Target(("mtp", n, "weight"), "copy")
    moe = cfg.num_experts > 0  # as mtp.mtp_layer_config builds them
    for j in range(cfg.num_mtp_layers):
        t |= _layer_targets(cfg, f"mtp.layers.{j}.", ("mtp", "layers", j), FULL_ATTENTION, moe)
    return t


def _layer_targets(
    cfg: Qwen3NextConfig, p: str, L: tuple, kind: str, moe: bool
) -> dict[str, Target]:
    """One decoder layer's tensors: checkpoint prefix ``p``, parameter path prefix ``L``."""
    t: dict[str, Target] = {}
    t[p + "input_layernorm.weight"] = Target(L + ("input_layernorm", "weight"), "copy")
    t[p + "post_attention_layernorm.weight"] = Target(
        L + ("post_attention_layernorm", "weight"), "copy"
    )
    if kind == FULL_ATTENTION:
        a = L + ("self_attn",)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "t")
        for n in ("q_norm", "k_norm"):
            t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "copy")
    else:
        g = L + ("linear_attn",)
        for n in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            t[p + f"linear_attn.{n}.weight"] = Target(g + (n, "weight"), "t")
        t[p + "linear_attn.conv1d.weight"] = Target(g + ("conv1d",), "conv")
        t[p + "linear_attn.A_log"] = Target(g + ("A_log",), "copy")
        t[p + "linear_attn.dt_bias"] = Target(g + ("dt_bias",), "copy")
        t[p + "linear_attn.norm.weight"] = Target(g + ("norm", "weight"), "copy")
    m = L + ("mlp",)
    if moe:
        t[p + "mlp.gate.weight"] = Target(m + ("gate", "weight"), "t")
        t[p + "mlp.shared_expert_gate.weight"] = Target(m + ("shared_expert_gate", "weight"), "t")
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.shared_expert.{n}.weight"] = Target(m + ("shared_expert", n, "weight"), "t")
        for e in range(cfg.num_experts):
            for n, dst in (
                ("gate_proj", "experts_gate"),
                ("up_proj", "experts_up"),
                ("down_proj", "experts_down"),
            ):
                t[p + f"mlp.experts.{e}.{n}.weight"] = Target(m + (dst,), "t", expert=e)
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.{n}.weight"] = Target(m + (n, "weight"), "t")
    return t
