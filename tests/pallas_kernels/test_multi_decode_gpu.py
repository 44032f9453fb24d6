"""The k-token decode (speculative verify) GPU kernels vs the families' prefill references.

Interpret mode on CPU checks the indexing: ragged rows of 1..k tokens, src 0 and src > 0,
dst 0, checkpoints at every offset or some, padding rows that carry slots and tokens, and a
NaN-filled pool (a stray read shows in the outputs, a stray write in a slot that must come
back NaN). A last test lowers both kernels to Triton IR at the real models' shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import multi_decode_gpu as md
from pallas_kernels.gdn.reference import gdn_prefill_reference
from pallas_kernels.kda.reference import kda_prefill_reference
from tests.pallas_kernels.ragged_cases import abstract_slots, assert_close, state_slots

PAD_ROWS, PAD_TOKENS = 2, 3


@dataclasses.dataclass
class VerifyCase:
    """Rows of ``lens`` tokens, then two padding rows whose slots point at real slots (they
    must be ignored) and own the padding tokens::

        rows:   0    1    2    3   ...   | pad       pad
        tokens: lens[0] ...              | 1         2
        src:    0    s    s    0   ...   | s' (NaN)  s'        even rows start fresh
        dst:    d    0    =src d   ...   | d'        d'        row 1 no store, row 2 in place
    """

    lens: list[int]
    qsl: np.ndarray  # i32[S+1]
    src: np.ndarray
    dst: np.ndarray
    ck_off: np.ndarray  # i32[S, M]
    ck_slot: np.ndarray
    num_slots: int

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qsl[-1])

    def slots(self):
        return state_slots(self.src, self.dst, self.ck_off, self.ck_slot, self.num_seqs)

    def pool(self, rng, slot_shape) -> np.ndarray:
        """NaN but in the states the live rows read, and in the slots the padding rows name
        (but the first padding row's src): a padding row that ran would change them."""
        n = self.num_seqs
        pool = np.full((self.num_slots, *slot_shape), np.nan, np.float32)
        finite = [*self.src[:n], *self.src[n + 1 :], *self.dst[n:], *self.ck_slot[n:].ravel()]
        for s in finite:
            if s > 0:
                pool[s] = rng.normal(size=slot_shape)
        return pool


def verify_case(lens: list[int], k: int, ckpts: str) -> VerifyCase:
    n = len(lens)
    rows = n + PAD_ROWS
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qsl = np.concatenate([qsl, qsl[-1] + np.array([1, PAD_TOKENS])]).astype(np.int32)
    next_slot = iter(range(1, 10_000))
    src = np.array([next(next_slot) if i % 2 else 0 for i in range(n)] + [0] * PAD_ROWS, np.int32)
    dst = np.array([next(next_slot) for _ in range(rows)], np.int32)
    dst[1] = 0
    if n > 2:
        src[2] = dst[2]  # in place: the running slot read and written
    ck_off = np.zeros((rows, k), np.int32)
    ck_slot = np.zeros((rows, k), np.int32)
    for i, length in enumerate(lens):
        if ckpts == "every":  # the verify step: the state after each draft token
            offs = range(1, length + 1)
        else:  # the last token only, and a pair past the row's end (must not be written)
            offs = [length, length + 1] if length else [1]
        for m, o in enumerate(list(offs)[:k]):
            ck_off[i, m], ck_slot[i, m] = o, next(next_slot)
    # Padding rows name real slots: a read would show NaN, a write would overwrite NaN.
    src[n:] = [next(next_slot) for _ in range(PAD_ROWS)]
    ck_off[n:, 0], ck_slot[n:, 0] = 1, [next(next_slot) for _ in range(PAD_ROWS)]
    num_slots = next(next_slot) + 2  # and two slots nobody names
    return VerifyCase(list(lens), qsl, src, dst, ck_off, ck_slot, num_slots)


def _gdn_inputs(rng, n, hk=2, hv=4, dk=16, dv=8):
    q, k = rng.normal(size=(2, n, hk, dk))
    v = rng.normal(size=(n, hv, dv))
    a, b = rng.normal(size=(2, n, hv))
    A_log, dt_bias = rng.normal(size=(2, hv))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, a, b, A_log, dt_bias)], (hv, dv, dk)


def _kda_inputs(rng, n, h=3, dk=16, dv=16):
    q, k, g = rng.normal(size=(3, n, h, dk))
    v = rng.normal(size=(n, h, dv))
    b = rng.normal(size=(n, h))
    A_log = rng.normal(size=(h,))
    dt_bias = rng.normal(size=(h, dk))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, b, A_log, dt_bias)], (h, dv, dk)


FAMILIES = {
    # family: (inputs, reference, kernel, block_v: two Dv blocks per head)
    "gdn": (_gdn_inputs, gdn_prefill_reference, md.gdn_multi_decode, 4),
    "kda": (_kda_inputs, kda_prefill_reference, md.kda_multi_decode, 8),
}
LENS = {1: [1, 1, 1, 1, 1], 2: [2, 1, 2, 0, 1], 4: [4, 1, 3, 2, 4, 1]}


