"""KDA kernels on a GPU at Kimi-Linear-48B shapes: correctness, then time, FLA alongside.

For the Pallas GPU kernels (``pallas_kernels/kda/gpu.py``) this script

1. checks them against the pure-JAX reference (ragged batch, src/dst slots, checkpoint
   writes, NaN in the slots nobody reads) with FLA's error ratio ``rms(got - want) / rms(want)``;
2. checks the reference against flash-linear-attention's ``chunk_kda`` and
   ``fused_recurrent_kda`` (gate, l2norm and sigmoid in their kernels) on the same inputs,
   when ``fla`` imports: the semantics, not just the speed, are the same;
3. times prefill and decode with the state donated (:func:`benchmarks.common.time_stateful`:
   unrolled calls, every output consumed), per prefill path (``VARIANTS``), prefill with 0, 1
   and 4 checkpoints a sequence, and FLA's two kernels on the same shapes in the same run from
   a CUDA graph (:func:`benchmarks.common.torch_graph_ms`);
4. with ``--sweep``, tunes the default prefill's two launches apart (the intra launch timed
   alone, then each serial variant, checked against the default's output and state).

It prints one JSON summary (and writes it to ``--out``)::

    python -m benchmarks.kda_kernels --sweep --out KDA_KERNELS.json
    python -m benchmarks.kda_kernels --quick --interpret    # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    device_name,
    err_ratio,
    guarded_entries,
    prefill_batch,
    sweep_launches,
    time_stateful,
    torch_graph_ms,
    write_summary,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda import gpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference

H, D = 32, 128  # Kimi-Linear-48B: 32 KDA heads of 128 (Dk = Dv)
INTERPRET = False
# The prefill paths side by side on bf16 activations: the default (parallel intra launch, then
# the serial one that finishes each chunk's output; bf16 dot operands, as FLA's chunk_kda), the
# output in a parallel launch of its own, and f32 dot operands at TF32 (a float32 model's path).
VARIANTS = {
    "default": {"precision": None},
    "triton": {"precision": None, "serial": "triton"},  # the Triton serial launch
    "three": {"precision": None, "three_launches": True},
    # the serial launch in Mosaic GPU (TMA, wgmma; a token-aligned chunk plan)
    "mgpu": {"precision": None, "serial": "mgpu"},
    "f32ops_tf32": {"precision": jax.lax.Precision.DEFAULT, "operand_dtype": jnp.float32},
    # the diagonal blocks by two products through each block's middle row where its decay
    # allows (gpu.DIAG_FORMS "mid", the column loop elsewhere)
    "mid": {"precision": None, "diag_form": "mid"},
}


def _activations(key, n, dtype=jnp.bfloat16):
    """q, k, v, raw gate, beta logits [n, ...] and the gate parameters, as the layer has them."""
    ks = jax.random.split(key, 7)
    q = jax.random.normal(ks[0], (n, H, D), dtype)
    k = jax.random.normal(ks[1], (n, H, D), dtype)
    v = jax.random.normal(ks[2], (n, H, D), dtype)
    g = jax.random.normal(ks[3], (n, H, D), dtype)
    b = jax.random.normal(ks[4], (n, H), dtype)
    A_log = jnp.log(jax.random.uniform(ks[5], (H,), minval=1.0, maxval=16.0))
    dt_bias = jax.random.normal(ks[6], (H, D), jnp.float32)
    return q, k, v, g, b, A_log, dt_bias


def _pool(key, num_slots):
    """A state pool, ``[num_slots, H, Dv, Dk]`` (states stored transposed, ``hyjax.cache``)."""
    return 0.1 * jax.random.normal(key, (num_slots, H, D, D), jnp.float32)


def _kv(states):
    """Pool-layout states ``[..., Dv, Dk]`` as FLA holds them, ``[..., Dk, Dv]`` (and back)."""
    return jnp.swapaxes(jnp.asarray(states), -1, -2)


def _time_stateful(step, state, operands, *, iters: int) -> float:
    """:func:`benchmarks.common.time_stateful`: every output consumed, no loop round trips."""
    if INTERPRET:  # CPU smoke run: exercise the code path only
        return time_stateful(step, state, operands, iters=1, repeats=1, runs=1)
    return time_stateful(step, state, operands, iters=iters)


def _swap(out):
    """``(o, state)`` as ops return it -> ``(state, o)`` as :func:`time_stateful` takes it."""
    return out[1], out[0]


# ----------------------------------------------------------------------------- checks


def check_prefill(lens, **variant) -> dict:
    n = sum(lens) + 7
    acts = _activations(jax.random.PRNGKey(0), n)
    qsl = jnp.array([0, *np.cumsum(lens), sum(lens)], jnp.int32)
    s = len(lens) + 1
    src = np.zeros(s, np.int32)
    src[1:4] = [1, 2, 3]
    dst = np.zeros(s, np.int32)
    dst[: len(lens)] = [4, 1, 0, 2, 3, 5][: len(lens)]
    ck_off = np.zeros((s, 2), np.int32)
    ck_slot = np.zeros((s, 2), np.int32)
    long_row = int(np.argmax(lens))
    ck_off[long_row] = [64, 64 * (lens[long_row] // 128) or 1]
    ck_slot[long_row] = [6, 7]
    pool = _pool(jax.random.PRNGKey(1), 10).at[0].set(jnp.nan).at[4:].set(jnp.nan)
    slots = StateSlots(*(jnp.asarray(x) for x in (src, dst, ck_off, ck_slot)), jnp.int32(len(lens)))
    args = (*acts, pool, qsl, slots)
    want_o, want_s = jax.jit(kda_prefill_reference)(*args)
    kernel = functools.partial(gpu.kda_prefill, interpret=INTERPRET, **variant)
    got_o, got_s = jax.jit(kernel)(*args)
    got_s, want_s = np.asarray(got_s), np.asarray(want_s)
    nan = np.isnan(want_s).reshape(len(want_s), -1).all(1)  # slots the reference left alone
    return {
        "output_err_ratio": err_ratio(got_o, want_o),
        "state_err_ratio": err_ratio(got_s[~nan], want_s[~nan]),
        "untouched_slots_still_nan": bool(np.isnan(got_s[nan]).all()),
        "output_has_nan": bool(np.isnan(np.asarray(got_o, np.float32)).any()),
    }


def check_decode() -> dict:
    rows = 16
    acts = _activations(jax.random.PRNGKey(2), rows)
    pool = _pool(jax.random.PRNGKey(3), 2 * rows + 2)
    # No slot is written by one row and read by another in the same launch (DESIGN.md §4):
    # rows read slots 0..15 (0 = zeros) and write rows+1.., except row 2 (in place).
    src = jnp.arange(rows, dtype=jnp.int32).at[3].set(0)
    dst = (rows + 1 + jnp.arange(rows, dtype=jnp.int32)).at[5].set(0).at[2].set(2)
    ck_off = jnp.zeros((rows, 2), jnp.int32).at[0, 0].set(1)
    ck_slot = jnp.zeros((rows, 2), jnp.int32).at[0, 0].set(2 * rows + 1)
    args = (*acts, pool, StateSlots(src, dst, ck_off, ck_slot, jnp.int32(rows - 2)))
    want_o, want_s = jax.jit(kda_decode_reference)(*args)
    got_o, got_s = jax.jit(functools.partial(gpu.kda_decode, interpret=INTERPRET))(*args)
    return {
        "output_err_ratio": err_ratio(got_o, want_o),
        "state_err_ratio": err_ratio(got_s, want_s),
    }


# ----------------------------------------------------------------------------- FLA


def _fla():
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return torch, chunk_kda, fused_recurrent_kda


def _to_torch(torch, x):
    return torch.from_numpy(np.asarray(x, np.float32)).cuda()


def _fla_call(fn, torch, q, k, v, g, b, A_log, dt_bias, h0):
    """FLA with the whole KDA front end in its kernel, as the Kimi layer would call it."""
    bf = torch.bfloat16
    return fn(
        q.to(bf), k.to(bf), v.to(bf), g.to(bf), b.to(bf), A_log=A_log,
        dt_bias=dt_bias.reshape(-1), initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip


def check_against_fla(t: int = 300, rows: int = 8) -> dict:
    """The reference vs FLA on one sequence (chunk_kda) and on a decode batch (fused_recurrent)."""
    torch, chunk_kda, fused_recurrent_kda = _fla()
    out = {}
    acts = _activations(jax.random.PRNGKey(10), t)
    h0 = _pool(jax.random.PRNGKey(11), 2)
    one = jnp.array([0, t], jnp.int32)
    z = jnp.zeros((1, 1), jnp.int32)
    slot1 = jnp.array([1], jnp.int32)
    want_o, want_s = jax.jit(kda_prefill_reference)(
        *acts, h0, one, StateSlots(slot1, slot1, z, z, jnp.int32(1))
    )
    q, k, v, g, b, A_log, dt_bias = (_to_torch(torch, x) for x in acts)
    o, s = _fla_call(chunk_kda, torch, q[None], k[None], v[None], g[None], b[None], A_log,
                     dt_bias, _to_torch(torch, _kv(h0[1:2])))  # fmt: skip
    out["chunk_kda_output_err_ratio"] = err_ratio(o[0].float().cpu().numpy(), want_o)
    out["chunk_kda_state_err_ratio"] = err_ratio(s[0].float().cpu().numpy(), _kv(want_s[1]))
    acts = _activations(jax.random.PRNGKey(12), rows)
    pool = _pool(jax.random.PRNGKey(13), rows + 1)
    slots = jnp.arange(1, rows + 1, dtype=jnp.int32)
    zz = jnp.zeros((rows, 1), jnp.int32)
    running = StateSlots(slots, slots, zz, zz, jnp.int32(rows))
    want_o, want_s = jax.jit(kda_decode_reference)(*acts, pool, running)
    q, k, v, g, b, A_log, dt_bias = (_to_torch(torch, x) for x in acts)
    o, s = _fla_call(fused_recurrent_kda, torch, q[:, None], k[:, None], v[:, None], g[:, None],
                     b[:, None], A_log, dt_bias, _to_torch(torch, _kv(pool[1:])))  # fmt: skip
    out["fused_recurrent_output_err_ratio"] = err_ratio(o[:, 0].float().cpu().numpy(), want_o)
    out["fused_recurrent_state_err_ratio"] = err_ratio(s.float().cpu().numpy(), _kv(want_s[1:]))
    return out


def time_fla(prefill_shapes, decode_rows) -> dict:
    torch, chunk_kda, fused_recurrent_kda = _fla()
    out = {}

    def cuda_time(fn, iters):
        ms, mode = torch_graph_ms(torch, fn, iters)
        out.setdefault("timing_modes", []).append(mode)
        return ms

    def inputs(bsz, t):
        dev, bf = "cuda", torch.bfloat16
        q, k, v, g = (torch.randn(bsz, t, H, D, device=dev, dtype=bf) for _ in range(4))
        b = torch.randn(bsz, t, H, device=dev, dtype=bf)
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H, D, device=dev)
        h0 = 0.1 * torch.randn(bsz, H, D, D, device=dev)
        return q, k, v, g, b, A_log, dt_bias, h0

    for bsz, t in prefill_shapes:
        fn = functools.partial(_fla_call, chunk_kda, torch, *inputs(bsz, t))
        out[f"chunk_kda_B{bsz}_T{t}_ms"] = cuda_time(fn, 10)
    for rows in decode_rows:
        fn = functools.partial(_fla_call, fused_recurrent_kda, torch, *inputs(rows, 1))
        out[f"fused_recurrent_kda_B{rows}_us"] = 1e3 * cuda_time(fn, 50)
    return out


# ----------------------------------------------------------------------------- timings


def _prefill_step(kernel):
    def one(st, acts, qsl, slots):
        o, st = kernel(*acts, st, qsl, slots)
        return st, o

    return one


def time_prefill(bsz, seq_len, checkpoints: int = 0, **tuning) -> dict:
    """``checkpoints`` per sequence at multiples of 64 tokens inside it."""
    every = (seq_len // (checkpoints + 1)) // 64 * 64 if checkpoints else None
    qsl, slots, num_slots = prefill_batch(bsz, seq_len, checkpoints or 2, every)
    acts = _activations(jax.random.PRNGKey(4), bsz * seq_len)
    # jitted: the chain's calls share one lowering (gdn_kernels.time_prefill)
    kernel = jax.jit(functools.partial(gpu.kda_prefill, interpret=INTERPRET, **tuning))
    t = _time_stateful(
        _prefill_step(kernel), _pool(jax.random.PRNGKey(5), num_slots), (acts, qsl, slots),
        iters=10,
    )  # fmt: skip
    return {"pallas_ms": 1e3 * t, "pallas_Mtok_per_s": bsz * seq_len / t / 1e6}


# The serial launch's variants: (Dv block, warps, stages); the intra launch's (warps, stages).
SERIAL_SWEEP = [(32, 4, 2), (64, 4, 2), (64, 4, 1), (32, 4, 3), (16, 2, 2), (128, 8, 1)]
INTRA_SWEEP = [(4, 2), (8, 1), (8, 2), (8, 3)]


# The intra launch alone at 8x4096, (warps, stages), by --intra-sweep (GDN's blocked launch,
# the same 16-row blocks, ran 1.7x faster at 4 warps than at 8 on an H200)
# and the diagonal blocks' forms (gpu.DIAG_FORMS: in the intra launch a column at a time, or
# the column loop in a launch of its own)
INTRA_CONFIGS = [(2, 1, "columns"), (4, 2, "columns"), (2, 1, "launch"), (4, 2, "launch"),
                 (8, 2, "launch"), (8, 1, "launch"), (8, 2, "launch_rows"),
                 (4, 2, "launch_rows"), (8, 2, "mid")]  # fmt: skip


def _intra_step(n, nw, ns, tma_layout=False, diag_form=None):
    """The intra launch alone as a :func:`time_stateful` step on ``(acts, qsl, slots)`` of
    ``n`` tokens; ``tma_layout``: the default (Mosaic GPU) serial launch's scratch."""

    @jax.jit  # the chain's calls share one lowering
    def scratch(acts, qsl, slots):
        q, k, v, g, b, A_log, dt_bias = acts
        plan = gpu.plan_chunks(qsl, slots, num_tokens=n, chunk=gpu.CHUNK, token_aligned=tma_layout)
        nc = gpu.max_chunks(n, slots.num_rows, slots.ckpt_offsets.shape[1], gpu.CHUNK)
        (q, k, g, v, b), _ = gpu.pad_tokens((q, k, g, v, b), gpu.CHUNK)
        x = gpu.intra_launch(
            q, k, v, g, b, -jnp.exp(A_log), dt_bias, plan, num_chunks=nc,
            operand_dtype=v.dtype, precision=None, num_warps=nw, num_stages=ns,
            tma_layout=tma_layout, diag_form=diag_form, interpret=INTERPRET,
        )  # fmt: skip
        return tuple(x)

    return lambda st, acts, qsl, slots: (st, scratch(acts, qsl, slots))


