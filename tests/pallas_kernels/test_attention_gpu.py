"""The Triton-lowered GPU ragged paged attention vs the reference, in Pallas interpret mode.

Interpret mode checks the indexing (the short/long work lists, page gathers, split-KV merge,
the scatter back to tokens); a last test lowers the kernel to Triton for CUDA at
Qwen3-Next-80B shapes (no GPU needed). Compiling and timing it on a GPU is
``benchmarks/attention_kernels.py``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import gpu
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.pallas_kernels.attention_cases import attention_case, check_against_reference
from tests.pallas_kernels.ragged_cases import assert_close

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


DECODE_ONLY_CASES = [
    # (cached, new, hq, hkv, block_size, pad_tokens, target_programs): splits = 1 or > 1
    ([40, 0, 9], [1, 1, 1], 16, 2, 16, 3, 1),  # one split: the kernel writes the output
    ([40, 0, 9], [1, 1, 1], 16, 2, 16, 3, 64),  # 8 splits and the merge kernel
    ([70, 5], [2, 2], 8, 2, 32, 9, 1),  # two tokens per row; 9 padding tokens over 3 rows
    ([70, 5], [2, 2], 8, 2, 32, 0, 32),  # ... split, no padding token
    ([250], [1], 8, 1, 16, 1, 64),  # one row: 32 splits of one block, 16 of them empty
]
DECODE_ONLY_IDS = [
    f"{new=}_{hq=}_{hkv=}_{bs=}_{pad=}_{tp=}".replace(" ", "")
    for _, new, hq, hkv, bs, pad, tp in DECODE_ONLY_CASES
]


@pytest.mark.parametrize("cached,new,hq,hkv,bs,pad,tp", DECODE_ONLY_CASES, ids=DECODE_ONLY_IDS)
def test_decode_only_matches_reference(cached, new, hq, hkv, bs, pad, tp):
    """Row i is tile i; padding tokens and rows (NaN queries, num_seqs < S) come back 0."""
    case = attention_case(cached, new, hq=hq, hkv=hkv, d=128, block_size=bs, pad_tokens=pad,
                          pad_rows=2, seed=len(new) + tp)  # fmt: skip
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=case.scale))(
        *case.args
    )
    kernel = functools.partial(gpu.ragged_paged_attention, scale=case.scale, block_k_decode=16,
                               target_programs=tp, decode_only=True, interpret=True)  # fmt: skip
    got = jax.jit(kernel)(*case.args)
    check_against_reference(case, got, want, jnp.float32)


def test_decode_only_zeroes_a_row_longer_than_a_tile():
    """A row past ``16 // Gp`` tokens breaks the caller's promise: zeros, never stale memory."""
    case = attention_case([4, 9], [1, 3], hq=16, hkv=2, d=128, block_size=16, seed=3)
    want = jax.jit(functools.partial(ragged_paged_attention_reference, scale=case.scale))(
        *case.args
    )
    kernel = functools.partial(gpu.ragged_paged_attention, scale=case.scale, block_k_decode=16,
                               decode_only=True, interpret=True)  # fmt: skip
    got = np.asarray(jax.jit(kernel)(*case.args))
    assert_close(got[0], np.asarray(want[0]), rtol=1e-4, atol=1e-4)
    assert (got[1:] == 0).all()


@pytest.mark.parametrize("tp", [1, 256])
def test_decode_only_is_one_or_two_kernels_and_nothing_else(tp):
    """Only free reshapes around the kernel (and its merge when split): no regroup, work list
    or XLA merge. The lowering for CUDA runs without a GPU."""
    sd = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    t, s, max_blocks, d = 8, 8, 64, 256
    args = (sd((t, 16, d), bf), sd((300, 64, 2, d), bf), sd((300, 64, 2, d), bf),
            sd((s + 1,), i32), sd((s,), i32), sd((s, max_blocks), i32), sd((), i32))  # fmt: skip
    fn = functools.partial(gpu.ragged_paged_attention, scale=d**-0.5, target_programs=tp,
                           decode_only=True)  # fmt: skip
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text)) - {"output_operand_alias"}
    assert ops == {"custom_call", "reshape"}, ops
    assert "ragged_paged_attention_long" not in text
    assert ("ragged_paged_attention_decode_merge" in text) == (tp > 1)


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
