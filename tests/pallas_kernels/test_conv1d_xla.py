"""The shifted-slice XLA conv1d prefill (``pallas_kernels/conv1d/xla.py``) against the
reference: ragged rows, rows shorter than K - 1, in-place slots, checkpoints, padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d.reference import causal_conv1d_prefill_reference
from pallas_kernels.conv1d.xla import causal_conv1d_prefill_shifted
from tests.pallas_kernels.ragged_cases import ragged_case
from tests.pallas_kernels.test_conv1d_gpu import CASES, IDS, _check, _short_in_place_case


def _both(x, w, pool, qsl, slots):
    args = (x, w, pool, jnp.asarray(qsl, jnp.int32), slots)
    want = jax.jit(causal_conv1d_prefill_reference)(*args)
    return jax.jit(causal_conv1d_prefill_shifted)(*args), want


@pytest.mark.parametrize("lens,c,kw,dtype,bt,bc", CASES, ids=IDS)
def test_matches_reference(lens, c, kw, dtype, bt, bc):
    del bt, bc  # the kernel's tiles: nothing here
    rng = np.random.default_rng(sum(lens) + c + kw)
    case = ragged_case(lens, max_ckpt=3)
    x = jnp.asarray(rng.normal(size=(case.num_tokens, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    pool = jnp.asarray(case.pool(rng, (kw - 1, c), np.float32), dtype)
    got, want = _both(x, w, pool, case.query_start_loc, case.slots())
    _check(got, want, dtype)
    assert np.all(np.asarray(got[0], np.float32)[case.query_start_loc[-1] :] == 0)


@pytest.mark.parametrize("kw", [2, 4, 5])
def test_short_rows_in_place(kw):
    """Rows shorter than K - 1 read their taps from the source window they overwrite."""
    got, want = _both(*_short_in_place_case(np.random.default_rng(kw), 48, kw, jnp.float32))
    _check(got, want, jnp.float32)
