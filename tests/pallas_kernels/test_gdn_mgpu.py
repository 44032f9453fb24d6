"""GDN prefill's Mosaic GPU serial launch (``pallas_kernels.common.chunk_scan_mgpu``) in Pallas'
GPU interpreter, against the Triton serial launch and the reference.

The interpreter runs the kernel's copies, barriers, loops, masks and stores as written (its
products as plain dots), so the ragged logic is checked here: chunk windows at any offset and
inside the batch's 64-token blocks (a token-aligned plan), short chunks stored in runs,
checkpoints, source and destination slots, padding rows. What only a GPU
shows (the tiled TMA copies need windows at multiples of 64 tokens) is
``benchmarks/mgpu_probe.py``. The lowering at the 80B's shapes is
``test_mosaic_gpu_lowering.py``.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import chunk_scan_gpu, chunk_scan_mgpu
from pallas_kernels.gdn import gpu
from pallas_kernels.gdn.reference import gdn_prefill_reference
from tests.pallas_kernels.ragged_cases import assert_rel_close, ragged_case, state_slots

HK, HV, D = 1, 2, 64  # the launch's smallest tiles: Dk 64, one Dv block of 64


def _inputs(rng, n, hk=HK, hv=HV):
    bf = jnp.bfloat16
    q, k = (jnp.asarray(rng.normal(size=(n, hk, D)), bf) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(n, hv, D)), bf)
    a, b = (jnp.asarray(rng.normal(size=(n, hv)), bf) for _ in range(2))
    # slow gates (g ~ -1e-3 a token): each chunk's state reaches the next chunk's outputs
    A_log, dt_bias = jnp.log(jnp.linspace(0.01, 0.05, hv)), jnp.full(hv, -3.0)
    return q, k, v, a, b, A_log, dt_bias


def _serial(tma_layout, args, pool, qsl, slots, form="whole"):
    """The prefill up to its serial launch in one layout (row-aligned chunks for Triton,
    token-aligned ones for Mosaic GPU), then the launch, interpreted; ``form``: the intra
    launch's (``gpu.INTRA_FORMS``)."""
    plan, rp, x = gpu.prefill_scratch(
        *args, qsl, slots, operand_dtype=jnp.bfloat16, precision=None, tma_layout=tma_layout,
        form=form, interpret=True,
    )  # fmt: skip
    if tma_layout:
        return chunk_scan_mgpu.scan_mgpu(rp, x, pool, out_dtype=jnp.bfloat16, interpret=True)
    return chunk_scan_gpu.scan_launches(
        rp, x, pool, plan.start, plan.length, out_dtype=jnp.bfloat16, bv=D, precision=None,
        num_warps=4, num_stages=1, vb_first=True, three_launches=False, block_v_out=None,
        interpret=True, name="gdn_prefill",
    )  # fmt: skip


@pytest.mark.parametrize("form", ["whole", "blocked_bf16", "split", "split_blocked"])
def test_ragged_batch_matches_the_triton_launch(form):
    """Rows of 70, 3 and 130 tokens (rows and checkpoints at 1 and 64, or 35 and 65, cut chunks
    inside the blocks), one row from a state, two padding rows, NaN in every slot no row reads:
    the Triton launch's outputs and written slots (the two plans group tokens differently: bf16
    roundings apart), and untouched slots bit for bit. ``form``: the Mosaic GPU launch on the
    scratch of that intra launch (the blocked one: its transposed U, k_dec zeroed after the
    batch)."""
    rng = np.random.default_rng(0)
    case = ragged_case([70, 3, 130])
    args = _inputs(rng, case.num_tokens)
    pool = jnp.asarray(case.pool(rng, (HV, D, D), np.float32))
    qsl, slots = jnp.asarray(case.query_start_loc), case.slots()
    n = int(case.query_start_loc[-1])
    want_o, want_s = jax.jit(functools.partial(_serial, False))(args, jnp.copy(pool), qsl, slots)
    mgpu = functools.partial(_serial, True, form=form)
    got_o, got_s = jax.jit(mgpu)(args, jnp.copy(pool), qsl, slots)
    assert_rel_close(got_o[:n], want_o[:n], tol=1e-2, what="outputs")
    assert_rel_close(got_s, want_s, tol=1e-2, what="state pool")
    np.testing.assert_array_equal(  # NaN == NaN: unwritten slots come back as they were
        np.asarray(got_s, np.float32)[0], np.asarray(pool, np.float32)[0]
    )


