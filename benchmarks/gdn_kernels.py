"""GDN kernels on a GPU at Qwen3-Next-80B shapes: correctness, then time, next to the floors.

For each Pallas GPU kernel (``pallas_kernels/gdn/gpu.py``) this script

1. checks it against the pure-JAX reference (ragged batch with src/dst slots and checkpoint
   writes; FLA's error ratio ``rms(got - want) / rms(want)``, outputs and states);
2. times prefill (B=1 T=4096, B=1 T=16384, B=8 T=4096) and decode (B=1, 16, 64, 256) with the
   state donated, in a jitted loop (device time, no dispatch), at each matmul precision;
3. times flash-linear-attention's ``chunk_gated_delta_rule`` /
   ``fused_recurrent_gated_delta_rule`` on the same shapes when ``fla`` imports (else says why);
4. measures the floors: device-to-device copy bandwidth and bf16/f32 matmul rates, and prints
   what they imply (decode: bytes of state read + written / bandwidth).

It prints one JSON summary (and writes it to ``--out``)::

    python -m benchmarks.gdn_kernels --out GDN_KERNELS.json
    python -m benchmarks.gdn_kernels --quick          # smaller shapes, a smoke run
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    copy_bandwidth,
    device_name,
    err_ratio,
    guarded_entries,
    prefill_batch,
    sweep_launches,
    time_stateful,
    torch_graph_ms,
    write_summary,
)
from pallas_kernels.common import register_cap
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from pallas_kernels.gdn import fused_decode, gpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference

HK, HV, D = 16, 32, 128
INTERPRET = False  # --interpret: run the kernels in Pallas interpret mode (CPU smoke runs)
# --trace: the timed prefill programs run once more under the profiler; their kernels' times
# and the device's idle time between them are recorded beside each figure (``*_trace``)
TRACE = False
# --mgpu-variants: which of mgpu_scan's decompositions and prefetches run (MGPU_SCAN_VARIANTS)
MGPU_VARIANTS: tuple[str, ...] | None = None
# The prefill variants timed: (precision, operand dtype, three launches). ``default`` is what
# the engine calls for a bf16 model (hyjax.ops: precision None, operands in the activations'
# dtype, the launch count by the scratch rule).
PREFILL_VARIANTS = {  # name: (precision, operand dtype, three launches, more tuning)
    "default": (None, None, None, {}),
    "triton": (None, None, None, dict(serial="triton")),  # the Triton serial launch
    # the Mosaic GPU serial launch (the timed batches' chunks start at multiples of 64 tokens)
    "mgpu": (None, None, None, dict(serial="mgpu")),
    # the intra launch of the whole chunk (the default until 2026-11-29), or by 16-row blocks
    # (gpu._intra_kernel_blocked) with f32 or bf16 products (bf16: a bf16 model's default)
    "whole": (None, None, None, dict(intra_form="whole")),
    "blocked": (None, None, None, dict(intra_form="blocked")),
    "blocked_bf16": (None, None, None, dict(intra_form="blocked_bf16")),
    "split": (None, None, None, dict(intra_form="split")),  # two intra launches, Tm between
    "split_blocked": (None, None, None, dict(intra_form="split_blocked")),
    # Aqk and the rows' scalings made in the Mosaic GPU serial launch (gdn_prefill(fold=True))
    "fold": (None, None, None, dict(serial="mgpu", fold=True)),
    "nofold": (None, None, None, dict(serial="mgpu", fold=False)),  # (the default until 11-30)
    # the fold's intra launch with Tm diag(beta) as diag(beta) M^-1 (gpu.FOLD_BETA_ROWS, the
    # default since 2026-11-30), or with Tm's columns scaled (the default before)
    "foldbeta": (None, None, None, dict(serial="mgpu", fold=True, fold_beta_rows=True)),
    "foldcols": (None, None, None, dict(serial="mgpu", fold=True, fold_beta_rows=False)),
    # the fold's scratch by XLA and a Mosaic GPU launch (gdn.intra_mgpu, gpu.FOLD_INTRA)
    "foldmgpu": (None, None, None, dict(serial="mgpu", fold=True, fold_intra="mgpu")),
    "foldtriton": (None, None, None, dict(serial="mgpu", fold=True, fold_intra="triton")),
    # and with each chunk's Aqk made there (gpu.FOLD_AQK): no q k^T in the serial launch
    "foldaqk": (None, None, None, dict(serial="mgpu", fold=True, fold_aqk=True)),
    # the scratch's launch persistent (intra_mgpu.PERSIST): 528 programs (4 an SM), 396 (3)
    "foldpers": (None, None, None, dict(serial="mgpu", fold=True, fold_persist=528)),
    "foldpers3": (None, None, None, dict(serial="mgpu", fold=True, fold_persist=396)),
    # (the persistent launch is the default since session 36: the plain one, for A / B)
    "foldplain": (None, None, None, dict(serial="mgpu", fold=True, fold_persist=0)),
    "foldpersaqk": (
        None,
        None,
        None,
        dict(serial="mgpu", fold=True, fold_persist=528, fold_aqk=True),
    ),
    # the fold's serial launch by pairs (chunk_scan_mgpu.PAIR: a (head, row) a program, its two
    # Dv blocks a warpgroup each), forced on / off (off by default)
    "pair": (None, None, None, dict(serial="mgpu", fold=True, serial_pair=True)),
    "nopair": (None, None, None, dict(serial="mgpu", fold=True, serial_pair="0")),
    # both launches, the plan picking one on the device (chunk_scan_mgpu.pair_mode); and with
    # 63 one-token rows after the long ones (a mixed step's decode rows), the default beside
    "pairdyn": (None, None, None, dict(serial="mgpu", fold=True, serial_pair="dynamic")),
    "mixed63": (None, None, None, dict(short_rows=63)),
    "pairdynmixed63": (None, None, None, dict(short_rows=63, serial_pair="dynamic")),
    "pairpers": (
        None,
        None,
        None,
        dict(serial="mgpu", fold=True, serial_pair=True, fold_persist=528),
    ),
    "bf16ops_serial": (None, jnp.bfloat16, False, {}),
    "bf16ops_three": (None, jnp.bfloat16, True, {}),
    "tf32_f32ops_three": (jax.lax.Precision.DEFAULT, jnp.float32, True, {}),
}
PRECISIONS = {
    "f32": jax.lax.Precision.HIGHEST,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32": jax.lax.Precision.DEFAULT,
}


# ----------------------------------------------------------------------------- inputs


def _activations(key, n, dtype=jnp.bfloat16, slow_gates: bool = False):
    """GDN's inputs at the 80B's heads; ``slow_gates``: decays of ~1e-3 a token (the state
    carries over hundreds of tokens, so a wrong carried or resumed state shows)."""
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (n, HK, D), dtype)
    k = jax.random.normal(ks[1], (n, HK, D), dtype)
    v = jax.random.normal(ks[2], (n, HV, D), dtype)
    a = jax.random.normal(ks[3], (n, HV), dtype)
    b = jax.random.normal(ks[4], (n, HV), dtype)
    A_log = jnp.log(jnp.linspace(1.0, 16.0, HV, dtype=jnp.float32))
    dt_bias = jnp.ones(HV, jnp.float32)
    if slow_gates:
        A_log = jnp.log(jnp.linspace(0.01, 0.05, HV, dtype=jnp.float32))
        dt_bias = jnp.full(HV, -3.0, jnp.float32)
    return q, k, v, a, b, A_log, dt_bias


def _running_slots(rows) -> StateSlots:
    """Decode rows that read and write their own slot 1..rows, no checkpoints."""
    running = 1 + jnp.arange(rows, dtype=jnp.int32)
    none = jnp.zeros((rows, 2), jnp.int32)
    return StateSlots(running, running, none, none, jnp.int32(rows))


def _pool(key, num_slots, dtype=jnp.float32):
    """A state pool, ``[num_slots, Hv, Dv, Dk]`` (states stored transposed, ``hyjax.cache``)."""
    return (0.1 * jax.random.normal(key, (num_slots, HV, D, D), jnp.float32)).astype(dtype)


# ----------------------------------------------------------------------------- timing


def _time_stateful(step, state, operands, *, iters: int, trace: dict | None = None) -> float:
    """:func:`benchmarks.common.time_stateful`: every output consumed, no loop round trips;
    ``trace`` filled (with ``--trace``) with what the device ran in the timed program."""
    trace = trace if TRACE else None
    if INTERPRET:  # CPU smoke run: exercise the code path only
        return time_stateful(step, state, operands, iters=1, repeats=1, trace=trace, runs=1)
    return time_stateful(step, state, operands, iters=iters, trace=trace)


def floors() -> dict:
    """Copy bandwidth (read + write bytes / s) and dense matmul rates."""
    iters = dict(iters=1, repeats=1) if INTERPRET else {}
    out = {"copy_bandwidth_GBps": copy_bandwidth(2**30, **iters) / 1e9}  # 1 GiB
    for name, dtype, n in [("bf16", jnp.bfloat16, 8192), ("f32", jnp.float32, 4096)]:
        a = jnp.ones((n, n), dtype)
        mm = jax.jit(
            lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32,
                              precision=jax.lax.Precision.HIGHEST)
        )  # fmt: skip
        mm(a).block_until_ready()
        out[f"matmul_{name}_TFLOPs"] = 2 * n**3 / _median_time(lambda a=a, mm=mm: mm(a)) / 1e12
    return out


def _median_time(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ----------------------------------------------------------------------------- checks


def check_prefill(precision, operand_dtype=None, pool_dtype=jnp.float32, **tuning) -> dict:
    key = jax.random.PRNGKey(0)
    lens = [1, 63, 64, 65, 700, 2000]
    n = sum(lens) + 7
    acts = _activations(key, n)
    qsl = jnp.array([0, *np.cumsum(lens), sum(lens)], jnp.int32)
    s = len(lens) + 1
    src = jnp.array([0, 1, 0, 2, 3, 0, 0], jnp.int32)
    dst = jnp.array([4, 1, 0, 2, 3, 5, 0], jnp.int32)
    ck_off = np.zeros((s, 2), np.int32)
    ck_slot = np.zeros((s, 2), np.int32)
    ck_off[4], ck_slot[4] = [64, 640], [6, 7]
    ck_off[5], ck_slot[5] = [1024, 1999], [8, 9]
    pool = _pool(jax.random.PRNGKey(1), 10, pool_dtype).at[0].set(jnp.nan).at[4:].set(jnp.nan)
    slots = StateSlots(src, dst, jnp.asarray(ck_off), jnp.asarray(ck_slot), jnp.int32(len(lens)))
    kernel = functools.partial(gpu.gdn_prefill, precision=precision, operand_dtype=operand_dtype)
    return _against_reference((*acts, pool, qsl, slots), kernel, n, range(1, 10), [0], **tuning)


def _against_reference(args, kernel, n, written, untouched, **tuning) -> dict:
    """``kernel(*args, **tuning)`` (a GDN prefill) against the reference: the first ``n``
    output rows, the ``written`` slots, and the ``untouched`` ones (NaN) left as they were."""
    want_o, want_s = jax.jit(gdn_prefill_reference)(*args)
    got_o, got_s = jax.jit(functools.partial(kernel, interpret=INTERPRET, **tuning))(*args)
    got_s, want_s = np.asarray(got_s, np.float32), np.asarray(want_s, np.float32)
    written, untouched = np.asarray(list(written)), np.asarray(list(untouched))
    return {
        "output_err_ratio": err_ratio(got_o[:n], want_o[:n]),
        "state_err_ratio": err_ratio(got_s[written], want_s[written]),
        "untouched_slots_still_nan": bool(np.isnan(got_s[untouched]).all()),
        "output_has_nan": bool(np.isnan(np.asarray(got_o, np.float32)).any()),
    }


def check_prefill_aligned(pool_dtype=jnp.float32, **tuning) -> dict:
    """Against the reference on a batch whose rows start at multiples of 64 tokens (the first
    Mosaic GPU serial launch ran only such batches right): rows of 256 and 200 tokens in 512
    slots, the first from a state with checkpoints at 64 and 192, the second from zeros."""
    lens = [256, 200]
    acts = _activations(jax.random.PRNGKey(6), 512, slow_gates=True)
    qsl = jnp.array([0, 256, 456, 456], jnp.int32)
    pool = _pool(jax.random.PRNGKey(7), 8, pool_dtype).at[0].set(jnp.nan).at[5:].set(jnp.nan)
    ck_off = jnp.array([[64, 192], [0, 0], [0, 0]], jnp.int32)
    ck_slot = jnp.array([[3, 4], [0, 0], [0, 0]], jnp.int32)
    src, dst = jnp.array([1, 0, 0], jnp.int32), jnp.array([1, 2, 0], jnp.int32)
    slots = StateSlots(src, dst, ck_off, ck_slot, jnp.int32(len(lens)))
    kernel = functools.partial(gpu.gdn_prefill, precision=None)
    args = (*acts, pool, qsl, slots)
    return _against_reference(args, kernel, sum(lens), range(1, 5), range(5, 8), **tuning)


def check_prefill_rows(batch: int = 8, seq_len: int = 512, **tuning) -> dict:
    """Against the reference on ``batch`` equal rows (:func:`prefill_batch`: every other row
    from its slot's state, the others from zeros): eight rows of 512 tokens make a dynamic
    pair pick the paired launch (``chunk_scan_mgpu.pair_mode``), which the ragged checks'
    rows do not."""
    qsl, slots, num_slots = prefill_batch(batch, seq_len)
    acts = _activations(jax.random.PRNGKey(8), batch * seq_len, slow_gates=True)
    pool = _pool(jax.random.PRNGKey(9), num_slots).at[0].set(jnp.nan)
    kernel = functools.partial(gpu.gdn_prefill, precision=None)
    args = (*acts, pool, qsl, slots)
    return _against_reference(args, kernel, batch * seq_len, range(1, batch + 1), [0], **tuning)


def check_decode() -> dict:
    rows = 16
    acts = _activations(jax.random.PRNGKey(2), rows)
    pool = _pool(jax.random.PRNGKey(3), 2 * rows + 2)
    src = jnp.arange(rows, dtype=jnp.int32).at[3].set(0)  # row 0 and row 3 start from zero
    dst = (rows + jnp.arange(rows, dtype=jnp.int32)).at[5].set(0)  # disjoint from src
    dst = dst.at[7].set(7)  # row 7 updates its slot in place
    ck_off = jnp.zeros((rows, 2), jnp.int32).at[0, 0].set(1)
    ck_slot = jnp.zeros((rows, 2), jnp.int32).at[0, 0].set(2 * rows + 1)
    args = (*acts, pool, StateSlots(src, dst, ck_off, ck_slot, jnp.int32(rows - 2)))
    want_o, want_s = jax.jit(gdn_decode_reference)(*args)
    got_o, got_s = jax.jit(functools.partial(gpu.gdn_decode, interpret=INTERPRET))(*args)
    return {
        "output_err_ratio": err_ratio(got_o, want_o),
        "state_err_ratio": err_ratio(got_s, want_s),
    }


# ----------------------------------------------------------------------------- timings


def time_prefill(
    batch, seq_len, precision, *, reference: bool, checkpoints: int = 0, **tuning
) -> dict:
    """``checkpoints`` per sequence at multiples of 64 tokens inside it (the default path)."""
    every = (seq_len // (checkpoints + 1)) // 64 * 64 if checkpoints else None
    short = tuning.pop("short_rows", 0)  # a mixed step: one-token rows after the long ones
    qsl, slot_args, num_slots = prefill_batch(
        batch, seq_len, max_ckpt=checkpoints or 2, ckpt_every=every, short_rows=short
    )
    acts = _activations(jax.random.PRNGKey(4), batch * seq_len + short)
    pool = _pool(jax.random.PRNGKey(5), num_slots)
    slots = (qsl, slot_args)
    out = {}
    # jitted: the chain's calls share one lowering (a Pallas call lowers in Python, a Mosaic GPU
    # one in ~0.25 s; ten apart took a prefill entry to ~70 s, 2026-11-29)
    kernel = jax.jit(
        functools.partial(gpu.gdn_prefill, precision=precision, interpret=INTERPRET, **tuning)
    )

    def step(fn):
        def one(st, acts, slots):
            o, st = fn(*acts, st, *slots)
            return st, o

        return one

    trace = {}
    t = _time_stateful(step(kernel), pool, (acts, slots), iters=10, trace=trace)
    out["pallas_ms"] = 1e3 * t
    if trace:
        out["pallas_trace"] = trace
    out["pallas_Mtok_per_s"] = batch * seq_len / t / 1e6
    if reference:
        t = _time_stateful(step(gdn_prefill_reference), _pool(jax.random.PRNGKey(5), num_slots),
                           (acts, slots), iters=1)  # fmt: skip
        out["reference_ms"] = 1e3 * t
    return out


# mgpu_scan's decompositions of the Mosaic GPU serial launch (scan_mgpu's arguments)
MGPU_SCAN_VARIANTS = {
    "chain_only": dict(diagnostic="chain"),
    "loads_only": dict(diagnostic="loads"),
    "prefetch1": dict(prefetch=1),
    "prefetch2": dict(prefetch=2),
    "loads_only_prefetch1": dict(diagnostic="loads", prefetch=1),
}


def mgpu_scan(batch, seq_len) -> dict:
    """The serial launch alone in its two lowerings, each on the intra launch's scratch in its
    own layout (``gdn.gpu.prefill_scratch``; bf16 operands, ``batch`` rows of ``seq_len``
    tokens, two checkpoints a row): Mosaic GPU (``pallas_kernels.common.chunk_scan_mgpu``: TMA
    copies, ``wgmma`` products) against Triton, each checked against the other (outputs,
    written slots), then each timed alone (the intra launch run once, outside the timing).
    Then Mosaic GPU's two decompositions (``scan_mgpu(diagnostic=...)``): the state's chain
    without ``o``, and the copies alone; and the launch with later chunks' tiles prefetched
    into L2 (``prefetch`` 1, 2); with each time per chunk of a row."""
    from pallas_kernels.common import chunk_scan_gpu, chunk_scan_mgpu, delta_rule_gpu

    every = (seq_len // 3) // 64 * 64
    qsl, slots, num_slots = prefill_batch(batch, seq_len, max_ckpt=2, ckpt_every=every)
    n = batch * seq_len
    acts = _activations(jax.random.PRNGKey(4), n)
    bv = delta_rule_gpu.serial_block_v(batch, HV, D, None)

    def scratch(tma_layout):
        @jax.jit
        def run(acts, qsl, slots):
            plan, rp, x = gpu.prefill_scratch(
                *acts, qsl, slots, operand_dtype=jnp.bfloat16, precision=None,
                tma_layout=tma_layout, interpret=INTERPRET,
            )  # fmt: skip
            return rp, x, plan.start, plan.length

        return run(acts, qsl, slots)

    def triton(pool, rp, x, start, length):
        o, pool = chunk_scan_gpu.scan_launches(
            rp, x, pool, start, length, out_dtype=jnp.bfloat16, bv=bv, precision=None,
            num_warps=4, num_stages=2, vb_first=delta_rule_gpu.SERIAL_VB_FIRST,
            three_launches=False, block_v_out=None, interpret=INTERPRET, name="gdn_prefill",
        )  # fmt: skip
        return pool, o

    def mgpu(pool, rp, x, diagnostic=None, prefetch=0):
        o, pool = chunk_scan_mgpu.scan_mgpu(
            rp, x, pool, out_dtype=jnp.bfloat16, diagnostic=diagnostic, prefetch=prefetch,
            interpret=INTERPRET,
        )  # fmt: skip
        return pool, o

    t_in, m_in = scratch(False), scratch(True)
    pool = _pool(jax.random.PRNGKey(5), num_slots)
    want_pool, want_o = jax.jit(triton)(jnp.copy(pool), *t_in)
    got_pool, got_o = jax.jit(mgpu)(jnp.copy(pool), *m_in[:2])
    written = np.unique(
        np.concatenate([np.asarray(slots.dst_slot), np.asarray(slots.ckpt_slots).ravel()])
    )
    written = written[written > 0]
    out = {
        "output_err_vs_triton": err_ratio(got_o[:n], want_o[:n]),
        "state_err_vs_triton": err_ratio(got_pool[written], want_pool[written]),
        "slots_checked": len(written),
    }
    traces = {"triton": {}, "mgpu": {}}
    out["triton_serial_ms"] = 1e3 * _time_stateful(
        triton, jnp.copy(pool), t_in, iters=10, trace=traces["triton"]
    )
    out["mgpu_serial_ms"] = 1e3 * _time_stateful(
        mgpu, jnp.copy(pool), m_in[:2], iters=10, trace=traces["mgpu"]
    )
    out.update({f"{k}_trace": v for k, v in traces.items() if v})
    out["mgpu_over_triton"] = out["mgpu_serial_ms"] / out["triton_serial_ms"]
    # What bounds it: the state's chain alone (no o, none of its copies), then the copies and
    # their waits alone (no products); each per chunk of a row (programs walk a row's chunks)
    chunks = -(-seq_len // 64)
    # and with a later chunk's tiles prefetched into L2 (scan_mgpu's prefetch), 1 or 2 ahead
    variants = {k: v for k, v in MGPU_SCAN_VARIANTS.items()
                if MGPU_VARIANTS is None or k in MGPU_VARIANTS}  # fmt: skip
    for name, kwargs in variants.items():
        step = functools.partial(mgpu, **kwargs)
        if "diagnostic" not in kwargs:  # the same results as the launch: checked, not assumed
            got_pool, got_o = jax.jit(step)(jnp.copy(pool), *m_in[:2])
            out[f"mgpu_{name}_err_vs_triton"] = (
                err_ratio(got_o[:n], want_o[:n]), err_ratio(got_pool[written], want_pool[written])
            )  # fmt: skip
        trace = {}
        ms = 1e3 * _time_stateful(step, jnp.copy(pool), m_in[:2], iters=10, trace=trace)
        out[f"mgpu_{name}_ms"] = ms
        if trace:
            out[f"mgpu_{name}_trace"] = trace
    for key in ("serial", *variants):
        out[f"mgpu_{key}_us_per_chunk"] = 1e3 * out[f"mgpu_{key}_ms"] / chunks
    return out


# The serial launch's variants: (Dv blocks on the fastest grid axis, Dv block, warps, stages).
SERIAL_SWEEP = [
    (False, 32, 4, 2),  # the default before the grid order was a parameter
    (True, 32, 4, 1),
    (True, 32, 4, 2),
    (True, 32, 4, 3),
    (True, 64, 4, 1),
    (True, 64, 4, 2),
    (True, 64, 8, 1),
    (True, 128, 8, 1),
    # one sequence: 256 programs of 16 columns (2 a SM) to hide the chunk step's load latency
    (True, 16, 2, 2),
    (True, 16, 4, 2),
]
INTRA_SWEEP = [(4, 2), (4, 1), (8, 2)]  # the intra launch's (warps, stages)


# The intra launch's (warps, stages, form) timed by --intra-sweep: at 8 warps it sits
# at the register cap (255 a thread, a 1 KB stack: ncu at 8x4096); 16 warps halve each
# thread's share of a chunk's tiles. Forms: gpu.INTRA_FORMS
INTRA_CONFIGS = [
    (8, 2, "whole"), (4, 2, "whole"), (16, 2, "whole"), (8, 2, "whole_bf16"), (4, 2, "whole_bf16"),
    (8, 2, "blocked"), (4, 2, "blocked"), (2, 1, "blocked"),
    (8, 2, "blocked_bf16"), (4, 2, "blocked_bf16"), (4, 1, "blocked_bf16"), (2, 1, "blocked_bf16"),
    (8, 2, "split"), (4, 2, "split"), (8, 2, "split_blocked"), (4, 2, "split_blocked"),
    (8, 2, "split_blocked_bf16"), (4, 2, "split_blocked_bf16"), (2, 1, "split_blocked_bf16"),
    (4, 2, "fold"), (8, 2, "fold"),  # blocked_bf16 as gdn_prefill(fold=True) runs it
    (4, 2, "foldbeta"), (4, 2, "foldcols"),  # with fold_beta_rows True, False
    (4, 2, "foldmgpu"),  # the fold's scratch by gdn.intra_mgpu (warps: not used)
]  # fmt: skip


def _intra_step(batch, seq_len, nw, ns, form):
    """The default prefill's intra launch alone (``gpu.prefill_scratch`` with the Mosaic GPU
    serial launch's layout, bf16 operands) as a :func:`time_stateful` step, and its operands.
    ``form`` ``"fold"``: ``blocked_bf16`` as ``gdn_prefill(fold=True)`` runs it (its scratch
    without the inputs it passes through, ``fold_beta_rows`` its default); ``"foldbeta"`` /
    ``"foldcols"`` the same with ``fold_beta_rows`` True / False; ``"foldmgpu"`` the fold's
    scratch by :mod:`pallas_kernels.gdn.intra_mgpu` (XLA's vectors and its launch)."""
    qsl, slots, _ = prefill_batch(batch, seq_len)
    acts = _activations(jax.random.PRNGKey(4), batch * seq_len)
    fold = form in ("fold", "foldbeta", "foldcols", "foldmgpu")
    beta_rows = {"foldbeta": True, "foldcols": False}.get(form)
    fold_intra = "mgpu" if form == "foldmgpu" else "triton"  # (fold, foldbeta, foldcols: Triton)

    @jax.jit  # the chain's calls share one lowering
    def scratch(acts, qsl, slots):
        _, _, x = gpu.prefill_scratch(
            *acts, qsl, slots, operand_dtype=jnp.bfloat16, precision=None, num_warps=nw,
            num_stages=ns, tma_layout=True, form="blocked_bf16" if fold else form, fold=fold,
            fold_beta_rows=beta_rows, fold_intra=fold_intra,
            interpret=INTERPRET,
        )  # fmt: skip
        return (x.w, x.tm, x.vec, x.decay) if fold else tuple(x)

    def one(st, acts, qsl, slots):
        return st, scratch(acts, qsl, slots)

    return one, (acts, qsl, slots)


def intra_floor(batch, seq_len, form="whole") -> dict:
    """The intra launch's bytes (its inputs read, its scratch written) at the copy rate
    measured here: the floor of :func:`intra_time`'s figures (``"fold"``: v not read)."""
    step, operands = _intra_step(batch, seq_len, 8, 2, form)
    x = jax.eval_shape(step, jnp.zeros(()), *operands)[1]
    bytes_out = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(x))
    acts = [a for i, a in enumerate(operands[0]) if not (form.startswith("fold") and i == 2)]
    bytes_in = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(acts))
    bw = copy_bandwidth(2**30, **(dict(iters=1, repeats=1) if INTERPRET else {}))
    return {"bytes_MB": (bytes_in + bytes_out) / 1e6, "copy_GBps": bw / 1e9,
            "byte_floor_ms": 1e3 * (bytes_in + bytes_out) / bw}  # fmt: skip


