"""``copy_flat``: one Triton kernel copying flat int32 arrays (interpret mode on CPU)."""

import numpy as np
import pytest

from pallas_kernels.common.copy_gpu import BLOCK, copy_flat


@pytest.mark.parametrize(
    "sizes", [(1,), (46, 2), (BLOCK,), (BLOCK + 1, 3), (3 * BLOCK - 5, 256, 7)], ids=str
)
def test_copies_every_element(sizes):
    rng = np.random.default_rng(len(sizes))
    xs = [rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32) for n in sizes]
    outs = copy_flat(*xs, blank=(5, BLOCK + 3), interpret=True)
    assert len(outs) == len(xs) + 2
    assert [(o.shape, o.dtype) for o in outs[len(xs) :]] == [
        ((5,), np.int32),
        ((BLOCK + 3,), np.int32),
    ]
    for x, o in zip(xs, outs, strict=False):
        assert o.shape == x.shape and o.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(o), x)


@pytest.mark.parametrize(
    "bad", [np.zeros((2, 3), np.int32), np.zeros(4, np.float32), np.zeros(0, np.int32)]
)
def test_rejects_what_it_cannot_copy(bad):
    with pytest.raises(ValueError, match="copy_flat takes non-empty 1-D int32"):
        copy_flat(bad, interpret=True)
