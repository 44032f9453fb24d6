"""The step's data-dependent branches: ``lax.cond``, or both sides computed and selected.

The sampler and the log-probs run only in steps where some row asks for them (a ``lax.cond``
on the batch). XLA:GPU records a conditional into its CUDA graphs as a conditional node, and
NCCL cannot instantiate a graph that holds both its kernels and conditional nodes (NVIDIA/nccl
issue 1986): under tensor parallelism every layer's all-reduce then cuts the step's graph.
In a step traced under ``selecting(True)`` (``EngineArgs.branch_free_step``) each branch is
computed on every step and its result selected, so the step holds no conditional and XLA may
keep the collectives inside one graph (``--xla_gpu_enable_command_buffer=+COLLECTIVES``).

Where a branch is already a no-op for the rows that do not ask for it (it masks by row),
``masked=True`` runs it alone, with no select.

The choice is read while tracing; the runner makes it part of the step's static arguments,
so each setting is its own compiled step. A context variable: the background warm-up traces
other buckets in other threads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

_SELECT: contextvars.ContextVar[bool] = contextvars.ContextVar("branch_free", default=False)


@contextlib.contextmanager
def selecting(on: bool) -> Iterator[None]:
    """Traces inside compute every branch of :func:`cond` and select (``on``)."""
    token = _SELECT.set(on)
    try:
        yield
    finally:
        _SELECT.reset(token)


def cond(pred: jax.Array, true_fn: Callable[[], Any], false_fn: Callable[[], Any], *,
         masked: bool = False) -> Any:  # fmt: skip
    """``lax.cond(pred, true_fn, false_fn)``; under :func:`selecting`, ``true_fn()`` alone if
    ``masked`` (it returns ``false_fn()``'s values wherever ``pred`` would be false), else both
    computed and ``pred`` selecting between them."""
    if not _SELECT.get():
        return jax.lax.cond(pred, true_fn, false_fn)
    if masked:
        return true_fn()
    return jax.tree.map(lambda t, f: jnp.where(pred, t, f), true_fn(), false_fn())
