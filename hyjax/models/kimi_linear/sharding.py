"""Kimi-Linear's partition rules: parameters, pools and head-parallel ops on ``n`` devices::

KDA   q_proj / k_proj / v_proj [D, H*Dk]  columns;  q_conv1d / k_conv1d / v_conv1d [H*Dk, K]
      rows, packed at trace time to q_s|k_s|v_s per device;  f_b_proj / g_b_proj [Dk, H*Dk]
      and b_proj [D, H] columns (f_a_proj / g_a_proj, rank Dk, replicated);
      A_log [H], dt_bias [H*Dk] split;  o_proj [H*Dk, D] rows
      state pool: conv [slots, K-1, 3*H*Dk] on channels, ssm [slots, H, Dv, Dk] on H
MLA   q_proj / q_b_proj [., H*(Dn+R)] columns (q_a_proj, q_a_layernorm replicated);
      kv_b_proj [L, H*(Dn+Dv)] columns (by head); o_proj [H*Dv, D] rows;
      kv_a_proj_with_mqa replicated. Latent pool [NB, bs, L+R] replicated: every head
      reads the whole latent, so each device keeps all of it (a KV block costs the same
      on every device as on one).
MoE   experts [E, D, F] on F (tensor parallel) or on E (--enable-expert-parallel);
      shared experts and dense MLPs column / row; router replicated
embed replicated; lm_head [D, V] columns (when n divides V)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx
from jax.sharding import PartitionSpec as P

from hyjax.models.kimi_linear.config import KimiLinearConfig
from hyjax.models.kimi_linear.model import KimiDeltaAttention
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

_WHAT = {"linear_num_heads": "KDA heads, linear_attn_config.num_heads"}


def check(cfg: KimiLinearConfig, tp: int, expert_parallel: bool) -> None:
    heads = {}
    if cfg.linear_layers:
        heads["linear_num_heads"] = cfg.linear_num_heads  # KDA
    if cfg.attention_layers:
        heads["num_attention_heads"] = cfg.num_attention_heads  # MLA
    divides(tp, _WHAT, **heads)
    check_mlps(
        cfg,
        tp,
        expert_parallel,
        shared_experts_dim=cfg.moe_intermediate_size * cfg.num_shared_experts,
    )


def rules(cfg: KimiLinearConfig, tp: int, expert_parallel: bool) -> Rules:
    # KDA and MLA layers are both ``self_attn``; q_proj / o_proj are column / row in each.
    # Unmatched (replicated): f_a_proj, g_a_proj, o_norm, q_a_proj, kv_a_proj_with_mqa, norms.
    attn = r".*/self_attn"
    return [
        (rf"{attn}/(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj)/weight", P(None, M)),
        (rf"{attn}/(q_conv1d|k_conv1d|v_conv1d)", P(M, None)),
        (rf"{attn}/(A_log|dt_bias)", P(M)),
        (rf"{attn}/(q_b_proj|kv_b_proj)/weight", P(None, M)),
        (rf"{attn}/o_proj/weight", P(M, None)),
        *expert_rules(expert_parallel),
        *mlp_rules(r".*/mlp/shared_experts"),
        *mlp_rules(r".*/mlp"),
        *lm_head_rules(cfg, tp),
    ]


def configure(model: nnx.Module, plan: ShardingPlan) -> None:
    for _, m in model.iter_modules():
        if isinstance(m, KimiDeltaAttention):
            m.conv_shards = plan.tp  # the filters are packed at trace time: nothing to permute
    configure_experts(model, plan)


LATENT = R  # [NB, bs, L+R]: one latent per token, read by every head

SHARDING = FamilySharding(
    check=check,
    rules=rules,
    configure=configure,
    kv_spec=LATENT,
    conv_spec=CONV_STATE,
    ssm_spec=SSM,
    ops={
        **CONV1D_OPS,
        # (q, k, v) [T, P] each, by head; their filters [3P, K] by device (q | k | v each)
        "conv1d_prefill_split": ((H2, P(M, None), CONV_STATE, R, SLOTS), (H2, CONV_STATE)),
        # q, k, v, g [T, H, D]; b [T, H]; A_log [H]; dt_bias [H, Dk]; state by head
        "kda_prefill": ((H3, H3, H3, H3, H2, H1, P(M, None), SSM, R, SLOTS), (H3, SSM)),
        "kda_multi_decode": ((H3, H3, H3, H3, H2, H1, P(M, None), SSM, R, SLOTS), (H3, SSM)),
        "kda_decode": ((H3, H3, H3, H3, H2, H1, P(M, None), SSM, SLOTS), (H3, SSM)),
        # mixed [T, 3P] and its filters [3P, K] by device (each device's q | k | v channels)
        "conv_kda_decode": (
            (H2, P(M, None), CONV_STATE, H3, H2, H1, P(M, None), SSM, SLOTS),
            (H3, CONV_STATE, SSM),
        ),
        # Every device writes the same latent into its own copy of the pool (no collective);
        # under shard_map so a Pallas writer would run per device too.
        "write_latent": ((R, LATENT, R), LATENT),
        # q [T, H, Dn+R], latent, w_kv_b [L, H, Dn+Dv], then the batch's (replicated) tables.
        "mla_prefill": ((H3, LATENT, H3, R, R, R, R), H3),
        "mla_decode": ((H3, LATENT, H3, R, R, R), H3),
    },
    kv_pool="replicated: the MLA latent is read by every head",
)
