"""How much of an engine step holds the GIL, phase by phase (issue 20: the HTTP server's rate).

``hyjax serve`` runs the engine loop in one process beside the threads that ship its outputs
to the front end (the outbox queue's feeder). ``benchmarks.frontend_rate`` showed the front
end keeping up with a fake engine while the engine thread releases the GIL for part of each
step, and falling to ~0.88 of the engine's rate when the step holds it throughout, near the
0.845 measured on an H200. This script asks the real engine which it does: a probe thread
counts loop turns while the engine steps, and each phase of the step (schedule, dispatch,
wait for the tokens, update, the rest) gets the turns the probe made during it, against its
rate with the engine idle. A phase that holds the GIL gives the probe ~0 turns a millisecond
(Python work too: the interpreter hands the GIL over only every 5 ms). On a 2-core CPU host
the device's threads take the probe's core as well, so only a GPU host's figures are clean.

    python -m benchmarks.step_gil --model bench --layers 8 --concurrency 8 --out GIL.json
    python -m benchmarks.step_gil --model tiny-qwen3-next --kernel-backend reference  # a CPU

The engine runs SGLang's workload shape (random prompts, ignore_eos) with its default
scheduling (async on a GPU); only decode steps are counted.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from benchmarks.common import device_name
from benchmarks.full_size import add_model_args, build_for_engine
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine


class Probe:
    """A thread that counts loop turns (each takes the GIL); ``turns()`` reads the count."""

    def __init__(self) -> None:
        self.count = 0
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self.stop:
            self.count += 1
            time.sleep(0)  # a switch point each turn, as a feeder thread has

    def rate(self, seconds: float = 0.5) -> float:
        """Turns a millisecond with the main thread asleep (the GIL free)."""
        c0 = self.count
        time.sleep(seconds)
        return (self.count - c0) / (seconds * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200, help="decode steps measured")
    p.add_argument("--cache-gib", type=float, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model, cfg, info = build_for_engine(args, dtype=args.dtype)
    n = args.concurrency
    engine = LLMEngine(
        EngineArgs(
            model=".", max_num_seqs=n, min_seq_bucket=n, max_num_batched_tokens=2048,
            min_token_bucket=2048, mixed_row_buckets=False, enable_prefix_caching=False,
            max_model_len=args.input_len + args.steps + 256, kernel_backend=args.kernel_backend,
            cache_bytes=int(args.cache_gib * 2**30) if args.cache_gib else None,
            tensor_parallel_size=args.tp, warmup=False, progress=False,
        ),
        preloaded=(model, cfg),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True)
    vocab = min(cfg.vocab_size, 150000)
    for _ in range(n):
        engine.add_request(EngineRequest(rng.integers(0, vocab, args.input_len).tolist(), params))
    while not engine.timing.last[1] or engine.timing.last[0] < n:  # prefill, compiles
        engine.step()
    for _ in range(8):  # the decode bucket compiled and warm
        engine.step()

    probe = Probe()
    probe.thread.start()
    idle = probe.rate()
    phases = {"schedule": [0.0, 0], "dispatch": [0.0, 0], "wait": [0.0, 0], "update": [0.0, 0]}
    sched, runner = engine.scheduler, engine.runner

    def timed(name, fn):
        def wrapper(*a, **k):
            c0, t0 = probe.count, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ph = phases[name]
                ph[0] += time.perf_counter() - t0
                ph[1] += probe.count - c0

        return wrapper

    sched.schedule = timed("schedule", sched.schedule)
    runner.submit = timed("dispatch", runner.submit)
    runner.fetch = timed("wait", runner.fetch)
    engine._update = timed("update", engine._update)  # scheduler.update: the tokens taken
    c0, t0 = probe.count, time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - t0
    turns = probe.count - c0
    probe.stop = True
    # the rest of the step: detokenizing, outputs, the engine's own bookkeeping
    phases["rest"] = [wall - sum(s for s, _ in phases.values()),
                      turns - sum(c for _, c in phases.values())]  # fmt: skip
    res = {
        "device": device_name(),
        "model": info,
        "concurrency": n,
        "async_scheduling": engine.async_scheduling,
        "probe_turns_per_ms_idle": round(idle, 2),
        "step_ms": round(1e3 * wall / args.steps, 3),
        # the share of the step's wall time the probe could run, at its idle rate
        "gil_free_share_of_step": round(turns / (idle * 1e3 * wall), 3),
        "phases": {
            name: {
                "ms_per_step": round(1e3 * s / args.steps, 3),
                "gil_free_share": round(c / (idle * 1e3 * s), 3) if s else None,
            }
            for name, (s, c) in phases.items()
        },
    }
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
