"""A dense, differentiable forward of :class:`Qwen3NextForCausalLM` over ``[B, T]`` batches.

It walks the serving model's own NNX modules and parameters (projections, norms, RoPE, the
MoE weights), so what is trained here is exactly what serving loads; only the sequence mixers
change form: the gated delta rule runs chunked (:mod:`hyjax.training.chunked`) instead of the
token-by-token reference scan, the short convolution is a padded shift-and-add, and full
attention is plain causal softmax attention instead of paged attention. The MoE computes every
expert and zeroes the unrouted ones (exactly top-k routing; at these sizes one dense product
beats sorting tokens into groups) and returns the router logits for the load-balancing loss.

Every sequence starts at position 0 from a zero recurrent state and an empty KV cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hyjax.layers.moe import SparseMoe
from hyjax.layers.rope import apply_partial_rope
from hyjax.models.qwen3_next.model import (
    DecoderLayer,
    GatedAttention,
    GatedDeltaNet,
    Qwen3NextForCausalLM,
)
from hyjax.training.chunked import chunk_gated_delta_rule
from pallas_kernels.gdn.reference import gdn_gates, l2norm


def causal_conv1d_silu(
    x: jax.Array,  # [B, T, C]
    weight: jax.Array,  # [C, K]  weight[:, K-1] multiplies the current token
) -> jax.Array:
    """Depthwise causal conv over time from a zero window, then SiLU (f32 inside)."""
    kk = weight.shape[1]
    t = x.shape[1]
    xp = jnp.pad(x.astype(jnp.float32), [(0, 0), (kk - 1, 0), (0, 0)])  # [B, T+K-1, C]
    w = weight.astype(jnp.float32)
    y = sum(xp[:, j : j + t] * w[:, j] for j in range(kk))
    return jax.nn.silu(y).astype(x.dtype)


def gdn_dense(layer: GatedDeltaNet, x: jax.Array) -> jax.Array:
    """Gated DeltaNet over ``x [B, T, D]`` -> ``[B, T, D]`` (same split as the serving layer)."""
    bsz, t, _ = x.shape
    hk, hv, dk, dv, r = layer.hk, layer.hv, layer.dk, layer.dv, layer.ratio
    qkvz = layer.in_proj_qkvz(x).reshape(bsz, t, hk, 2 * dk + 2 * r * dv)
    ba = layer.in_proj_ba(x).reshape(bsz, t, hk, 2 * r)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(bsz, t, hv, dv)
    z = qkvz[..., 2 * dk + r * dv :].reshape(bsz, t, hv, dv)
    b, a = ba[..., :r].reshape(bsz, t, hv), ba[..., r:].reshape(bsz, t, hv)

    mixed = jnp.concatenate(
        [q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], axis=-1
    )
    mixed = causal_conv1d_silu(mixed, layer.conv1d[...])  # [B, T, C]
    q = mixed[..., : hk * dk].reshape(bsz, t, hk, dk)
    k = mixed[..., hk * dk : 2 * hk * dk].reshape(bsz, t, hk, dk)
    v = mixed[..., 2 * hk * dk :].reshape(bsz, t, hv, dv)
    # GVA: value head h reads key head h // r (the reference's repeat along the head axis).
    q = jnp.repeat(l2norm(q), r, axis=2) * (dk**-0.5)
    k = jnp.repeat(l2norm(k), r, axis=2)
    g, beta = gdn_gates(a, b, layer.A_log[...], layer.dt_bias[...])
    o, _ = chunk_gated_delta_rule(q, k, v.astype(jnp.float32), g, beta)
    o = layer.norm(o.astype(x.dtype), z).reshape(bsz, t, hv * dv)
    return layer.out_proj(o)


def attention_dense(layer: GatedAttention, x: jax.Array) -> jax.Array:
    """Gated causal GQA over ``x [B, T, D]`` -> ``[B, T, D]``; positions ``0 .. T-1``."""
    bsz, t, _ = x.shape
    hq, hkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    qg = layer.q_proj(x).reshape(bsz, t, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = layer.k_proj(x).reshape(bsz, t, hkv, hd)
    v = layer.v_proj(x).reshape(bsz, t, hkv, hd)
    positions = jnp.arange(t, dtype=jnp.int32)
    rope = dict(rotary_dim=layer.rotary_dim, theta=layer.rope_theta)
    q = apply_partial_rope(layer.q_norm(q), positions, **rope)
    k = apply_partial_rope(layer.k_norm(k), positions, **rope)
    # Query head h reads kv head h // group, as the paged reference does.
    q = q.reshape(bsz, t, hkv, hq // hkv, hd).astype(jnp.float32)
    scores = jnp.einsum("BqKGD,BkKD->BKGqk", q, k.astype(jnp.float32)) * hd**-0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("BKGqk,BkKD->BqKGD", probs, v.astype(jnp.float32)).astype(x.dtype)
    o = o.reshape(bsz, t, hq * hd) * jax.nn.sigmoid(gate.reshape(bsz, t, hq * hd))
    return layer.o_proj(o)


def moe_dense(moe: SparseMoe, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [N, D]`` -> ``(y [N, D], router logits f32[N, E])``; every expert computed."""
    num_experts = moe.experts_gate.shape[0]
    logits = moe.gate(x).astype(jnp.float32)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)  # [N, k]
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(x.dtype)
    # [N, E]: the routing weight of each expert, 0 where the token was not routed.
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=x.dtype) * weights[..., None], 1)
    h = jnp.einsum("ND,EDF->NEF", x, moe.experts_gate[...])
    u = jnp.einsum("ND,EDF->NEF", x, moe.experts_up[...])
    act = jax.nn.silu(h) * u * combine[..., None]
    routed = jnp.einsum("NEF,EFD->ND", act, moe.experts_down[...])
    shared = moe.shared_expert(x) * jax.nn.sigmoid(moe.shared_expert_gate(x))
    return routed + shared, logits