def test_diagnostic_modes_keep_the_chain_and_the_loads():
    """L2 prefetches change no result (``scan_mgpu(prefetch=1)``). The benchmarks'
    decompositions of the launch (``scan_mgpu(diagnostic=...)``): ``"chain"``
    (no o, none of its copies) writes every slot as the full launch does;
    ``"loads"`` (the copies and waits alone) passes each row's source state to its ``dst``
    unchanged (zeros from slot 0). The aligned case: a row from a state, one from zeros."""
    rng = np.random.default_rng(3)
    qsl, slots, n = _aligned_case()
    args = _inputs(rng, n)
    pool = jnp.asarray(rng.normal(size=(5, HV, D, D)), jnp.float32)

    def run(diagnostic, pool, prefetch=0):
        _, rp, x = gpu.prefill_scratch(
            *args, qsl, slots, operand_dtype=jnp.bfloat16, precision=None, tma_layout=True,
            interpret=True,
        )  # fmt: skip
        return chunk_scan_mgpu.scan_mgpu(
            rp,
            x,
            pool,
            out_dtype=jnp.bfloat16,
            diagnostic=diagnostic,
            prefetch=prefetch,
            interpret=True,
        )[1]

    full = np.asarray(jax.jit(functools.partial(run, None))(jnp.copy(pool)))
    prefetched = np.asarray(jax.jit(functools.partial(run, None, prefetch=1))(jnp.copy(pool)))
    np.testing.assert_array_equal(prefetched, full)  # (the prefetch's indexing runs, no effect)
    chain = np.asarray(jax.jit(functools.partial(run, "chain"))(jnp.copy(pool)))
    loads = np.asarray(jax.jit(functools.partial(run, "loads"))(jnp.copy(pool)))
    assert_rel_close(chain, full, tol=1e-6, what="the chain alone")  # (other fusions)
    assert not np.allclose(full[2], np.asarray(pool)[1]), "the full launch changes the state"
    np.testing.assert_array_equal(loads[2], np.asarray(pool)[1])  # row 0: slot 1 -> 2
    np.testing.assert_array_equal(loads[3], 0.0)  # row 1: zeros -> 3
    with pytest.raises(ValueError, match="diagnostic='fast'"):
        run("fast", pool)
    with pytest.raises(ValueError, match="prefetch=-1"):
        run(None, pool, prefetch=-1)


def _check_against_reference(args, pool, qsl, slots, **kwargs):
    """``gdn_prefill(serial="mgpu")`` against the reference (bf16 operands: 2e-2); returns the
    kernel's ``(o, state)``."""
    want_o, want_s = jax.jit(gdn_prefill_reference)(*args, pool, qsl, slots)
    kernel = functools.partial(
        gpu.gdn_prefill, precision=None, serial="mgpu", interpret=True, **kwargs
    )
    got_o, got_s = jax.jit(kernel)(*args, jnp.copy(pool), qsl, slots)
    assert_rel_close(got_o, want_o, tol=2e-2, what="outputs")
    assert_rel_close(got_s, want_s, tol=2e-2, what="state pool")
    return got_o, got_s


def _aligned_case():
    """Rows of 128 and 100 tokens from token 0 and 128 (chunk starts at multiples of 64), the
    first from a state with a checkpoint at 64, the second from zeros; a padding row."""
    qsl = jnp.array([0, 128, 228, 228], jnp.int32)
    slots = state_slots([1, 0, 0], [2, 3, 0], [[64, 0], [0, 0], [0, 0]],
                        [[4, 0], [0, 0], [0, 0]], 2)  # fmt: skip
    return qsl, slots, 228