def intra_time(batch, seq_len, nw, ns, form) -> dict:
    """The intra launch alone at one of :data:`INTRA_CONFIGS`, each call on its own inputs."""
    step, operands = _intra_step(batch, seq_len, nw, ns, form)
    return {"ms": 1e3 * _time_stateful(step, jnp.zeros(()), operands, iters=10)}


def sweep_prefill(batch, seq_len) -> dict:
    """The default prefill's two launches tuned apart (:func:`benchmarks.common.sweep_launches`):
    the intra launch alone at each of ``INTRA_SWEEP``, the whole at each of ``SERIAL_SWEEP``."""
    qsl, slots, num_slots = prefill_batch(batch, seq_len)
    acts = _activations(jax.random.PRNGKey(4), batch * seq_len)
    n = batch * seq_len

    def intra(nw, ns):
        def one(st, acts, qsl, slots):
            q, k, v, a, b, A_log, dt_bias = acts
            plan = gpu.plan_chunks(qsl, slots, num_tokens=n, chunk=gpu.CHUNK)
            nc = gpu.max_chunks(n, slots.num_rows, slots.ckpt_offsets.shape[1], gpu.CHUNK)
            (q, k, v, a, b), _ = gpu.pad_tokens((q, k, v, a, b), gpu.CHUNK)
            x = gpu.intra_launch(
                q, k, v, a, b, A_log, dt_bias, plan, num_chunks=nc, operand_dtype=v.dtype,
                precision=None, num_warps=nw, num_stages=ns, interpret=INTERPRET,
            )  # fmt: skip
            return st, tuple(x)

        return one

    variants = {
        f"{'vbfirst' if vb_first else 'rowsfirst'}_bv{bv}_w{nw}_s{ns}": dict(
            vb_first=vb_first, block_v=bv, num_warps=nw, num_stages=ns
        )
        for vb_first, bv, nw, ns in SERIAL_SWEEP
    }
    return sweep_launches(
        functools.partial(gpu.gdn_prefill, precision=None, interpret=INTERPRET),
        intra,
        (acts, qsl, slots),
        lambda: _pool(jax.random.PRNGKey(5), num_slots),
        intra_sweep=INTRA_SWEEP,
        serial_variants=variants,
        time_fn=_time_stateful,
    )


