"""What a launch of a tiny kernel costs inside one jitted program, by who made the kernel.

The GDN prefill at 1x4096 keeps the device busy only ~60 % of its span (H200, session 36: 274
us of kernels in a 452 us span a call, two of them Mosaic GPU launches; at 8x4096 busy and
span agree). Mosaic GPU builds each launch's TMA descriptors on the host
(``cuTensorMapEncodeTiled``, one per distinct copied slice shape and operand) and passes them
as a kernel argument; XLA's fusions and Triton's kernels carry no such host work. This times a
chain of ``--calls`` dependent calls of the smallest kernel of each kind on one ``[64, 128]``
bf16 tile, in one jitted program (each call's output the next one's input, an optimization
barrier between calls so that XLA fuses nothing across them):

- ``xla``: ``x * 0.5 + 1`` (one XLA fusion);
- ``triton``: the same in a Pallas Triton kernel;
- ``mgpu_1``: the same in a Mosaic GPU kernel (``plgpu.kernel``), x in by one TMA copy, out
  by one TMA store;
- ``mgpu_12``: the same, with 11 more ``[64, 128]`` operands each copied in (12 descriptors
  in, like the serial launch's stage).

Per kind: the program's wall time a call (the host's launches and the device's work, whichever
is longer) and, from a profile of one more run, the device's busy time and span a call.

    python -m benchmarks.kernel_launch_cost --calls 50 --out COST.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.common import device_name, device_trace, write_summary

SHAPE = (64, 128)


def _xla(x, extra):
    return x * 0.5 + 1


def _triton(x, extra):
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        o_ref[...] = (x_ref[...].astype(jnp.float32) * 0.5 + 1).astype(o_ref.dtype)

    from jax.experimental.pallas import triton as pltr

    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
    )(x)


def _mgpu(x, extra):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = 1 + len(extra)

    def body(*refs):
        *ins, o_ref = refs

        def scoped(bufs, out_s, bar):
            for src, buf in zip(ins, bufs, strict=True):
                plgpu.copy_gmem_to_smem(src, buf, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            y = bufs[0][...].astype(jnp.float32) * 0.5 + 1
            for buf in bufs[1:]:
                y = y + buf[...].astype(jnp.float32)  # (each copy read)
            out_s[...] = y.astype(out_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            [plgpu.SMEM(SHAPE, x.dtype) for _ in range(n)],
            plgpu.SMEM(SHAPE, x.dtype),
            plgpu.Barrier(num_arrivals=n, num_barriers=1),
        )

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    mesh = plgpu.Mesh(grid=(1,), grid_names=("g",))
    run = pl.kernel(
        body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh, compiler_params=params
    )
    return run(x, *extra)


KINDS = {"xla": (_xla, 0), "triton": (_triton, 0), "mgpu_1": (_mgpu, 0), "mgpu_12": (_mgpu, 11)}


def chain(kind: str, calls: int):
    fn, num_extra = KINDS[kind]

    @jax.jit
    def run(x, extra):
        for _ in range(calls):
            x = jax.lax.optimization_barrier(fn(x, extra[:num_extra]))
        return x

    return run


def time_kind(kind: str, calls: int, repeats: int) -> dict:
    x = jnp.ones(SHAPE, jnp.bfloat16)
    extra = [jnp.full(SHAPE, i, jnp.bfloat16) for i in range(11)]
    run = chain(kind, calls)
    run(x, extra).block_until_ready()  # compile and warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(x, extra).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    trace = device_trace(lambda: run(x, extra).block_until_ready())
    out = {"wall_us_per_call": 1e6 * best / calls}
    if trace.get("kernels"):
        out["device_busy_us_per_call"] = trace["device_busy_us"] / calls
        out["device_span_us_per_call"] = trace["device_span_us"] / calls
        out["kernels"] = trace["kernels"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    summary = {"device": device_name(), "jax": jax.__version__, "calls": args.calls}
    for kind in args.kinds.split(","):
        try:
            summary[kind] = time_kind(kind, args.calls, args.repeats)
        except Exception as e:  # (one kind failing leaves the others' figures)
            summary[kind] = {"failed": f"{type(e).__name__}: {e}"[:400]}
        print(kind, json.dumps(summary[kind]), flush=True)
    write_summary(summary, args.out)
    return summary


if __name__ == "__main__":
    main()
