"""Qwen3-Next's partition rules: parameters, pools and head-parallel ops on ``n`` devices::

GDN   in_proj_qkvz [D, Hk*(2Dk+2rDv)]  columns: Hk/n key-head groups (q_g|k_g|v|z) each
      in_proj_ba   [D, Hk*2r]          columns, same groups
      conv1d       [C, K]              rows, permuted to q_s|k_s|v_s per device
      A_log, dt_bias [Hv]              split;  out_proj [Hv*Dv, D]  rows
      state pool: conv [slots, K-1, C] on C, ssm [slots, Hv, Dv, Dk] on Hv
attn  q_proj (rows [q_h | gate_h] per head) columns, o_proj rows; k_proj / v_proj columns
      when n divides Hkv, else replicated and each kv head repeated n/Hkv times;
      KV pool [NB, bs, Hkv', D] on Hkv'
MoE   experts [E, D, F] on F (tensor parallel) or on E (--enable-expert-parallel);
      shared expert and dense MLPs column / row; router replicated
embed replicated; lm_head [D, V] columns (when n divides V)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from hyjax.layers.conv_channels import conv_channel_order
from hyjax.models.qwen3_next.config import Qwen3NextConfig
from hyjax.models.qwen3_next.model import GatedAttention, GatedDeltaNet
from hyjax.partition import (
    CONV1D_OPS,
    CONV_STATE,
    H1,
    H2,
    H3,
    SLOTS,
    SSM,
    FamilySharding,
    M,
    R,
    Rules,
    check_mlps,
    configure_experts,
    divides,
    expert_rules,
    lm_head_rules,
    mlp_rules,
)

if TYPE_CHECKING:
    from hyjax.sharding import ShardingPlan

_WHAT = {
    "linear_num_key_heads": "GDN key heads",
    "linear_num_value_heads": "GDN value heads",
}


def check(cfg: Qwen3NextConfig, tp: int, expert_parallel: bool) -> None:
    divides(
        tp,
        _WHAT,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        num_attention_heads=cfg.num_attention_heads,
    )
    hkv = cfg.num_key_value_heads
    if hkv % tp and tp % hkv:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide or be a multiple of num_key_value_heads={hkv}"
        )
    shared = cfg.shared_expert_intermediate_size
    check_mlps(cfg, tp, expert_parallel, shared_expert_intermediate_size=shared)


def rules(cfg: Qwen3NextConfig, tp: int, expert_parallel: bool) -> Rules:
    kv = P(None, M) if cfg.num_key_value_heads % tp == 0 else R
    return [
        (r".*/linear_attn/(in_proj_qkvz|in_proj_ba)/weight", P(None, M)),
        (r".*/linear_attn/conv1d", P(M, None)),
        (r".*/linear_attn/(A_log|dt_bias)", P(M)),
        (r".*/linear_attn/out_proj/weight", P(M, None)),
        (r".*/self_attn/q_proj/weight", P(None, M)),
        (r".*/self_attn/(k_proj|v_proj)/weight", kv),
        (r".*/self_attn/o_proj/weight", P(M, None)),
        *expert_rules(expert_parallel),
        *mlp_rules(r".*/mlp/shared_expert"),
        *mlp_rules(r".*/mlp"),
        *lm_head_rules(cfg, tp),
    ]


def _set_conv_shards(model: nnx.Module, shards: int) -> None:
    """Permutes every GDN conv filter's rows into the channel order of ``shards`` devices."""
    for _, m in model.iter_modules():
        if isinstance(m, GatedDeltaNet) and m.conv_shards != shards:
            heads = ((m.hk, m.dk), (m.hv, m.dv))
            # current -> checkpoint order -> the new order
            to_ckpt = np.argsort(conv_channel_order(*heads, m.conv_shards))
            idx = to_ckpt[conv_channel_order(*heads, shards)]
            # [C, K], or [G, C, K] in the scanned form: the channel axis is second to last
            m.conv1d.set_value(m.conv1d[...][..., idx, :])
            m.conv_shards = shards


def configure(model: nnx.Module, plan: ShardingPlan) -> None:
    _set_conv_shards(model, plan.tp)
    for _, m in model.iter_modules():
        if isinstance(m, GatedAttention):
            m.kv_repeat = max(1, plan.tp // plan.cfg.num_key_value_heads)
    configure_experts(model, plan)


def pool_config(cfg: Qwen3NextConfig, tp: int) -> Qwen3NextConfig:
    """More devices than kv heads: each kv head is repeated (and cached) tp / Hkv times."""
    if tp > cfg.num_key_value_heads:
        return dataclasses.replace(cfg, num_key_value_heads=tp)
    return cfg


KV = P(None, None, M, None)  # [NB, bs, Hkv, D]: by kv head

SHARDING = FamilySharding(
    check=check,
    rules=rules,
    configure=configure,
    kv_spec=KV,
    conv_spec=CONV_STATE,
    ssm_spec=SSM,
    ops={
        **CONV1D_OPS,
        "conv1d_prefill_qkvz": ((H2, P(M, None), CONV_STATE, R, SLOTS), (H2, H2, H2, CONV_STATE)),
        "gdn_prefill": ((H3, H3, H3, H2, H2, H1, H1, SSM, R, SLOTS), (H3, SSM)),
        "gdn_multi_decode": ((H3, H3, H3, H2, H2, H1, H1, SSM, R, SLOTS), (H3, SSM)),
        "gdn_decode": ((H3, H3, H3, H2, H2, H1, H1, SSM, SLOTS), (H3, SSM)),
        "conv_gdn_decode": (
            (H2, P(M, None), CONV_STATE, H2, H2, H1, H1, SSM, SLOTS),
            (H3, CONV_STATE, SSM),
        ),
        "write_kv": ((H3, H3, KV, KV, R), (KV, KV)),
        "paged_attention": ((H3, KV, KV, R, R, R, R), H3),
        "paged_attention_decode": ((H3, KV, KV, R, R, R, R), H3),
    },
    pool_config=pool_config,
    checkpoint_layout=lambda model: _set_conv_shards(model, 1),
)