def time_decode(rows, state_dtype=jnp.float32, **tuning) -> dict:
    acts = _activations(jax.random.PRNGKey(6), rows)
    pool = _pool(jax.random.PRNGKey(7), rows + 1, state_dtype)
    slots = (_running_slots(rows),)

    def step(fn):
        def one(st, acts, slots):
            o, st = fn(*acts, st, *slots)
            return st, o

        return one

    kernel = functools.partial(gpu.gdn_decode, interpret=INTERPRET, **tuning)
    t = _time_stateful(step(kernel), pool, (acts, slots), iters=50)
    state_bytes = 2 * rows * HV * D * D * jnp.dtype(state_dtype).itemsize  # read src + write dst
    out = {"pallas_us": 1e6 * t, "pallas_state_GBps": state_bytes / t / 1e9}
    if not tuning and state_dtype == jnp.float32:
        pool = _pool(jax.random.PRNGKey(7), rows + 1)
        out["reference_us"] = 1e6 * _time_stateful(
            step(gdn_decode_reference), pool, (acts, slots), iters=50
        )
    return out


CONV_C, CONV_K = 2 * HK * D + HV * D, 4  # conv channels of Qwen3-Next-80B's linear layers


def _fused_inputs(rows, key=8):
    ks = jax.random.split(jax.random.PRNGKey(key), 4)
    mixed = jax.random.normal(ks[0], (rows, CONV_C), jnp.bfloat16)
    weight = 0.5 * jax.random.normal(ks[1], (CONV_C, CONV_K), jnp.bfloat16)
    conv = jax.random.normal(ks[2], (rows + 1, CONV_K - 1, CONV_C), jnp.bfloat16)
    _, _, _, a, b, A_log, dt_bias = _activations(ks[3], rows)
    return mixed, weight, conv, a, b, A_log, dt_bias