def layer_dense(layer: DecoderLayer, h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """One decoder layer over ``h [B, T, D]``: ``(h, router logits f32[B*T, E] or None)``."""
    bsz, t, _ = h.shape
    x = layer.input_layernorm(h)
    if layer.is_attention:
        h = h + attention_dense(layer.self_attn, x)
    else:
        h = h + gdn_dense(layer.linear_attn, x)
    x = layer.post_attention_layernorm(h).reshape(bsz * t, -1)
    logits = None
    if isinstance(layer.mlp, SparseMoe):
        y, logits = moe_dense(layer.mlp, x)
    else:
        y = layer.mlp(x)
    return h + y.reshape(bsz, t, -1), logits


def dense_hidden(
    model: Qwen3NextForCausalLM,
    input_ids: jax.Array,  # i32[B, T]
) -> tuple[jax.Array, list[jax.Array]]:
    """Returns ``(final hidden states [B, T, D] after model.norm, router logits per MoE layer)``."""
    h = model.embed_tokens[...][input_ids]  # [B, T, D]
    router_logits = []
    for layer in model.layers:
        h, logits = layer_dense(layer, h)
        if logits is not None:
            router_logits.append(logits)
    return model.norm(h), router_logits


def dense_forward(
    model: Qwen3NextForCausalLM,
    input_ids: jax.Array,  # i32[B, T]
) -> tuple[jax.Array, list[jax.Array]]:
    """Returns ``(logits f32[B, T, vocab], router logits: one f32[B*T, E] per MoE layer)``."""
    bsz, t = input_ids.shape
    h, router_logits = dense_hidden(model, input_ids)
    return model.logits(h.reshape(bsz * t, -1)).reshape(bsz, t, -1), router_logits


def load_balancing_loss(router_logits: list[jax.Array], top_k: int) -> jax.Array:
    """Qwen3-Next's auxiliary MoE loss (the Switch-Transformer form transformers uses).

    Over the router logits of all MoE layers stacked as one set of ``N`` rows:
    ``E * sum_{j, e} frac[j, e] * mean_prob[e]`` where ``frac[j, e]`` is the fraction of rows
    whose j-th choice is expert ``e``. Perfect balance gives ``top_k``; the trainer adds
    ``router_aux_loss_coef`` times it to the cross-entropy.
    """
    logits = jnp.concatenate(router_logits, axis=0)  # [L*N, E]
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)  # [L*N, k]
    frac = jnp.mean(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), axis=0)  # [k, E]
    mean_prob = jnp.mean(probs, axis=0)  # [E]
    return num_experts * jnp.sum(frac * mean_prob[None, :])
