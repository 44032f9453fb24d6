"""The reference ops on ragged batches against float64 oracles.

Unused slots and pages are poisoned with NaN: a stray read shows up as NaN, a stray write
as a changed slot.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from tests.pallas_kernels.oracles import attention_sequence, conv_sequence, gdn_sequence
from tests.pallas_kernels.ragged_cases import assert_close, state_slots

HK, HV, DK, DV, NUM_SLOTS, M = 2, 6, 8, 4, 12, 3


def _ragged(lens, extra_tokens=5, extra_rows=2):
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(qsl[-1])
    qsl = np.concatenate([qsl, np.full(extra_rows, total, np.int32)])
    return qsl, total + extra_tokens, len(lens) + extra_rows


CASES = {
    "lens=1,63,64,65,130": [1, 63, 64, 65, 130],
    "lens=5": [5],
    "lens=64,1,1": [64, 1, 1],
}


@pytest.mark.parametrize("lens", CASES.values(), ids=CASES.keys())
def test_gdn_prefill(lens):
    rng = np.random.default_rng(len(lens))
    qsl, t, s = _ragged(lens)
    q, k = rng.normal(size=(2, t, HK, DK))
    v = rng.normal(size=(t, HV, DV))
    a, b = rng.normal(size=(2, t, HV))
    A_log, dt_bias = rng.normal(size=(2, HV))
    pool = np.full((NUM_SLOTS, HV, DV, DK), np.nan)
    n = len(lens)
    src = np.zeros(s, np.int32)
    dst = np.zeros(s, np.int32)
    ck_off = np.zeros((s, M), np.int32)
    ck_slot = np.zeros((s, M), np.int32)
    src[:n] = [1 + i if i % 2 else 0 for i in range(n)]  # odd rows read a slot, even rows zero
    for i in range(n):
        if src[i]:
            pool[src[i]] = rng.normal(size=(HV, DV, DK))
    dst[:n] = [6 + i if i != 1 else 0 for i in range(n)]  # row 1 writes nothing
    writes = {}
    for i, length in enumerate(lens):
        offs = sorted({o for o in (1, 64, length // 2, length) if 1 <= o <= length})[:M]
        for j, o in enumerate(offs[:2]):
            ck_off[i, j], ck_slot[i, j] = o, 12 + 2 * i + j
    pool = np.concatenate([pool, np.full((12, HV, DV, DK), np.nan)])  # checkpoint slots
    out, new = gdn_prefill_reference(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v, a, b, A_log, dt_bias, pool)),
        jnp.asarray(qsl),
        state_slots(src, dst, ck_off, ck_slot, n),
    )
    out, new = np.asarray(out), np.asarray(new)
    for i in range(n):
        lo, hi = qsl[i], qsl[i + 1]
        s0 = pool[src[i]] if src[i] else np.zeros((HV, DV, DK))
        o, states = gdn_sequence(
            q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], A_log, dt_bias, s0
        )
        assert_close(out[lo:hi], o, rtol=1e-4, atol=1e-4)
        if dst[i]:
            assert_close(new[dst[i]], states[-1], rtol=1e-4, atol=1e-4)
            writes[dst[i]] = True
        for j in range(M):
            if ck_slot[i, j]:
                assert_close(new[ck_slot[i, j]], states[ck_off[i, j] - 1], rtol=1e-4, atol=1e-4)
                writes[ck_slot[i, j]] = True
    assert np.all(out[qsl[n] :] == 0), "padding tokens must give zeros"
    for slot in range(len(pool)):
        if slot not in writes:
            np.testing.assert_array_equal(
                new[slot], pool[slot].astype(np.float32), err_msg=f"slot {slot} changed"
            )


def test_gdn_decode_matches_prefill_of_one_token():
    rng = np.random.default_rng(3)
    s = 5
    q, k = rng.normal(size=(2, s, HK, DK)).astype(np.float32)
    v = rng.normal(size=(s, HV, DV)).astype(np.float32)
    a, b = rng.normal(size=(2, s, HV)).astype(np.float32)
    A_log, dt_bias = rng.normal(size=(2, HV)).astype(np.float32)
    pool = np.full((NUM_SLOTS, HV, DV, DK), np.nan, np.float32)
    pool[1:4] = rng.normal(size=(3, HV, DV, DK))
    src = np.array([1, 2, 0, 3, 0], np.int32)
    dst = np.array([1, 5, 6, 0, 0], np.int32)  # row 4 is padding
    ck_off = np.zeros((s, M), np.int32)
    ck_slot = np.zeros((s, M), np.int32)
    ck_off[0, 0], ck_slot[0, 0] = 1, 9  # a decode step reaching a checkpoint boundary
    ck_off[2, 1], ck_slot[2, 1] = 0, 10  # offset 0: ignored
    args = [jnp.asarray(x) for x in (q, k, v, a, b, A_log, dt_bias, pool)]
    out, new = gdn_decode_reference(*args, state_slots(src, dst, ck_off, ck_slot, 4))
    out, new = np.asarray(out), np.asarray(new)
    for i in range(4):
        s0 = pool[src[i]] if src[i] else np.zeros((HV, DV, DK))
        o, st = gdn_sequence(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], a[i : i + 1], b[i : i + 1], A_log, dt_bias, s0
        )
        assert_close(out[i], o[0], rtol=1e-5, atol=1e-5)
        if dst[i]:
            assert_close(new[dst[i]], st[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new[9], new[1])
    assert np.isnan(new[10]).all() and np.isnan(new[0]).all() and np.isnan(new[7]).all()
    np.testing.assert_array_equal(new[3], pool[3])  # dst 0: not written
    assert np.all(out[4] == 0)


@pytest.mark.parametrize("lens", CASES.values(), ids=CASES.keys())
def test_conv1d_prefill_and_update(lens):
    rng = np.random.default_rng(7)
    c, kw = 10, 4
    qsl, t, s = _ragged(lens)
    x = rng.normal(size=(t, c)).astype(np.float32)
    w = rng.normal(size=(c, kw)).astype(np.float32)
    pool = np.full((NUM_SLOTS + 12, kw - 1, c), np.nan, np.float32)
    n = len(lens)
    src = np.zeros(s, np.int32)
    dst = np.zeros(s, np.int32)
    src[:n] = [1 + i if i % 2 else 0 for i in range(n)]
    for i in range(n):
        if src[i]:
            pool[src[i]] = rng.normal(size=(kw - 1, c))
    dst[:n] = 6 + np.arange(n)
    ck_off = np.zeros((s, M), np.int32)
    ck_slot = np.zeros((s, M), np.int32)
    for i, length in enumerate(lens):
        ck_off[i, 0], ck_slot[i, 0] = max(1, length // 2), 12 + i  # may be < K-1 tokens
    y, new = causal_conv1d_prefill_reference(
        *(jnp.asarray(z) for z in (x, w, pool, qsl)), state_slots(src, dst, ck_off, ck_slot, n)
    )
    y, new = np.asarray(y), np.asarray(new)
    for i in range(n):
        lo, hi = qsl[i], qsl[i + 1]
        w0 = pool[src[i]] if src[i] else np.zeros((kw - 1, c))
        yy, windows = conv_sequence(x[lo:hi].astype(np.float64), w, w0)
        assert_close(y[lo:hi], yy, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new[dst[i]], windows[-1], rtol=1e-6)
        np.testing.assert_allclose(new[ck_slot[i, 0]], windows[ck_off[i, 0] - 1], rtol=1e-6)
    assert np.isnan(new[0]).all()
    # Decode continues from the written windows exactly like a longer prefill would.
    xd = rng.normal(size=(s, c)).astype(np.float32)
    live = np.arange(s) < n
    yd, new2 = causal_conv1d_update_reference(
        *(jnp.asarray(z) for z in (xd, w, new)),
        state_slots(dst * live, dst * live, ck_off * 0, ck_slot, n),
    )
    for i in range(n):
        yy, windows = conv_sequence(xd[i : i + 1].astype(np.float64), w, new[dst[i]])
        assert_close(np.asarray(yd)[i], yy[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new2)[dst[i]], windows[0], rtol=1e-6)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_paged_attention(block_size, head_dim):
    rng = np.random.default_rng(block_size + head_dim)
    hq, hkv, nb = 4, 2, 24
    cached = [0, 40, 7, 33]
    new = [5, 1, 1, 20]
    lens = [c + n for c, n in zip(cached, new)]
    max_blocks = 4
    k_cache = np.full((nb, block_size, hkv, head_dim), np.nan, np.float32)
    v_cache = np.full((nb, block_size, hkv, head_dim), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, nb))
    tables = np.zeros((6, max_blocks), np.int32)
    k_all, v_all = [], []
    slot_mapping, q_rows = [], []
    used = 0
    for i, n in enumerate(lens):
        blocks = perm[used : used + -(-n // block_size)]
        used += len(blocks)
        tables[i, : len(blocks)] = blocks
        kk = rng.normal(size=(n, hkv, head_dim)).astype(np.float32)
        vv = rng.normal(size=(n, hkv, head_dim)).astype(np.float32)
        k_all.append(kk)
        v_all.append(vv)
        for p in range(cached[i]):  # the cached part is already in the cache
            k_cache[blocks[p // block_size], p % block_size] = kk[p]
            v_cache[blocks[p // block_size], p % block_size] = vv[p]
        for p in range(cached[i], n):
            slot_mapping.append(blocks[p // block_size] * block_size + p % block_size)
        q_rows.append(rng.normal(size=(new[i], hq, head_dim)).astype(np.float32))
    pad = 3
    slot_mapping += [0] * pad  # padding tokens go to the null block
    q = np.concatenate(q_rows + [np.zeros((pad, hq, head_dim), np.float32)])
    k_new = np.concatenate(
        [k[c:] for k, c in zip(k_all, cached)] + [np.zeros((pad, hkv, head_dim))]
    )
    v_new = np.concatenate(
        [v[c:] for v, c in zip(v_all, cached)] + [np.zeros((pad, hkv, head_dim))]
    )
    qsl = np.concatenate([[0], np.cumsum(new), [sum(new)] * 2]).astype(np.int32)
    seq_lens = np.array(lens + [0, 0], np.int32)
    kc, vc = write_kv_reference(
        *(jnp.asarray(z, jnp.float32) for z in (k_new, v_new, k_cache, v_cache)),
        jnp.asarray(np.array(slot_mapping, np.int32)),
    )
    out = ragged_paged_attention_reference(
        jnp.asarray(q),
        kc,
        vc,
        *(jnp.asarray(z) for z in (qsl, seq_lens, tables)),
        jnp.int32(4),
        scale=head_dim**-0.5,
    )
    out = np.asarray(out)
    for i in range(4):
        want = attention_sequence(
            q_rows[i].astype(np.float64), k_all[i], v_all[i], cached[i], head_dim**-0.5
        )
        assert_close(out[qsl[i] : qsl[i + 1]], want, rtol=1e-5, atol=1e-5)
    assert np.all(out[qsl[4] :] == 0)


def test_reference_ops_jit():
    """The references trace under jit with static shapes (what the runner needs)."""
    f = jax.jit(gdn_prefill_reference)
    t, s = 8, 2
    z = jnp.zeros
    o, st = f(
        z((t, HK, DK)),
        z((t, HK, DK)),
        z((t, HV, DV)),
        z((t, HV)),
        z((t, HV)),
        z(HV),
        z(HV),
        z((4, HV, DV, DK)),
        jnp.array([0, 3, 8], jnp.int32),
        state_slots(np.zeros(s), [1, 2], np.zeros((s, M)), np.zeros((s, M)), 2),
    )
    assert o.shape == (t, HV, DV) and st.shape == (4, HV, DV, DK)
