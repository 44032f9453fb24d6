"""How much of a step's launch is XLA re-recording its CUDA graphs (issue 20).

XLA runs a step's kernels as command buffers (CUDA graphs). Before each launch it compares
the device addresses of the buffer allocations the graph's kernels use with those it
recorded; when one moved, it updates every kernel node that touches a moved allocation
(``cuGraphExecKernelNodeSetParams``, host work a kernel) and skips the others. Which
allocations move from one step to the next (the step's fresh inputs and outputs only, or the
executable's temp buffer, which nearly every kernel touches) decides whether the launch costs
a few microseconds a graph or ~2 us a kernel.

This runs ``benchmarks.serving_throughput`` in a child process with XLA's command-buffer
logging on (``TF_CPP_VMODULE``) and reads, for the measured run of each scheduling mode
(between its ``compile:`` line and its result line):

- graph launches, and how many of them re-recorded (``updated_allocs`` > 0);
- per update: the number of moved allocations, the kernels updated and skipped, the host
  microseconds XLA reports for it;
- all of that per engine step (the run's ``engine_steps`` from its result).

    python -m benchmarks.cmdbuf_updates --out J.json -- --model bench --layers 8 \
        --concurrency 8 --input-len 200 --output-len 128 --scheduling sync async
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

VMODULE = "command_buffer_thunk=3,command_buffer_cmd=1,command_executor=1"

# XLA's log lines (jaxlib 0.10-0.11): the thunk's decision, then the executor's summary.
UPDATE = re.compile(r"num_commands=(\d+); updated_allocs=(\d+)")
THUNK_TIME = re.compile(r"Updated command buffer in (\d+) \S+; num_commands=(\d+)")
EXECUTOR = re.compile(r"Updated (\d+) commands in (\d+) \S+ \(skipped (\d+) command updates\)")
EXECUTE = re.compile(r"Execute command buffer.*num_executions=(\d+)")
DEVICE = re.compile(r"\] \[(\d+)\] ")  # the thunk's lines name the device ordinal


def summarize(lines: list[str], steps: int | None) -> dict:
    """The command-buffer log of one measured run -> counts, per step where ``steps`` is
    known."""
    launches = sum(1 for ln in lines if EXECUTE.search(ln))
    updates = [tuple(map(int, m.groups())) for ln in lines if (m := UPDATE.search(ln))]
    thunk_us = [int(m.group(1)) for ln in lines if (m := THUNK_TIME.search(ln))]
    executor = [tuple(map(int, m.groups())) for ln in lines if (m := EXECUTOR.search(ln))]
    moved = [u for _, u in updates]
    out = {
        "log_lines": len(lines),
        "graph_launches": launches,
        "graph_updates": len(updates),
        "moved_allocs_median": statistics.median(moved) if moved else 0,
        "moved_allocs_max": max(moved, default=0),
        "commands_in_updated_graphs": sum(n for n, _ in updates),
        "update_us_total": sum(thunk_us),
        "update_us_median": statistics.median(thunk_us) if thunk_us else 0,
        "kernels_updated": sum(n - s for n, _, s in executor),
        "kernels_skipped": sum(s for _, _, s in executor),
    }
    if steps:
        for k in ("graph_launches", "graph_updates", "update_us_total", "kernels_updated",
                  "kernels_skipped", "commands_in_updated_graphs"):  # fmt: skip
            out[k.removesuffix("_total") + "_per_step"] = round(out[k] / steps, 2)
    # per device (each has its own launch thread under tensor parallelism; the slowest one
    # paces the step): its re-recordings and their host time
    by_device: dict[str, dict] = {}
    for ln in lines:
        if not (d := DEVICE.search(ln)):
            continue
        dev = by_device.setdefault(d.group(1), {"graph_updates": 0, "update_us": 0})
        if UPDATE.search(ln):
            dev["graph_updates"] += 1
        elif m := THUNK_TIME.search(ln):
            dev["update_us"] += int(m.group(1))
    if steps:
        for dev in by_device.values():
            dev["graph_updates_per_step"] = round(dev["graph_updates"] / steps, 2)
            dev["update_us_per_step"] = round(dev["update_us"] / steps, 2)
    out["by_device"] = dict(sorted(by_device.items()))
    return out


def split_runs(text: str) -> list[tuple[dict, list[str]]]:
    """The child's merged output -> (result, log lines of its measured run) per run."""
    runs, seg, measuring = [], [], False
    for ln in text.splitlines():
        if ln.startswith("compile: "):
            seg, measuring = [], True
        elif measuring and ln.startswith('{"concurrency"'):
            runs.append((json.loads(ln), seg))
            measuring = False
        elif measuring:
            seg.append(ln)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="JSON summary")
    p.add_argument("--log", help="keep the child's whole output here")
    p.add_argument("--max-seconds", type=float, default=280)
    p.add_argument("throughput_args", nargs=argparse.REMAINDER,
                   help="after --: benchmarks.serving_throughput's arguments")  # fmt: skip
    args = p.parse_args()
    rest = [a for a in args.throughput_args if a != "--"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=VMODULE)
    cmd = [sys.executable, "-u", "-m", "benchmarks.serving_throughput", *rest]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=args.max_seconds, check=False)  # fmt: skip
    if args.log:
        with open(args.log, "w") as f:
            f.write(proc.stdout)
    result = {"command": cmd[2:], "vmodule": VMODULE, "rc": proc.returncode, "runs": []}
    for run, seg in split_runs(proc.stdout):
        steps = run.get("engine_steps")
        keep = {k: run.get(k) for k in ("concurrency", "async_scheduling", "output_tok_per_s")}
        keep["steps"] = steps
        keep |= summarize(seg, steps)
        result["runs"].append(keep)
        print(json.dumps(keep), flush=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if not result["runs"]:
        print(proc.stdout[-3000:])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
