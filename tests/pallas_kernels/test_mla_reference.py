"""The reference MLA ops on the paged latent cache against a float64 oracle.

Pages nobody wrote hold NaN, so a read past a sequence's length, or of another sequence's
page, shows up as NaN. Prefill (decompressed K/V) and decode (absorbed weights) are checked
against the same oracle, which decompresses every key and value explicitly.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.mla_reference import (
    mla_decode_reference,
    mla_prefill_reference,
    write_latent_reference,
)
from tests.pallas_kernels.ragged_cases import assert_close

H, L, R, DN, DV, NB = 3, 10, 4, 8, 6, 24
SCALE = (DN + R) ** -0.5


def mla_sequence(q, latents, w, num_cached):
    """q [n, H, Dn+R] new tokens; latents [ctx, L+R] all positions; w [L, H, Dn+Dv]."""
    c, k_rope = latents[:, :L], latents[:, L:]
    kv = np.einsum("cl,lhe->che", c, w)
    k = np.concatenate([kv[..., :DN], np.broadcast_to(k_rope[:, None], (len(c), H, R))], -1)
    v = kv[..., DN:]
    out = []
    for i in range(len(q)):
        n = num_cached + i + 1
        s = np.einsum("hd,chd->hc", q[i], k[:n]) * SCALE
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hc,chd->hd", p, v[:n]))
    return np.array(out)


def _paged(rng, cached, new, block_size, max_blocks):
    """Caches with the cached part written and the rest NaN; the new tokens' latents."""
    cache = np.full((NB, block_size, L + R), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, NB))
    tables = np.zeros((len(cached) + 2, max_blocks), np.int32)  # two padding rows
    latents, slot_mapping, used = [], [], 0
    for i, (c, n) in enumerate(zip(cached, new)):
        blocks = perm[used : used + -(-(c + n) // block_size)]
        used += len(blocks)
        tables[i, : len(blocks)] = blocks
        lat = rng.normal(size=(c + n, L + R)).astype(np.float32)
        latents.append(lat)
        for p in range(c + n):
            where = blocks[p // block_size] * block_size + p % block_size
            if p < c:
                cache[where // block_size, where % block_size] = lat[p]
            else:
                slot_mapping.append(where)
    return cache, tables, latents, slot_mapping


def _new_latents(latents, cached, pad):
    """This step's latents, row after row, then ``pad`` padding tokens."""
    return np.concatenate([lat[c:] for lat, c in zip(latents, cached)] + [np.zeros((pad, L + R))])


@pytest.mark.parametrize("block_size", [16])
def test_mla_prefill_on_paged_latents(block_size):
    rng = np.random.default_rng(block_size)
    cached, new = [0, 21, 7, 30], [5, 1, 1, 12]
    cache, tables, latents, slot_mapping = _paged(rng, cached, new, block_size, max_blocks=6)
    w = rng.normal(size=(L, H, DN + DV)).astype(np.float32)
    pad = 3
    new_lat = _new_latents(latents, cached, pad)
    slot_mapping = np.array(slot_mapping + [0] * pad, np.int32)  # padding -> the null block
    q_rows = [rng.normal(size=(n, H, DN + R)).astype(np.float32) for n in new]
    q = np.concatenate(q_rows + [np.zeros((pad, H, DN + R), np.float32)])
    qsl = np.concatenate([[0], np.cumsum(new), [sum(new)] * 2]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in zip(cached, new)] + [0, 0], np.int32)
    written = write_latent_reference(
        jnp.asarray(new_lat, jnp.float32), jnp.asarray(cache), jnp.asarray(slot_mapping)
    )
    out = mla_prefill_reference(
        jnp.asarray(q),
        written,
        jnp.asarray(w),
        *(jnp.asarray(a) for a in (qsl, seq_lens, tables)),
        jnp.int32(4),
        nope_dim=DN,
        scale=SCALE,
    )
    out = np.asarray(out)
    for i in range(4):
        want = mla_sequence(q_rows[i].astype(np.float64), latents[i], w, cached[i])
        assert_close(out[qsl[i] : qsl[i + 1]], want, rtol=1e-5, atol=1e-5)
    assert np.all(out[qsl[4] :] == 0)
    # Only the new tokens' positions (and the null block, for padding) were written.
    changed = ~np.isclose(np.asarray(written), cache, equal_nan=True).all(-1)
    assert changed.sum() == sum(new) + 1 and changed[0].any()


def test_mla_decode_absorbed_matches_oracle():
    rng = np.random.default_rng(5)
    block_size = 8
    cached = [0, 20, 7, 33]
    new = [1, 1, 1, 1]
    cache, tables, latents, slot_mapping = _paged(rng, cached, new, block_size, max_blocks=6)
    w = rng.normal(size=(L, H, DN + DV)).astype(np.float32)
    rows = len(cached) + 2
    new_lat = _new_latents(latents, cached, 2)
    slot_mapping = np.array(slot_mapping + [0, 0], np.int32)
    q = rng.normal(size=(rows, H, DN + R)).astype(np.float32)
    seq_lens = np.array([c + 1 for c in cached] + [0, 0], np.int32)
    written = write_latent_reference(
        jnp.asarray(new_lat, jnp.float32), jnp.asarray(cache), jnp.asarray(slot_mapping)
    )
    attn = dict(nope_dim=DN, scale=SCALE)
    out = mla_decode_reference(
        jnp.asarray(q), written, jnp.asarray(w), jnp.asarray(seq_lens), jnp.asarray(tables),
        jnp.int32(4), **attn,
    )  # fmt: skip
    out = np.asarray(out)
    for i in range(4):
        want = mla_sequence(q[i : i + 1].astype(np.float64), latents[i], w, cached[i])
        assert_close(out[i], want[0], rtol=1e-5, atol=1e-5)
    assert np.all(out[4:] == 0) and not np.isnan(out).any()
    # The same step as a prefill of one token per row gives the same outputs.
    qsl = np.arange(rows + 1, dtype=np.int32).clip(max=4)
    pre = mla_prefill_reference(
        jnp.asarray(q), written, jnp.asarray(w), jnp.asarray(qsl), jnp.asarray(seq_lens),
        jnp.asarray(tables), jnp.int32(4), **attn,
    )  # fmt: skip
    assert_close(out, np.asarray(pre), rtol=1e-5, atol=1e-5)


def test_mla_bad_widths_name_the_argument():
    q = jnp.zeros((2, H, DN + R))
    cache = jnp.zeros((4, 8, L + R + 1))
    w = jnp.zeros((L, H, DN + DV))
    args = (jnp.array([1, 1], jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.int32(2))
    with pytest.raises(ValueError, match="latent_cache width 15 must be kv_lora_rank 10"):
        mla_decode_reference(q, cache, w, *args, nope_dim=DN, scale=1.0)
    with pytest.raises(ValueError, match="w_kv_b"):
        mla_decode_reference(q, cache[..., :-1], w[:, :2], *args, nope_dim=DN, scale=1.0)
