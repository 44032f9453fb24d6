"""The reference KDA ops on ragged batches against a float64 token-by-token oracle.

Unused slots are poisoned with NaN: a stray read shows up as NaN, a stray write as a changed
slot (see :mod:`tests.pallas_kernels.ragged_cases` for the case layout).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from tests.pallas_kernels.ragged_cases import assert_close, ragged_case, state_slots, zero_slots

H, DK, DV = 3, 8, 6


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def kda_sequence(q, k, v, g, b, A_log, dt_bias, s0):
    """One sequence in float64: q, k, g [L, H, Dk]; v [L, H, Dv]; b [L, H]; s0 [H, Dv, Dk], a
    slot of the pool (each state stored transposed, S^T).

    Returns the outputs [L, H, Dv] and the state after every token as the pool stores it,
    [L, H, Dv, Dk]. The math runs on S [Dk, Dv].
    """
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    decay = -np.exp(A_log)[:, None] * softplus(g + dt_bias)  # [L, H, Dk]
    beta = 1 / (1 + np.exp(-b))
    s = np.swapaxes(s0, -1, -2).astype(np.float64)  # S [H, Dk, Dv]
    outs, states = [], []
    for t in range(len(q)):
        s = s * np.exp(decay[t])[:, :, None]  # one decay per key channel: the state's rows
        pred = np.einsum("hkv,hk->hv", s, k[t])
        s = s + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        outs.append(np.einsum("hkv,hk->hv", s, q[t]))
        states.append(np.swapaxes(s, -1, -2).copy())  # the pool's S^T
    return np.array(outs), np.array(states)


def _inputs(rng, n):
    q, k = rng.normal(size=(2, n, H, DK))
    v = rng.normal(size=(n, H, DV))
    g = 2 * rng.normal(size=(n, H, DK))
    b = rng.normal(size=(n, H))
    A_log = rng.normal(size=H)
    dt_bias = rng.normal(size=(H, DK))
    return q, k, v, g, b, A_log, dt_bias


CASES = {
    "lens=1,63,64,65,130": [1, 63, 64, 65, 130],
    "lens=64,1,1": [64, 1, 1],
}


@pytest.mark.parametrize("lens", CASES.values(), ids=CASES.keys())
def test_kda_prefill(lens):
    rng = np.random.default_rng(len(lens))
    case = ragged_case(lens, max_ckpt=2)
    x = _inputs(rng, case.num_tokens)
    pool = case.pool(rng, (H, DV, DK), np.float32)
    qsl = case.query_start_loc
    out, new = kda_prefill_reference(
        *(jnp.asarray(a, jnp.float32) for a in x),
        jnp.asarray(pool),
        jnp.asarray(qsl),
        case.slots(),
    )
    out, new = np.asarray(out), np.asarray(new)
    written = set()
    for i in range(case.num_seqs):
        lo, hi = qsl[i], qsl[i + 1]
        s0 = pool[case.src[i]] if case.src[i] else np.zeros((H, DV, DK))
        o, states = kda_sequence(*(a[lo:hi] for a in x[:5]), *x[5:], s0)
        assert_close(out[lo:hi], o, rtol=1e-4, atol=1e-4)
        if case.dst[i]:
            assert_close(new[case.dst[i]], states[-1], rtol=1e-4, atol=1e-4)
            written.add(case.dst[i])
        for off, slot in zip(case.ckpt_offsets[i], case.ckpt_slots[i]):
            if slot:
                assert_close(new[slot], states[off - 1], rtol=1e-4, atol=1e-4)
                written.add(slot)
    assert np.all(out[qsl[case.num_seqs] :] == 0), "padding tokens must give zeros"
    for slot in set(range(case.num_slots)) - written:
        np.testing.assert_array_equal(new[slot], pool[slot], err_msg=f"slot {slot} changed")


def test_kda_decode_continues_prefill():
    """Decode after a prefill equals one longer sequence; offset-1 checkpoints are written."""
    rng = np.random.default_rng(3)
    rows = 4
    q, k, v, g, b, A_log, dt_bias = _inputs(rng, rows)
    pool = np.full((10, H, DV, DK), np.nan, np.float32)
    pool[1:4] = rng.normal(size=(3, H, DV, DK))
    src = np.array([1, 2, 0, 0], np.int32)
    dst = np.array([1, 5, 6, 0], np.int32)  # row 3 is padding
    ck_off = np.array([[1, 0], [0, 0], [0, 1], [1, 0]], np.int32)
    ck_slot = np.array([[7, 0], [8, 0], [0, 9], [3, 0]], np.int32)  # row 1 offset 0: ignored
    out, new = kda_decode_reference(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, b, A_log, dt_bias)),
        jnp.asarray(pool),
        state_slots(src, dst, ck_off, ck_slot, 3),
    )
    out, new = np.asarray(out), np.asarray(new)
    for i in range(3):
        s0 = pool[src[i]] if src[i] else np.zeros((H, DV, DK))
        one = (a[i : i + 1] for a in (q, k, v, g, b))
        o, st = kda_sequence(*one, A_log, dt_bias, s0)
        assert_close(out[i], o[0], rtol=1e-5, atol=1e-5)
        assert_close(new[dst[i]], st[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new[7], new[1])
    np.testing.assert_array_equal(new[9], new[6])
    assert np.isnan(new[8]).all() and np.isnan(new[0]).all()
    np.testing.assert_array_equal(new[3], pool[3])  # a padding row writes nothing
    assert np.all(out[3] == 0)


def test_kda_bad_shapes_name_the_argument():
    z = jnp.zeros
    args = [z((4, H, DK)), z((4, H, DK)), z((4, H, DV)), z((4, H)), z((4, H)), z(H), z((H, DK))]
    state, slots = z((3, H, DV, DK)), zero_slots(2, 1)
    with pytest.raises(ValueError, match=r"g \(4, 3\) must be \[N=4, H=3, Dk=8\]"):
        kda_decode_reference(*args, state, slots)
    args[3] = z((4, H, DK))
    # the pool in the [K, V] layout: rejected, the message names the layout it must have
    want = r"state \(3, 3, 8, 6\) must be \[num_slots, H=3, Dv=6, Dk=8\]"
    with pytest.raises(ValueError, match=want):
        kda_decode_reference(*args, jnp.swapaxes(state, -1, -2), slots)
    with pytest.raises(ValueError, match="state dtype float16 must be float32 or bfloat16"):
        kda_decode_reference(*args, state.astype(jnp.float16), slots)
    with pytest.raises(ValueError, match="ckpt_slots .* must match"):
        kda_decode_reference(*args, state, zero_slots(2, 1, ckpt_slots=z((2, 2), jnp.int32)))
