"""The Mosaic GPU decode (``pallas_kernels.common.decode_mgpu``) in Pallas' GPU interpreter,
against the decode references.

The interpreter runs the kernel's copies, barriers, buffer rotation, item walk and masked
stores as written, so the slot contract is checked here: a row from zeros (``src`` 0, whose
slot holds NaN), a row that writes nothing (``dst`` 0), a checkpoint at offset 1, a padding
row, and slots no row writes left bit for bit. Several programs, each over several items, with
fewer buffers than items: the pipeline's refills. The GPU check and timing is
``benchmarks/decode_mgpu.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import chunk_scan_mgpu, decode_mgpu
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn.reference import gdn_decode_reference
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda.reference import kda_decode_reference

ROWS, D = 6, 64
bf = jnp.bfloat16


def _slots():
    """Row 1 from zeros, row 2 writes nothing, row 3 to a fresh slot, row 0 also a checkpoint
    at offset 1 (slot 9), row 5 padding. Slots 0, 8 and 10 are read by no row: NaN."""
    src = jnp.array([1, 0, 3, 4, 5, 6], jnp.int32)
    dst = jnp.array([1, 2, 0, 7, 5, 6], jnp.int32)
    ck_off = jnp.zeros((ROWS, 2), jnp.int32).at[0, 1].set(1).at[4, 0].set(2)
    ck_slot = jnp.zeros((ROWS, 2), jnp.int32).at[0, 1].set(9).at[4, 0].set(10)
    return StateSlots(src, dst, ck_off, ck_slot, jnp.int32(ROWS - 1))


def _pool(rng, heads, dtype=jnp.float32):
    pool = jnp.asarray(0.5 * rng.normal(size=(11, heads, D, D)), jnp.float32)
    return pool.at[jnp.array([0, 8, 10])].set(jnp.nan).astype(dtype)


def _check(got, want, pool, *, tol):
    (o, s), (wo, ws) = got, want
    live = ROWS - 1
    np.testing.assert_allclose(
        np.asarray(o[:live], np.float32), np.asarray(wo[:live], np.float32), rtol=tol, atol=tol
    )
    assert not np.asarray(o[live:], np.float32).any(), "a padding row's output must be zeros"
    written = [1, 2, 7, 5, 9]
    np.testing.assert_allclose(
        np.asarray(s[jnp.array(written)], np.float32),
        np.asarray(ws[jnp.array(written)], np.float32),
        rtol=tol,
        atol=tol,
    )
    for slot in (0, 3, 4, 6, 8, 10):  # read or never touched: left as they were
        np.testing.assert_array_equal(
            np.asarray(s[slot], np.float32), np.asarray(pool[slot], np.float32)
        )


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_gdn_matches_the_reference(pool_dtype):
    rng = np.random.default_rng(0)
    hk, hv = 2, 4  # GQA: value head h reads key head h // 2
    q, k = (jnp.asarray(rng.normal(size=(ROWS, hk, D)), bf) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(ROWS, hv, D)), bf)
    a, b = (jnp.asarray(rng.normal(size=(ROWS, hv)), bf) for _ in range(2))
    A_log, dt_bias = jnp.log(jnp.linspace(1.0, 4.0, hv)), jnp.zeros(hv)
    pool, slots = _pool(rng, hv, pool_dtype), _slots()
    args = (q, k, v, a, b, A_log, dt_bias)
    want = gdn_decode_reference(*args, pool, slots)
    # 24 items over 5 programs of 3 buffers: each program refills its buffers
    got = jax.jit(
        lambda p: decode_mgpu.gdn_decode_mgpu(*args, p, slots, programs=5, interpret=True)
    )(pool)
    _check(got, want, pool, tol=2e-2 if pool_dtype == jnp.bfloat16 else 2e-3)


@pytest.mark.parametrize("lag, buffers", [(1, 3), (1, 4), (0, 3)])
def test_stores_left_reading_an_item_match_the_reference(lag, buffers):
    """``lag=1`` (the default): a buffer is refilled while the last item's stores (its own
    commit group) may still read theirs, so ``buffers - 2`` copies are in flight; every item's
    tile and ``o`` in their own buffers. ``lag=0``: the first design, each refill after the
    last item's stores have read."""
    rng = np.random.default_rng(7)
    args, pool = _gdn_args(rng)
    slots = _slots()
    want = gdn_decode_reference(*args, pool, slots)
    run = functools.partial(
        decode_mgpu.gdn_decode_mgpu, lag=lag, buffers=buffers, programs=3, interpret=True
    )
    _check(jax.jit(lambda p: run(*args, p, slots))(pool), want, pool, tol=2e-3)
    with pytest.raises(ValueError, match="lag=1 with 2 buffers"):
        decode_mgpu.gdn_decode_mgpu(*args, pool, slots, lag=1, buffers=2, interpret=True)