def test_aligned_batch_through_gdn_prefill_matches_the_reference():
    rng = np.random.default_rng(1)
    qsl, slots, n = _aligned_case()
    args = _inputs(rng, n)
    pool = np.full((6, HV, D, D), np.nan, np.float32)
    pool[1] = 0.1 * rng.normal(size=(HV, D, D))
    pool = jnp.asarray(pool)
    _check_against_reference(args, pool, qsl, slots)


def test_ragged_rows_through_gdn_prefill_match_the_reference():
    """Rows starting inside 64-token blocks (lengths 70, 3, 130: the token-aligned plan cuts
    them at the blocks' edges too), checkpoints, a padding row, poisoned slots."""
    rng = np.random.default_rng(2)
    case = ragged_case([70, 3, 130])
    args = _inputs(rng, case.num_tokens)
    pool = jnp.asarray(case.pool(rng, (HV, D, D), np.float32))
    qsl, slots = jnp.asarray(case.query_start_loc), case.slots()
    _check_against_reference(args, pool, qsl, slots)


def _fold_case(seed, gates, hk, hv):
    """The ragged rows (70, 3, 130 tokens: chunks inside blocks, checkpoints, a padding row,
    poisoned slots) with ``hk`` / ``hv`` heads; ``strong`` gates decay ~e^-5 a token.
    Returns ``(args, pool, qsl, slots, case)``."""
    rng = np.random.default_rng(seed)
    case = ragged_case([70, 3, 130])
    args = _inputs(rng, case.num_tokens, hk, hv)
    if gates == "strong":
        args = (*args[:5], jnp.full(hv, np.log(4.0)), jnp.full(hv, 1.0))
    pool = jnp.asarray(case.pool(rng, (hv, D, D), np.float32))
    return args, pool, jnp.asarray(case.query_start_loc), case.slots(), case


@pytest.mark.parametrize("gates, hk, hv", [("slow", HK, HV), ("strong", HK, HV), ("slow", 2, 4)])
def test_fold_matches_the_reference_and_the_launch_it_replaces(gates, hk, hv):
    """``gdn_prefill(fold=True)``: the serial launch makes U, ``Aqk`` and the rows' scalings
    from v's, q's and k's own rows (``chunk_scan_mgpu._fold_step``, the intra launch's
    vectors and ``Tm diag(beta)``) on the ragged rows above (chunks inside blocks,
    checkpoints, a padding row, poisoned slots): the reference's outputs and slots, the
    unfolded launch's to bf16 roundings, untouched slots bit for bit. ``strong`` gates (decays
    ~e^-5 a token): every exponent kept finite. Two key heads of two value heads each: each
    value head reads its own key head's rows and its own columns of v."""
    args, pool, qsl, slots, case = _fold_case(4, gates, hk, hv)
    n = int(case.query_start_loc[-1])
    fold_o, fold_s = _check_against_reference(args, pool, qsl, slots, fold=True)
    kernel = functools.partial(gpu.gdn_prefill, precision=None, serial="mgpu", interpret=True)
    plain_o, plain_s = jax.jit(functools.partial(kernel, fold=False))(
        *args, jnp.copy(pool), qsl, slots
    )
    assert_rel_close(fold_o[:n], plain_o[:n], tol=1e-2, what="outputs (the unfolded launch's)")
    assert_rel_close(fold_s, plain_s, tol=1e-2, what="state pool (the unfolded launch's)")
    np.testing.assert_array_equal(np.asarray(fold_s)[0], np.asarray(pool)[0])  # NaN, unread
    assert np.isfinite(np.asarray(fold_o[:n], np.float32)).all()
    # Tm diag(beta) with beta in its columns (fold_beta_rows=False; the default makes it as
    # diag(beta) (I + L diag(beta))^-1): the reference's, and the default's to its bf16 roundings
    cols_o, cols_s = _check_against_reference(
        args, pool, qsl, slots, fold=True, fold_beta_rows=False
    )
    assert_rel_close(cols_o[:n], fold_o[:n], tol=1e-2, what="outputs (beta in Tm's rows)")
    assert_rel_close(cols_s, fold_s, tol=1e-2, what="state pool (beta in Tm's rows)")
    np.testing.assert_array_equal(np.asarray(cols_s)[0], np.asarray(pool)[0])


