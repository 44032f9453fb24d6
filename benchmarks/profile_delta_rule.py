"""One GDN or KDA prefill or decode on a GPU, for a kernel profiler: counters, not a timing.

Runs the engine's default kernel (the path ``hyjax.ops`` calls for bf16 models) once to
compile and warm up, then ``--calls`` more times, with the benches' inputs (Qwen3-Next-80B's
GDN heads, Kimi-Linear-48B's KDA heads): ``--op prefill`` at ``--batch`` rows of
``--seq-len`` tokens, ``--op decode`` at ``--batch`` rows of one token each reading and
writing its own f32 slot (the decode bench's case)::

    /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:_gpu \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python -m benchmarks.profile_delta_rule --family gdn --op prefill --batch 8

``--launch-skip`` leaves out the warm-up call's launches (two for a prefill: intra, serial;
one for a decode). ``--mgpu-decode`` profiles the Mosaic GPU decode instead
(``--kernel-name regex:_decode_mgpu``: the name Pallas gives it; not yet run under ncu).
``--clock-control none`` keeps the card's own clocks: ncu locks them to base by default
(1.36 GHz on an H200 on 2026-11-29, against up to 1.98), so the durations it reports would
not be the benches' figures. Its occupancy, launch and warp-state sections are the kernel's
own. ``--interpret``: a CPU smoke run of the inputs.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--op", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096, help="prefill tokens a row")
    p.add_argument("--calls", type=int, default=1, help="profiled calls after the warm-up")
    p.add_argument("--mgpu-decode", action="store_true",
                   help="--op decode: the Mosaic GPU decode (common/decode_mgpu.py)")  # fmt: skip
    p.add_argument("--interpret", action="store_true", help="CPU smoke run")
    args = p.parse_args()
    from benchmarks.common import prefill_batch
    from pallas_kernels.common.slots import StateSlots

    if args.family == "gdn":
        from benchmarks import gdn_kernels as bench
        from pallas_kernels.gdn import gpu
    else:
        from benchmarks import kda_kernels as bench
        from pallas_kernels.kda import gpu
    if args.op == "prefill":
        qsl, slots, num_slots = prefill_batch(args.batch, args.seq_len)
        acts = bench._activations(jax.random.PRNGKey(4), args.batch * args.seq_len)
        kernel = getattr(gpu, f"{args.family}_prefill")
        fn = functools.partial(kernel, precision=None, interpret=args.interpret)
        tail = (qsl, slots)
    else:  # rows read and write their own slot 1..B
        num_slots = args.batch + 1
        acts = bench._activations(jax.random.PRNGKey(6), args.batch)
        running = 1 + jnp.arange(args.batch, dtype=jnp.int32)
        none = jnp.zeros((args.batch, 2), jnp.int32)
        tail = (StateSlots(running, running, none, none, jnp.int32(args.batch)),)
        fn = getattr(gpu, f"{args.family}_decode")
        if args.mgpu_decode:
            from pallas_kernels.common import decode_mgpu

            fn = getattr(decode_mgpu, f"{args.family}_decode_mgpu")
        fn = functools.partial(fn, interpret=args.interpret)
    fn = jax.jit(fn, donate_argnums=7)
    pool = bench._pool(jax.random.PRNGKey(5), num_slots)
    for _ in range(1 + args.calls):
        o, pool = fn(*acts, pool, *tail)
        jax.block_until_ready((o, pool))
    print(f"{args.family} {args.op}, {args.batch} rows: {1 + args.calls} calls")


if __name__ == "__main__":
    main()
