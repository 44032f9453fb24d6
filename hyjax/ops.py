"""Op dispatch: each op of the model by backend (DESIGN.md §6).

``reference`` is pure JAX (the CPU path and the oracle). ``pallas`` and ``interpret`` register
here as their kernels land; ``auto`` picks by platform.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference


@dataclasses.dataclass(frozen=True)
class Ops:
    conv1d_prefill: Callable
    conv1d_update: Callable
    gdn_prefill: Callable
    gdn_decode: Callable
    write_kv: Callable
    paged_attention: Callable


BACKENDS: dict[str, Ops] = {
    "reference": Ops(
        conv1d_prefill=causal_conv1d_prefill_reference,
        conv1d_update=causal_conv1d_update_reference,
        gdn_prefill=gdn_prefill_reference,
        gdn_decode=gdn_decode_reference,
        write_kv=write_kv_reference,
        paged_attention=ragged_paged_attention_reference,
    ),
}


def resolve_backend(name: str) -> str:
    """Maps ``auto`` to the best backend available on this platform."""
    if name == "auto":
        platform = jax.default_backend()
        return "pallas" if platform in ("gpu", "tpu") and "pallas" in BACKENDS else "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; available: {sorted(BACKENDS)}, auto")
    return name


def get_ops(name: str) -> Ops:
    return BACKENDS[resolve_backend(name)]