@pytest.mark.parametrize(
    "gates, hk, hv, persist",
    [("slow", HK, HV, 0), ("strong", HK, HV, 0), ("slow", 2, 4, 0), ("slow", 2, 4, 3),
     ("strong", HK, HV, 5)],
)  # fmt: skip
def test_fold_scratch_by_mosaic_gpu_matches_the_triton_launch(
    monkeypatch, gates, hk, hv, persist
):  # fmt: skip
    """``gdn.intra_mgpu.fold_scratch`` (``fold_intra="mgpu"``: XLA's vectors, the inverse by
    wgmma doubling steps in f16) on the ragged rows (two chunks in a block, checkpoints, a
    padding row): W, ``Tm diag(beta)``, the serial launch's vectors and the chunk decays are
    the Triton launch's to bf16 roundings on every token of a chunk, and the prefill through
    it is the reference's. ``strong`` gates (decays ~e^-5 a token); ``persist`` programs of
    the persistent launch (``PERSIST``: each taking several items, two stages)."""
    from pallas_kernels.gdn import intra_mgpu

    monkeypatch.setattr(intra_mgpu, "PERSIST", persist)
    args, pool, qsl, slots, _ = _fold_case(5, gates, hk, hv)
    made = {}
    for who in ("triton", "mgpu"):
        plan, _, x = gpu.prefill_scratch(
            *args, qsl, slots, operand_dtype=jnp.bfloat16, precision=None, tma_layout=True,
            form="blocked_bf16", fold=True, fold_intra=who, interpret=True,
        )  # fmt: skip
        made[who] = x
    live = np.flatnonzero(np.asarray(plan.live))  # every token of a chunk
    want, got = made["triton"], made["mgpu"]
    for name in ("w", "tm"):
        assert_rel_close(getattr(got, name)[:, live], getattr(want, name)[:, live], tol=1e-2,
                         what=name)  # fmt: skip
    rows = len(gpu.FOLD_VECTORS)
    assert_rel_close(got.vec[:, :rows, live], want.vec[:, :rows, live], tol=1e-5, what="vec")
    nc = int(plan.num_chunks[0])
    assert_rel_close(got.decay[:nc], want.decay[:nc], tol=1e-5, what="decays")
    o, s = _check_against_reference(args, pool, qsl, slots, fold=True, fold_intra="mgpu")
    # each chunk's Aqk made there too (fold_aqk: the serial launch reads it), as the serial
    # launch makes it: the same outputs to bf16 roundings, the reference's
    o_a, s_a = _check_against_reference(
        args, pool, qsl, slots, fold=True, fold_intra="mgpu", fold_aqk=True
    )
    n = int(qsl[-1])
    assert_rel_close(o_a[:n], o[:n], tol=1e-2, what="outputs (Aqk made in the serial launch)")
    assert_rel_close(s_a, s, tol=1e-2, what="state pool (Aqk made in the serial launch)")


