"""The tiny Qwen3-Next with the NVIDIA kernels (Pallas' generic interpreter on CPU) gives the
reference logits and states: the GPU prefill (both launch plans) and the fused conv + delta-rule
decode, wired through the model exactly as ``--kernel-backend pallas`` runs them on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import qwen3_next_tiny
from hyjax.cache import init_caches
from hyjax.models.qwen3_next import Qwen3NextForCausalLM
from hyjax.ops import REFERENCE
from hyjax.testing import SeqChunk, make_batch
from pallas_kernels.gdn import fused_decode
from pallas_kernels.gdn import gpu as gdn_gpu
from tests.pallas_kernels.ragged_cases import assert_close

BS = 16


def _gpu_ops(three_launches):
    return dataclasses.replace(
        REFERENCE,
        gdn_prefill=functools.partial(
            gdn_gpu.gdn_prefill, three_launches=three_launches, interpret=True
        ),
        conv_gdn_decode=functools.partial(fused_decode.conv_gdn_decode, min_rows=0, interpret=True),
    )


def _run(state, graphdef, cfg, ops):
    @functools.partial(jax.jit, static_argnames="decode_only")
    def forward(state, batch, caches, decode_only=False):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    rng = np.random.default_rng(1)
    tokens = rng.integers(3, cfg.vocab_size, size=80).tolist()
    caches = init_caches(cfg, num_blocks=16, block_size=BS, num_slots=6, dtype=jnp.float32,
                         fill=np.nan)  # fmt: skip
    outs = []
    rows = [
        SeqChunk(tokens[:70], 0, range(1, 6), dst_slot=1, ckpts=[(64, 2)]),
        SeqChunk(tokens[70:75], 0, [7], dst_slot=3),
    ]
    batch, idx = make_batch(rows, block_size=BS, num_tokens=80, num_seqs=4, max_blocks=6)
    caches, logits = forward(state, batch, caches)
    outs += [np.asarray(logits)[i] for i in idx]
    for t in range(2):  # decode: row 0 in place, row 1 from the checkpoint at 64 into slot 4
        rows = [
            SeqChunk(tokens[70 + t : 71 + t], 70 + t, range(1, 6), src_slot=1, dst_slot=1),
            SeqChunk(tokens[64 + t : 65 + t], 64 + t, range(1, 6), src_slot=2 if t == 0 else 4,
                     dst_slot=4),
        ]  # fmt: skip
        batch, idx = make_batch(rows, block_size=BS, num_tokens=2, num_seqs=2, max_blocks=6)
        caches, logits = forward(state, batch, caches, decode_only=True)
        outs += [np.asarray(logits)[i] for i in idx]
    return outs, caches


def test_gpu_kernels_match_reference_in_the_model():
    """The three-launch prefill (what short prompts get; the two-launch plan is covered by
    tests/pallas_kernels/test_gdn_gpu.py) and the fused decode."""
    cfg = qwen3_next_tiny()
    graphdef, state = nnx.split(Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    want, want_caches = _run(state, graphdef, cfg, REFERENCE)
    got, got_caches = _run(state, graphdef, cfg, _gpu_ops(three_launches=True))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not np.isnan(g).any(), f"output {i} has NaN"
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-4, f"output {i}: relative error {err:.2e}"
    for g, w in zip(got_caches.ssm, want_caches.ssm, strict=True):
        assert_close(np.asarray(g)[1:5], np.asarray(w)[1:5], rtol=1e-4, atol=1e-4)
