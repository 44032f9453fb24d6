"""The delta rule's chunk step, shared by the GDN and KDA kernels.

Both families run the gated delta rule over a value head's state ``S [Dk, Dv]``; per token::

    S = diag(exp(g)) S;   S += k (beta (v - S^T k))^T;   o = S^T q

They differ only in the gate ``g``: GDN has one per head (a scalar per token), KDA one per key
channel (a ``[Dk]`` vector per token). Prefill runs the chunked (WY/UT) form. With ``gam_i``
the cumulative log-decay of row ``i`` inside the chunk (``cumsum(g)``, per channel for KDA),
``gam_last`` that of the chunk's last row and ``e_ij = exp(gam_i - gam_j)`` (for KDA per
channel, inside the dot products)::

    A     = strict_lower(beta_i k_i . k_j e_ij)          [C, C]
    Aqk   = incl_lower(q_i . k_j e_ij)                   [C, C]
    Tm    = (I + A)^-1                                   recursive 2x2 block inversion
    W, U  = Tm (beta k exp(gam)),  Tm (beta v)           the UT transform
    Vnew  = U - W S
    o     = (q exp(gam)) S + Aqk Vnew
    S     = diag(exp(gam_last)) S + (k exp(gam_last - gam))^T Vnew

A kernel builds the gate-specific operands (:class:`GatedChunk`: ``A``, ``Aqk`` and the
decayed rows; how the pairwise decays are formed is what differs) and hands them to
:func:`delta_rule_chunk`, the rest of the step, written once: the GDN and KDA TPU kernels run
it whole; the GPU prefills of both, whose parallel launch computes everything but the state's
products, run its serial part :func:`chunk_recurrence`
(:mod:`pallas_kernels.common.chunk_scan_gpu`; its three-launch path splits that part once
more: ``Vnew`` and ``S`` serially, ``o`` in parallel).
Padded rows have ``g = beta = 0`` and ``q = k = v = 0``: they contribute nothing.

Everything here is traced inside a kernel body and uses only what both Mosaic and Triton lower
(2-D tiles, ``dot_general``, shifts instead of integer division), so TPU and GPU kernels can
share it. The platform skeletons (slot loads and stores, grids) are
:mod:`pallas_kernels.common.delta_rule_tpu` and :mod:`pallas_kernels.common.delta_rule_gpu`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
NN = ((1,), (0,))  # x @ y
NT = ((1,), (1,))  # x @ y^T
TN = ((0,), (0,))  # x^T @ y


def mm(x, y, contract=NN, precision=HIGHEST):
    """``dot_general`` accumulating in f32 (``precision``: the GPU prefill's is a parameter)."""
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


# log1p(t) / t on [0, 1] as a degree-8 polynomial in t (a Chebyshev fit, highest power first):
# f32 Horner on it is within 2e-7 of log1p(t) / t (softplus_poly's docstring)
_LOG1P_POLY = (
    0.005253457929939032, -0.02958850748836994, 0.07836166769266129, -0.13674770295619965,
    0.19111430644989014, -0.24844369292259216, 0.33319270610809326, -0.49999502301216125, 1.0,
)  # fmt: skip


def softplus_poly(x):
    """:func:`softplus` as ``max(x, 0) + log1p(e^-|x|)``, ``log1p(t) = t p(t)`` with ``p`` a
    degree-8 polynomial on ``t`` in ``(0, 1]``: one ``exp`` and nine multiply-adds where the
    GPU's ``log1p`` runs a ~40-instruction routine (the per-channel gates of KDA's prefill
    launches, a ``[16, Dk]`` tile of them a block). Within 2.6e-7 of the exact value, relative,
    at every ``x`` (checked against float64 in the tests); equal to ``x`` above 20 as PyTorch's
    threshold makes it (``log1p(e^-20)`` is below half an ulp of 20)."""
    t = jnp.exp(-jnp.abs(x))
    p = jnp.full_like(t, _LOG1P_POLY[0])
    for c in _LOG1P_POLY[1:]:
        p = p * t + c
    return jnp.maximum(x, 0.0) + p * t


def l2norm(x, axis=-1):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def unit_lower_inverse(a, precision=HIGHEST):
    """``(I + a)^-1`` for strictly lower-triangular ``a [n, n]`` (n a power of two).

    Recursive 2x2 block inversion, all levels at once: with ``x`` the block-diagonal inverse
    for blocks of size ``s``, the inverse for blocks of ``2s`` is ``x - x c x`` where ``c``
    keeps the entries of ``a`` below the diagonal blocks inside each ``2s`` block::

        [D1  0 ]^-1   [ D1^-1              0    ]
        [C   D2]    = [ -D2^-1 C D1^-1     D2^-1]

    Products of true sub-inverses only (unlike a Neumann series, nothing grows beyond the
    inverse itself); ``2 log2(n)`` matmuls. The block masks use shifts: Mosaic has no vector
    integer division.
    """
    n = a.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    x = (i == j).astype(jnp.float32)
    s, shift = 1, 0
    while s < n:
        same_pair = jnp.right_shift(i, shift + 1) == jnp.right_shift(j, shift + 1)
        other_half = jnp.right_shift(i, shift) != jnp.right_shift(j, shift)
        c = jnp.where(same_pair & other_half, a, 0.0)
        x = x - mm(x, mm(c, x, precision=precision), precision=precision)
        s, shift = 2 * s, shift + 1
    return x


def block_unit_lower_inverse(a, nsub: int, precision=HIGHEST):
    """``(I + A)^-1`` of a strictly lower ``A`` held as blocks: ``a[i, j]`` (``i >= j``, each
    ``[s, s]``; the diagonal ones strictly lower) of an ``nsub x nsub`` block grid. Returns the
    inverse's blocks ``t[i, j]`` (``i >= j``; those above are zero): ``T_II = (I + A_II)^-1``
    (:func:`unit_lower_inverse`), then ``T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ`` (block forward
    substitution). For a chunk of 64 in blocks of 16: ~30 small products instead of the 12
    full-size ones of :func:`unit_lower_inverse` on ``[64, 64]``, whose masks multiply zeros."""
    t = {}
    for bi in range(nsub):
        t[bi, bi] = unit_lower_inverse(a[bi, bi], precision)
        for bj in range(bi - 1, -1, -1):
            acc = sum(mm(a[bi, m], t[m, bj], precision=precision) for m in range(bj, bi))
            t[bi, bj] = -mm(t[bi, bi], acc, precision=precision)
    return t


class GatedChunk(NamedTuple):
    """A chunk's operands with the gate's decays applied: what the chunk step needs besides
    ``beta v`` and the state. ``e_ij = exp(gam_i - gam_j)``, per key channel ``d`` for KDA."""

    a_kk: jax.Array  # [C, C]  A = strict_lower(beta_i sum_d k_id k_jd e_ij)
    a_qk: jax.Array  # [C, C]  incl_lower(sum_d q_id k_jd e_ij)
    q_dec: jax.Array  # [C, Dk]  q exp(gam)
    kb_dec: jax.Array  # [C, Dk]  beta k exp(gam)
    k_dec: jax.Array  # [C, Dk]  k exp(gam_last - gam)
    s_decay: jax.Array  # exp(gam_last): [1, 1] or a scalar (GDN), [Dk, 1] (KDA)


def chunk_recurrence(
    state, w, u, q_dec, a_qk, k_dec, s_decay, precision=HIGHEST, operand_dtype=None
):
    """The chunk's output and the state after it, from the UT transform's ``W [C, Dk]`` and
    ``U [C, Dv]``: the serial part of the chunk step. Returns ``(o [C, Dv], state [Dk, Dv])``.

    ``operand_dtype`` (e.g. bf16) casts the state and ``Vnew`` where they enter a product;
    accumulation and the returned state stay float32."""
    sb = state if operand_dtype is None else state.astype(operand_dtype)
    vnew = u.astype(jnp.float32) - mm(w, sb, precision=precision)  # [C, Dv]
    vb = vnew if operand_dtype is None else vnew.astype(operand_dtype)
    o = mm(q_dec, sb, precision=precision) + mm(a_qk, vb, precision=precision)
    state = state * s_decay + mm(k_dec, vb, TN, precision=precision)
    return o, state


def delta_rule_chunk(gc: GatedChunk, v_beta, state, precision=HIGHEST):
    """One chunk of one head: ``v_beta [C, Dv]`` is ``beta v``, ``state [Dk, Dv]`` the state
    before the chunk. Returns ``(o [C, Dv], state)``."""
    tm = unit_lower_inverse(gc.a_kk, precision)
    w = mm(tm, gc.kb_dec, precision=precision)  # [C, Dk]
    u = mm(tm, v_beta, precision=precision)  # [C, Dv]
    return chunk_recurrence(state, w, u, gc.q_dec, gc.a_qk, gc.k_dec, gc.s_decay, precision)


def group_refs(kernel, group, **params):
    """Pallas passes a kernel's refs one by one: ``kernel`` gets the first
    ``len(group._fields)`` of them as one ``group`` (a NamedTuple of refs), then the rest."""
    n = len(group._fields)

    def flat(*refs):
        return kernel(group(*refs[:n]), *refs[n:], **params)

    return flat
