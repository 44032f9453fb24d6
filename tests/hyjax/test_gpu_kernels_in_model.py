"""The tiny Qwen3-Next and Kimi-Linear with the NVIDIA kernels (Pallas' generic interpreter on
CPU: the ``interpret-gpu`` backend, the op table's GPU column) give the reference logits and
states: the GDN / KDA prefill, the conv update + delta-rule decodes, paged attention and MLA,
wired through the model exactly as ``--kernel-backend pallas`` runs them on a GPU."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import kimi_linear_tiny, qwen3_next_tiny
from hyjax.cache import init_caches
from hyjax.models.kimi_linear import KimiLinearForCausalLM
from hyjax.models.qwen3_next import Qwen3NextForCausalLM
from hyjax.ops import REFERENCE, ops_for_model
from hyjax.testing import SeqChunk, make_batch
from pallas_kernels.attention import gpu as attention_gpu
from tests.pallas_kernels.ragged_cases import abstract_slots, assert_close
from tests.pallas_kernels.test_gdn_fused_decode import _case as gdn_case
from tests.pallas_kernels.test_kda_fused_decode import _case as kda_case

BS = 16


def _gpu_ops(cfg, three_launches):
    """The ``interpret-gpu`` ops for ``cfg`` (a kernel that cannot take its shapes is the
    reference op, as on a GPU)."""
    ops = ops_for_model("interpret-gpu", cfg, jnp.float32)
    return dataclasses.replace(
        ops, gdn_prefill=functools.partial(ops.gdn_prefill, three_launches=three_launches)
    )


def _gpu_kernels(op, *args, **kwargs) -> list[str]:
    """The GPU kernels ``op`` runs on these arguments, in order (its jaxpr's ``pallas_call``
    names)."""
    text = str(jax.make_jaxpr(functools.partial(op, **kwargs))(*args))
    return [name for name in re.findall(r"name=(\w+)", text) if name.endswith("_gpu")]


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


def _assert_matches(got, want, got_caches, want_caches) -> None:
    """Every logits row within 1e-4 of the reference's (relative), and the written slots."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not np.isnan(g).any(), f"output {i} has NaN"
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-4, f"output {i}: relative error {err:.2e}"
    for name in ("conv", "ssm"):
        for g, w in zip(getattr(got_caches, name), getattr(want_caches, name), strict=True):
            assert_close(np.asarray(g)[1:5], np.asarray(w)[1:5], rtol=1e-4, atol=1e-4)


def test_gpu_kernels_match_reference_in_the_model():
    """The three-launch prefill (the default two-launch one is covered by
    tests/pallas_kernels/test_gdn_gpu.py, and in a model by KDA's test below: one serial launch
    for both) and the decode: the conv update kernel, then the
    GDN decode kernel."""
    cfg = qwen3_next_tiny()
    graphdef, state = nnx.split(Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    want, want_caches = _run(state, graphdef, cfg, REFERENCE)
    ops = _gpu_ops(cfg, three_launches=True)
    assert ops.paged_attention.func is attention_gpu.ragged_paged_attention  # the kernel runs
    case = gdn_case(np.random.default_rng(0), hk=1, hv=2, dk=16, dv=16, kernel=4, dtype=jnp.float32)
    kernels = _gpu_kernels(ops.conv_gdn_decode, *case, num_k_heads=1)
    assert kernels == ["causal_conv1d_update_gpu", "gdn_decode_gpu"]
    # The prefill conv reads q | k | v in the projection's output: no packing around it.
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_dim
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    qkvz = sd((50, 2 * hk * dk + 2 * hv * dv), f32)
    conv_args = (qkvz, sd((c, 4), f32), sd((6, 3, c), f32), sd((3,), jnp.int32))
    conv_args += (abstract_slots(2, 2),)
    conv = functools.partial(ops.conv1d_prefill_qkvz, num_k_heads=hk, head_dims=(dk, dv))
    assert _gpu_kernels(conv, *conv_args) == ["causal_conv1d_prefill_gpu"]
    assert "concatenate" not in str(jax.make_jaxpr(conv)(*conv_args))
    got, got_caches = _run(state, graphdef, cfg, ops)
    _assert_matches(got, want, got_caches, want_caches)


def test_kimi_gpu_kernels_match_reference_in_the_model():
    """KDA prefill, the conv update + KDA decode kernels (row 0 in place, row 1 from a
    checkpoint into another slot) and the MLA kernels."""
    cfg = kimi_linear_tiny(moe_intermediate_size=32)
    model = KimiLinearForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    want, want_caches = _run(state, graphdef, cfg, REFERENCE)
    ops = ops_for_model("interpret-gpu", cfg, jnp.float32)
    case = kda_case(np.random.default_rng(0), h=2, dk=16, dv=16, kernel=4, dtype=jnp.float32)
    assert _gpu_kernels(ops.conv_kda_decode, *case) == [
        "causal_conv1d_update_gpu",
        "kda_decode_gpu",
    ]
    # The prefill: the diagonal blocks' launch and the intra launch, then the serial launch
    # shared with GDN (no per-chunk state scratch, nothing long enough to need another path).
    t, h, d = 100, 2, 16
    sd = jax.ShapeDtypeStruct
    acts = [sd((t, h, d), jnp.float32)] * 4 + [sd((t, h), jnp.float32)]
    gates = [sd((h,), jnp.float32), sd((h, d), jnp.float32)]
    prefill_args = (*acts, *gates, sd((4, h, d, d), jnp.float32), sd((3,), jnp.int32))
    assert _gpu_kernels(ops.kda_prefill, *prefill_args, abstract_slots(2, 2)) == [
        "kda_prefill_diag_gpu",
        "kda_prefill_intra_gpu",
        "kda_prefill_serial_gpu",
    ]
    # The prefill conv reads q, k, v apart and writes them apart: no packing around it.
    p = cfg.linear_num_heads * cfg.linear_head_dim
    qkv = tuple(sd((50, p), jnp.float32) for _ in "qkv")
    conv_args = (qkv, sd((3 * p, 4), jnp.float32), sd((6, 3, 3 * p), jnp.float32))
    conv_args += (sd((3,), jnp.int32), abstract_slots(2, 2))
    assert _gpu_kernels(ops.conv1d_prefill_split, *conv_args) == ["causal_conv1d_prefill_gpu"]
    assert "concatenate" not in str(jax.make_jaxpr(ops.conv1d_prefill_split)(*conv_args))
    got, got_caches = _run(state, graphdef, cfg, ops)
    _assert_matches(got, want, got_caches, want_caches)