def run_both(family, case, *, max_tokens, seed=0, **kwargs):
    make, reference, kernel, bv = FAMILIES[family]
    rng = np.random.default_rng(seed)
    inputs, slot_shape = make(rng, case.num_tokens)
    pool = case.pool(rng, slot_shape)
    args = (*inputs, jnp.asarray(pool), jnp.asarray(case.qsl), case.slots())
    want = jax.jit(reference)(*args)
    fn = functools.partial(kernel, max_tokens=max_tokens, block_v=bv, interpret=True, **kwargs)
    got = jax.jit(fn)(*args)
    return got, want, pool


@pytest.mark.parametrize(
    "family, k, ckpts, inputs_first",
    [(f, k, c, False) for f in ("gdn", "kda") for k in (1, 2, 4) for c in ("every", "some")]
    # every load before the first store
    + [(f, 4, c, True) for f in ("gdn", "kda") for c in ("every", "some")],
)
def test_matches_prefill_reference(family, k, ckpts, inputs_first):
    case = verify_case(LENS[k], k, ckpts)
    (got_o, got_s), (want_o, want_s), pool = run_both(
        family, case, max_tokens=k, seed=k, inputs_first=inputs_first
    )
    assert not np.isnan(np.asarray(got_o)).any(), "a NaN slot was read"
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")
    got_s = np.asarray(got_s)
    written = set(case.dst[: case.num_seqs]) | set(case.ck_slot[: case.num_seqs].ravel())
    for slot in range(case.num_slots):
        live_write = slot in written and not np.isnan(np.asarray(want_s)[slot]).all()
        if not live_write:  # untouched: bit-identical (NaN or the source state)
            np.testing.assert_array_equal(got_s[slot], pool[slot], err_msg=f"{slot=}")


def test_max_tokens_above_the_longest_row():
    """A bucket's static max_tokens may exceed every row (rows of 1 and 2 with max 4)."""
    case = verify_case([2, 1, 2, 1], 2, "every")
    (got_o, got_s), (want_o, want_s), _ = run_both("gdn", case, max_tokens=4)
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")


LONG_ROW = verify_case([3, 1, 2], 3, "every")  # row 0 longer than max_tokens=2


def assert_long_row_poisoned(got, want, tol):
    """:data:`LONG_ROW` run with ``max_tokens=2``: row 0's outputs and final state NaN, its
    checkpoints at offsets 1 and 2 exact, offset 3's slot untouched, the other rows clean."""
    case = LONG_ROW
    (got_o, got_s), (_, want_s) = got, want
    got_o, got_s, want_s = map(np.asarray, (got_o, got_s, want_s))
    assert np.isnan(got_o[:2]).all(), "the long row's outputs"
    assert np.isnan(got_s[case.dst[0]]).all(), "the long row's final state"
    for m in range(2):  # its checkpoints within max_tokens are exact
        slot = case.ck_slot[0, m]
        assert_close(got_s[slot], want_s[slot], rtol=tol, atol=tol, what=f"ckpt {m}")
    assert np.isnan(got_s[case.ck_slot[0, 2]]).all(), "offset 3 is never reached"
    assert not np.isnan(got_o[case.qsl[1] :]).any(), "the other rows"


def test_row_longer_than_max_tokens_is_poisoned_under_jit():
    got, want, _ = run_both("kda", LONG_ROW, max_tokens=2)
    assert_long_row_poisoned(got, want, 1e-5)


def test_host_checks():
    case = verify_case([3, 1], 3, "every")
    inputs, slot_shape = _gdn_inputs(np.random.default_rng(0), case.num_tokens)
    args = (*inputs, jnp.zeros((case.num_slots, *slot_shape)), jnp.asarray(case.qsl))
    with pytest.raises(ValueError, match="row 0 has 3 tokens, more than max_tokens=2"):
        md.gdn_multi_decode(*args, case.slots(), max_tokens=2, interpret=True)
    with pytest.raises(ValueError, match=r"max_tokens=0 must be a static int in \[1, 16\]"):
        md.gdn_multi_decode(*args, case.slots(), max_tokens=0, interpret=True)


def test_kernels_lower_to_triton_at_real_shapes():
    """Qwen3-Next-80B GDN (Hk 16, Hv 32, D 128) and Kimi-Linear-48B KDA (H 32, D 128)."""
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    rows, k, d = 8, 4, 128
    t = rows * k
    slots = abstract_slots(rows, k)
    qsl = sd((rows + 1,), i32)
    hk, hv = 16, 32
    gdn = [sd((t, hk, d), bf)] * 2 + [sd((t, hv, d), bf)] + [sd((t, hv), bf)] * 2
    gdn += [sd((hv,), f32)] * 2 + [sd((8, hv, d, d), f32), qsl, slots]
    h = 32
    kda = [sd((t, h, d), bf)] * 4 + [sd((t, h), bf), sd((h,), f32), sd((h, d), f32)]
    kda += [sd((8, h, d, d), f32), qsl, slots]
    for fn, args in [(md.gdn_multi_decode, gdn), (md.kda_multi_decode, kda)]:
        # (k = 4 runs Mosaic GPU's kernel by default: multi_decode_mgpu.MGPU_MIN_TOKENS)
        lowered = jax.jit(functools.partial(fn, max_tokens=k, kernel="triton")).trace(*args)
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