def test_kda_matches_the_reference():
    rng = np.random.default_rng(1)
    h = 2
    q, k, v, g = (jnp.asarray(rng.normal(size=(ROWS, h, D)), bf) for _ in range(4))
    b = jnp.asarray(rng.normal(size=(ROWS, h)), bf)
    A_log = jnp.log(jnp.array([1.0, 8.0]))
    dt_bias = jnp.asarray(rng.normal(size=(h, D)), jnp.float32)
    pool, slots = _pool(rng, h), _slots()
    args = (q, k, v, g, b, A_log, dt_bias)
    want = kda_decode_reference(*args, pool, slots)
    # through the engine's entry point (kernel="mgpu"): 12 items over 4 programs of 3 buffers
    got = jax.jit(lambda p: kda_gpu.kda_decode(*args, p, slots, kernel="mgpu", interpret=True))(
        pool
    )
    _check(got, want, pool, tol=2e-3)


def test_items_of_two_blocks_match_the_reference():
    """``item_rows=128``: an item copies 128 rows of ``S^T`` (Dv 128, Dk 64) and updates them
    64 at a time; each half's v and o in place."""
    rng = np.random.default_rng(6)
    h, hk, dv = 32, 16, 128
    q, k = (jnp.asarray(rng.normal(size=(ROWS, hk, D)), bf) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(ROWS, h, dv)), bf)
    a, b = (jnp.asarray(rng.normal(size=(ROWS, h)), bf) for _ in range(2))
    args = (q, k, v, a, b, jnp.log(jnp.linspace(0.5, 4.0, h)), jnp.zeros(h))
    pool = jnp.asarray(0.5 * rng.normal(size=(11, h, dv, D)), jnp.float32)
    pool = pool.at[jnp.array([0, 8, 10])].set(jnp.nan)
    slots = _slots()
    want = gdn_decode_reference(*args, pool, slots)
    run = functools.partial(
        decode_mgpu.gdn_decode_mgpu, item_rows=128, buffers=3, programs=5, interpret=True
    )
    got = jax.jit(lambda p: run(*args, p, slots))(pool)
    _check(got, want, pool, tol=2e-3)


def test_stream_only_stores_each_tile_as_read():
    """The benchmark's streaming ceiling (``stream_only``) moves the same bytes: each row's
    source tile lands in its destination and checkpoint slots unchanged."""
    rng = np.random.default_rng(3)
    args, pool = _gdn_args(rng)
    slots = _slots()
    acts = decode_mgpu.gdn_inputs(*args)
    _, got = decode_mgpu.decode_mgpu(
        acts, pool, slots, out_dtype=jnp.float32, name="gdn_decode", stream_only=True,
        interpret=True,
    )  # fmt: skip
    for src, dst in [(1, 1), (0, 2), (4, 7), (1, 9), (5, 5)]:  # row 0's checkpoint: slot 9
        np.testing.assert_array_equal(np.asarray(got[dst]), np.asarray(pool[src]))
    for slot in (3, 6):  # row 2 writes nothing, row 5 is padding
        np.testing.assert_array_equal(np.asarray(got[slot]), np.asarray(pool[slot]))


def test_unsupported_shapes_name_why():
    assert "Dk=96" in decode_mgpu.unsupported_reason(8, 32, 96, 128, 2, jnp.float32)
    assert "Dv=96" in decode_mgpu.unsupported_reason(8, 32, 128, 96, 2, jnp.float32)
    assert "shared memory" in decode_mgpu.unsupported_reason(1 << 16, 32, 128, 128, 2, jnp.float32)
    assert decode_mgpu.unsupported_reason(256, 32, 128, 128, 2, jnp.float32) is None


