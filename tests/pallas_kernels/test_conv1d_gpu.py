"""The Triton-lowered causal conv1d kernels (prefill, decode update) vs the pure-JAX reference,
in Pallas' interpret mode on CPU (no GPU needed). Timing them: ``benchmarks/conv1d_kernels.py``
(prefill) and ``benchmarks/decode_variants.py`` (the update before a decode kernel), on a GPU.

The conv windows written to the pool are copies of inputs, so the pool must come back
bit-identical to the reference's (NaN-poisoned slots nobody reads or writes included); the
outputs are the same float32 sums in the same order.
"""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyjax.layers.conv_channels import pack_conv_channels, split_qkvz
from pallas_kernels.conv1d import gpu
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from tests.pallas_kernels.ragged_cases import (
    FUSED_UNTOUCHED,
    abstract_slots,
    assert_close,
    assert_rel_close,
    fused_decode_case,
    ragged_case,
    state_slots,
    zero_slots,
)


def _run_both(x, w, pool, qsl, slots, **tiles):
    args = (x, w, pool, jnp.asarray(qsl, jnp.int32), slots)
    want = jax.jit(causal_conv1d_prefill_reference)(*args)
    got = jax.jit(lambda *a: gpu.causal_conv1d_prefill(*a, **tiles, interpret=True))(*args)
    return got, want


def _check(got, want, dtype):
    (got_y, got_s), (want_y, want_s) = got, want
    assert got_y.dtype == dtype and got_s.dtype == want_s.dtype
    assert not np.isnan(np.asarray(got_y, np.float32)).any(), "a poisoned slot was read"
    np.testing.assert_array_equal(
        np.asarray(got_s, np.float32), np.asarray(want_s, np.float32), err_msg="conv state pool"
    )
    if dtype == jnp.float32:
        assert_close(got_y, want_y, rtol=1e-6, atol=1e-6, what="outputs")
    else:  # the same f32 sums, rounded to bf16: at most one bf16 step apart
        assert_rel_close(got_y, want_y, tol=8e-3, what="outputs")


CASES = [
    # (lens, channels, kernel width, dtype, block_t, block_c)
    ([1, 63, 64, 65, 130], 40, 4, jnp.float32, 32, 128),
    ([1, 63, 64, 65, 130], 40, 4, jnp.bfloat16, 16, 16),  # C not a multiple of the tile
    ([2, 1, 5, 1, 3], 24, 4, jnp.float32, 4, 8),  # shorter than K - 1: windows from the state
    ([64, 1, 1], 256, 3, jnp.bfloat16, 32, 128),
    ([200, 7], 40, 2, jnp.float32, 16, 32),
    ([9, 4, 17], 20, 6, jnp.float32, 8, 16),  # K - 1 = 5: a window of 8 rows, 3 masked
    ([150, 3, 40], 300, 4, jnp.bfloat16, 16, 256),  # general-path tiles in 2 x 128 channels
    ([130, 70], 72, 4, jnp.float32, 16, 512),  # the default tiles, shrunk to C
]
IDS = [
    f"{lens=}_{c=}_{kw=}_{jnp.dtype(dt).name}_{bt=}_{bc=}".replace(" ", "")
    for lens, c, kw, dt, bt, bc in CASES
]


