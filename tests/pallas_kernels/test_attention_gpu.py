"""The Triton-lowered GPU ragged paged attention vs the reference, in Pallas interpret mode.

Interpret mode checks the indexing (the short/long work lists, page gathers, split-KV merge,
the scatter back to tokens); a last test lowers the kernel to Triton for CUDA at
Qwen3-Next-80B shapes (no GPU needed). Compiling and timing it on a GPU is
``benchmarks/attention_kernels.py``.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention import gpu
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.pallas_kernels.attention_cases import attention_case, check_against_reference

CASES = [
    # (kind, cached, new, hq, hkv, d, block_size, dtype, target_programs)
    ("decode", [40, 0, 9], [1, 1, 2], 16, 2, 128, 16, jnp.float32, 8),  # one split per row
    ("mixed", [33, 5, 0], [1, 21, 1], 4, 2, 256, 32, jnp.bfloat16, 64),  # split-KV merges
    ("one_row", [250], [1], 8, 1, 128, 16, jnp.float32, 64),  # 32 splits of 16 blocks, 16 empty
]
IDS = [
    f"{kind}_{hq=}_{hkv=}_{d=}_{bs=}_{jnp.dtype(dt).name}_{tp=}"
    for kind, _, _, hq, hkv, d, bs, dt, tp in CASES
]


@pytest.mark.parametrize("kind,cached,new,hq,hkv,d,bs,dtype,tp", CASES, ids=IDS)
def test_matches_reference(kind, cached, new, hq, hkv, d, bs, dtype, tp):
    case = attention_case(cached, new, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype,
                          seed=bs + d)  # fmt: skip
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=case.scale))(
        *case.args
    )
    kernel = functools.partial(
        gpu.ragged_paged_attention,
        scale=case.scale,
        interpret=True,
        block_k_decode=16,
        block_k_prefill=16,
        rows_prefill=16,
        target_programs=tp,
    )  # small blocks and a few splits: several KV blocks, tiles and splits per row
    got = jax.jit(kernel)(*case.args)
    check_against_reference(case, got, want, dtype)


def test_decode_only_leaves_out_the_prefill_launch():
    """Rows of at most 16 // Gp tokens: one Triton launch, same outputs as the reference."""
    case = attention_case([40, 0, 9], [1, 1, 2], hq=16, hkv=2, d=128, block_size=16, seed=5)
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=case.scale))(
        *case.args
    )
    kernel = functools.partial(gpu.ragged_paged_attention, scale=case.scale, block_k_decode=16,
                               target_programs=16, decode_only=True)  # fmt: skip
    got = jax.jit(functools.partial(kernel, interpret=True))(*case.args)
    check_against_reference(case, got, want, jnp.float32)
    text = jax.jit(kernel).trace(*case.args).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention_short" in text
    assert "ragged_paged_attention_long" not in text


def test_rejects_non_power_of_two_head_dim():
    case = attention_case([3], [1], d=96)
    with pytest.raises(ValueError, match="head_dim=96 must be a power of two"):
        gpu.ragged_paged_attention(*case.args, scale=1.0)


def test_rejects_caches_past_32_bit_offsets():
    sd = jax.ShapeDtypeStruct
    args = (sd((4, 16, 256), jnp.bfloat16), sd((1 << 16, 64, 2, 256), jnp.bfloat16),
            sd((1 << 16, 64, 2, 256), jnp.bfloat16), sd((3,), jnp.int32), sd((2,), jnp.int32),
            sd((2, 8), jnp.int32), sd((), jnp.int32))  # fmt: skip
    with pytest.raises(ValueError, match="2\\*\\*31 elements"):
        jax.eval_shape(functools.partial(gpu.ragged_paged_attention, scale=1.0), *args)


def test_lowers_to_triton_at_80b_shapes():
    sd = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    t, s, max_blocks, d = 64, 8, 32, 256
    args = (sd((t, 16, d), bf), sd((100, 16, 2, d), bf), sd((100, 16, 2, d), bf),
            sd((s + 1,), i32), sd((s,), i32), sd((s, max_blocks), i32), sd((), i32))  # fmt: skip
    fn = functools.partial(gpu.ragged_paged_attention, scale=d**-0.5)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    # each trip of an XLA while loop on GPU is a host round trip: none around the kernels
    assert "stablehlo.while" not in text