def _pair_case(seed: int):
    """The pairs' ragged rows (70, 3 and 130 tokens: chunks inside blocks, short chunks' rows,
    checkpoints, a padding row, poisoned slots) at ``Dv = 128``: ``(args, pool, qsl, slots,
    tokens)``."""
    rng = np.random.default_rng(seed)
    case = ragged_case([70, 3, 130])
    hk, hv, dv = 1, 2, 2 * chunk_scan_mgpu.BV
    q, k, _, a, b, A_log, dt_bias = _inputs(rng, case.num_tokens, hk, hv)
    v = jnp.asarray(rng.normal(size=(case.num_tokens, hv, dv)), jnp.bfloat16)
    pool = jnp.asarray(case.pool(rng, (hv, dv, D), np.float32))
    qsl, slots = jnp.asarray(case.query_start_loc), case.slots()
    return (q, k, v, a, b, A_log, dt_bias), pool, qsl, slots, case.num_tokens


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4,
    reason="Pallas' GPU interpreter runs each warpgroup as an XLA execution on the host's pool: "
    "with fewer than 4 CPUs one warpgroup waiting for the other's copies holds the last thread",
)
def test_fold_by_pairs_matches_the_reference_and_the_unpaired_launch():
    """``gdn_prefill(serial_pair=True)`` (``chunk_scan_mgpu.PAIR``: a program a (head, row), its
    two Dv blocks a warpgroup each; warpgroup 0 copies the tiles both read, warpgroup 1 frees
    a stage by ``consumed``) on the ragged rows (chunks inside blocks, short chunks' rows,
    checkpoints, a padding row, poisoned slots) at ``Dv = 128``: the reference's outputs and
    slots, the unpaired launch's to bf16 roundings, untouched slots bit for bit."""
    args, pool, qsl, slots, n = _pair_case(6)
    pair_o, pair_s = _check_against_reference(args, pool, qsl, slots, fold=True, serial_pair=True)
    kernel = functools.partial(gpu.gdn_prefill, precision=None, serial="mgpu", interpret=True)
    one_o, one_s = jax.jit(functools.partial(kernel, fold=True, serial_pair=False))(
        *args, jnp.copy(pool), qsl, slots
    )
    assert_rel_close(pair_o[:n], one_o[:n], tol=1e-2, what="outputs (one warpgroup a program)")
    assert_rel_close(pair_s, one_s, tol=1e-2, what="state pool (one warpgroup a program)")
    np.testing.assert_array_equal(np.asarray(pair_s)[0], np.asarray(pool)[0])  # NaN, unread


def _dynamic_case(monkeypatch, resident: int):
    """The pair test's ragged rows (2, 1 and 3 chunks, a padding row) through a dynamic pair
    (``serial_pair="dynamic"``) and through the launch ``resident`` SMs would pick, bit for
    bit: two long rows of two heads' two Dv blocks are 8 unpaired programs, a pair past 1.5
    waves (``resident`` < 6)."""
    monkeypatch.setattr(chunk_scan_mgpu, "resident_programs", lambda: resident)
    args, pool, qsl, slots, _ = _pair_case(7)
    kernel = functools.partial(gpu.gdn_prefill, precision=None, serial="mgpu", fold=True,
                               interpret=True)  # fmt: skip
    got = jax.jit(functools.partial(kernel, serial_pair="dynamic"))(
        *args, jnp.copy(pool), qsl, slots
    )
    want = jax.jit(functools.partial(kernel, serial_pair=resident < 6))(
        *args, jnp.copy(pool), qsl, slots
    )
    for g, w, what in zip(got, want, ("outputs", "state pool"), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


def test_a_dynamic_pair_runs_the_unpaired_launch_where_the_plan_says_so(monkeypatch):
    """``serial_pair="dynamic"`` (``chunk_scan_mgpu.pair_mode``): both launches run, and where
    the plan's long rows fill no more than 1.5 waves of unpaired programs each pair program
    exits at once and the unpaired launch's outputs and slots are the result (its ``o`` taken
    in place by the pair's launch)."""
    _dynamic_case(monkeypatch, resident=10)


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4,
    reason="Pallas' GPU interpreter runs each warpgroup as an XLA execution on the host's pool: "
    "with fewer than 4 CPUs one warpgroup waiting for the other's copies holds the last thread",
)
def test_a_dynamic_pair_runs_the_paired_launch_where_the_plan_says_so(monkeypatch):
    """The same where the long rows fill more than 1.5 waves: the unpaired programs exit and
    the pair's launch writes every row's ``o`` into the unpaired launch's buffer."""
    _dynamic_case(monkeypatch, resident=1)


