"""The MTP head's training forward (dense [B, T]) against the serving MTP pass, and a few
training steps of the frozen-target head lowering its loss on a fixed batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyjax.cache import init_caches
from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from hyjax.models.qwen3_next.mtp import init_mtp_caches
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, make_batch, tiny_qwen3_next_config
from hyjax.training.dense import dense_hidden
from hyjax.training.mtp import MTP, attach_mtp, make_train_step, mtp_dense

BS = 16


def _model():
    cfg = Qwen3NextConfig.from_hf(
        tiny_qwen3_next_config(model_type="qwen3_next", torch_dtype="float32")
    )
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model, cfg = attach_mtp(model, cfg, seed=1)
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in str(path):  # away from the zero init: (1 + w) vs w must matter
            var[...] = var[...] + jnp.asarray(0.3 * rng.standard_normal(var.shape))
    return model, cfg


def test_dense_mtp_matches_serving_pass():
    model, cfg = _model()
    n = 40
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, size=n + 1)
    dense_h, _ = jax.jit(dense_hidden)(model, jnp.asarray(tokens[None, :n], jnp.int32))
    dense, _ = jax.jit(mtp_dense)(model, dense_h[:, :-1], jnp.asarray(tokens[None, 1:n]))

    batch, _ = make_batch([SeqChunk(tokens[:n], 0, [1, 2, 3])], block_size=BS, num_tokens=n,
                          num_seqs=1, max_blocks=3)  # fmt: skip
    kw = dict(num_blocks=4, block_size=BS, dtype=jnp.float32, fill=np.nan)
    caches, mtp_caches = init_caches(cfg, num_slots=2, **kw), init_mtp_caches(cfg, **kw)
    ops = get_ops("reference")

    @jax.jit
    def serving(model, batch, caches, mtp_caches, next_ids):
        _, _, hidden = model(batch, caches, ops, return_hidden=True)
        _, h = model.mtp(model.embed_tokens[...], hidden, next_ids, mtp_caches[0], batch, ops)
        return hidden, model.logits(h)

    hidden, want = serving(model, batch, caches, mtp_caches, jnp.asarray(tokens[1:], jnp.int32))
    np.testing.assert_allclose(np.asarray(dense_h[0]), np.asarray(hidden), atol=2e-5, rtol=1e-4)
    want = np.asarray(want)[: n - 1]
    err = np.abs(np.asarray(dense[0]) - want).max() / np.abs(want).max()
    assert err < 1e-4, f"relative error {err:.2e}"


def test_training_steps_lower_the_loss_and_freeze_the_target():
    model, cfg = _model()
    graphdef, mtp_params, rest = nnx.split(model, MTP, ...)
    frozen = jax.tree.map(np.asarray, rest)
    tx = optax.adam(1e-2)
    step = make_train_step(graphdef, tx, top_k=cfg.num_experts_per_tok, aux_coef=1e-3)
    opt_state = tx.init(mtp_params)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, cfg.vocab_size, (4, 33)), jnp.int32)
    losses = []
    for _ in range(8):
        mtp_params, opt_state, m = step(mtp_params, rest, opt_state, tokens)
        losses.append(float(m["ce"]))
    assert losses[-1] < losses[0] - 0.1, losses
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), frozen, rest)
    assert all(jax.tree.leaves(same))
