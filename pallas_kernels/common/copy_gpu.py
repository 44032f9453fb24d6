"""Flat int32 arrays copied by one Triton kernel, which also makes the step's result buffers.

XLA sees through every copy written in jax.numpy: it folds ``concatenate`` then ``slice`` back
onto the operands and fuses the slices into each consumer, ``optimization_barrier``
included (XLA expands the barrier into control dependencies before fusion). A custom call is
opaque to it, so after :func:`copy_flat` every consumer reads the kernel's outputs and only
that one kernel reads the inputs. Why that matters for the engine's step: see
``serving.worker.runner._step_body``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

BLOCK = 1024  # elements a program copies of each array


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _copy_kernel(*refs, sizes: tuple[int, ...], block: int):
    """Program ``i`` copies elements ``[i * block, (i + 1) * block)`` of every array long
    enough; each output is padded to a whole number of blocks (zeros), so every store is
    unmasked and each element is written once."""
    n = len(sizes)
    i = pl.program_id(0)
    lanes = i * block + jnp.arange(block, dtype=jnp.int32)
    for x_ref, o_ref, size in zip(refs[:n], refs[n:], sizes, strict=True):

        @pl.when(i * block < size)
        def _(x_ref=x_ref, o_ref=o_ref, size=size):
            live = lanes < size
            x = pltr.load(x_ref.at[jnp.minimum(lanes, size - 1)], mask=live, other=0)
            o_ref[pl.ds(i * block, block)] = jnp.where(live, x, 0)


def copy_flat(
    *xs: jax.Array, blank: tuple[int, ...] = (), interpret: bool = False
) -> tuple[jax.Array, ...]:
    """Copies of the 1-D int32 arrays ``xs``, all written by one kernel launch, then one
    int32 array of each size in ``blank`` that the kernel allocates and never writes (its
    contents undefined): buffers that exist from the kernel on, for the caller to fill."""
    for x in xs:
        if x.ndim != 1 or x.dtype != jnp.int32 or x.shape[0] == 0:
            raise ValueError(f"copy_flat takes non-empty 1-D int32 arrays, got {x.dtype}{x.shape}")
    sizes = tuple(x.shape[0] for x in xs)
    block = min(BLOCK, _pow2(max(sizes)))
    padded = tuple(-(-n // block) * block for n in sizes)
    n = len(xs)

    def kernel(*refs):  # the blank outputs' refs come last, untouched
        _copy_kernel(*refs[:n], *refs[n : 2 * n], sizes=sizes, block=block)

    outs = pl.pallas_call(
        kernel,
        grid=(max(padded) // block,),
        out_shape=tuple(jax.ShapeDtypeStruct((p,), jnp.int32) for p in padded + blank),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="copy_flat",
    )(*xs)
    copies = tuple(o[:m] for o, m in zip(outs, sizes, strict=False))
    return copies + tuple(outs[n:])
