"""The Mosaic GPU k-token decode (``pallas_kernels.common.multi_decode_mgpu``) in Pallas' GPU
interpreter, against the families' prefill references, on ``test_multi_decode_gpu``'s verify
batches: ragged rows of 0..k tokens, ``src`` 0 and > 0, ``dst`` 0 and in place, a checkpoint
after every token or at the last token and past the row, padding rows that name real slots,
and a NaN pool (a stray read shows in the outputs, a stray write in a slot that must stay NaN).
Few programs, several items each, fewer buffers than items: the refills and the store buffers'
alternation across items. The GPU check and timing is ``benchmarks/multi_decode.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import decode_mgpu, multi_decode_mgpu
from pallas_kernels.common import multi_decode_gpu as md
from pallas_kernels.gdn.reference import gdn_prefill_reference
from pallas_kernels.kda.reference import kda_prefill_reference
from tests.pallas_kernels.ragged_cases import assert_close
from tests.pallas_kernels.test_multi_decode_gpu import (
    LENS,
    LONG_ROW,
    _gdn_inputs,
    _kda_inputs,
    assert_long_row_poisoned,
    verify_case,
)

D = 64


_gdn = functools.partial(_gdn_inputs, hk=2, hv=4, dk=D, dv=128)  # two Dv blocks a head, GQA
_kda = functools.partial(_kda_inputs, h=2, dk=D, dv=D)


FAMILIES = {"gdn": (_gdn, gdn_prefill_reference, md.gdn_multi_decode),
            "kda": (_kda, kda_prefill_reference, md.kda_multi_decode)}  # fmt: skip


def _run(family, case, *, max_tokens, seed=0, **kw):
    make, reference, kernel = FAMILIES[family]
    rng = np.random.default_rng(seed)
    inputs, slot_shape = make(rng, case.num_tokens)
    pool = case.pool(rng, slot_shape)
    args = (*inputs, jnp.asarray(pool), jnp.asarray(case.qsl), case.slots())
    want = jax.jit(reference)(*args)
    fn = functools.partial(kernel, max_tokens=max_tokens, kernel="mgpu", interpret=True, **kw)
    return jax.jit(fn)(*args), want, pool


def _check(case, got, want, pool):
    (got_o, got_s), (want_o, want_s) = got, want
    assert not np.isnan(np.asarray(got_o)).any(), "a NaN slot was read"
    assert_close(got_o, want_o, rtol=2e-5, atol=2e-5, what="outputs")
    assert_close(got_s, want_s, rtol=2e-5, atol=2e-5, what="state pool")
    got_s, want_s = np.asarray(got_s), np.asarray(want_s)
    written = set(case.dst[: case.num_seqs]) | set(case.ck_slot[: case.num_seqs].ravel())
    for slot in range(case.num_slots):
        if not (slot in written and not np.isnan(want_s[slot]).all()):
            np.testing.assert_array_equal(got_s[slot], pool[slot], err_msg=f"{slot=}")


@pytest.mark.parametrize(
    "family, k, ckpts",
    [("gdn", 1, "every"), ("gdn", 2, "some"), ("gdn", 4, "every"), ("kda", 2, "every"),
     ("kda", 4, "some")],
)  # fmt: skip
def test_matches_prefill_reference(family, k, ckpts):
    case = verify_case(LENS[k], k, ckpts)
    got, want, pool = _run(family, case, max_tokens=k, seed=k)
    _check(case, got, want, pool)


def test_two_buffers_and_odd_token_counts_match_the_reference():
    """Two programs of two buffers (one item in flight: every step refills), rows of up to
    three tokens. (An odd count is where the store buffers' alternation must count the
    program's tokens, not the row's; the interpreter's copies complete at once, so a buffer
    rewritten while its store still reads it shows only on a GPU: the benchmark's check.)"""
    case = verify_case([3, 1, 3, 2], 3, "every")
    rng = np.random.default_rng(5)
    inputs, slot_shape = _gdn(rng, case.num_tokens)
    pool = case.pool(rng, slot_shape)
    qsl, slots = jnp.asarray(case.qsl), case.slots()
    want = jax.jit(gdn_prefill_reference)(*inputs, jnp.asarray(pool), qsl, slots)

    def run(pool):
        acts = decode_mgpu.gdn_inputs(*inputs)
        return multi_decode_mgpu.multi_decode_mgpu(
            acts, pool, qsl, slots, max_tokens=3, out_dtype=jnp.float32, name="gdn_multi_decode",
            programs=2, buffers=2, interpret=True,
        )  # fmt: skip

    _check(case, jax.jit(run)(jnp.asarray(pool)), want, pool)


def test_row_longer_than_max_tokens_is_poisoned_under_jit():
    got, want, _ = _run("kda", LONG_ROW, max_tokens=2)
    assert_long_row_poisoned(got, want, 2e-5)
    assert np.isnan(np.asarray(got[0])[2]).all(), "its third token's output too"


def test_route_default_and_unsupported_shapes(monkeypatch, caplog):
    """Triton's unless asked (and in interpret mode); asked for a shape it cannot take, a
    ValueError names why; by default on a GPU, that shape falls back with one log line."""
    case = verify_case([2, 1], 2, "every")
    slots = case.slots()
    pool = jnp.zeros((case.num_slots, 4, 128, D))
    is_mgpu = multi_decode_mgpu.multi_decode_is_mgpu
    assert not is_mgpu(None, pool, slots, 2, 2, interpret=True)
    assert is_mgpu("mgpu", pool, slots, 2, 2, interpret=True)
    odd = jnp.zeros((case.num_slots, 4, 96, D))
    with pytest.raises(ValueError, match="Dv=96"):
        is_mgpu("mgpu", odd, slots, 2, 2, interpret=False)
    # the default ("auto"): this kernel on a GPU from MGPU_MIN_TOKENS tokens a row on
    monkeypatch.setattr(multi_decode_mgpu, "MULTI_DECODE_DEFAULT", "auto")
    n = multi_decode_mgpu.MGPU_MIN_TOKENS
    assert multi_decode_mgpu.MGPU_MIN_TOKENS == 4
    assert is_mgpu(None, pool, slots, n, 2, interpret=False)
    assert not is_mgpu(None, pool, slots, n - 1, 2, interpret=False)
    assert not is_mgpu(None, pool, slots, n, 2, interpret=True)
    assert not is_mgpu("triton", pool, slots, n, 2, interpret=False)
    monkeypatch.setattr(multi_decode_mgpu, "MULTI_DECODE_DEFAULT", "mgpu")
    with caplog.at_level("WARNING"):
        assert not is_mgpu(None, odd, slots, 2, 2, interpret=False)
    assert "Dv=96" in caplog.text
    why = multi_decode_mgpu.unsupported_reason(64, 32, 128, 128, 16, 16, jnp.float32, 3)
    assert "shared memory" in why


def test_lowers_to_mosaic_gpu_at_real_shapes():
    """Qwen3-Next-80B GDN (Hk 16, Hv 32, D 128) and Kimi-Linear-48B KDA (H 32, D 128), 64 rows
    of k + 1 = 4 tokens, a checkpoint after each: layouts, copies and shared memory pass Mosaic
    GPU's checks, the pool aliased in and out."""
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    rows, k, d = 64, 4, 128
    t = rows * k
    from tests.pallas_kernels.ragged_cases import abstract_slots

    slots, qsl = abstract_slots(rows, k), sd((rows + 1,), i32)
    hk, hv = 16, 32
    gdn = [sd((t, hk, d), bf)] * 2 + [sd((t, hv, d), bf)] + [sd((t, hv), bf)] * 2
    gdn += [sd((hv,), f32)] * 2 + [sd((rows * (k + 2), hv, d, d), f32), qsl, slots]
    h = 32
    kda = [sd((t, h, d), bf)] * 4 + [sd((t, h), bf), sd((h,), f32), sd((h, d), f32)]
    kda += [sd((rows * (k + 2), h, d, d), f32), qsl, slots]
    for fn, args in [(md.gdn_multi_decode, gdn), (md.kda_multi_decode, kda)]:
        run = functools.partial(fn, max_tokens=k, kernel="mgpu")
        lowered = jax.jit(run, donate_argnums=7).trace(*args).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "custom_call @mosaic_gpu" in text
        assert "tf.aliasing_output" in text


def test_benchmark_dry_run_checks_and_times(tmp_path, monkeypatch):
    """``benchmarks/multi_decode.py --interpret --quick`` with this kernel: its check against
    the prefill references passes for both families, and every timed entry ran."""
    import json
    import sys

    from benchmarks import multi_decode as bench

    out = tmp_path / "m.json"
    argv = ["multi_decode", "--interpret", "--quick", "--no-baselines", "--kernels", "mgpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    for name in ("INTERPRET", "GDN_HK", "GDN_HV", "KDA_H", "D"):  # main() sets them
        monkeypatch.setattr(bench, name, getattr(bench, name))
    bench.main()
    summary = json.loads(out.read_text())
    assert summary["check_gdn_mgpu"]["ok"] and summary["check_kda_mgpu"]["ok"], summary
    timed = [k for k in summary if "_mgpu_B" in k]
    assert len(timed) == 4 and all("us" in summary[k] for k in timed), summary


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("k, mosaic", [(4, True), (2, False)])
def test_engine_verify_op_takes_the_default_by_tokens_a_row(family, k, mosaic, monkeypatch):
    """Where the engine calls it: the family's k-token decode with no kernel asked for, wrapped
    as the TP op (its model's ``SHARDING`` specs on a one-device mesh) in a ``lax.scan`` over
    layers whose pools are the scan's operand, at the 80B / Kimi heads and 64 rows. The
    default ("auto") lowers Mosaic GPU's kernel at 4 tokens a row and Triton's at 2."""
    from hyjax.sharding import _shard_op, make_mesh
    from tests.pallas_kernels.ragged_cases import abstract_slots

    monkeypatch.setattr(multi_decode_mgpu, "MULTI_DECODE_DEFAULT", "auto")
    sd, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    rows, d = 64, 128
    t = rows * k
    if family == "gdn":
        from hyjax.models.qwen3_next.sharding import SHARDING

        hk, h = 16, 32
        acts = (sd((t, hk, d), bf), sd((t, hk, d), bf), sd((t, h, d), bf), sd((t, h), bf),
                sd((t, h), bf), sd((h,), f32), sd((h,), f32))  # fmt: skip
        op = md.gdn_multi_decode
    else:
        from hyjax.models.kimi_linear.sharding import SHARDING

        h = 32
        acts = (*[sd((t, h, d), bf)] * 4, sd((t, h), bf), sd((h,), f32), sd((h, d), f32))
        op = md.kda_multi_decode
    in_specs, out_specs = SHARDING.ops[f"{family}_multi_decode"]
    sharded = _shard_op(functools.partial(op, max_tokens=k), make_mesh(1), in_specs, out_specs, 1)
    qsl, slots = sd((rows + 1,), i32), abstract_slots(rows, k)

    def step(acts, pools, qsl, slots):
        def layer(total, pool):
            o, pool = sharded(*acts, pool, qsl, slots)
            return total + o.astype(f32).sum(), pool

        return jax.lax.scan(layer, 0.0, pools)

    pools = sd((2, 1 + rows * (k + 1), h, d, d), f32)
    lowered = jax.jit(step, donate_argnums=1).trace(acts, pools, qsl, slots)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert ("custom_call @mosaic_gpu" in text) == mosaic
    assert ("triton" in text) == (not mosaic)
