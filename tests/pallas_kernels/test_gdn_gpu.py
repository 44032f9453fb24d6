"""The Triton-lowered GPU gated-delta-rule kernels vs the reference, in Pallas interpret mode.

Interpret mode checks the indexing (ragged chunk windows, masks, slots); a last test lowers
both kernels to Triton IR for CUDA at Qwen3-Next-80B shapes (no GPU needed). Compiling and
timing them is ``benchmarks/gdn_kernels.py`` on a GPU machine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import gpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from tests.pallas_kernels.ragged_cases import (
    abstract_slots,
    assert_close,
    assert_rel_close,
    ragged_case,
    state_slots,
    zero_slots,
)


def _inputs(rng, n, hk, hv, dk, dv, dtype):
    q, k = rng.normal(size=(2, n, hk, dk))
    v = rng.normal(size=(n, hv, dv))
    a, b = rng.normal(size=(2, n, hv))
    A_log, dt_bias = rng.normal(size=(2, hv))
    cast = [jnp.asarray(x, dtype) for x in (q, k, v, a, b)]
    return cast + [jnp.asarray(A_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32)]


PREFILL_CASES = [
    # (lens, hk, hv, dk, dv, dtype, block_v)
    ([1, 63, 64, 65, 130], 2, 6, 16, 8, jnp.float32, 4),
    ([5, 2], 2, 4, 16, 16, jnp.float32, None),  # T < 64: the wrapper pads
    ([200, 7], 2, 8, 16, 16, jnp.bfloat16, 8),  # rows != heads: the grid order shows
]
PREFILL_IDS = [
    f"{lens=}_{hv=}_{jnp.dtype(dtype).name}_{bv=}" for lens, _, hv, _, _, dtype, bv in PREFILL_CASES
]


# (three launches, the serial grid's Dv blocks on its fastest axis)
PREFILL_PATHS = {
    "scan_output": (False, True),
    "three_launches": (True, True),
    "scan_output_rows_first": (False, False),
}


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("lens,hk,hv,dk,dv,dtype,bv", PREFILL_CASES, ids=PREFILL_IDS)
def test_prefill_matches_reference(lens, hk, hv, dk, dv, dtype, bv, path):
    three, vb_first = PREFILL_PATHS[path]
    _check_prefill(lens, hk, hv, dk, dv, dtype, bv, three_launches=three, vb_first=vb_first)


def _check_prefill(lens, hk, hv, dk, dv, dtype, bv, seed=0, **tuning):
    """``gdn_prefill(**tuning)`` on a ragged case against the reference (f32 to 1e-4, bf16 to
    2e-2 relative), with no poisoned slot read."""
    rng = np.random.default_rng(sum(lens) + seed)
    case = ragged_case(lens)
    inputs = _inputs(rng, case.num_tokens, hk, hv, dk, dv, dtype)
    pool = jnp.asarray(case.pool(rng, (hv, dv, dk), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(gdn_prefill_reference)(*args)
    kernel = functools.partial(gpu.gdn_prefill, block_v=bv, interpret=True, **tuning)
    got_o, got_s = jax.jit(kernel)(*args)
    assert not np.isnan(np.asarray(got_o, np.float32)).any(), "a poisoned slot was read"
    if dtype == jnp.float32:
        assert_close(got_o, want_o, rtol=1e-4, atol=1e-4, what="outputs")
        assert_close(got_s, want_s, rtol=1e-4, atol=1e-4, what="state pool")
    else:
        assert_rel_close(got_o, want_o, tol=2e-2, what="outputs")
        assert_rel_close(got_s, want_s, tol=2e-2, what="state pool")


def test_decode_matches_reference():
    rng = np.random.default_rng(2)
    rows, num_seqs, hk, hv, dk, dv, m = 6, 5, 2, 6, 16, 8, 2
    inputs = _inputs(rng, rows, hk, hv, dk, dv, jnp.float32)
    pool = np.full((16, hv, dv, dk), np.nan, np.float32)
    src = np.array([1, 2, 0, 3, 4, 0], np.int32)
    pool[src[src > 0]] = rng.normal(size=(4, hv, dv, dk))
    dst = np.array([1, 0, 7, 3, 8, 0], np.int32)
    ck_off = np.zeros((rows, m), np.int32)
    ck_slot = np.zeros((rows, m), np.int32)
    ck_off[0], ck_slot[0] = [1, 1], [12, 13]
    ck_off[3, 1], ck_slot[3, 1] = 0, 14
    args = (
        *inputs, jnp.asarray(pool), state_slots(src, dst, ck_off, ck_slot, num_seqs),
    )  # fmt: skip
    want_o, want_s = gdn_decode_reference(*args)
    got_o, got_s = jax.jit(lambda *x: gpu.gdn_decode(*x, block_v=4, interpret=True))(*args)
    assert_close(got_o, want_o, rtol=1e-5, atol=1e-5, what="outputs")
    assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, what="state pool")


def test_rejects_non_power_of_two_heads():
    z = jnp.zeros
    with pytest.raises(ValueError, match="block_v=3 must be a power of two"):
        gpu.gdn_decode(
            z((2, 1, 16)), z((2, 1, 16)), z((2, 1, 12)), z((2, 1)), z((2, 1)), z(1), z(1),
            z((3, 1, 12, 16)), zero_slots(2, 1), block_v=3, interpret=True,
        )  # fmt: skip


def test_kernels_lower_to_triton_at_80b_shapes():
    hk, hv, d, n, rows, m = 16, 32, 128, 256, 4, 2
    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    gates = [sd((hv,), f32)] * 2
    slots = abstract_slots(rows, m)
    pool = sd((8, hv, d, d), f32)
    prefill = [sd((rows + 1,), i32)]
    # (the default prefill of a bf16 model has no Triton launch: Mosaic GPU's fold scratch and
    # serial launch; Triton's serial launch, and the fold with Triton's scratch launch)
    triton_serial = functools.partial(gpu.gdn_prefill, serial="triton")
    blocked = functools.partial(gpu.gdn_prefill, intra_form="blocked_bf16", fold_intra="triton")
    split = functools.partial(gpu.gdn_prefill, intra_form="split_blocked_bf16")
    for t, f, extra in [(n, triton_serial, prefill), (n, blocked, prefill), (n, split, prefill),
                        (rows, gpu.gdn_decode, [])]:  # fmt: skip
        acts = [sd((t, hk, d), bf)] * 2 + [sd((t, hv, d), bf)] + [sd((t, hv), bf)] * 2
        lowered = jax.jit(f).trace(*acts, *gates, pool, *extra, slots)
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_serial_block_v_widens_when_the_launch_fills_the_sms(monkeypatch):
    from pallas_kernels.common import delta_rule_gpu

    monkeypatch.setattr(delta_rule_gpu, "resident_programs", lambda: 132)
    # 80B shapes (32 value heads, Dv 128): one row has 64 programs of 64 columns, two have 128.
    assert delta_rule_gpu.serial_block_v(1, 32, 128, None) == 32
    assert delta_rule_gpu.serial_block_v(2, 32, 128, None) == 64
    assert delta_rule_gpu.serial_block_v(8, 32, 128, None) == 64
    assert delta_rule_gpu.serial_block_v(8, 32, 48, None) == 16  # Dv's largest power-of-2 divisor
    assert delta_rule_gpu.serial_block_v(8, 32, 128, 16) == 16  # a requested block is kept


@pytest.mark.parametrize("form", [f for f in gpu.INTRA_FORMS if f != "whole"])
@pytest.mark.parametrize("lens,hk,hv,dk,dv,dtype,bv", PREFILL_CASES[::2], ids=PREFILL_IDS[::2])
def test_intra_launch_forms_match_reference(lens, hk, hv, dk, dv, dtype, bv, form):
    """The intra launch's other forms: by 16-row blocks (``intra_form="blocked"``: A and Aqk by
    blocks, the block forward substitution for Tm), and split in two launches (``"split"``: Tm
    stored between them; ``"split_blocked"``: its first launch by blocks). Ragged rows of
    1-200 tokens, checkpoints, slots, as the whole-chunk launch (f32: to 1e-4 of the
    reference; the chunks span all four blocks and cross the diagonal ones, so a wrong block
    decay or a missing block shows). With bf16 products (``"blocked_bf16"``) to bf16's
    rounding (2e-2 relative), as the bf16 models."""
    if form.endswith("bf16") and dtype == jnp.float32:
        dtype = jnp.bfloat16  # bf16 operands: a bf16 model's path
    _check_prefill(lens, hk, hv, dk, dv, dtype, bv, seed=1, intra_form=form)


def test_a_bf16_model_runs_the_blocked_intra_launch_with_bf16_products(monkeypatch):
    """The intra launch's default form follows the operands (the fastest measured on an H200
    for bf16 ones, the f32 products kept for f32 ones) unless a process sets its own, and
    each form has its own warps and stages."""
    assert gpu.default_intra_form(jnp.bfloat16) == "blocked_bf16"
    assert gpu.default_intra_form(jnp.float32) == "whole"
    monkeypatch.setattr(gpu, "INTRA_FORM", "split")
    assert gpu.default_intra_form(jnp.bfloat16) == "split"
    assert set(gpu.INTRA_TUNING) == set(gpu.INTRA_FORMS)
    assert gpu.INTRA_TUNING["blocked_bf16"] == (4, 2)


def test_an_unknown_intra_form_is_named():
    rng = np.random.default_rng(3)
    case = ragged_case([5, 2])
    inputs = _inputs(rng, case.num_tokens, 2, 4, 16, 16, jnp.float32)
    pool = jnp.asarray(case.pool(rng, (4, 16, 16), np.float32))
    args = (*inputs, pool, jnp.asarray(case.query_start_loc), case.slots())
    kernel = functools.partial(gpu.gdn_prefill, intra_form="fast", interpret=True)
    with pytest.raises(ValueError, match="intra launch form 'fast'"):
        jax.eval_shape(kernel, *args)


def test_the_bf16_forms_products_are_bf16_mmas(tmp_path):
    """The ``*_bf16`` intra forms' scores, W and U are bf16 MMAs in the Triton IR the launch
    compiles from (f32 accumulation), the inverse's f32; the f32 forms have none."""
    import re

    from benchmarks.triton_registers import dump_intra_ttir

    def dots(form):
        text = "".join(open(p).read() for p in dump_intra_ttir(f"gdn_{form}", str(tmp_path)))
        found = re.findall(r"tt\.dot [^:]+: tensor<[0-9x]+x(\w+)> \* tensor<[0-9x]+x(\w+)>", text)
        return {(a, b) for a, b in found}

    assert ("bf16", "bf16") in dots("whole_bf16") and ("f32", "f32") in dots("whole_bf16")
    assert ("bf16", "bf16") in dots("blocked_bf16")
    assert ("bf16", "bf16") not in dots("whole")
