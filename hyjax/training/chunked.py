"""The gated delta rule over dense ``[B, T]`` batches in 64-token chunks (WY/UT form), pure JAX.

Same math as :mod:`pallas_kernels.gdn.reference` (the token recurrence), reorganised so almost
all work is batched matrix products: per chunk of ``C`` tokens, with ``gamma`` the in-chunk
inclusive cumsum of the log decays ``g``::

    A   = strict_tril(beta_i * (k_i . k_j) * exp(gamma_i - gamma_j))     [C, C]
    T   = (I + A)^-1                     (unit lower triangular: a triangular solve)
    W   = T (beta * exp(gamma) * K)      U = T (beta * V)
    Vn  = U - W S                                        (S: the state entering the chunk)
    O   = (Q * exp(gamma)) S + tril(Q K^T * exp(gamma_i - gamma_j)) Vn
    S'  = exp(gamma_last) S + (K * exp(gamma_last - gamma))^T Vn

Only the last line runs sequentially (a scan over the ``T / C`` chunks). Padding tokens at
the end carry ``g = beta = 0`` and ``q = k = v = 0``, which leaves states and outputs exact.
It starts from a zero state: training sequences are independent windows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64


def chunk_gated_delta_rule(
    q: jax.Array,  # f32[B, T, H, Dk]  l2-normalised and scaled, one per value head
    k: jax.Array,  # f32[B, T, H, Dk]  l2-normalised
    v: jax.Array,  # f32[B, T, H, Dv]
    g: jax.Array,  # f32[B, T, H]      log decay (<= 0)
    beta: jax.Array,  # f32[B, T, H]
    *,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(o f32[B, T, H, Dv], final state f32[B, H, Dk, Dv])`` from a zero state."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t

    def blocks(x):  # [B, T, H, ...] -> [N, B, H, C, ...] (chunk axis first: the scan axis)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    qc, kc, vc, gc, bc = (blocks(x.astype(jnp.float32)) for x in (q, k, v, g, beta))
    gamma = jnp.cumsum(gc, axis=-1)  # [N, B, H, C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))  # i >= j
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)  # i > j
    diff = gamma[..., :, None] - gamma[..., None, :]  # [N, B, H, C, C]
    # exp only where i >= j: above the diagonal diff > 0 and exp could overflow.
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)

    kb = kc * bc[..., None]  # [N, B, H, C, Dk]
    a = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", kb, kc) * decay, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    rhs = jnp.concatenate([kb * jnp.exp(gamma)[..., None], vc * bc[..., None]], axis=-1)
    wu = jax.lax.linalg.triangular_solve(
        eye + a, rhs, left_side=True, lower=True, unit_diagonal=True
    )  # [N, B, H, C, Dk + Dv]
    w, u = wu[..., :dk], wu[..., dk:]
    qk = jnp.einsum("...ik,...jk->...ij", qc, kc) * decay  # [N, B, H, C, C] (incl. diagonal)
    q_dec = qc * jnp.exp(gamma)[..., None]
    g_last = gamma[..., -1]  # [N, B, H]: padding rows have g = 0, so this is the last valid row
    k_dec = kc * jnp.exp(g_last[..., None] - gamma)[..., None]

    def step(s, xs):  # s: [B, H, Dk, Dv]
        w_c, u_c, q_c, qk_c, k_c, gl = xs
        vn = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", qk_c, vn)
        s = jnp.exp(gl)[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", k_c, vn)
        return s, o

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
    s, o = jax.lax.scan(step, s0, (w, u, q_dec, qk, k_dec, g_last))  # o: [N, B, H, C, Dv]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, n * chunk, h, dv)
    return o[:, :t], s
