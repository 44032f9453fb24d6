"""CPU affinity for ``hyjax serve``: the engine process on CPUs of its own.

The engine process's host work (scheduling, and above all XLA's launch of each step's
kernels) bounds a decode step on a GPU; the HTTP process beside it streams one event a token a
request. ``--engine-cpus`` gives the engine process its own CPUs and leaves the HTTP process
the others it may use, so the two never take each other's cores (benchmarks.http_serving).
"""

from __future__ import annotations

import os


def parse_cpu_list(spec: str) -> set[int]:
    """``"0-5"`` or ``"0,2,4-7"`` as a set of CPU ids; a clear error for anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a range of CPU ids")
        cpus.update(range(first, last + 1))
    return cpus


def split_engine_cpus(spec: str, allowed: set[int] | None = None) -> tuple[set[int], set[int]]:
    """The engine process's CPUs (``spec``) and the HTTP process's: the rest of ``allowed``
    (default: the CPUs this process may run on). Every engine CPU must be allowed, and at
    least one must be left for the HTTP process."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    engine = parse_cpu_list(spec)
    if not engine <= allowed:
        raise ValueError(
            f"--engine-cpus {spec}: CPUs {sorted(engine - allowed)} are not among the "
            f"{len(allowed)} this process may use ({_ranges(allowed)})"
        )
    rest = allowed - engine
    if not rest:
        raise ValueError(
            f"--engine-cpus {spec} takes every CPU this process may use ({_ranges(allowed)}): "
            "leave at least one for the HTTP server"
        )
    return engine, rest


def _ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``"0-2,5"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (``os.sched_setaffinity(0)`` moves the
    calling thread only; threads started later inherit its CPUs)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
