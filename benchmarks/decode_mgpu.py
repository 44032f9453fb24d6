"""The Mosaic GPU decode (``pallas_kernels.common.decode_mgpu``) on a GPU: checked, then timed
beside the engine's Triton decode and a copy of the same state bytes, in one process.

    python -m benchmarks.decode_mgpu --out decode_mgpu.json [--batches 64,256]

For GDN and KDA (80B / Kimi-Linear-48B heads, f32 state [V, K]): first the check at 64 rows
on ``decode_variants.check_slots`` (a row from zeros, slot 0 NaN, a row writing nothing, a
checkpoint at offset 1, a padding row) against the reference in IEEE f32, the same bounds as
``decode_variants``' tilings (state 1e-5, bf16 output 4e-3); then, at each batch, the copy,
the Triton decode, this kernel at its defaults and in its first design (two programs an SM of
three buffers, no store lag), the kernel alone on inputs made outside the timed chain, and its
copies and stores alone (``stream_only``: the design's streaming ceiling), with
``decode_variants``' timing (chains of unrolled calls, state donated, every output consumed).
``--bf16``: then both decodes (the engine's entries, ``kernel`` triton / mgpu) on a bf16 pool
against a copy of its bytes, and how much faster than on the f32 pool (the issue's bf16 state:
half the bytes). ``--sweep``: GDN at (programs, buffers, item rows, lag) combinations, no
check. ``--dry-run``: CPU, interpret mode, tiny shapes. A kernel that fails its check is not
timed.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.decode_variants import (
    INPUTS,
    Runner,
    Shapes,
    _swap,
    check_decode,
    copy_step,
    pool,
    running_slots,
)
from pallas_kernels.common import decode_mgpu
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.kda import gpu as kda_gpu

# (programs an SM or "pN": N programs, buffers, rows of S^T an item copies, lag, stream_only)
SWEEP = [(2, 3, 64, 0, False), (2, 3, 64, 1, False), (1, 4, 64, 1, False), (1, 5, 64, 1, False),
         (1, 6, 64, 1, False), (1, 3, 128, 1, False), ("p256", 3, 64, 0, False),
         ("p256", 3, 64, 1, False), (2, 3, 64, 0, True), (2, 3, 64, 1, True),
         (1, 6, 64, 1, True), ("p256", 3, 64, 1, True)]  # fmt: skip
TOKEN_INPUTS = {"gdn": decode_mgpu.gdn_inputs, "kda": decode_mgpu.kda_inputs}
KERNELS = {"gdn": decode_mgpu.gdn_decode_mgpu, "kda": decode_mgpu.kda_decode_mgpu}


def check(run: Runner, fam: str, rows: int, programs: int | None, **kw) -> dict:
    kernel = functools.partial(KERNELS[fam], programs=programs, interpret=run.interpret, **kw)
    return check_decode(run.sh, fam, rows, lambda *acts, st, slots: kernel(*acts, st, slots))


def timed(run: Runner, fam, rows, programs, copy_s, buffers=None, kernel_only=False, **kw) -> dict:
    """The kernel from the family's activations (its norms and gates by XLA in the same call),
    or ``kernel_only``: from its inputs made once outside the timed chain, ``o`` left in f32
    (the kernel's own time, without the two XLA launches around it); ``kw``: more of
    ``decode_mgpu``'s arguments (``stream_only``)."""
    acts = INPUTS[fam](run.sh, rows, jax.random.PRNGKey(1))
    st = pool(run.sh, rows + 1, jax.random.PRNGKey(2))
    more = {"buffers": buffers, **kw} if buffers else kw
    if kernel_only:
        acts = jax.jit(TOKEN_INPUTS[fam])(*acts)

        def fn(*args):
            *inputs, state, slots = args
            return decode_mgpu.decode_mgpu(
                tuple(inputs), state, slots, out_dtype=jnp.float32, name=f"{fam}_decode",
                programs=programs, interpret=run.interpret, **more,
            )  # fmt: skip
    else:
        fn = functools.partial(KERNELS[fam], programs=programs, interpret=run.interpret, **more)
    return run.timed(rows, run.time(_swap(fn), st, (acts, running_slots(rows))), copy_s)


ENGINE_DECODES = {"gdn": gdn_gpu.gdn_decode, "kda": kda_gpu.kda_decode}


def copy_bf16(run: Runner, rows: int) -> dict:
    """A copy of a bf16 pool's bytes (half the f32 state's)."""
    x = pool(run.sh, rows, jax.random.PRNGKey(0)).astype(jnp.bfloat16)
    t = run.time(copy_step, x, ())
    return {"us": 1e6 * t, "GBps": run.state_bytes(rows) / 2 / t / 1e9}


def timed_bf16(run: Runner, fam, rows, copy_s, kernel, f32: dict) -> dict:
    """The engine's decode entry (``kernel``: ``"triton"`` or ``"mgpu"``) on a bf16 pool
    (``--state-dtype bfloat16``), against the bf16 copy; ``vs_f32``: how much faster than the
    same kernel's f32 entry ``f32``."""
    acts = INPUTS[fam](run.sh, rows, jax.random.PRNGKey(1))
    st = pool(run.sh, rows + 1, jax.random.PRNGKey(2)).astype(jnp.bfloat16)
    fn = functools.partial(ENGINE_DECODES[fam], kernel=kernel, interpret=run.interpret)
    t = run.time(_swap(fn), st, (acts, running_slots(rows)))
    out = {"us": 1e6 * t, "state_GBps": run.state_bytes(rows) / 2 / t / 1e9, "vs_copy": copy_s / t}
    if "us" in f32:
        out["vs_f32"] = f32["us"] / out["us"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--families", default="gdn,kda")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--chains", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--sweep", action="store_true",
                   help="GDN: (programs an SM, buffers, item rows) a batch, no check")  # fmt: skip
    p.add_argument("--bf16", action="store_true",
                   help="also both decodes on a bf16 pool, against a bf16 copy")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpret mode")
    args = p.parse_args()
    sh, batches = Shapes(), [int(b) for b in args.batches.split(",")]
    if args.dry_run:
        sh, batches = Shapes(hk=2, hv=4, d=64), [8]
    run = Runner(args, sh)
    sms = 2 if args.dry_run else decode_mgpu._num_sms()
    fams = args.families.split(",")
    if args.sweep:
        for rows in batches:
            copy_s = run.record(f"copy_B{rows}", lambda r=rows: run.copy(r)).get("us", 0) * 1e-6
            run.record(
                f"gdn_decode_B{rows}", lambda r=rows, c=copy_s: run.baseline("gdn_decode", r, c)
            )
            for per_sm, buffers, item, lag, stream in SWEEP:
                progs = int(per_sm[1:]) if isinstance(per_sm, str) else per_sm * sms
                where = per_sm if isinstance(per_sm, str) else f"{per_sm}per_sm"
                kind = "stream_only" if stream else "gdn_mgpu"
                run.record(
                    f"{kind}_{where}_{buffers}buf_{item}rows_lag{lag}_B{rows}",
                    lambda r=rows,
                    n=progs,
                    c=copy_s,
                    nb=buffers,
                    kw=dict(  # noqa: C408
                        item_rows=item, lag=lag, stream_only=stream, kernel_only=stream
                    ): timed(run, "gdn", r, n, c, nb, **kw),
                )
        return
    ok = {}
    for fam in fams:
        res = run.record(f"{fam}_mgpu_check", lambda fam=fam: check(run, fam, batches[0], None))
        ok[fam] = bool(res.get("ok"))
    for rows in batches:
        copy_s = run.record(f"copy_B{rows}", lambda rows=rows: run.copy(rows)).get("us", 0) * 1e-6
        for fam in fams:
            name = f"{fam}_decode"
            run.record(f"{name}_B{rows}", lambda n=name, r=rows, c=copy_s: run.baseline(n, r, c))
            if not ok[fam]:
                continue
            run.record(  # the defaults (decode_mgpu.PROGRAMS_PER_SM, BUFFERS, LAG)
                f"{fam}_mgpu_B{rows}", lambda f=fam, r=rows, c=copy_s: timed(run, f, r, None, c)
            )
            run.record(  # the first design: two programs an SM of 3 buffers, no store lag
                f"{fam}_mgpu_first_B{rows}",
                lambda f=fam, r=rows, n=2 * sms, c=copy_s: timed(run, f, r, n, c, 3, lag=0),
            )
            run.record(
                f"{fam}_mgpu_kernel_only_B{rows}",
                lambda f=fam, r=rows, c=copy_s: timed(run, f, r, None, c, kernel_only=True),
            )
        # this design's streaming ceiling: the same copies and stores, no update
        run.record(
            f"mgpu_stream_only_B{rows}",
            lambda r=rows, c=copy_s: timed(
                run, "gdn", r, None, c, kernel_only=True, stream_only=True
            ),
        )
        run.record(f"copy_again_B{rows}", lambda rows=rows: run.copy(rows))
        if not args.bf16:
            continue
        res = run.record(f"copy_bf16_B{rows}", lambda r=rows: copy_bf16(run, r))
        copy16 = res.get("us", 0) * 1e-6
        for fam in fams:
            for kern, f32_name in (("triton", f"{fam}_decode"), ("mgpu", f"{fam}_mgpu")):
                if kern == "mgpu" and not ok[fam]:
                    continue
                f32 = run.summary.get(f"{f32_name}_B{rows}", {})
                run.record(
                    f"{f32_name}_bf16_B{rows}",
                    lambda f=fam, r=rows, c=copy16, kn=kern, x=f32: timed_bf16(run, f, r, c, kn, x),
                )


if __name__ == "__main__":
    main()