def check_fused_decode() -> dict:
    rows = 16
    mixed, weight, conv, a, b, A_log, dt_bias = _fused_inputs(rows)
    ssm = _pool(jax.random.PRNGKey(9), rows + 1)
    src = jnp.arange(1, rows + 1, dtype=jnp.int32).at[3].set(0)
    dst = jnp.arange(1, rows + 1, dtype=jnp.int32).at[5].set(0)  # in place (src == dst)
    ck_off = jnp.zeros((rows, 2), jnp.int32)
    ck_slot = jnp.zeros((rows, 2), jnp.int32)
    slots = StateSlots(src, dst, ck_off, ck_slot, jnp.int32(rows - 2))
    args = (mixed, weight, conv, a, b, A_log, dt_bias, ssm, slots)
    ref = functools.partial(fused_decode.conv_gdn_decode_reference, num_k_heads=HK)
    want = jax.jit(ref)(*args)
    kernel = functools.partial(fused_decode.conv_gdn_decode, num_k_heads=HK, interpret=INTERPRET)
    got = jax.jit(kernel)(*args)
    return {
        f"{name}_err_ratio": err_ratio(g, w)
        for name, g, w in zip(["output", "conv_state", "ssm_state"], got, want)
    }


def time_fused_decode(rows) -> dict:
    """Fused conv + delta rule vs XLA conv update + the GDN decode kernel vs the references."""
    mixed, weight, conv, a, b, A_log, dt_bias = _fused_inputs(rows)
    slots = _running_slots(rows)
    unfused = fused_decode.composed_conv_gdn_decode(
        causal_conv1d_update_reference, functools.partial(gpu.gdn_decode, interpret=INTERPRET)
    )
    fns = {
        "fused": functools.partial(
            fused_decode.conv_gdn_decode, num_k_heads=HK, interpret=INTERPRET
        ),
        "xla_conv_then_kernel": functools.partial(unfused, num_k_heads=HK),
        "reference": functools.partial(fused_decode.conv_gdn_decode_reference, num_k_heads=HK),
    }
    out = {}
    for name, fn in fns.items():

        def step(st, *ops, fn=fn):
            conv, ssm = st
            o, conv, ssm = fn(ops[0], ops[1], conv, *ops[2:6], ssm, slots)
            return (conv, ssm), o

        state = (jnp.copy(conv), _pool(jax.random.PRNGKey(7), rows + 1))  # donated each time
        t = _time_stateful(step, state, (mixed, weight, a, b, A_log, dt_bias), iters=50)
        out[f"{name}_us"] = 1e6 * t
    moved = 2 * rows * (HV * D * D * 4 + (CONV_K - 1) * CONV_C * 2)
    out["fused_state_GBps"] = moved / (out["fused_us"] * 1e-6) / 1e9
    return out


