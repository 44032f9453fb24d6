"""The training forward (dense [B, T], chunked gated delta rule) against the serving forward.

The serving path (ragged batch, paged KV, state slots, reference ops that scan token by token)
is the oracle: on the same parameters both must give the same logits. Then a few optimizer
steps of the real training step must lower the loss.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyjax.cache import init_caches
from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, make_batch, tiny_qwen3_next_config
from hyjax.training.chunked import chunk_gated_delta_rule
from hyjax.training.dense import dense_forward, load_balancing_loss
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn.reference import gdn_prefill_reference
from tests.pallas_kernels.ragged_cases import assert_close

BS = 16


def _model(seed=0, **overrides):
    # Three layers cover every kind: GDN + MoE, gated attention + MoE, GDN + dense MLP.
    overrides = (
        dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_only_layers=[2],
        )
        | overrides
    )
    cfg = Qwen3NextConfig.from_hf(
        tiny_qwen3_next_config(model_type="qwen3_next", torch_dtype="float32", **overrides)
    )
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # Non-default gates and norms, so a convention slip cannot hide behind 0 / 1 values.
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("dt_bias", "A_log") or "norm" in str(path):
            var[...] = var[...] + jnp.asarray(0.3 * rng.standard_normal(var.shape))
    return model, cfg


def _serving_logits(model, cfg, tokens: list[int]) -> np.ndarray:
    """Every position's logits from one ragged prefill step on the serving interface."""
    n = len(tokens)
    blocks = range(1, -(-n // BS) + 1)
    batch, (idx,) = make_batch(
        [SeqChunk(tokens, 0, blocks, dst_slot=1, all_logits=True)],
        block_size=BS,
        num_tokens=n,
        num_seqs=n,
        max_blocks=len(blocks),
    )
    caches = init_caches(cfg, num_blocks=len(blocks) + 1, block_size=BS, num_slots=2,
                         dtype=jnp.float32, fill=np.nan)  # fmt: skip
    _, logits = jax.jit(lambda m, b, c: m(b, c, get_ops("reference")))(model, batch, caches)
    return np.asarray(logits)[idx]


def test_dense_logits_match_serving():
    seq_len = 100  # two 64-token chunks, the second partial
    model, cfg = _model()
    rng = np.random.default_rng(1)
    rows = rng.integers(3, cfg.vocab_size, size=(2, seq_len))
    dense, router = jax.jit(dense_forward)(model, jnp.asarray(rows, jnp.int32))
    assert len(router) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    for b in range(2):
        want = _serving_logits(model, cfg, rows[b].tolist())
        err = np.abs(np.asarray(dense[b]) - want).max() / np.abs(want).max()
        assert err < 1e-4, f"row {b}: relative error {err:.2e}"


def test_chunked_rule_matches_token_scan():
    """Chunked WY/UT form vs the reference token recurrence, last chunk partial."""
    chunk = 16
    t, hk, hv, dk, dv = 75, 2, 4, 16, 8
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (t, hk, dk))
    k = jax.random.normal(ks[1], (t, hk, dk))
    v = jax.random.normal(ks[2], (t, hv, dv))
    a = jax.random.normal(ks[3], (t, hv))
    b = jax.random.normal(ks[4], (t, hv))
    a_log, dt_bias = jnp.linspace(-1.0, 1.5, hv), jnp.linspace(-0.5, 0.5, hv)
    state = jnp.full((2, hv, dv, dk), jnp.nan)  # the pool: states stored transposed
    zeros = jnp.zeros((1, 1), jnp.int32)
    fresh = StateSlots(jnp.array([0]), jnp.array([1]), zeros, zeros, jnp.int32(1))
    want_o, want_s = gdn_prefill_reference(
        q, k, v, a, b, a_log, dt_bias, state, jnp.array([0, t], jnp.int32), fresh
    )
    from pallas_kernels.gdn.reference import _prepare

    q32, k32, v32, g, beta = _prepare(q, k, v, a, b, a_log, dt_bias)
    o, s = chunk_gated_delta_rule(q32[None], k32[None], v32[None], g[None], beta[None], chunk=chunk)
    assert_close(o[0], want_o, rtol=1e-4, atol=1e-4)
    assert_close(s[0], jnp.swapaxes(want_s[1], -1, -2), rtol=1e-4, atol=1e-4)


def test_load_balancing_loss_is_top_k_when_balanced_and_grows_when_not():
    e, k = 8, 2
    uniform = [jnp.zeros((64, e))]
    assert float(load_balancing_loss(uniform, k)) == pytest.approx(k, rel=1e-5)
    skewed = [jnp.tile(jnp.arange(e, dtype=jnp.float32) * 2.0, (64, 1))]
    assert float(load_balancing_loss(skewed, k)) > 1.5 * k


def test_optimizer_steps_lower_the_loss():
    """The real training step (dense forward, CE + aux loss, AdamW) on one repeated batch."""
    from hyjax.training.train import TrainConfig, make_optimizer, make_train_step, model_config

    cfg = dataclasses.replace(
        model_config("tiny", vocab_size=64),
        num_hidden_layers=2,
        layer_types=("linear_attention", "full_attention"),
    )
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tc = TrainConfig(out="", steps=8, warmup_steps=1, lr=1e-2)
    tx = make_optimizer(tc)
    step = make_train_step(graphdef, tx, top_k=cfg.num_experts_per_tok, aux_coef=1e-3)
    opt_state = tx.init(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 33)), jnp.int32)
    losses = []
    for _ in range(8):
        params, opt_state, m = step(params, opt_state, tokens)
        losses.append(float(m["ce"]))
        assert np.isfinite(float(m["aux"])) and float(m["aux"]) >= 1.0  # >= top_k / E * E
    assert losses[-1] < losses[0] - 0.5, losses
