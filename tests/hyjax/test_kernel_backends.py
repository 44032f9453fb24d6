"""The tiny Qwen3-Next gives the same logits and states with the Pallas kernels (run by the TPU
interpreter on CPU) as with the reference ops, over prefill, checkpoint resume and decode steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from configs import qwen3_next_tiny
from hyjax.cache import init_caches
from hyjax.models.qwen3_next import Qwen3NextForCausalLM
from hyjax.ops import (
    BACKENDS,
    GPU_DECODE_ATTENTION,
    GRID,
    REFERENCE,
    Ops,
    backend_ops,
    get_ops,
    resolve_backend,
)
from hyjax.testing import SeqChunk, make_batch
from pallas_kernels.attention import gpu as attention_gpu
from pallas_kernels.attention import tpu as attention_tpu
from pallas_kernels.conv1d import gpu as conv1d_gpu
from tests.pallas_kernels.ragged_cases import assert_close

BS = 16
RTOL = 1e-4


@pytest.fixture(scope="module")
def model():
    # One layer of each kind: the interpreted kernels' compile time grows with every layer.
    cfg = qwen3_next_tiny(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          mlp_only_layers=[])  # fmt: skip
    graphdef, state = nnx.split(Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    return cfg, graphdef, state


def _run_steps(model, backend):
    """Prefill with checkpoints, a ragged step resuming from one, then decode; all outputs."""
    cfg, graphdef, state = model
    ops = get_ops(backend)

    @functools.partial(jax.jit, static_argnames="decode_only")
    def forward(state, batch, caches, decode_only=False):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    def run(rows, caches, num_tokens, num_seqs, decode_only=False):
        batch, idx = make_batch(
            rows, block_size=BS, num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=12,
            num_logits=136,
        )  # fmt: skip
        caches, logits = forward(state, batch, caches, decode_only=decode_only)
        logits = np.asarray(logits)
        return caches, [logits[i] for i in idx]

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, size=160).tolist()
    caches = init_caches(cfg, num_blocks=48, block_size=BS, num_slots=8, dtype=jnp.float32,
                         fill=np.nan)  # fmt: skip
    outs = []
    caches, o = run(
        [SeqChunk(tokens[:130], 0, range(1, 10), dst_slot=1, ckpts=[(64, 2), (128, 3)],
                  all_logits=True)],
        caches, num_tokens=136, num_seqs=4,
    )  # fmt: skip
    outs += o
    caches, o = run(
        [
            SeqChunk(tokens[130:131], 130, range(1, 10), src_slot=1, dst_slot=1),  # decode row
            SeqChunk(tokens[64:100], 64, [*range(1, 5), 20, 21, 22], src_slot=2, dst_slot=4,
                     all_logits=True),  # resumes from the checkpoint at 64
            SeqChunk(tokens[:3], 0, [30], dst_slot=5, all_logits=True),  # fresh, shorter than K
        ],
        caches, num_tokens=136, num_seqs=4,  # the first step's shapes: no new compile
    )  # fmt: skip
    outs += o
    for t in range(131, 134):
        caches, o = run(
            [
                SeqChunk(tokens[t : t + 1], t, range(1, 10), src_slot=1, dst_slot=1),
                SeqChunk(tokens[t - 31 : t - 30], t - 31, [*range(1, 5), 20, 21, 22],
                         src_slot=4, dst_slot=4, ckpts=[(1, 6)] if t == 132 else []),
            ],
            caches, num_tokens=4, num_seqs=4, decode_only=True,
        )  # fmt: skip
        outs += o
    return outs, caches


def test_interpret_backend_matches_reference(model):
    want, want_caches = _run_steps(model, "reference")
    got, got_caches = _run_steps(model, "interpret")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        assert not np.isnan(g).any(), f"output {i} has NaN"
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < RTOL, f"output {i}: relative error {err:.2e}"
    for name in ("conv", "ssm"):
        for g, w in zip(getattr(got_caches, name), getattr(want_caches, name), strict=True):
            assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_backend_grid():
    """Each backend runs one column of the grid, its kernels compiled or interpreted; the
    platform picks ``pallas``'s column once, when the ops are built."""
    assert set(BACKENDS) == {"reference", "interpret", "interpret-gpu", "pallas"}
    assert set(GRID) == set(Ops.__dataclass_fields__) - {"matmul_precision"}
    # the parity test above runs the attention kernel, not the reference op twice
    interpret = backend_ops("interpret", "cpu")
    assert interpret.paged_attention.func is attention_tpu.ragged_paged_attention
    assert interpret.paged_attention_decode.func is attention_tpu.ragged_paged_attention
    assert isinstance(interpret.paged_attention.keywords["interpret"], pltpu.InterpretParams)
    # the GPU column interpreted on CPU, as tests/hyjax/test_gpu_kernels_in_model.py runs it
    gpu_interpret = backend_ops("interpret-gpu", "cpu")
    assert gpu_interpret.paged_attention.func is attention_gpu.ragged_paged_attention
    assert gpu_interpret.paged_attention.keywords == {"interpret": True}
    # the prefill convs' kernels (measured faster than XLA's packing around the plain kernel)
    assert gpu_interpret.conv1d_prefill_qkvz.func is conv1d_gpu.causal_conv1d_prefill_qkvz
    assert gpu_interpret.conv1d_prefill_split.func is conv1d_gpu.causal_conv1d_prefill_split
    assert gpu_interpret.conv1d_update is REFERENCE.conv1d_update  # no GPU kernel: XLA's
    # decode-only buckets on NVIDIA: the kernel's one-launch variant (its own test lowers it)
    assert GPU_DECODE_ATTENTION.func is attention_gpu.ragged_paged_attention
    assert GPU_DECODE_ATTENTION.keywords == {"decode_only": True}
    for platform in ("cuda", "rocm"):
        assert backend_ops("pallas", platform).paged_attention_decode is GPU_DECODE_ATTENTION
    assert backend_ops("pallas", "tpu").paged_attention is attention_tpu.ragged_paged_attention
    assert backend_ops("pallas", "tpu").moe_experts is REFERENCE.moe_experts  # no TPU kernel
    assert backend_ops("pallas", "cpu") == REFERENCE  # no kernels for the host
    assert backend_ops("pallas", "tpu") is backend_ops("pallas", "tpu")  # built once
    if jax.default_backend() == "cpu":
        assert resolve_backend("auto") == "reference"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve_backend("cuda-graphs")


@pytest.mark.parametrize(
    "platform,want",
    [("tpu", "pallas"), ("cuda", "pallas"), ("rocm", "reference"), ("cpu", "reference")],
)
def test_auto_backend_by_platform(monkeypatch, platform, want):
    import hyjax.ops

    monkeypatch.setattr(hyjax.ops, "accelerator_platform", lambda: platform)
    assert resolve_backend("auto") == want
    assert resolve_backend("reference") == "reference"  # an explicit choice is kept