def time_conv_prefill(seq_len) -> dict:
    """The XLA conv1d prefill (the GPU path today) against its bytes floor."""
    x = jax.random.normal(jax.random.PRNGKey(10), (seq_len, CONV_C), jnp.bfloat16)
    weight = 0.5 * jax.random.normal(jax.random.PRNGKey(11), (CONV_C, CONV_K), jnp.bfloat16)
    conv = jnp.zeros((3, CONV_K - 1, CONV_C), jnp.bfloat16)
    qsl = jnp.array([0, seq_len], jnp.int32)
    none = jnp.zeros((1, 2), jnp.int32)
    one, two = jnp.array([1], jnp.int32), jnp.array([2], jnp.int32)
    slots = StateSlots(one, two, none, none, jnp.int32(1))

    def step(conv, x, weight):
        y, conv = causal_conv1d_prefill_reference(x, weight, conv, qsl, slots)
        return conv, y

    t = _time_stateful(step, conv, (x, weight), iters=20)
    return {"reference_us": 1e6 * t, "bytes_moved_MB": 3 * x.nbytes / 1e6}  # x, y in; y out


def time_fla(prefill_shapes, decode_rows) -> dict:
    try:
        import torch
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # noqa: BLE001 - report any import failure and go on
        return {"skipped": f"{type(e).__name__}: {e}"}
    dev = "cuda"
    out = {}

    def cuda_time(fn, iters):
        ms, mode = torch_graph_ms(torch, fn, iters)
        out.setdefault("timing_modes", []).append(mode)
        return ms

    def inputs(b, t, hk=HK):
        q = torch.randn(b, t, hk, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, t, hk, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, t, HV, D, device=dev, dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(b, t, HV, device=dev, dtype=torch.float32))
        beta = torch.rand(b, t, HV, device=dev, dtype=torch.float32).sigmoid()
        h0 = torch.randn(b, HV, D, D, device=dev, dtype=torch.float32)
        return q, k, v, g, beta, h0

    def call(fn, q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)  # fmt: skip

    for b, t in prefill_shapes:
        try:
            ms = cuda_time(functools.partial(call, chunk_gated_delta_rule, *inputs(b, t)), 10)
            out[f"prefill_B{b}_T{t}_ms"] = ms
        except Exception as e:  # noqa: BLE001
            out[f"prefill_B{b}_T{t}"] = f"failed: {type(e).__name__}: {e}"
    for rows in decode_rows:
        try:
            # q/k repeated to the value heads: FLA 0.6.0's fused_recurrent with fewer key
            # than value heads hit an illegal address at B >= 64 on an H200.
            fn = functools.partial(call, fused_recurrent_gated_delta_rule, *inputs(rows, 1, hk=HV))
            ms = cuda_time(fn, 50)
            out[f"decode_B{rows}_us"] = 1e3 * ms
        except Exception as e:  # noqa: BLE001
            out[f"decode_B{rows}"] = f"failed: {type(e).__name__}: {e}"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    p.add_argument("--precisions", default="f32,tf32")
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--skip-floors", action="store_true")
    p.add_argument("--no-fla-decode", action="store_true",
                   help="FLA's prefill only: its decode at 256 rows hit an illegal address on "
                        "an H200 (2026-11-29), which ends the process")  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="prefill tuning sweep at B1 T4096")
    p.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    p.add_argument("--shapes", default=None,
                   help="prefill shapes BxT, comma-separated (default: issue 19's)")  # fmt: skip
    p.add_argument(
        "--mgpu-scan", action="store_true",
        help="only the serial launch, Mosaic GPU against Triton on the same scratch",
    )  # fmt: skip
    p.add_argument("--intra-sweep", action="store_true",
                   help="only the intra launch, at each of INTRA_CONFIGS")  # fmt: skip
    p.add_argument(
        "--trace",
        action="store_true",
        help="record the device's kernels and idle time in each timed prefill",
    )
    p.add_argument("--maxnreg", type=int, default=0,
                   help="a register cap for the intra launch (pallas_kernels.common.register_cap;"
                   " recorded in the summary)")  # fmt: skip
    p.add_argument("--mgpu-variants", default=None,
                   help=f"--mgpu-scan: comma-separated of {','.join(MGPU_SCAN_VARIANTS)} "
                   "(default all; 'none': the two launches only)")  # fmt: skip
    args = p.parse_args()
    only = tuple(args.only.split(",")) if args.only else None
    global INTERPRET, TRACE, MGPU_VARIANTS
    INTERPRET, TRACE = args.interpret, args.trace
    if args.mgpu_variants is not None:
        names = tuple(n for n in args.mgpu_variants.split(",") if n and n != "none")
        if bad := set(names) - set(MGPU_SCAN_VARIANTS):
            p.error(f"--mgpu-variants: unknown {sorted(bad)}; of {list(MGPU_SCAN_VARIANTS)}")
        MGPU_VARIANTS = names
    prefill_shapes = [(1, 4096), (1, 16384), (8, 4096), (1, 32768)]
    decode_rows = [1, 16, 64, 256]
    if args.shapes:
        prefill_shapes = [tuple(int(x) for x in bt.split("x")) for bt in args.shapes.split(",")]
    if args.quick:
        prefill_shapes, decode_rows = [(1, 256)], [1, 4]
    summary = {"device": device_name(), "jax": jax.__version__, "shapes": f"Hk={HK} Hv={HV} D={D}"}
    if args.maxnreg:  # before any lowering: every intra launch of this process is capped
        register_cap.set_cap("gdn_prefill_intra", args.maxnreg)
        summary["intra_maxnreg"] = args.maxnreg

    guarded = guarded_entries(summary, args.out, only)

    if args.mgpu_scan:  # the serial launch alone, in its two lowerings
        for b, t in [(1, 256)] if args.quick else [(1, 4096), (8, 4096), (1, 16384), (1, 32768)]:
            guarded(f"mgpu_scan_B{b}_T{t}", lambda b=b, t=t: mgpu_scan(b, t))
        write_summary(summary, args.out)
        return
    if args.intra_sweep:  # the intra launch alone, at each of INTRA_CONFIGS
        for b, t in [(1, 256)] if args.quick else [(8, 4096)]:  # 17k programs: 130 waves
            guarded(f"intra_B{b}_T{t}_floor", lambda b=b, t=t: intra_floor(b, t))
            guarded(f"intra_B{b}_T{t}_fold_floor", lambda b=b, t=t: intra_floor(b, t, "fold"))
            for nw, ns, form in INTRA_CONFIGS:  # an entry each: saved as it ends
                guarded(
                    f"intra_B{b}_T{t}_{form}_w{nw}_s{ns}",
                    lambda b=b, t=t, nw=nw, ns=ns, form=form: intra_time(b, t, nw, ns, form),
                )
        write_summary(summary, args.out)
        return
    if not args.skip_floors:
        guarded("floors", floors)
    guarded("check_decode", check_decode)
    guarded("check_fused_decode", check_fused_decode)
    precisions = {k: PRECISIONS[k] for k in args.precisions.split(",")}
    for name, prec in precisions.items():
        guarded(f"check_prefill_{name}", lambda prec=prec: check_prefill(prec))
    guarded("check_prefill_bf16ops", lambda: check_prefill(None, operand_dtype=jnp.bfloat16))
    guarded("check_prefill_bf16state", lambda: check_prefill(None, pool_dtype=jnp.bfloat16))
    guarded("check_prefill_mgpu", lambda: check_prefill(None, serial="mgpu"))
    # the whole chunk's intra launch (f32 products, the default until 2026-11-29) beside the
    # default's bf16 products: their error ratios in one process
    guarded("check_prefill_whole", lambda: check_prefill(None, intra_form="whole"))
    guarded("check_prefill_mgpu_aligned", lambda: check_prefill_aligned(serial="mgpu"))
    guarded("check_prefill_fold", lambda: check_prefill(None, serial="mgpu", fold=True))
    guarded("check_prefill_fold_aligned", lambda: check_prefill_aligned(serial="mgpu", fold=True))
    cols = dict(serial="mgpu", fold=True, fold_beta_rows=False)
    guarded("check_prefill_foldcols", lambda: check_prefill(None, **cols))
    fmg = dict(serial="mgpu", fold=True, fold_intra="mgpu")
    guarded("check_prefill_foldmgpu", lambda: check_prefill(None, **fmg))
    guarded("check_prefill_foldmgpu_aligned", lambda: check_prefill_aligned(**fmg))
    faqk = dict(serial="mgpu", fold=True, fold_aqk=True)
    guarded("check_prefill_foldaqk", lambda: check_prefill(None, **faqk))
    guarded("check_prefill_foldaqk_aligned", lambda: check_prefill_aligned(**faqk))
    fpers = dict(serial="mgpu", fold=True, fold_persist=528)  # (the persistent scratch)
    guarded("check_prefill_foldpers", lambda: check_prefill(None, **fpers))
    guarded("check_prefill_foldpers_aligned", lambda: check_prefill_aligned(**fpers))
    fpair = dict(serial="mgpu", fold=True, serial_pair=True)
    guarded("check_prefill_pair", lambda: check_prefill(None, **fpair))
    guarded("check_prefill_pair_aligned", lambda: check_prefill_aligned(**fpair))
    fdyn = dict(serial="mgpu", fold=True, serial_pair="dynamic")
    guarded("check_prefill_pairdyn", lambda: check_prefill(None, **fdyn))
    guarded("check_prefill_pairdyn_aligned", lambda: check_prefill_aligned(**fdyn))
    guarded("check_prefill_pairdyn_rows8", lambda: check_prefill_rows(**fdyn))  # (paired)
    # the baseline first: a section cut by its time limit still has it
    fla_rows = [] if args.no_fla_decode else decode_rows
    guarded("fla", lambda: time_fla(prefill_shapes, fla_rows))
    for b, t in prefill_shapes:
        for variant, (prec, op, three, more) in PREFILL_VARIANTS.items():
            guarded(
                f"prefill_B{b}_T{t}_{variant}",
                lambda b=b, t=t, prec=prec, op=op, three=three, more=more: time_prefill(
                    b, t, prec, reference=False, operand_dtype=op, three_launches=three, **more
                ),
            )
    # FLA once more after hyjax's entries: how far its figure drifts within a process (two
    # calls on two machines of one kind differed by 8-11 %, session 37)
    guarded("again_fla", lambda: time_fla(prefill_shapes, []))
    b, t = prefill_shapes[-1] if args.quick else (8, 4096)
    for n_ckpt in (0, 1, 4):  # checkpoints inside each sequence (multiples of 64 tokens)
        guarded(
            f"prefill_B{b}_T{t}_ckpt{n_ckpt}",
            lambda n_ckpt=n_ckpt: time_prefill(b, t, None, reference=False, checkpoints=n_ckpt),
        )
    if args.sweep:  # tuning: each launch of the default (two-launch) prefill apart
        for b, t in [(1, 256)] if args.quick else [(1, 4096), (2, 4096), (8, 4096)]:
            guarded(f"sweep_prefill_B{b}_T{t}", lambda b=b, t=t: sweep_prefill(b, t))
        for rows in (64, 256):
            for bv, nw in [
                (16, 1),
                (16, 2),
                (32, 2),
                (32, 4),
                (64, 2),
                (64, 8),
                (128, 4),
                (128, 8),
            ]:  # noqa: E501
                guarded(
                    f"sweep_decode_B{rows}_bv{bv}_w{nw}",
                    lambda rows=rows, bv=bv, nw=nw: time_decode(rows, block_v=bv, num_warps=nw),
                )
    for rows in decode_rows:
        guarded(f"decode_B{rows}", lambda rows=rows: time_decode(rows))
    for rows in decode_rows:  # --state-dtype bfloat16: half the bytes
        guarded(
            f"decode_bf16state_B{rows}",
            lambda rows=rows: time_decode(rows, state_dtype=jnp.bfloat16),
        )
    for rows in decode_rows:
        guarded(f"fused_decode_B{rows}", lambda rows=rows: time_fused_decode(rows))
    for t in sorted({t for _, t in prefill_shapes}):
        guarded(f"conv_prefill_T{t}", lambda t=t: time_conv_prefill(t))
    bw = summary.get("floors", {}).get("copy_bandwidth_GBps")
    if bw:
        summary["decode_floor_us"] = {
            f"B{r}": 1e6 * 2 * r * HV * D * D * 4 / (bw * 1e9) for r in decode_rows
        }
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