def test_benchmark_dry_run_checks_and_times(tmp_path, monkeypatch):
    """``benchmarks/decode_mgpu.py --dry-run`` (interpret mode, tiny shapes): both families'
    checks pass against the reference, and every timed entry ran (no ``failed``)."""
    import json
    import sys

    from benchmarks import decode_mgpu as bench

    out = tmp_path / "d.json"
    monkeypatch.setattr(sys, "argv", ["decode_mgpu", "--dry-run", "--bf16", "--out", str(out)])
    bench.main()
    summary = json.loads(out.read_text())
    assert summary["gdn_mgpu_check"]["ok"] and summary["kda_mgpu_check"]["ok"]
    timed = [k for k in summary if k.endswith("_B8")]
    want = {"gdn_mgpu_B8", "gdn_mgpu_first_B8", "kda_mgpu_kernel_only_B8", "gdn_decode_B8",
            "kda_mgpu_bf16_B8", "gdn_decode_bf16_B8"}  # fmt: skip
    assert want <= set(timed), timed
    assert not [k for k in timed if "failed" in summary[k]], summary


def _gdn_args(rng, dk=D):
    hk, hv = 2, 4
    q, k = (jnp.asarray(rng.normal(size=(ROWS, hk, dk)), bf) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(ROWS, hv, D)), bf)
    a, b = (jnp.asarray(rng.normal(size=(ROWS, hv)), bf) for _ in range(2))
    A_log, dt_bias = jnp.log(jnp.linspace(1.0, 4.0, hv)), jnp.zeros(hv)
    pool = jnp.asarray(0.5 * rng.normal(size=(11, hv, D, dk)), jnp.float32)
    return (q, k, v, a, b, A_log, dt_bias), pool


def test_engine_decode_runs_it_when_asked(monkeypatch):
    """``gdn_decode(kernel="mgpu")`` (what ``HYJAX_DECODE_KERNEL=mgpu`` makes the default) runs
    this kernel and matches the reference; asked for a shape it cannot take, a ValueError names
    it; in interpret mode the default stays Triton's."""
    from pallas_kernels.gdn import gpu as gdn_gpu

    rng = np.random.default_rng(2)
    args, pool = _gdn_args(rng)
    pool = pool.at[0].set(jnp.nan)
    slots = _slots()
    want = gdn_decode_reference(*args, pool, slots)
    calls = []
    real = decode_mgpu.gdn_decode_mgpu
    monkeypatch.setattr(
        decode_mgpu, "gdn_decode_mgpu", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = gdn_gpu.gdn_decode(*args, pool, slots, kernel="mgpu", interpret=True)
    assert calls, "kernel='mgpu' must run the Mosaic GPU decode"
    _check(got, want, pool, tol=2e-3)
    monkeypatch.setattr(decode_mgpu, "DECODE_DEFAULT", "mgpu")
    gdn_gpu.gdn_decode(*args, pool, slots, interpret=True)  # interpret: Triton's
    assert len(calls) == 1
    args32, pool32 = _gdn_args(rng, dk=32)
    with pytest.raises(ValueError, match="Dk=32"):
        gdn_gpu.gdn_decode(*args32, pool32, slots, kernel="mgpu", interpret=True)
    with pytest.raises(ValueError, match="kernel='fast'"):
        gdn_gpu.gdn_decode(*args, pool, slots, kernel="fast", interpret=True)


def test_default_falls_back_with_one_log_line(monkeypatch, caplog):
    """Under ``HYJAX_DECODE_KERNEL=mgpu`` a batch the kernel cannot take runs Triton's, logged
    once a reason; a bad variable value is an error naming it."""
    monkeypatch.setattr(decode_mgpu, "DECODE_DEFAULT", "mgpu")
    chunk_scan_mgpu._log_fallback.cache_clear()
    sds, rows = jax.ShapeDtypeStruct, 8
    z = jnp.zeros(rows, jnp.int32)
    slots = StateSlots(z, z, jnp.zeros((rows, 2), jnp.int32), jnp.zeros((rows, 2), jnp.int32), 8)
    good, bad = sds((9, 32, 128, 128), jnp.float32), sds((9, 32, 96, 128), jnp.float32)  # Dv 96
    with caplog.at_level("WARNING", logger=chunk_scan_mgpu.__name__):
        assert not decode_mgpu.decode_is_mgpu(None, bad, slots, 2, False)
        assert not decode_mgpu.decode_is_mgpu(None, bad, slots, 2, False)
    assert len([r for r in caplog.records if "Dv=96" in r.getMessage()]) == 1
    assert decode_mgpu.decode_is_mgpu(None, good, slots, 2, False)
    assert not decode_mgpu.decode_is_mgpu("triton", good, slots, 2, False)
    monkeypatch.setattr(decode_mgpu, "DECODE_DEFAULT", "fast")
    with pytest.raises(ValueError, match="HYJAX_DECODE_KERNEL='fast'"):
        decode_mgpu.decode_is_mgpu(None, good, slots, 2, False)