def test_a_dynamic_pair_picks_by_the_rows_that_run_long(monkeypatch):
    """``pair_mode`` at the 80B's 32 value heads on an H200's 132 SMs: paired from four rows
    of 4096 (256 unpaired programs, measured 1.02x) and eight (1.08x); unpaired at two or three
    rows (0.79x at two), and for one long row among 63 rows of one chunk (a step's decode
    rows), whatever the step's static row count."""
    from types import SimpleNamespace

    monkeypatch.setattr(chunk_scan_mgpu, "resident_programs", lambda: 132)

    def mode(*chunks):
        rp = SimpleNamespace(row_chunks=jnp.asarray(chunks, jnp.int32))
        return int(chunk_scan_mgpu.pair_mode(rp, 32, 128))

    assert mode(*[64] * 8) == 1 and mode(*[64] * 4, *[0] * 4) == 1
    assert mode(64, 64, 0, 0) == 0 and mode(64, 64, 64, 0) == 0
    assert mode(64, *[1] * 63) == 0 and mode(*[1] * 64) == 0
    assert mode(64, 40, 33, 32, 1, 1, 1, 1) == 1  # (rows of half the longest's chunks count)
    assert mode(64, 40, 33, 31, 1, 1, 1, 1) == 0


def test_pairs_are_chosen_past_one_wave_and_refused_where_they_cannot_run(monkeypatch):
    """``chunk_scan_mgpu.use_pair``: "auto" pairs GDN's fold at Dv 128 once its one-warpgroup
    programs outnumber the SMs (two rows of the 80B's 32 value heads: 128 programs, one wave
    of an H200's 132; four rows: 256), never another launch; asked for, a launch it cannot
    take is an error naming why."""
    monkeypatch.setattr(chunk_scan_mgpu, "resident_programs", lambda: 132)
    use = chunk_scan_mgpu.use_pair
    common = dict(fold=True, fold_aqk=False, dk=128, dv=128, heads=32, num_chunks=600,
                  pool_dtype=jnp.float32, op_dtype=jnp.bfloat16)  # fmt: skip
    assert not use("auto", **common, rows=2) and use("auto", **common, rows=4)
    assert not use("auto", **{**common, "fold_aqk": True}, rows=8)
    assert not use("auto", **{**common, "dv": 64}, rows=8)
    assert not use("0", **common, rows=8) and use(True, **common, rows=1)
    # "dynamic": both launches where "auto" would pair (the plan picks on the device)
    assert use("dynamic", **common, rows=4) == "dynamic"
    assert use("dynamic", **common, rows=2) is False
    assert use("dynamic", **{**common, "dv": 64}, rows=8) is False
    with pytest.raises(ValueError, match="Dv=64"):
        use(True, **{**common, "dv": 64}, rows=8)
    with pytest.raises(ValueError, match="4000 chunks: shared memory"):
        use("1", **{**common, "num_chunks": 4000}, rows=8)
    with pytest.raises(ValueError, match="pair='yes'"):
        use("yes", **common, rows=8)
    # set for the process, it never fails a launch it cannot take (KDA's, Dv 64): unpaired
    monkeypatch.setattr(chunk_scan_mgpu, "PAIR", "1")
    assert use(None, **common, rows=1)
    assert not use(None, **{**common, "fold": False}, rows=8)
    assert not use(None, **{**common, "dv": 64}, rows=8)
    with pytest.raises(ValueError, match="other than GDN's fold"):
        use(True, **{**common, "fold": False}, rows=8)


def test_the_fold_scratch_launch_is_persistent_by_default(monkeypatch):
    """``intra_mgpu.persist_programs``: four programs an SM by default (the persistent launch,
    1.13x the plain one's time at 8x4096 on an H200), the environment's or the call's count
    otherwise, 0 the plain launch."""
    from pallas_kernels.gdn import intra_mgpu

    monkeypatch.setattr(intra_mgpu, "resident_programs", lambda: 132)
    monkeypatch.setattr(intra_mgpu, "PERSIST", None)
    assert intra_mgpu.persist_programs() == 528
    assert intra_mgpu.persist_programs(0) == 0 and intra_mgpu.persist_programs(3) == 3
    monkeypatch.setattr(intra_mgpu, "PERSIST", 0)
    assert intra_mgpu.persist_programs() == 0 and intra_mgpu.persist_programs(5) == 5


