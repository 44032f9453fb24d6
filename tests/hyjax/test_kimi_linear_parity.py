"""Kimi-Linear in hyjax vs transformers (>= 5.17) on a tiny random checkpoint it saved.

Every forward runs on the serving interface: the paged MLA latent cache (block tables, slot
mapping) and the KDA state pool with src/dst slots and checkpoint writes. Caches start
poisoned with NaN, so a read of anything not written first shows up as NaN logits. The
checkpoint is what ``save_pretrained`` writes (its dense layer 0 under ``block_sparse_moe``),
and the model has KDA and MLA layers, a dense and MoE layers with two expert groups.

Two step shapes only (prefill: 160 tokens, decode: 2 rows), so each compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyjax.cache import init_caches
from hyjax.loader import load_model
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, hf_logits, make_batch, save_tiny_kimi_linear

BS = 16  # KV block size
RTOL = 1e-4
LONG = 150
PREFILL = 160  # tokens (and rows, so that every token's logits fit) of a prefill step
DECODE = 2  # rows of a decode step


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear_tiny")
    save_tiny_kimi_linear(path, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 128, size=LONG).tolist()
    return path, tokens, hf_logits(path, tokens)


@pytest.fixture(scope="module")
def runner(ckpt):
    model, cfg = load_model(ckpt[0])
    graphdef, state = nnx.split(model)
    ops = get_ops("reference")

    @functools.partial(jax.jit, static_argnames="decode_only")
    def forward(state, batch, caches, decode_only=False):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    def run(rows, caches, *, decode_only=False):
        n = DECODE if decode_only else PREFILL
        batch, idx = make_batch(rows, block_size=BS, num_tokens=n, num_seqs=n, max_blocks=16)
        caches, logits = forward(state, batch, caches, decode_only=decode_only)
        logits = np.asarray(logits)
        return caches, [logits[i] for i in idx]

    def fresh_caches():
        return init_caches(
            cfg, num_blocks=40, block_size=BS, num_slots=8, dtype=jnp.float32, fill=np.nan
        )

    return run, fresh_caches


def assert_close(got, want):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < RTOL, f"relative error {err:.2e}"


def test_whole_prompt_one_step(ckpt, runner):
    _, tokens, ref = ckpt
    run, fresh = runner
    n = 70
    caches, (out,) = run(
        [SeqChunk(tokens[:n], 0, range(1, 6), dst_slot=1, all_logits=True)], fresh()
    )
    assert not np.isnan(out).any()
    assert_close(out, ref[:n])
    # The MLA cache holds one latent per token (kv_lora_rank + rope dims), nothing per head.
    (latent,) = caches.kv[0]
    assert latent.shape == (40, BS, 16 + 8)
    assert not np.isnan(np.asarray(latent[1:5])).any()  # blocks 1..4 full, block 5 partly


def test_chunked_prefill_then_decode(ckpt, runner):
    _, tokens, ref = ckpt
    run, fresh = runner
    caches = fresh()
    blocks = list(range(3, 13))
    pos = 0
    for i, size in enumerate([5, 59, 64, 3]):  # chunks of different sizes, 131 tokens
        row = SeqChunk(
            tokens[pos : pos + size],
            pos,
            blocks,
            src_slot=0 if i == 0 else 2,
            dst_slot=2,
            all_logits=True,
        )
        caches, (out,) = run([row], caches)
        assert_close(out, ref[pos : pos + size])
        pos += size
    for _ in range(8):  # decode token by token through the absorbed MLA and the update ops
        caches, (out,) = run(
            [SeqChunk(tokens[pos : pos + 1], pos, blocks, src_slot=2, dst_slot=2)],
            caches,
            decode_only=True,
        )
        assert_close(out[0], ref[pos])
        pos += 1


def test_mixed_ragged_step(ckpt, runner):
    """One step: a decode of a cached sequence, a fresh 1-token prompt, and longer chunks."""
    path, tokens, ref = ckpt
    run, fresh = runner
    caches = fresh()
    caches, _ = run([SeqChunk(tokens[:40], 0, [1, 2, 3, 4], dst_slot=1)], caches)
    ref1 = hf_logits(path, tokens[:1])
    rows = [
        SeqChunk(tokens[40:41], 40, [1, 2, 3, 4], src_slot=1, dst_slot=1),  # decode, length 1
        SeqChunk(tokens[:1], 0, [5], dst_slot=2),  # a 1-token prompt
        SeqChunk(tokens[:65], 0, [6, 7, 8, 9, 10], dst_slot=3, all_logits=True),  # 65 tokens
        SeqChunk(tokens[:7], 0, [11], dst_slot=4, all_logits=True),  # 7 tokens
    ]
    caches, outs = run(rows, caches)
    assert_close(outs[0][0], ref[40])
    assert_close(outs[1][0], ref1[0])
    assert_close(np.stack(outs[2]), ref[:65])
    assert_close(np.stack(outs[3]), ref[:7])
    # The written running slots continue correctly in a decode-only step.
    caches, outs = run(
        [
            SeqChunk(tokens[41:42], 41, [1, 2, 3, 4], src_slot=1, dst_slot=1),
            SeqChunk(tokens[65:66], 65, [6, 7, 8, 9, 10], src_slot=3, dst_slot=3),
        ],
        caches,
        decode_only=True,
    )
    assert_close(outs[0][0], ref[41])
    assert_close(outs[1][0], ref[65])


@pytest.mark.parametrize("resume_at", [64, 128])
def test_resume_from_checkpoint(ckpt, runner, resume_at):
    """Checkpoints written inside one 150-token step resume to the same logits."""
    _, tokens, ref = ckpt
    run, fresh = runner
    caches = fresh()
    blocks = list(range(1, 11))
    caches, (straight,) = run(
        [SeqChunk(tokens, 0, blocks, dst_slot=1, ckpts=[(64, 2), (128, 3)], all_logits=True)],
        caches,
    )
    assert_close(straight, ref)
    # A second request shares the prefix blocks and reads the checkpoint as its source.
    shared = blocks[: resume_at // BS]
    own = list(range(20, 20 + (LONG - resume_at) // BS + 1))
    slot = {64: 2, 128: 3}[resume_at]
    row = SeqChunk(
        tokens[resume_at:], resume_at, shared + own, src_slot=slot, dst_slot=5, all_logits=True
    )
    caches, (resumed,) = run([row], caches)
    np.testing.assert_allclose(resumed, straight[resume_at:], rtol=0, atol=1e-4)
    assert_close(resumed, ref[resume_at:])
