"""One GDN or KDA prefill on a GPU, for a kernel profiler: the launches' counters, not a timing.

Runs the engine's default prefill (the path ``hyjax.ops`` calls for bf16 models) once to
compile and warm up, then ``--calls`` more times, with the benches' inputs at ``--batch`` rows
of ``--seq-len`` tokens (Qwen3-Next-80B's GDN heads, Kimi-Linear-48B's KDA heads)::

    /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:prefill_ \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python -m benchmarks.profile_prefill --family gdn --batch 8 --seq-len 4096

``--launch-skip 2`` leaves out the warm-up call's two launches (intra, serial).
``--clock-control none`` keeps the card's own clocks: ncu locks them to base by default
(1.36 GHz on an H200 on 2026-11-29, against up to 1.98), so the durations it reports are not
the benches' figures. Its occupancy, launch and warp-state sections are the kernel's own.
Without ncu, the script only runs (a smoke run of the inputs with ``--interpret``).
"""

from __future__ import annotations

import argparse
import functools

import jax


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--calls", type=int, default=1, help="profiled calls after the warm-up")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run")
    args = p.parse_args()
    from benchmarks.common import prefill_batch

    if args.family == "gdn":
        from benchmarks import gdn_kernels as bench
        from pallas_kernels.gdn.gpu import gdn_prefill as prefill
    else:
        from benchmarks import kda_kernels as bench
        from pallas_kernels.kda.gpu import kda_prefill as prefill
    qsl, slots, num_slots = prefill_batch(args.batch, args.seq_len)
    acts = bench._activations(jax.random.PRNGKey(4), args.batch * args.seq_len)
    fn = jax.jit(
        functools.partial(prefill, precision=None, interpret=args.interpret), donate_argnums=7
    )
    pool = bench._pool(jax.random.PRNGKey(5), num_slots)
    for _ in range(1 + args.calls):
        o, pool = fn(*acts, pool, qsl, slots)
        jax.block_until_ready((o, pool))
    print(f"{args.family} prefill {args.batch} x {args.seq_len}: {1 + args.calls} calls")


if __name__ == "__main__":
    main()
