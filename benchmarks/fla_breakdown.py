"""FLA's chunked GDN prefill by kernel: each of its launches' device time a call (PyTorch's
profiler over CUDA's activity records), at issue 19's shapes, with the whole call's time
from a CUDA graph beside it. What FLA spends before its state recurrence (the scores, the
triangular solve, W and U) is the figure hyjax's intra launch is weighed against.

    python -m benchmarks.fla_breakdown --shapes 8x4096,1x4096 --out fla_breakdown.json
"""

from __future__ import annotations

import argparse
import collections

from benchmarks.common import guarded_entries, torch_graph_ms, write_summary
from benchmarks.gdn_kernels import HK, HV, D


def inputs(torch, b, t):
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(b, t, HK, D, device=dev, dtype=bf)
    k = torch.randn(b, t, HK, D, device=dev, dtype=bf)
    v = torch.randn(b, t, HV, D, device=dev, dtype=bf)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, HV, device=dev))
    beta = torch.rand(b, t, HV, device=dev).sigmoid()
    h0 = torch.randn(b, HV, D, D, device=dev)
    return q, k, v, g, beta, h0


def by_kernel(torch, fn, calls: int) -> dict:
    """Each kernel's device time a call (us), summed over its launches, from ``calls`` calls
    under the profiler (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time  # us
    return {name: us / calls for name, us in total.most_common()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x4096,1x4096,1x16384", help="BxT, comma-separated")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    summary = {"device": torch.cuda.get_device_name()}
    guarded = guarded_entries(summary, args.out)
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))

        def entry(b=b, t=t):
            q, k, v, g, beta, h0 = inputs(torch, b, t)

            def call():
                return chunk_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )  # fmt: skip

            kernels = by_kernel(torch, call, args.calls)
            graph_ms, mode = torch_graph_ms(torch, call, args.calls)
            return {
                "graph_ms": graph_ms,
                "timing_mode": mode,
                "kernels_us": kernels,
                "kernels_sum_us": sum(kernels.values()),
            }

        guarded(f"fla_B{b}_T{t}", entry)
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
