"""Ragged batches with NaN-poisoned state pools, shared by the kernel-vs-reference tests.

Layout of a case with ``n`` live rows (two padding rows and five padding tokens follow)::

    rows:        0      1      2      3   ...   n-1  | pad  pad
    src_slot:    0      2      0      4   ...        |  0    0     odd rows read a slot
    dst_slot:   S+0     0     S+2    S+3  ...        |  0    0     row 1 writes nothing
    ckpts:      up to M (offset, slot) pairs per row at offsets 1, 64, len // 2, len

Every slot that no row reads holds NaN, so a stray read shows up in the outputs, and a slot
that no row writes must come back bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common.slots import StateSlots


def state_slots(src, dst, ckpt_offsets, ckpt_slots, num_seqs) -> StateSlots:
    """A :class:`StateSlots` from host arrays (int32 on device)."""
    return StateSlots(
        *(jnp.asarray(x, jnp.int32) for x in (src, dst, ckpt_offsets, ckpt_slots)),
        jnp.int32(num_seqs),
    )


@dataclasses.dataclass
class RaggedCase:
    lens: list[int]
    query_start_loc: np.ndarray  # i32[S+1]
    num_tokens: int
    src: np.ndarray  # i32[S]
    dst: np.ndarray  # i32[S]
    ckpt_offsets: np.ndarray  # i32[S, M]
    ckpt_slots: np.ndarray  # i32[S, M]
    num_slots: int

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    def slots(self) -> StateSlots:
        return state_slots(self.src, self.dst, self.ckpt_offsets, self.ckpt_slots, self.num_seqs)

    def pool(self, rng: np.random.Generator, slot_shape: tuple[int, ...], dtype) -> np.ndarray:
        """A NaN-poisoned pool with random states in the slots that rows read."""
        pool = np.full((self.num_slots,) + slot_shape, np.nan, np.float32)
        for s in self.src[self.src > 0]:
            pool[s] = rng.normal(size=slot_shape)
        return pool.astype(dtype)


def ragged_case(lens: list[int], *, max_ckpt: int = 2, extra_tokens: int = 5, extra_rows: int = 2):
    n = len(lens)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(qsl[-1])
    qsl = np.concatenate([qsl, np.full(extra_rows, total, np.int32)])
    rows = n + extra_rows
    src = np.zeros(rows, np.int32)
    dst = np.zeros(rows, np.int32)
    src[:n] = [1 + i if i % 2 else 0 for i in range(n)]
    dst[:n] = [n + 1 + i if i != 1 else 0 for i in range(n)]
    ck_off = np.zeros((rows, max_ckpt), np.int32)
    ck_slot = np.zeros((rows, max_ckpt), np.int32)
    next_slot = 2 * n + 2
    for i, length in enumerate(lens):
        offs = sorted({o for o in (1, 64, length // 2, length) if 1 <= o <= length})
        for j, o in enumerate(offs[:max_ckpt]):
            ck_off[i, j], ck_slot[i, j] = o, next_slot
            next_slot += 1
    return RaggedCase(
        lens=list(lens),
        query_start_loc=qsl,
        num_tokens=total + extra_tokens,
        src=src,
        dst=dst,
        ckpt_offsets=ck_off,
        ckpt_slots=ck_slot,
        num_slots=next_slot + 2,  # two slots nobody touches
    )


def assert_close(got, want, *, rtol: float, atol: float, what: str = ""):
    """Elementwise closeness with NaN == NaN (untouched poisoned slots must stay NaN).

    ``atol`` is relative to the magnitude compared: it is scaled by ``max(1, max |want|)``.
    Float32 rounding in a sum grows with its terms, not its result, so a near-zero entry of a
    large state or output carries the noise of the large ones; an absolute bound would sit at
    the noise floor and pass or fail with the host's vector width (AVX2 vs AVX-512). The
    callers' inputs are of magnitude ~1, where this is the plain absolute tolerance.
    """
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


def assert_rel_close(got, want, *, tol: float, what: str):
    """``max |got - want| / max |want|`` below ``tol`` (for bf16 runs), NaN patterns equal."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    ok = ~np.isnan(want)
    scale = max(float(np.abs(want[ok]).max(initial=0.0)), 1e-6)
    err = float(np.abs(got[ok] - want[ok]).max(initial=0.0)) / scale
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


def zero_slots(rows: int, m: int, **replace) -> StateSlots:
    """All-zero slots of ``rows`` rows and ``m`` checkpoint pairs, fields replaced by
    ``replace`` (the shape-check tests break one at a time)."""
    z = functools.partial(jnp.zeros, dtype=jnp.int32)
    fields = dict(
        src_slot=z(rows), dst_slot=z(rows), ckpt_offsets=z((rows, m)), ckpt_slots=z((rows, m)),
        num_seqs=jnp.int32(1),
    )  # fmt: skip
    return StateSlots(**{**fields, **replace})


def abstract_slots(rows: int, m: int) -> StateSlots:
    """The slots as shapes only, for tracing a kernel without data (the lowering tests)."""
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    return StateSlots(sd((rows,), i32), sd((rows,), i32), sd((rows, m), i32),
                      sd((rows, m), i32), sd((), i32))  # fmt: skip


# Poisoned slots of :func:`fused_decode_case`: read and written by no row.
FUSED_UNTOUCHED = [0, 4, 5, 9, 12, 14, 15]


def fused_decode_case(rng, conv_channels: int, kernel: int, state_shape: tuple, dtype):
    """Seven decode rows for the fused conv + delta-rule decodes: ``(conv pool, state pool,
    slots)``. Rows: 0 in place (src == dst) with two checkpoints after the one token, 1 reads
    without writing, 2 from zero, 3 and 4 read a shared slot and write their own (row 3's
    checkpoint at offset 0 writes nothing); 5, 6 are padding. Slots nobody reads hold NaN
    (``FUSED_UNTOUCHED`` must come back so)."""
    rows, num_seqs, m, num_slots = 7, 5, 2, 16
    src = np.array([1, 2, 0, 3, 3, 0, 0], np.int32)
    dst = np.array([1, 0, 6, 7, 8, 0, 0], np.int32)
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [10, 11]
    ck_off[3, 1], ck_slot[3, 1] = 0, 12
    ck_off[4, 0], ck_slot[4, 0] = 1, 13
    conv = np.full((num_slots, kernel - 1, conv_channels), np.nan, np.float32)
    ssm = np.full((num_slots, *state_shape), np.nan, np.float32)
    for s in (1, 2, 3):
        conv[s] = rng.normal(size=(kernel - 1, conv_channels))
        ssm[s] = rng.normal(size=state_shape)
    slots = state_slots(src, dst, ck_off, ck_slot, num_seqs)
    return jnp.asarray(conv, dtype), jnp.asarray(ssm), slots