def test_fold_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="fold: the Mosaic GPU launch's scratch"):
        gpu.intra_launch(*([None] * 8), num_chunks=1, operand_dtype=jnp.bfloat16,
                         precision=None, form="whole", tma_layout=True, fold=True)  # fmt: skip


def test_token_aligned_plan_keeps_each_chunk_inside_a_block():
    """``plan_chunks(token_aligned=True)``: every chunk inside one 64-token block of the batch,
    every live token in exactly one chunk, each checkpoint offset a chunk's end, within the
    plan's static capacity."""
    from pallas_kernels.common.chunking import plan_chunks

    case = ragged_case([70, 3, 130, 64, 1], max_ckpt=3)
    plan = plan_chunks(
        jnp.asarray(case.query_start_loc), case.slots(), num_tokens=case.num_tokens, chunk=64,
        token_aligned=True,
    )  # fmt: skip
    start, length, seq, end = (np.asarray(x) for x in (plan.start, plan.length, plan.seq, plan.end))
    live = length > 0
    start, length, seq, end = start[live], length[live], seq[live], end[live]
    assert (start // 64 == (start + length - 1) // 64).all(), "a chunk crosses a block's edge"
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(start, length, strict=True)])
    np.testing.assert_array_equal(np.sort(covered), np.arange(case.query_start_loc[-1]))
    for row, offs in enumerate(case.ckpt_offsets[: case.num_seqs]):
        for off in offs[offs > 0]:
            assert off in end[seq == row], f"row {row}: checkpoint {off} is no chunk's end"
    plain = plan_chunks(
        jnp.asarray(case.query_start_loc), case.slots(), num_tokens=case.num_tokens, chunk=64
    )
    assert live.sum() > (np.asarray(plain.length) > 0).sum()  # the blocks' edges cut more


