"""Host time to launch one jitted call, by the number of argument buffers, jit against AOT.

The engine's host time a step is mostly XLA's launch of the step (py-spy of the in-process
engine, bench model at 8 layers on an H200: 56 % of its wall time in ``Compiled.__call__``,
1.6 ms a step; BENCHMARKS.md). The step takes every parameter as its own buffer (~17 a layer)
plus the pools. This separates what a launch costs per argument buffer from the rest: a
trivial program over N small f32 buffers (it reads five of them, so the kernels stay tiny),
launched back to back without waiting (the host's dispatch alone, as under async scheduling),
by three paths:

- ``jit``: ``jax.jit`` (the engine without ``--compilation-cache-dir``);
- ``aot``: ``jit(...).lower(...).compile()`` called directly (the runner's kept executables);
- ``aot_loaded``: the same serialized and loaded back (a warm start's kept executables).

Microseconds a launch (median of ``--repeats`` runs of ``--calls`` launches), per path and N.

    python -m benchmarks.launch_overhead --args 10 100 300 1000 --out LAUNCH.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import device_name


def _program(n: int):
    def f(leaves, x):
        return x + sum(leaf[0] for leaf in leaves[:5])

    leaves = [jnp.full((4,), i, jnp.float32) for i in range(n)]
    return f, leaves


def time_launches(call, leaves, x, calls: int, repeats: int) -> float:
    """Median microseconds a launch: ``calls`` launches back to back, each fed the last."""
    out = call(leaves, x)
    out.block_until_ready()
    runs = []
    for _ in range(repeats):
        y = out
        start = time.perf_counter()
        for _ in range(calls):
            y = call(leaves, y)
        runs.append((time.perf_counter() - start) / calls)
        y.block_until_ready()
    return 1e6 * statistics.median(runs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--args", type=int, nargs="+", default=[10, 100, 300, 1000])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from jax.experimental import serialize_executable

    results = {"device": device_name(), "jax": jax.__version__, "launch_us": {}}
    for n in args.args:
        f, leaves = _program(n)
        x = jnp.zeros((), jnp.float32)
        jitted = jax.jit(f, keep_unused=True)  # the default prunes unread buffers
        compiled = jitted.lower(leaves, x).compile()
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        row = {}
        for name, call in (("jit", jitted), ("aot", compiled), ("aot_loaded", loaded)):
            row[name] = round(time_launches(call, leaves, x, args.calls, args.repeats), 1)
        row["jit_per_arg"] = round(row["jit"] / n, 2)
        results["launch_us"][str(n)] = row
        print(f"{n} buffers:", json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