def intra_time(bsz, seq_len, nw, ns, diag_form) -> dict:
    """The default prefill's intra launch alone (bf16 operands, the Mosaic GPU serial
    launch's layout) at ``nw`` warps, ``ns`` stages, the diagonal blocks in ``diag_form``;
    each chained call on its own inputs."""
    qsl, slots, _ = prefill_batch(bsz, seq_len)
    # (the CPU smoke run on f32: XLA's CPU dot rejects the bf16 products' interpreted form in
    # this chained program)
    dtype = jnp.float32 if INTERPRET else jnp.bfloat16
    acts = _activations(jax.random.PRNGKey(4), bsz * seq_len, dtype)
    step = _intra_step(bsz * seq_len, nw, ns, tma_layout=True, diag_form=diag_form)
    return {"ms": 1e3 * _time_stateful(step, jnp.zeros(()), (acts, qsl, slots), iters=10)}


def sweep_prefill(bsz, seq_len) -> dict:
    """The default prefill's two launches tuned apart (:func:`benchmarks.common.sweep_launches`):
    the intra launch alone at each of ``INTRA_SWEEP``, the whole at each of ``SERIAL_SWEEP``."""
    qsl, slots, num_slots = prefill_batch(bsz, seq_len)
    acts = _activations(jax.random.PRNGKey(4), bsz * seq_len)
    n = bsz * seq_len
    return sweep_launches(
        functools.partial(gpu.kda_prefill, precision=None, interpret=INTERPRET),
        lambda nw, ns: _intra_step(n, nw, ns),
        (acts, qsl, slots),
        lambda: _pool(jax.random.PRNGKey(5), num_slots),
        intra_sweep=INTRA_SWEEP,
        serial_variants={
            f"serial_bv{bv}_w{nw}_s{ns}": dict(block_v=bv, num_warps=nw, num_stages=ns)
            for bv, nw, ns in SERIAL_SWEEP
        },
        time_fn=_time_stateful,
    )