@pytest.mark.parametrize("lens,c,kw,dtype,bt,bc", CASES, ids=IDS)
def test_prefill_matches_reference(lens, c, kw, dtype, bt, bc):
    """Ragged rows (src 0 and src > 0, dst 0 and dst > 0, padding rows and tokens),
    checkpoints at offsets 1, 64, len // 2 and len."""
    rng = np.random.default_rng(sum(lens) + c + kw)
    case = ragged_case(lens, max_ckpt=3)
    x = jnp.asarray(rng.normal(size=(case.num_tokens, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    pool = jnp.asarray(case.pool(rng, (kw - 1, c), np.float32), dtype)
    got, want = _run_both(x, w, pool, case.query_start_loc, case.slots(), block_t=bt, block_c=bc)
    _check(got, want, dtype)
    y = np.asarray(got[0], np.float32)
    assert np.all(y[case.query_start_loc[-1] :] == 0), "padding tokens must give 0"


def _short_in_place_case(rng, c, kw, dtype):
    """Rows that read and write the same slot, most shorter than K - 1, with checkpoints
    inside the window (offsets 0 .. 2) and a row whose last window is all state."""
    lens = [1, 2, 1, 3, 8]
    qsl = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    rows = len(lens) + 1
    src = np.array([1, 2, 0, 3, 4, 0], np.int32)
    dst = np.array([1, 2, 5, 3, 4, 0], np.int32)  # in place, except row 2 (fresh slot 5)
    ck_off = np.zeros((rows, 2), np.int32)
    ck_slot = np.zeros((rows, 2), np.int32)
    ck_off[1], ck_slot[1] = [1, 0], [6, 7]  # offset 0: the source window itself
    ck_off[3], ck_slot[3] = [2, 1], [8, 9]
    ck_off[4], ck_slot[4] = [2, 7], [10, 11]
    num_slots = 14
    pool = np.full((num_slots, kw - 1, c), np.nan, np.float32)
    pool[1:5] = rng.normal(size=(4, kw - 1, c))
    x = jnp.asarray(rng.normal(size=(sum(lens) + 3, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    slots = state_slots(src, dst, ck_off, ck_slot, len(lens))
    return x, w, jnp.asarray(pool, dtype), qsl, slots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kw", [4, 5])
def test_short_rows_in_place(dtype, kw):
    """src == dst on rows shorter than K - 1: the outputs and the new windows read the old
    window, which the same launch overwrites."""
    rng = np.random.default_rng(kw)
    args = _short_in_place_case(rng, 48, kw, dtype)
    got, want = _run_both(*args, block_t=4, block_c=16)
    _check(got, want, dtype)


def test_state_dtype_wider_than_inputs():
    """bf16 inputs with a float32 conv state: the windows are widened exactly."""
    rng = np.random.default_rng(3)
    x, w, pool, qsl, slots = _short_in_place_case(rng, 32, 4, jnp.bfloat16)
    got, want = _run_both(x, w, pool.astype(jnp.float32), qsl, slots, block_t=8)
    _check(got, want, jnp.bfloat16)


def test_one_token_rows_many_per_tile():
    """A decode-like batch (one token per row, 37 rows), 16 rows a token tile: the bisection
    over ``query_start_loc`` must find every row."""
    rng = np.random.default_rng(4)
    rows, c, kw = 37, 16, 4
    qsl = np.arange(rows + 1, dtype=np.int32)
    src = np.arange(1, rows + 1, dtype=np.int32)
    dst = np.arange(1, rows + 1, dtype=np.int32)
    none = np.zeros((rows, 1), np.int32)
    pool = jnp.asarray(rng.normal(size=(rows + 1, kw - 1, c)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(rows, c)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(c, kw)), jnp.float32)
    slots = state_slots(src, dst, none, none, rows - 2)  # two padding rows
    got, want = _run_both(x, w, pool, qsl, slots, block_t=16)
    _check(got, want, jnp.float32)


BAD = {
    "x_rank": (dict(x=jnp.zeros((10, 2, 8))), r"x .* must be \[T, C\]"),
    "weight_channels": (dict(weight=jnp.zeros((7, 4))), "weight .* must be"),
    "kernel_width": (dict(weight=jnp.zeros((8, 12))), "kernel width K=12"),
    "state_shape": (dict(conv_state=jnp.zeros((4, 2, 8))), "conv_state .* must be"),
    "qsl_shape": (dict(query_start_loc=jnp.zeros(2, jnp.int32)), "query_start_loc .* must be"),
    "block_c": (dict(block_c=48), "block_c=48 must be a power of two"),
}


@pytest.mark.parametrize("bad,match", BAD.values(), ids=BAD.keys())
def test_prefill_rejects_bad_shapes(bad, match):
    z = jnp.zeros
    kw = dict(
        x=z((10, 8)), weight=z((8, 4)), conv_state=z((4, 3, 8)),
        query_start_loc=z(4, jnp.int32), slots=zero_slots(3, 2),
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        gpu.causal_conv1d_prefill(**{**kw, **bad}, interpret=True)


def test_kernel_lowers_to_triton_at_80b_shapes():
    """Qwen3-Next-80B's GDN conv: 2 * 16 * 128 + 32 * 128 = 8192 channels, width 4, bf16."""
    c, kw, n, rows, m = 8192, 4, 4096, 8, 2
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = [sd((n, c), bf), sd((c, kw), bf), sd((20, kw - 1, c), bf),
            sd((rows + 1,), jnp.int32), abstract_slots(rows, m)]  # fmt: skip
    lowered = jax.jit(gpu.causal_conv1d_prefill).trace(*args)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_padding_rows_with_tokens_give_zeros():
    """Tokens past ``query_start_loc[num_seqs]`` are padding even inside a padding row's span
    (a whole tile of them, which the inner-tile path must not compute)."""
    rng = np.random.default_rng(5)
    c, kw = 16, 4
    qsl = np.array([0, 20, 60], np.int32)
    one, none = np.array([1, 2], np.int32), np.zeros((2, 1), np.int32)
    pool = jnp.asarray(rng.normal(size=(3, kw - 1, c)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(64, c)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(c, kw)), jnp.float32)
    got, want = _run_both(x, w, pool, qsl, state_slots(one, one, none, none, 1), block_t=16)
    _check(got, want, jnp.float32)


# ----------------------------------------------------------------------------- decode update


@pytest.mark.parametrize(
    "c,kw,dtype,block_c,splits",
    [(64, 4, jnp.float32, 16, None), (96, 4, jnp.bfloat16, 256, (16, 16, 64)),
     (48, 3, jnp.float32, 256, (16, 16, 16)), (40, 2, jnp.float32, 8, (8, 8, 24))],
    ids=["one_output_4_tiles", "qkv_bf16_tile32", "k3_qkv", "k2_tile8"],
)  # fmt: skip
def test_update_matches_reference(c, kw, dtype, block_c, splits):
    """Rows in place with checkpoints, read-only, from zero, sharing a source slot, padding
    (``fused_decode_case``): the pool bit-identical to the reference's (its poisoned slots
    untouched), the outputs the same f32 sums."""
    rng = np.random.default_rng(c + kw)
    conv, _, slots = fused_decode_case(rng, c, kw, (1,), dtype)
    x = jnp.asarray(rng.normal(size=(slots.num_rows, c)), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)) * 0.5, dtype)
    want = jax.jit(causal_conv1d_update_reference)(x, w, conv, slots)
    got = jax.jit(
        lambda *a: gpu.causal_conv1d_update(*a, splits=splits, block_c=block_c, interpret=True)
    )(x, w, conv, slots)
    assert len(got) == (2 if splits is None else len(splits) + 1)
    ys, pool = got[:-1], got[-1]
    assert [y.shape[1] for y in ys] == list(splits or (c,))
    _check((jnp.concatenate(ys, axis=1), pool), want, dtype)
    assert np.isnan(np.asarray(pool, np.float32)[FUSED_UNTOUCHED]).all()


@pytest.mark.parametrize(
    "bad,match",
    [({"splits": (8, 8)}, r"splits \(8, 8\) must sum to the 24 channels"),
     ({"x": jnp.zeros((3, 24))}, r"decode rows 3 must equal"),
     ({"x": jnp.zeros((2, 12)), "weight": jnp.zeros((12, 4)),
       "conv_state": jnp.zeros((4, 3, 12))}, r"no power-of-two tile of >= 8 divides")],
    ids=["splits_sum", "rows", "channels_12"],
)  # fmt: skip
def test_update_rejects_bad_shapes(bad, match):
    z = jnp.zeros
    kw = dict(x=z((2, 24)), weight=z((24, 4)), conv_state=z((4, 3, 24)), slots=zero_slots(2, 1))
    with pytest.raises(ValueError, match=match):
        gpu.causal_conv1d_update(**{**kw, **bad}, interpret=True)


def test_update_lowers_to_triton_at_80b_shapes():
    """Qwen3-Next-80B's GDN conv at decode, handed back as q | k | v."""
    c, kw, rows = 8192, 4, 8
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    fn = jax.jit(lambda *a: gpu.causal_conv1d_update(*a, splits=(2048, 2048, 4096)))
    args = [sd((rows, c), bf), sd((c, kw), bf), sd((20, kw - 1, c), bf), abstract_slots(rows, 2)]
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _pack_qkvz(qkvz, hk, dk, dv, ratio):
    """The conv's q | k | v channels out of a GDN projection's ``[T, Hk * W]`` output, as the
    layer packs them (the oracle's input)."""
    q, k, v, _ = split_qkvz(qkvz, hk, dk, dv, ratio)
    return pack_conv_channels(q, k, v, 1)


QKVZ_CASES = [
    # (lens, hk, dk, dv, ratio, dtype, block_t, block_c): run = min(Dk, r Dv, BC)
    ([1, 63, 64, 65, 130], 2, 16, 8, 2, jnp.float32, 16, 32),  # run 16 < BC: two runs a tile
    ([150, 3, 40], 2, 32, 16, 2, jnp.bfloat16, 16, 64),  # run 32: q and k tiles span heads
    ([2, 1, 5, 1, 3], 1, 16, 16, 1, jnp.float32, 4, 16),  # rows shorter than K - 1
]


@pytest.mark.parametrize("lens,hk,dk,dv,ratio,dtype,bt,bc", QKVZ_CASES)
def test_prefill_reads_qkvz_in_place(lens, hk, dk, dv, ratio, dtype, bt, bc):
    """The conv of q | k | v read where the GDN projection leaves them and handed back apart:
    the packed call's windows bit for bit, its outputs split, z never read."""
    rng = np.random.default_rng(sum(lens) + dk)
    case = ragged_case(lens, max_ckpt=3)
    kw, hv = 4, hk * ratio
    c = 2 * hk * dk + hv * dv
    qkvz = jnp.asarray(rng.normal(size=(case.num_tokens, hk * (2 * dk + 2 * ratio * dv))), dtype)
    w = jnp.asarray(rng.normal(size=(c, kw)), dtype)
    pool = jnp.asarray(case.pool(rng, (kw - 1, c), np.float32), dtype)
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    packed = _pack_qkvz(qkvz, hk, dk, dv, ratio)
    want_y, want_s = jax.jit(causal_conv1d_prefill_reference)(packed, w, pool, qsl, case.slots())
    fn = jax.jit(
        lambda *a: gpu.causal_conv1d_prefill_qkvz(
            *a, num_k_heads=hk, head_dims=(dk, dv), block_t=bt, block_c=bc, interpret=True
        )
    )
    *got_ys, got_s = fn(qkvz, w, pool, qsl, case.slots())
    assert [y.shape for y in got_ys] == [(case.num_tokens, n) for n in (hk * dk, hk * dk, hv * dv)]
    _check((jnp.concatenate(got_ys, axis=1), got_s), (want_y, want_s), dtype)
    # z is not an input: poisoning it changes nothing
    z_cols = np.concatenate(
        [h * (2 * dk + 2 * ratio * dv) + np.arange(2 * dk + ratio * dv, 2 * dk + 2 * ratio * dv)
         for h in range(hk)]
    )  # fmt: skip
    *poisoned, _ = fn(qkvz.at[:, z_cols].set(jnp.nan), w, pool, qsl, case.slots())
    for a, b in zip(poisoned, got_ys, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_prefill_qkvz_rejects_bad_shapes():
    case = ragged_case([5, 3])
    w = jnp.zeros((2 * 16 + 2 * 8, 4))  # hk=1, dk=16, hv=2, dv=8
    pool = jnp.zeros((4, 3, 48))
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    call = functools.partial(gpu.causal_conv1d_prefill_qkvz, interpret=True)
    with pytest.raises(ValueError, match="is not q | k | v"):
        call(jnp.zeros((8, 64)), w, pool, qsl, case.slots(), num_k_heads=1, head_dims=(16, 7))
    with pytest.raises(ValueError, match=r"qkvz \(8, 60\) is not"):
        call(jnp.zeros((8, 60)), w, pool, qsl, case.slots(), num_k_heads=1, head_dims=(16, 8))


def test_prefill_qkvz_packs_heads_without_a_run(caplog):
    """Dk = r Dv = 12: no run of >= 8 channels divides both, so XLA packs q | k | v around the
    plain kernel, with one log line, and the result is the reference's."""
    dk, dv, ratio = 12, 12, 1
    hk = 2
    rng = np.random.default_rng(dk)
    case = ragged_case([5, 70, 1], max_ckpt=2)
    c = 2 * hk * dk + hk * ratio * dv
    qkvz = jnp.asarray(rng.normal(size=(case.num_tokens, hk * (2 * dk + 2 * ratio * dv))))
    qkvz = qkvz.astype(jnp.float32)
    w = jnp.asarray(rng.normal(size=(c, 4)), jnp.float32)
    pool = jnp.asarray(case.pool(rng, (3, c), np.float32))
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    want = causal_conv1d_prefill_reference(
        _pack_qkvz(qkvz, hk, dk, dv, ratio), w, pool, qsl, case.slots()
    )
    gpu._log_packed.cache_clear()
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        *ys, state = gpu.causal_conv1d_prefill_qkvz(
            qkvz, w, pool, qsl, case.slots(), num_k_heads=hk, head_dims=(dk, dv), interpret=True
        )
    shapes = [(case.num_tokens, n) for n in (hk * dk, hk * dk, hk * ratio * dv)]
    assert [y.shape for y in ys] == shapes
    call = functools.partial(gpu.causal_conv1d_prefill_qkvz, num_k_heads=hk, head_dims=(dk, dv))
    assert "concatenate" in str(jax.make_jaxpr(call)(qkvz, w, pool, qsl, case.slots()))  # packed
    _check((jnp.concatenate(ys, axis=1), state), want, jnp.float32)
    assert sum("packed path" in r.getMessage() for r in caplog.records) == 1


def test_prefill_qkvz_cuts_the_tile_to_four_runs():
    """Dk = 16 at the default 256-channel tile: 16 runs a tile would be unrolled; the launch
    takes 64-channel tiles instead (the grid's channel axis: C / 64)."""
    hk, dk, dv, ratio = 2, 16, 8, 2
    c = 2 * hk * dk + hk * ratio * dv
    sd = jax.ShapeDtypeStruct
    call = functools.partial(gpu.causal_conv1d_prefill_qkvz, num_k_heads=hk, head_dims=(dk, dv))
    args = (sd((40, hk * (2 * dk + 2 * ratio * dv)), jnp.float32), sd((c, 4), jnp.float32),
            sd((6, 3, c), jnp.float32), sd((3,), jnp.int32), abstract_slots(2, 2))  # fmt: skip
    text = str(jax.make_jaxpr(call)(*args))
    grids = re.findall(r"GridMapping\(grid=\((\d+), (\d+)\)", text)
    assert [int(g[1]) for g in grids] == [-(-c // (gpu.MAX_RUNS_PER_TILE * 16))]  # 96 / 64


def test_prefill_qkvz_lowers_to_triton_at_80b_shapes():
    sd = jax.ShapeDtypeStruct
    hk, dk, dv, ratio = 16, 128, 128, 2
    c = 2 * hk * dk + hk * ratio * dv
    qkvz = sd((512, hk * (2 * dk + 2 * ratio * dv)), jnp.bfloat16)
    fn = functools.partial(gpu.causal_conv1d_prefill_qkvz, num_k_heads=hk, head_dims=(dk, dv))
    lowered = jax.jit(fn).trace(
        qkvz, sd((c, 4), jnp.bfloat16), sd((8, 3, c), jnp.bfloat16), sd((5,), jnp.int32),
        abstract_slots(4, 2),
    )  # fmt: skip
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


SPLIT_CASES = [
    # (lens, widths, dtype, block_t, block_c)
    ([1, 63, 64, 65, 130], (32, 32, 32), jnp.float32, 16, 32),  # a Kimi layer's q, k, v
    ([150, 3, 40], (64, 64, 40), jnp.bfloat16, 8, 256),  # tile cut to 64; the last one partial
    ([2, 1, 5, 1, 3], (16, 48), jnp.float32, 4, 16),  # rows shorter than K - 1, two inputs
]


@pytest.mark.parametrize("lens,widths,dtype,bt,bc", SPLIT_CASES)
def test_prefill_reads_inputs_apart(lens, widths, dtype, bt, bc):
    """The conv of channels held in several arrays, each read in place and its output written
    apart: the packed call's windows bit for bit, no concatenation in the program."""
    rng = np.random.default_rng(sum(lens) + sum(widths))
    case = ragged_case(lens, max_ckpt=3)
    c = sum(widths)
    xs = tuple(jnp.asarray(rng.normal(size=(case.num_tokens, n)), dtype) for n in widths)
    w = jnp.asarray(rng.normal(size=(c, 4)), dtype)
    pool = jnp.asarray(case.pool(rng, (3, c), np.float32), dtype)
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    want = jax.jit(causal_conv1d_prefill_reference)(
        jnp.concatenate(xs, axis=1), w, pool, qsl, case.slots()
    )
    call = functools.partial(
        gpu.causal_conv1d_prefill_split, block_t=bt, block_c=bc, interpret=True
    )
    ys, state = jax.jit(call)(xs, w, pool, qsl, case.slots())
    assert [y.shape for y in ys] == [x.shape for x in xs]
    _check((jnp.concatenate(ys, axis=1), state), want, dtype)
    jaxpr = str(jax.make_jaxpr(call)(xs, w, pool, qsl, case.slots()))
    assert "concatenate" not in jaxpr and jaxpr.count("pallas_call") == 1


def test_prefill_split_packs_widths_without_a_tile(caplog):
    """Widths 12, 12, 12: no tile of >= 8 channels lies in one input, so XLA packs them around
    the plain kernel, with one log line, and the result is the reference's."""
    rng = np.random.default_rng(3)
    case = ragged_case([5, 70, 1], max_ckpt=2)
    xs = tuple(jnp.asarray(rng.normal(size=(case.num_tokens, 12)), jnp.float32) for _ in "qkv")
    w = jnp.asarray(rng.normal(size=(36, 4)), jnp.float32)
    pool = jnp.asarray(case.pool(rng, (3, 36), np.float32))
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    want = causal_conv1d_prefill_reference(jnp.concatenate(xs, axis=1), w, pool, qsl, case.slots())
    gpu._log_packed_inputs.cache_clear()
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        ys, state = gpu.causal_conv1d_prefill_split(xs, w, pool, qsl, case.slots(), interpret=True)
    _check((jnp.concatenate(ys, axis=1), state), want, jnp.float32)
    assert sum("packed path" in r.getMessage() for r in caplog.records) == 1


def test_prefill_split_rejects_bad_inputs():
    case = ragged_case([5, 3])
    qsl = jnp.asarray(case.query_start_loc, jnp.int32)
    w, pool = jnp.zeros((64, 4)), jnp.zeros((4, 3, 64))
    call = functools.partial(gpu.causal_conv1d_prefill_split, interpret=True)
    with pytest.raises(ValueError, match="are not the 64 channels"):
        call((jnp.zeros((8, 32)), jnp.zeros((8, 16))), w, pool, qsl, case.slots())
    with pytest.raises(ValueError, match="differ in T or dtype"):
        call((jnp.zeros((8, 32)), jnp.zeros((9, 32))), w, pool, qsl, case.slots())


def test_prefill_split_lowers_to_triton_at_kimi_shapes():
    """Kimi-Linear-48B's KDA conv: q, k, v of 32 heads x 128 apart."""
    sd = jax.ShapeDtypeStruct
    p = 32 * 128
    xs = tuple(sd((512, p), jnp.bfloat16) for _ in "qkv")
    lowered = jax.jit(gpu.causal_conv1d_prefill_split).trace(
        xs, sd((3 * p, 4), jnp.bfloat16), sd((8, 3, 3 * p), jnp.bfloat16), sd((5,), jnp.int32),
        abstract_slots(4, 2),
    )  # fmt: skip
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