def test_the_default_is_the_triton_launch(monkeypatch):
    """The engine's prefill keeps the Triton launch (its batches' chunks start anywhere); the
    Mosaic GPU one is asked for, and refuses what it cannot take by name."""

    def fail(*a, **k):
        raise AssertionError("the Mosaic GPU launch ran by default")

    monkeypatch.setattr(chunk_scan_mgpu, "scan_mgpu", fail)
    qsl, slots, n = _aligned_case()
    args = _inputs(np.random.default_rng(3), n)
    pool = jnp.zeros((6, HV, D, D), jnp.float32)
    gpu.gdn_prefill(*args, pool, qsl, slots, precision=None, interpret=True)
    f32_args = [x.astype(jnp.float32) for x in args[:5]] + list(args[5:])
    with pytest.raises(ValueError, match="operand dtype float32"):
        gpu.gdn_prefill(*f32_args, pool, qsl, slots, serial="mgpu", interpret=True)
    with pytest.raises(ValueError, match="three_launches"):
        gpu.gdn_prefill(*args, pool, qsl, slots, serial="mgpu", three_launches=True)
    with pytest.raises(ValueError, match="serial='fast'"):
        gpu.gdn_prefill(*args, pool, qsl, slots, serial="fast", interpret=True)
    bf16_pool = jnp.zeros((6, HV, D, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 pool"):
        gpu.gdn_prefill(*args, bf16_pool, qsl, slots, serial="mgpu", interpret=True)
    assert "Dk=16" in chunk_scan_mgpu.unsupported_reason(16, 64, 4, jnp.bfloat16, jnp.float32)
    assert "Dv=24" in chunk_scan_mgpu.unsupported_reason(64, 24, 4, jnp.bfloat16, jnp.float32)
    assert "shared memory" in chunk_scan_mgpu.unsupported_reason(
        128, 128, 5000, jnp.bfloat16, jnp.float32
    )


def test_a_mosaic_gpu_default_falls_back_by_shape(monkeypatch, caplog):
    """With ``SERIAL_DEFAULT = "mgpu"`` (once a GPU has passed the probe), a shape the launch
    takes runs it and one it cannot take runs Triton, with one log line a reason; interpret
    mode keeps Triton."""
    ran = []
    real = chunk_scan_mgpu.scan_mgpu
    monkeypatch.setattr(chunk_scan_mgpu, "SERIAL_DEFAULT", "mgpu")
    monkeypatch.setattr(
        chunk_scan_mgpu, "scan_mgpu", lambda *a, **k: ran.append(1) or real(*a, **k)
    )
    qsl, slots, n = _aligned_case()
    args = _inputs(np.random.default_rng(4), n)
    pool = jnp.zeros((6, HV, D, D), jnp.float32)
    is_mgpu = functools.partial(chunk_scan_mgpu.serial_is_mgpu, per_channel_decay=False)
    assert is_mgpu(None, D, D, 8, jnp.bfloat16, jnp.float32, False, False)
    gpu.gdn_prefill(*args, pool, qsl, slots, precision=None, interpret=True)
    assert not ran  # interpret mode: Triton
    chunk_scan_mgpu._log_fallback.cache_clear()
    with caplog.at_level("WARNING", logger=chunk_scan_mgpu.__name__):
        for _ in range(2):
            assert not is_mgpu(None, 16, D, 8, jnp.bfloat16, jnp.float32, False, False)
    monkeypatch.setattr(chunk_scan_mgpu, "SERIAL_DEFAULT", "fast")
    with pytest.raises(ValueError, match="HYJAX_PREFILL_SERIAL='fast'"):
        is_mgpu(None, D, D, 8, jnp.bfloat16, jnp.float32, False, False)
    assert [r.getMessage() for r in caplog.records].count(
        "prefill serial launch: Triton's (Mosaic GPU's cannot take "
        "Dk=16 (64 or 128: the f32 accumulator S^T [64, Dk] in registers))"
    ) == 1


def test_kda_ragged_batch_through_the_mosaic_gpu_launch():
    """KDA's prefill on the same launch, its decay per key channel (a ``[Dk]`` vector a chunk,
    brought with the chunk's tiles): ragged rows starting inside blocks, checkpoints, a row
    from a state, poisoned slots, slow gates; against the reference and the Triton launch."""
    from pallas_kernels.kda import gpu as kda_gpu
    from pallas_kernels.kda.reference import kda_prefill_reference

    rng = np.random.default_rng(5)
    case = ragged_case([70, 3, 130])
    n, h = case.num_tokens, 1
    bf = jnp.bfloat16
    q, k, v, g = (jnp.asarray(rng.normal(size=(n, h, D)), bf) for _ in range(4))
    b = jnp.asarray(rng.normal(size=(n, h)), bf)
    A_log = jnp.log(jnp.full(h, 0.02, jnp.float32))
    dt_bias = jnp.full((h, D), -3.0, jnp.float32)
    pool = jnp.asarray(case.pool(rng, (h, D, D), np.float32))
    args = (q, k, v, g, b, A_log, dt_bias, pool, jnp.asarray(case.query_start_loc), case.slots())
    want_o, want_s = jax.jit(kda_prefill_reference)(*args)
    kernel = functools.partial(kda_gpu.kda_prefill, precision=None, interpret=True)
    tri_o, tri_s = jax.jit(functools.partial(kernel, serial="triton"))(*args)
    got_o, got_s = jax.jit(functools.partial(kernel, serial="mgpu"))(*args)
    assert_rel_close(got_o, want_o, tol=2e-2, what="outputs")
    assert_rel_close(got_s, want_s, tol=2e-2, what="state pool")
    assert_rel_close(got_o, tri_o, tol=1e-2, what="outputs vs Triton")
    assert_rel_close(got_s, tri_s, tol=1e-2, what="state pool vs Triton")