def time_decode(rows) -> dict:
    acts = _activations(jax.random.PRNGKey(6), rows)
    pool = _pool(jax.random.PRNGKey(7), rows + 1)
    slots = (1 + jnp.arange(rows)).astype(jnp.int32)
    zeros = jnp.zeros((rows, 2), jnp.int32)
    args = (StateSlots(slots, slots, zeros, zeros, jnp.int32(rows)),)
    out = {}
    for name, fn in [("pallas", functools.partial(gpu.kda_decode, interpret=INTERPRET)),
                     ("reference", kda_decode_reference)]:  # fmt: skip
        step = functools.partial(lambda st, a, s, fn: _swap(fn(*a, st, *s)), fn=fn)
        t = _time_stateful(step, pool, (acts, args), iters=50)
        out[f"{name}_us"] = 1e6 * t
        pool = _pool(jax.random.PRNGKey(7), rows + 1)
    # Bytes that must move: the state read once and written once, f32.
    out["state_bytes_MB"] = 2 * rows * H * D * D * 4 / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--sweep", action="store_true", help="tune the prefill's launches")
    p.add_argument("--no-fla-decode", action="store_true",
                   help="FLA's prefill only (gdn_kernels: its GDN decode at 256 rows hit an "
                        "illegal address, which ends the process)")  # fmt: skip
    p.add_argument("--intra-sweep", action="store_true",
                   help="only the intra launch, at each of INTRA_CONFIGS")  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    args = p.parse_args()
    only = tuple(args.only.split(",")) if args.only else None
    global INTERPRET, H, D
    INTERPRET = args.interpret
    if args.interpret:  # the interpreter runs every program in Python: tiny heads only
        H, D = 2, 16
    prefill_shapes = [(1, 4096), (1, 16384), (8, 1024), (8, 4096)]
    decode_rows = [1, 64, 256]
    check_lens = [1, 63, 64, 65, 700, 1500]
    ckpt_shape, sweep_shapes = (8, 4096), [(1, 4096), (8, 4096)]
    if args.quick:
        prefill_shapes, decode_rows, check_lens = [(1, 128)], [2], [1, 17, 40, 130]
        ckpt_shape, sweep_shapes = (2, 256), [(1, 128)]
    summary = {"device": device_name(), "jax": jax.__version__, "shapes": f"H={H} D={D}"}

    guarded = guarded_entries(summary, args.out, only)

    if args.intra_sweep:  # the intra launch alone, an entry a configuration
        bsz, t = (1, 128) if args.quick else (8, 4096)
        for nw, ns, form in INTRA_CONFIGS:
            guarded(f"intra_B{bsz}_T{t}_{form}_w{nw}_s{ns}",
                    lambda nw=nw, ns=ns, f=form: intra_time(bsz, t, nw, ns, f))  # fmt: skip
        write_summary(summary, args.out)
        return
    guarded("check_decode", check_decode)
    checks = {
        **VARIANTS,
        "f32ops_ieee": {"precision": jax.lax.Precision.HIGHEST, "operand_dtype": jnp.float32},
    }
    for vname, variant in checks.items():
        guarded(f"check_prefill_{vname}", lambda v=variant: check_prefill(check_lens, **v))
    guarded("check_reference_vs_fla", check_against_fla)
    fla_rows = [] if args.no_fla_decode else decode_rows
    guarded("fla", lambda: time_fla(prefill_shapes, fla_rows))  # the baseline first
    for i, (bsz, t) in enumerate(prefill_shapes):
        for vname, variant in VARIANTS.items():
            if vname.startswith("f32ops") and i > 0:  # a float32 model's path: one shape
                continue
            guarded(
                f"prefill_B{bsz}_T{t}_{vname}",
                lambda b=bsz, t=t, v=variant: time_prefill(b, t, **v),
            )
    for n_ckpt in (0, 1, 4):  # checkpoints inside each sequence (multiples of 64 tokens)
        guarded(
            f"prefill_B{ckpt_shape[0]}_T{ckpt_shape[1]}_ckpt{n_ckpt}",
            lambda n=n_ckpt: time_prefill(*ckpt_shape, checkpoints=n, precision=None),
        )
    if args.sweep:
        for bsz, t in sweep_shapes:
            guarded(f"sweep_prefill_B{bsz}_T{t}", lambda b=bsz, t=t: sweep_prefill(b, t))
    for rows in decode_rows:
        guarded(f"decode_B{rows}", lambda rows=rows: time_decode(rows))
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
