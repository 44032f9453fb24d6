"""Ragged paged-attention batches for the kernel tests: cached context + this step's tokens.

Pages are handed out in random order; every page no sequence owns (the null block included)
and every slot past a sequence's context is NaN, so a kernel that reads one fails loudly. The
new tokens' K/V go into the cache through ``write_kv_reference``, as the attention layer does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.reference import write_kv_reference


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    args: tuple  # (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs)
    scale: float
    num_live_tokens: int


def attention_case(cached, new, *, hq=4, hkv=2, d=128, block_size=16, dtype=jnp.float32,
                   pad_tokens=3, pad_rows=1, seed=0) -> AttentionCase:  # fmt: skip
    """``cached[i]`` tokens already in the cache, ``new[i]`` written and attended this step."""
    rng = np.random.default_rng(seed)
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    blocks_per = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks_per) + 1  # a trailing 0 entry in every table
    num_blocks = sum(blocks_per) + 3  # + the null block and two pages nobody owns
    perm = rng.permutation(np.arange(1, num_blocks))
    rows = len(lens) + pad_rows
    tables = np.zeros((rows, max_blocks), np.int32)
    k_cache = np.full((num_blocks, block_size, hkv, d), np.nan, np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    k_new, v_new, slots = [], [], []
    used = 0
    for i, n in enumerate(lens):
        blocks = perm[used : used + blocks_per[i]]
        used += blocks_per[i]
        tables[i, : len(blocks)] = blocks
        kk, vv = rng.normal(size=(2, n, hkv, d)).astype(np.float32)
        for p in range(n):
            b, o = blocks[p // block_size], p % block_size
            if p < cached[i]:
                k_cache[b, o], v_cache[b, o] = kk[p], vv[p]
            else:
                slots.append(b * block_size + o)
        k_new.append(kk[cached[i] :])
        v_new.append(vv[cached[i] :])
    live = sum(new)
    slots += [0] * pad_tokens  # padding tokens go to the null block
    zeros = np.zeros((pad_tokens, hkv, d), np.float32)
    k_cache, v_cache = write_kv_reference(
        jnp.asarray(np.concatenate(k_new + [zeros]), dtype),
        jnp.asarray(np.concatenate(v_new + [zeros]), dtype),
        jnp.asarray(k_cache, dtype),
        jnp.asarray(v_cache, dtype),
        jnp.asarray(np.array(slots, np.int32)),
    )
    q = rng.normal(size=(live + pad_tokens, hq, d)).astype(np.float32)
    q[live:] = np.nan  # padding queries: their outputs must come back 0, not NaN
    qsl = np.concatenate([[0], np.cumsum(new), [live] * pad_rows]).astype(np.int32)
    seq_lens = np.array(lens + [0] * pad_rows, np.int32)
    args = (jnp.asarray(q, dtype), k_cache, v_cache, jnp.asarray(qsl), jnp.asarray(seq_lens),
            jnp.asarray(tables), jnp.int32(len(lens)))  # fmt: skip
    return AttentionCase(args=args, scale=d**-0.5, num_live_tokens=live)


def check_against_reference(case: AttentionCase, got: jax.Array, want: jax.Array, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    n = case.num_live_tokens
    assert not np.isnan(got).any(), "NaN in the output: a poisoned page or padding was read"
    assert (got[n:] == 0).all(), "padding tokens must come back as zeros"
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    err = np.abs(got[:n] - want[:n]).max() / np.abs(want[:n]).max()
    assert err < tol, f"relative error {err:.2e} >= {tol}"
