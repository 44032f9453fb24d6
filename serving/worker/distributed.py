"""What the processes of a multi-process job agree on before they serve (collectives).

Every process runs each step on pools of one size, since the leader's scheduler hands out the
block and slot ids for all of them; these helpers make the processes agree on the budget and
the checkpoint slots that size them. Each is a collective: every process must call it. The
plan channel between the processes is :mod:`serving.engine.multihost`'s.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def gather_ints(mine: list[int]) -> list[list[int]]:
    """Every process's ``mine`` (non-negative ints up to ~2**61), in process order: a
    collective every process must enter. Each int travels as two int32 halves (without
    jax_enable_x64 an int64 would be cut to 32 bits, and an H100's budget is ~2**36 bytes); a
    bad value still enters the collective, so that every process raises the same error instead
    of leaving the others waiting in it."""
    import jax
    from jax.experimental import multihost_utils

    halves = []
    for v in mine:
        hi, lo = divmod(v, 1 << 30)
        halves += [max(-(1 << 31), min(hi, (1 << 31) - 1)), lo]  # clipped at ~2**61
    try:
        gathered = np.asarray(multihost_utils.process_allgather(np.array(halves, np.int32)))
    except Exception as e:  # a process that failed before this point never joins it
        raise RuntimeError(
            f"process {jax.process_index()} of {jax.process_count()} could not agree on the "
            "pool sizes with the others: did one of them fail to start? (see its log) "
            f"[{type(e).__name__}: {e}]"
        ) from e
    rows = gathered.reshape(-1, len(mine), 2)  # [num_processes, len(mine), (hi, lo)]
    return [[(int(h) << 30) + int(low) for h, low in row] for row in rows]


def smallest_cache_bytes(mine: int) -> int:
    """The least cache budget of all processes (a collective: every process must call it).

    Each process measures its own devices' free memory, but all of them run the same step on
    pools of one size: the leader's scheduler hands out block and slot ids for everyone, and a
    follower with a smaller pool would index past its end. So every process plans its pools
    from the smallest budget any of them can hold.

    Args:
      mine: this process's budget in bytes (per device), as it would plan alone.
    """
    import jax

    budgets = [row[0] for row in gather_ints([mine])]
    least = min(budgets)
    smallest = budgets.index(least)
    if least < 1:
        raise ValueError(f"process {smallest}'s cache budget of {least} bytes must be positive")
    log.info(
        "pools sized to the smallest process: %d bytes (%.2f GiB) per device, process %d's "
        "budget (this is process %d; budgets by process: %s)",
        least,
        least / (1 << 30),
        smallest,
        jax.process_index(),
        budgets,
    )
    return least


def fewest_checkpoint_slots(mine: int) -> int:
    """The fewest checkpoint slots any process planned (a collective), so that all plan the
    same pools from the same budget even where their defaults differ (on CPU the default is
    four a sequence without ``--cache-bytes`` and a tenth of the budget with it)."""
    counts = [row[0] for row in gather_ints([mine])]
    if len(set(counts)) > 1:
        log.info("checkpoint slots by process: %s; all use %d", counts, min(counts))
    return min(counts)
