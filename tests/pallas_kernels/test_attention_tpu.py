"""The Mosaic TPU ragged paged attention vs the reference, run by the TPU interpreter on CPU.

Cases cover decode-only, prefill-only and mixed batches, block sizes 16/32/64/128, head dims
128 and 256, Qwen3-Next's GQA group of 8, several KV blocks per sequence (the double-buffered
page DMAs), several query tiles per prefill chunk, NaN-poisoned unused pages and padding. A last
test lowers the kernel for ``tpu`` (Pallas -> Mosaic) at Qwen3-Next-80B shapes without a TPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention import tpu
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.pallas_kernels.attention_cases import attention_case, check_against_reference

CASES = [
    # (kind, cached, new, hq, hkv, d, block_size, dtype)
    ("decode", [37, 0, 70], [1, 1, 1], 4, 2, 128, 16, jnp.float32),
    ("prefill", [0, 40], [19, 6], 4, 2, 256, 32, jnp.float32),
    ("mixed", [65, 3, 0], [1, 12, 1], 16, 2, 128, 64, jnp.float32),
    ("mixed", [130, 0, 20], [1, 9, 1], 4, 2, 256, 128, jnp.bfloat16),
]
IDS = [
    f"{kind}_{hq=}_{hkv=}_{d=}_{bs=}_{jnp.dtype(dt).name}"
    for kind, _, _, hq, hkv, d, bs, dt in CASES
]


@pytest.mark.parametrize("kind,cached,new,hq,hkv,d,bs,dtype", CASES, ids=IDS)
def test_matches_reference(kind, cached, new, hq, hkv, d, bs, dtype):
    case = attention_case(cached, new, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype,
                          seed=bs + d)  # fmt: skip
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=case.scale))(
        *case.args
    )
    kernel = functools.partial(
        tpu.ragged_paged_attention, scale=case.scale, interpret=pltpu.InterpretParams(),
        block_q=4, kv_block_tokens=2 * bs,  # several tiles per chunk, several KV blocks
    )  # fmt: skip
    got = jax.jit(kernel)(*case.args)
    check_against_reference(case, got, want, dtype)


def test_rejects_bad_arguments():
    case = attention_case([3], [1], d=128)
    with pytest.raises(ValueError, match="block_q=3 must be a power of two"):
        tpu.ragged_paged_attention(*case.args, scale=1.0, block_q=3)
    q, k, v, *rest = case.args
    with pytest.raises(ValueError, match="num_q_heads=3 must be divisible by num_kv_heads=2"):
        tpu.ragged_paged_attention(q[:, :3], k, v, *rest, scale=1.0)
    with pytest.raises(ValueError, match="v_cache .* must match k_cache"):
        tpu.ragged_paged_attention(q, k, v[:, :8], *rest, scale=1.0)


@pytest.mark.parametrize("d,hq,hkv,bs", [(256, 16, 2, 16), (128, 32, 4, 128)])
def test_lowers_for_tpu(d, hq, hkv, bs):
    sd = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    t, s, max_blocks = 64, 8, 32
    args = (sd((t, hq, d), bf), sd((100, bs, hkv, d), bf), sd((100, bs, hkv, d), bf),
            sd((s + 1,), i32), sd((s,), i32), sd((s, max_blocks), i32), sd((), i32))  # fmt: skip
    tpu_v6e = jax.sharding.AbstractDevice("TPU v6e", 1, "tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=tpu_v6e)):
        traced = jax.jit(functools.partial(tpu.ragged_paged_attention, scale=d**-0.5)).trace(*args)
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
