"""Qwen3-Next for causal LM, in Flax NNX, on the ragged, paged and slotted serving interface.

Decoder layer ``i`` (zero-centred RMSNorm ``(1 + w) * normalize(x)`` everywhere)::

    h = h + mixer(input_layernorm(h))       mixer: GatedDeltaNet or GatedAttention
    h = h + mlp(post_attention_layernorm(h))  mlp: SparseMoe (or a dense MLP)

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
from hyjax.layers.conv_channels import pack_conv_channels, split_qkvz
from hyjax.layers.linear import Linear
from hyjax.layers.moe import MLP, SparseMoe
from hyjax.layers.norms import GatedRMSNorm, RMSNorm
from hyjax.layers.rope import apply_partial_rope
from hyjax.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from hyjax.models.qwen3_next.config import Qwen3NextConfig

if TYPE_CHECKING:
    from hyjax.ops import Ops

# conv [slots, K-1, C], ssm f32 | bf16[slots, Hv, Dv, Dk] (the states transposed: hyjax.cache)
StateCache = tuple[jax.Array, jax.Array]


class GatedDeltaNet(nnx.Module):
    """in_proj -> causal conv1d + SiLU -> gated delta rule -> gated RMSNorm(z) -> out_proj.

    ``in_proj_qkvz`` / ``in_proj_ba`` keep the checkpoint's per-key-head-group interleave::

        qkvz row group g (one per key head): | q_g (Dk) | k_g (Dk) | v (r*Dv) | z (r*Dv) |
        ba   row group g:                    | b (r) | a (r) |          r = Hv // Hk

    and are de-interleaved here; the conv channels are ``q (all heads) | k | v``, or, under
    tensor parallelism over ``conv_shards`` devices, that order within each device's heads::

        | q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...     (s: the heads of device s)

    so each device's slice of the channels is a whole local ``q | k | v`` (no resharding
    around the conv and the kernels; :mod:`hyjax.layers.conv_channels`). The family's
    sharding permutes ``conv1d`` to match.
    """

    conv_shards: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = self.hv // self.hk
        d, kk = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.in_proj_qkvz = Linear(
            d, 2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, dtype=dtype, rngs=rngs
        )
        self.in_proj_ba = Linear(d, 2 * self.hv, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.5)
        self.conv1d = nnx.Param(init(rngs.params(), (cfg.conv_dim, kk), dtype))  # [C, K]
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (self.hv,), minval=1.0, maxval=16.0))
        )
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), jnp.float32))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.linear_value_dim, d, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: StateCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[StateCache, jax.Array]:
        n = x.shape[0]
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.ratio
        qkvz = self.in_proj_qkvz(x)
        q, k, v, z = split_qkvz(qkvz, hk, dk, dv, r)
        ba = self.in_proj_ba(x).reshape(n, hk, 2 * r)
        b, a = ba[..., :r].reshape(n, hv), ba[..., r:].reshape(n, hv)

        conv_state, ssm_state = cache
        slots, qsl = batch.slots, batch.query_start_loc
        gates = (self.A_log[...], self.dt_bias[...])
        if decode_only:  # one token per row: conv and delta rule in one pass over the slots
            mixed = pack_conv_channels(q, k, v, self.conv_shards)  # [n, C]
            o, conv_state, ssm_state = ops.conv_gdn_decode(
                mixed, self.conv1d[...], conv_state, a, b, *gates, ssm_state, slots,
                num_k_heads=hk,
            )  # fmt: skip
        else:  # the conv reads q | k | v from the projection's output (on each device, its heads)
            q, k, v, conv_state = ops.conv1d_prefill_qkvz(
                qkvz, self.conv1d[...], conv_state, qsl, slots, num_k_heads=hk,
                head_dims=(dk, dv),
            )  # fmt: skip
            q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
            if batch.max_row_tokens:  # verify rows (a few tokens each): token by token
                o, ssm_state = ops.gdn_multi_decode(
                    q, k, v, a, b, *gates, ssm_state, qsl, slots, max_tokens=batch.max_row_tokens
                )
            else:
                o, ssm_state = ops.gdn_prefill(q, k, v, a, b, *gates, ssm_state, qsl, slots)
        o = self.norm(o, z).reshape(n, hv * dv)
        return (conv_state, ssm_state), self.out_proj(o)


KVCache = tuple[jax.Array, jax.Array]


class GatedAttention(nnx.Module):
    """q/k RMSNorm -> partial RoPE -> paged GQA attention -> ``* sigmoid(gate)`` -> o_proj.

    ``q_proj`` rows interleave per head ``[query(D) | gate(D)]``, as the checkpoint stores them.
    With more tensor-parallel devices than kv heads, each kv head is repeated ``kv_repeat``
    times after the projection (and cached so), so every device holds the kv head its query
    heads read.
    """

    kv_repeat: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, hq, hkv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.q_proj = Linear(d, hq * hd * 2, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(hq * hd, d, dtype=dtype, rngs=rngs)
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.q_norm = RMSNorm(hd, **norm)
        self.k_norm = RMSNorm(hd, **norm)

    def __call__(
        self, x: jax.Array, cache: KVCache, batch: Batch, ops: Ops, *, decode_only: bool = False
    ) -> tuple[KVCache, jax.Array]:
        num_tokens = x.shape[0]
        qg = self.q_proj(x).reshape(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_repeat > 1:  # [T, Hkv * kv_repeat, D], copies of a head side by side
            k = jnp.repeat(k, self.kv_repeat, axis=1)
            v = jnp.repeat(v, self.kv_repeat, axis=1)
        rope = dict(rotary_dim=self.rotary_dim, theta=self.rope_theta)
        q = apply_partial_rope(self.q_norm(q), batch.positions, **rope)
        k = apply_partial_rope(self.k_norm(k), batch.positions, **rope)

        k_cache, v_cache = ops.write_kv(k, v, cache[0], cache[1], batch.slot_mapping)
        attend = ops.paged_attention_decode if decode_only else ops.paged_attention
        o = attend(
            q,
            k_cache,
            v_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            batch.num_seqs,
            scale=self.head_dim**-0.5,
        )
        o = o.reshape(num_tokens, -1) * jax.nn.sigmoid(gate.reshape(num_tokens, -1))
        return (k_cache, v_cache), self.o_proj(o)


class DecoderLayer(HybridDecoderLayer):
    """The mixer is ``self_attn`` (attention layers) or ``linear_attn`` (GDN layers)."""

    zero_centred_norm = True

    def __init__(self, cfg: Qwen3NextConfig, i: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg, i, dtype=dtype)
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        if cfg.is_moe_layer(i):
            self.mlp = SparseMoe(
                cfg.hidden_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                expert_dim=cfg.moe_intermediate_size,
                shared_dim=cfg.shared_expert_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def mixer(self) -> nnx.Module:
        return self.self_attn if self.is_attention else self.linear_attn


class Qwen3NextForCausalLM(HybridForCausalLM):
    """The hybrid stack, plus ``mtp`` (the multi-token prediction layers, parameters
    ``mtp/...``) when the config builds them (``num_mtp_layers``; built last, so every other
    random init is what it was without them)."""

    layer_class = DecoderLayer

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        if cfg.num_mtp_layers:
            from hyjax.models.qwen3_next.mtp import MultiTokenPredictor  # it imports this module

            self.mtp = MultiTokenPredictor(cfg, dtype=dtype, rngs=rngs)
