"""Float64 numpy oracles, written straight from the math, for the reference ops' tests."""

import numpy as np


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def gdn_sequence(q, k, v, a, b, A_log, dt_bias, s0):
    """One sequence: q, k [L, Hk, Dk]; v [L, Hv, Dv]; a, b [L, Hv]; s0 [Hv, Dv, Dk], a slot of
    the pool (which stores each state transposed, S^T).

    Returns the outputs [L, Hv, Dv] and the state after every token as the pool stores it,
    [L, Hv, Dv, Dk]. The math below runs on S [Dk, Dv], as written in the papers.
    """
    r = v.shape[1] // q.shape[1]
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), r, axis=1)
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), r, axis=1)
    q = q * q.shape[-1] ** -0.5
    g = -np.exp(A_log) * softplus(a + dt_bias)
    beta = 1 / (1 + np.exp(-b))
    s = np.swapaxes(s0, -1, -2).astype(np.float64)  # S [Hv, Dk, Dv]
    outs, states = [], []
    for t in range(len(q)):
        s = s * np.exp(g[t])[:, None, None]
        pred = np.einsum("hkv,hk->hv", s, k[t])
        s = s + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        outs.append(np.einsum("hkv,hk->hv", s, q[t]))
        states.append(np.swapaxes(s, -1, -2).copy())  # the pool's S^T
    return np.array(outs), np.array(states)


def conv_sequence(x, w, window0):
    """x [L, C], w [C, K], window0 [K-1, C] -> y [L, C], windows after each token [L, K-1, C]."""
    km1 = w.shape[1] - 1
    full = np.concatenate([window0, x], axis=0)
    y = np.stack([(full[t : t + km1 + 1] * w.T).sum(0) for t in range(len(x))])
    y = y / (1 + np.exp(-y))
    windows = np.stack([full[t + 1 : t + 1 + km1] for t in range(len(x))])
    return y, windows


def attention_sequence(q, k, v, num_cached, scale):
    """q [L, Hq, D] new tokens; k, v [n, Hkv, D] all positions; causal with an offset."""
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    out = []
    for i in range(len(q)):
        n = num_cached + i + 1
        s = np.einsum("hd,chd->hc", q[i], kk[:n]) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hc,chd->hd", p, vv[:n]))
    return np.array(out)
