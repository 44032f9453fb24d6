"""In-kernel math shared by the delta-rule kernels (GDN and KDA).

Everything here is traced inside a kernel body and uses only what both Mosaic and Triton lower
(2-D tiles, ``dot_general``, shifts instead of integer division), so TPU and GPU kernels can
share it. The TPU skeleton (slot loads and stores, grids) is
:mod:`pallas_kernels.common.delta_rule_tpu`.
"""

from __future__ import annotations

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


def group_refs(kernel, group, **params):
    """Pallas passes a kernel's refs one by one: ``kernel`` gets the first
    ``len(group._fields)`` of them as one ``group`` (a NamedTuple of refs), then the rest."""
    n = len(group._fields)

    def flat(*refs):
        return kernel(group(*refs[:n]), *refs[n:], **params)

    return flat
