"""Kimi-Linear for causal LM, in Flax NNX, on the ragged, paged and slotted serving interface.

Decoder layer ``i`` (pre-norm residual, plain RMSNorm ``w * normalize(x)`` everywhere)::

    h = h + self_attn(input_layernorm(h))        self_attn: KDA, or MLA (NoPE) on the latent cache
    h = h + mlp(post_attention_layernorm(h))     mlp: dense SwiGLU (the first layers) or SigmoidMoe

The stack around the layers (embedding, cache walk, final norm, logits) is
:mod:`hyjax.models.hybrid`'s; this file says what fills it: the two mixers, which only this
family has, and the decoder layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.layers.conv_channels import pack_conv_channels
from hyjax.layers.linear import Linear
from hyjax.layers.moe import MLP, SigmoidMoe
from hyjax.layers.norms import RMSNorm, rms_normalize
from hyjax.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from hyjax.models.kimi_linear.config import KimiLinearConfig

if TYPE_CHECKING:
    from hyjax.ops import Ops

# conv [slots, K-1, 3P], ssm f32 | bf16[slots, H, Dv, Dk] (the states transposed: hyjax.cache)
StateCache = tuple[jax.Array, jax.Array]


class SigmoidGatedRMSNorm(nnx.Module):
    """KDA output norm (FLA ``FusedRMSNormGated``, sigmoid): ``w * normalize(x) * sigmoid(g)``.

    All in float32, per head over the last axis; cast to ``x.dtype`` at the end.
    """

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)
        return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class KimiDeltaAttention(nnx.Module):
    """q/k/v projections -> three short convs + SiLU -> KDA -> gated o_norm -> o_proj.

    The three depthwise convolutions are kept as the checkpoint stores them (``q_conv1d``,
    ``k_conv1d``, ``v_conv1d``) and run as one conv over the channels ``q | k | v``: the conv
    window of a slot holds the three windows side by side. The forget gate is low rank
    (``f_a_proj`` then ``f_b_proj``) with one decay per key channel; the KDA op applies
    ``A_log`` / ``dt_bias`` / softplus itself, like the GDN op does.

    Under tensor parallelism over ``conv_shards`` devices the conv channels are ``q | k | v``
    within each device's heads (:mod:`hyjax.layers.conv_channels`)::

        | q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...     (s: the heads of device s)

    so each device's slice of the channels, and of the conv window pool, is a whole local
    ``q | k | v``. The checkpoint keeps the three filters apart, so the layout is built at
    trace time and nothing is permuted on load or save.
    """

    conv_shards: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: KimiLinearConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.h, self.d = cfg.linear_num_heads, cfg.linear_head_dim
        p, hidden, kk = cfg.linear_dim, cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.q_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.5)
        self.q_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))  # [P, K]
        self.k_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))
        self.v_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))
        self.f_a_proj = Linear(hidden, self.d, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(self.d, p, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (self.h,), minval=1.0, maxval=16.0))
        )
        self.dt_bias = nnx.Param(jnp.ones((p,), jnp.float32))  # per head x key channel
        self.b_proj = Linear(hidden, self.h, dtype=dtype, rngs=rngs)
        self.g_a_proj = Linear(hidden, self.d, dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear(self.d, p, dtype=dtype, rngs=rngs)
        self.o_norm = SigmoidGatedRMSNorm(self.d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(p, hidden, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: StateCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[StateCache, jax.Array]:
        n, h, d = x.shape[0], self.h, self.d
        p = h * d
        shards = self.conv_shards
        qkv = (self.q_proj(x), self.k_proj(x), self.v_proj(x))  # [T, P] each
        # The conv channels q | k | v (per device's heads), one depthwise filter each.
        filters = (self.q_conv1d[...].T, self.k_conv1d[...].T, self.v_conv1d[...].T)  # [K, P]
        weight = pack_conv_channels(*filters, shards).T  # [3P, K]
        g = self.f_b_proj(self.f_a_proj(x)).reshape(n, h, d)  # raw per-channel gate
        b = self.b_proj(x)  # [T, H] beta logits
        conv_state, ssm_state = cache
        slots, qsl = batch.slots, batch.query_start_loc
        gates = (self.A_log[...], self.dt_bias[...].reshape(h, d))
        if decode_only:  # the conv update and KDA in one op (one kernel pass on a GPU)
            mixed = pack_conv_channels(*qkv, shards)  # [T, 3P]
            o, conv_state, ssm_state = ops.conv_kda_decode(
                mixed, weight, conv_state, g, b, *gates, ssm_state, slots
            )
        else:  # q, k, v read and written apart (on each device, its heads)
            qkv, conv_state = ops.conv1d_prefill_split(qkv, weight, conv_state, qsl, slots)
            q, k, v = (t.reshape(n, h, d) for t in qkv)  # [T, H, D] each
            if batch.max_row_tokens:  # verify rows (a few tokens each): token by token
                o, ssm_state = ops.kda_multi_decode(
                    q, k, v, g, b, *gates, ssm_state, qsl, slots, max_tokens=batch.max_row_tokens
                )
            else:
                o, ssm_state = ops.kda_prefill(q, k, v, g, b, *gates, ssm_state, qsl, slots)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(n, h, d)
        o = self.o_norm(o, gate).reshape(n, p)
        return (conv_state, ssm_state), self.o_proj(o)


LatentCache = tuple[jax.Array]  # ([num_blocks, block_size, kv_lora_rank + rope dims],)


class MultiHeadLatentAttention(nnx.Module):
    """Multi-head latent attention (NoPE) on the paged latent cache.

    Per token only the latent ``[c_kv (kv_lora_rank) | k_rope (rope dims)]`` is cached
    (:mod:`pallas_kernels.attention.mla_reference` draws the layout); ``kv_b_proj`` turns it into
    keys and values inside the attention op: decompressed for prefill, absorbed for decode.
    Kimi-Linear applies no rotary embedding anywhere: the "rope" dims enter the dot product as
    they are, shared by every head and not normalised.
    """

    def __init__(self, cfg: KimiLinearConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.lora = heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.scale = cfg.qk_head_dim**-0.5
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
            # The module default eps, as for kv_a_layernorm.
            self.q_a_layernorm = RMSNorm(
                cfg.q_lora_rank, eps=cfg.kv_a_layernorm_eps, zero_centred=False, dtype=dtype
            )
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.latent_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(
            cfg.kv_lora_rank, eps=cfg.kv_a_layernorm_eps, zero_centred=False, dtype=dtype
        )
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, heads * (self.nope + self.v_dim), dtype=dtype, rngs=rngs
        )
        self.o_proj = Linear(heads * self.v_dim, hidden, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: LatentCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[LatentCache, jax.Array]:
        n = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(n, self.num_heads, self.nope + self.rope)  # per head: q_nope | q_rope
        ckv = self.kv_a_proj_with_mqa(x)  # [T, L + R]
        c_kv = self.kv_a_layernorm(ckv[:, : self.lora])  # normalised; k_rope is not
        latent = jnp.concatenate([c_kv, ckv[:, self.lora :]], axis=-1)
        (latent_cache,) = cache
        latent_cache = ops.write_latent(latent, latent_cache, batch.slot_mapping)
        w_kv_b = self.kv_b_proj.weight[...].reshape(self.lora, self.num_heads, -1)  # [L, H, Dn+Dv]
        attn = dict(nope_dim=self.nope, scale=self.scale)
        if decode_only:
            o = ops.mla_decode(
                q, latent_cache, w_kv_b, batch.seq_lens, batch.block_tables, batch.num_seqs, **attn
            )
        else:
            o = ops.mla_prefill(
                q,
                latent_cache,
                w_kv_b,
                batch.query_start_loc,
                batch.seq_lens,
                batch.block_tables,
                batch.num_seqs,
                **attn,
            )
        return (latent_cache,), self.o_proj(o.reshape(n, self.num_heads * self.v_dim))


class KimiDecoderLayer(HybridDecoderLayer):
    """The mixer is ``self_attn`` in every layer, MLA or KDA (the checkpoint's names)."""

    zero_centred_norm = False

    def __init__(self, cfg: KimiLinearConfig, i: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg, i, dtype=dtype)
        if self.is_attention:
            self.self_attn = MultiHeadLatentAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs)
        if cfg.is_moe_layer(i):
            self.mlp = SigmoidMoe(
                cfg.hidden_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                expert_dim=cfg.moe_intermediate_size,
                shared_dim=cfg.moe_intermediate_size * cfg.num_shared_experts,
                renormalize=cfg.moe_renormalize,
                scaling_factor=cfg.routed_scaling_factor,
                num_groups=cfg.num_expert_group,
                topk_groups=cfg.topk_group,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def mixer(self) -> nnx.Module:
        return self.self_attn


class KimiLinearForCausalLM(HybridForCausalLM):
    layer_class = KimiDecoderLayer
