"""Op dispatch: each op of the model by backend (DESIGN.md §6).

- ``reference``: pure JAX (the CPU path and the oracle).
- ``interpret``: the Mosaic TPU kernels run by the TPU interpreter on CPU (how CI tests them).
- ``pallas``: Mosaic TPU kernels on TPU, Pallas GPU kernels on NVIDIA, chosen at trace time
  from ``jax.default_backend()``.

``auto`` picks ``pallas`` on NVIDIA GPUs and TPUs and ``reference`` elsewhere (CPU, ROCm).
On an H200 (BENCHMARKS.md) every GPU kernel matches the IEEE-f32 reference at Qwen3-Next-80B
shapes (GDN prefill in TF32: output error ratio 1.4e-3; decode 1e-5; fused decode 1e-6) and
beats it (prefill 70x, decode 5x at B >= 16). The TPU kernels pass their interpret-mode tests
and lower through Mosaic for v5e and v6e in CI, but have not run on a TPU: if one misbehaves
there, ``--kernel-backend reference`` is the way out. Where a kernel does not exist yet, a
backend falls back to the reference op; each such entry below says so.

The runner takes its ops from :func:`ops_for_model`, once at start-up: a kernel that cannot take
the model's shapes (the Triton kernels' power-of-two tiles; each GPU kernel module's
``unsupported_reason``) is swapped for its reference op with one warning, and
``Ops.matmul_precision`` makes float32 models compute IEEE float32 products on every platform
(XLA's dots and the Pallas GPU kernels' alike) unless TF32 is allowed (``--allow-tf32``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from hyjax.models import family_of
from pallas_kernels.attention import gpu as attention_gpu
from pallas_kernels.attention import mla_gpu, mla_tpu
from pallas_kernels.attention import tpu as attention_tpu
from pallas_kernels.attention.mla_reference import (
    mla_decode_reference,
    mla_prefill_reference,
    write_latent_reference,
)
from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pallas_kernels.conv1d import tpu as conv1d_tpu
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from pallas_kernels.gdn import fused_decode
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.gdn import tpu as gdn_tpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda import tpu as kda_tpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from pallas_kernels.moe import gpu as moe_gpu
from pallas_kernels.moe.reference import moe_experts_reference

log = logging.getLogger(__name__)


def _whole(x: jax.Array) -> jax.Array:
    return x


@dataclasses.dataclass(frozen=True)
class Ops:
    conv1d_prefill: Callable
    conv1d_update: Callable
    gdn_prefill: Callable
    gdn_decode: Callable
    write_kv: Callable
    paged_attention: Callable
    # Decode-only steps: the same attention without the (empty) prefill launch where a kernel
    # has one (GPU: ~8 us per layer call at 4k context on an H100).
    paged_attention_decode: Callable = ragged_paged_attention_reference
    # Decode: conv1d update + gated delta rule in one pass (one kernel where one exists).
    conv_gdn_decode: Callable = fused_decode.conv_gdn_decode_reference
    # Kimi-Linear (defaults: the reference ops, so backends opt in one kernel at a time).
    kda_prefill: Callable = kda_prefill_reference
    kda_decode: Callable = kda_decode_reference
    write_latent: Callable = write_latent_reference
    mla_prefill: Callable = mla_prefill_reference
    mla_decode: Callable = mla_decode_reference
    # The logits whole on every device before sampling (identity on one device). Under TP the
    # lm_head leaves them split by vocab, and XLA then partitions the sampler's sort and cumsum:
    # on two H100s that cumsum became a 75 968-trip while loop, ~1.5 s a step.
    gather_logits: Callable = _whole
    # The routed experts of a MoE layer (called inside the TP/EP shard_map of the experts, on
    # each device's share). The reference is ragged_dot, which XLA expands to dense matmuls
    # over every expert on NVIDIA GPUs; the GPU kernel is a grouped matmul.
    moe_experts: Callable = moe_experts_reference
    # The precision of every matmul of the step that does not pin its own, XLA's and the
    # Pallas GPU kernels' alike (``jax_default_matmul_precision`` while the step is traced):
    # None is the platform's default (f32 products in TF32 on NVIDIA, in bf16 passes on TPU),
    # "highest" is IEEE f32. :func:`ops_for_model` picks it from the model's dtype.
    matmul_precision: str | None = None


REFERENCE = Ops(
    conv1d_prefill=causal_conv1d_prefill_reference,
    conv1d_update=causal_conv1d_update_reference,
    gdn_prefill=gdn_prefill_reference,
    gdn_decode=gdn_decode_reference,
    write_kv=write_kv_reference,
    paged_attention=ragged_paged_attention_reference,
)


def _interpret(kernel: Callable) -> Callable:
    return functools.partial(kernel, interpret=pltpu.InterpretParams())


def _by_platform(*, tpu: Callable, gpu: Callable, other: Callable) -> Callable:
    """One op whose implementation is picked from ``jax.default_backend()`` when traced."""

    def op(*args, **kwargs):
        platform = jax.default_backend()
        fn = tpu if platform == "tpu" else gpu if platform in ("gpu", "cuda", "rocm") else other
        return fn(*args, **kwargs)

    return op


# Decode-only steps on NVIDIA: the attention kernel without its (empty) prefill launch.
GPU_DECODE_ATTENTION = functools.partial(attention_gpu.ragged_paged_attention, decode_only=True)

# The GDN prefill on NVIDIA follows ``Ops.matmul_precision`` (precision None): TF32 tensor
# cores inside the chunk for bfloat16 models and with --allow-tf32 (output error ratio 1.4e-3
# against the IEEE f32 reference on an H200; FLA's bar: 5e-3), IEEE f32 dots (~40x slower in
# the chunk) for float32 models.
GPU_GDN_PREFILL = functools.partial(gdn_gpu.gdn_prefill, precision=None)

BACKENDS: dict[str, Ops] = {
    "reference": REFERENCE,
    "interpret": dataclasses.replace(
        REFERENCE,
        conv1d_prefill=_interpret(conv1d_tpu.causal_conv1d_prefill),
        conv1d_update=_interpret(conv1d_tpu.causal_conv1d_update),
        gdn_prefill=_interpret(gdn_tpu.gdn_prefill),
        gdn_decode=_interpret(gdn_tpu.gdn_decode),
        conv_gdn_decode=fused_decode.composed_conv_gdn_decode(
            _interpret(conv1d_tpu.causal_conv1d_update), _interpret(gdn_tpu.gdn_decode)
        ),
        paged_attention=_interpret(attention_tpu.ragged_paged_attention),
        paged_attention_decode=_interpret(attention_tpu.ragged_paged_attention),
        kda_prefill=_interpret(kda_tpu.kda_prefill),
        kda_decode=_interpret(kda_tpu.kda_decode),
        mla_prefill=_interpret(mla_tpu.mla_prefill),
        mla_decode=_interpret(mla_tpu.mla_decode),
        # write_kv, write_latent: the XLA scatter on every backend (in place on the donated
        # cache).
    ),
    "pallas": dataclasses.replace(
        REFERENCE,
        # conv1d prefill on GPU: XLA (elementwise taps, one fused loop); decode uses the fused
        # conv + delta-rule kernel below.
        conv1d_prefill=_by_platform(
            tpu=conv1d_tpu.causal_conv1d_prefill,
            gpu=causal_conv1d_prefill_reference,
            other=causal_conv1d_prefill_reference,
        ),
        conv1d_update=_by_platform(
            tpu=conv1d_tpu.causal_conv1d_update,
            gpu=causal_conv1d_update_reference,
            other=causal_conv1d_update_reference,
        ),
        gdn_prefill=_by_platform(
            tpu=gdn_tpu.gdn_prefill, gpu=GPU_GDN_PREFILL, other=gdn_prefill_reference
        ),
        gdn_decode=_by_platform(
            tpu=gdn_tpu.gdn_decode, gpu=gdn_gpu.gdn_decode, other=gdn_decode_reference
        ),
        paged_attention=_by_platform(
            tpu=attention_tpu.ragged_paged_attention,
            gpu=attention_gpu.ragged_paged_attention,
            other=ragged_paged_attention_reference,
        ),
        paged_attention_decode=_by_platform(
            tpu=attention_tpu.ragged_paged_attention,
            gpu=GPU_DECODE_ATTENTION,
            other=ragged_paged_attention_reference,
        ),
        # TPU: the two Mosaic kernels in turn (a fused TPU kernel is still to come).
        conv_gdn_decode=_by_platform(
            tpu=fused_decode.composed_conv_gdn_decode(
                conv1d_tpu.causal_conv1d_update, gdn_tpu.gdn_decode
            ),
            gpu=fused_decode.conv_gdn_decode,
            other=fused_decode.conv_gdn_decode_reference,
        ),
        kda_prefill=_by_platform(
            tpu=kda_tpu.kda_prefill, gpu=kda_gpu.kda_prefill, other=kda_prefill_reference
        ),
        kda_decode=_by_platform(
            tpu=kda_tpu.kda_decode, gpu=kda_gpu.kda_decode, other=kda_decode_reference
        ),
        # MLA: latent attention with absorbed weights, decode rows and prefill chunks in one
        # call (H100: matches the IEEE-f32 reference at Kimi-Linear-48B shapes, BENCHMARKS.md).
        mla_prefill=_by_platform(
            tpu=mla_tpu.mla_prefill, gpu=mla_gpu.mla_prefill, other=mla_prefill_reference
        ),
        mla_decode=_by_platform(
            tpu=mla_tpu.mla_decode, gpu=mla_gpu.mla_decode, other=mla_decode_reference
        ),
        # MoE experts: the Triton grouped matmul on NVIDIA; ragged_dot on TPU and CPU.
        moe_experts=_by_platform(
            tpu=moe_experts_reference, gpu=moe_gpu.moe_experts, other=moe_experts_reference
        ),
    ),
}


# Platforms where ``auto`` means ``pallas``: NVIDIA GPUs (checked on an H200 by
# benchmarks/gdn_kernels.py and benchmarks/attention_kernels.py) and TPUs (interpret mode and
# Mosaic lowering in CI).
VALIDATED_PALLAS_PLATFORMS: tuple[str, ...] = ("cuda", "tpu")


def accelerator_platform() -> str:
    """``tpu``, ``cuda``, ``rocm`` or ``cpu``: ``jax.default_backend()`` says ``gpu`` for both
    NVIDIA and AMD, and the Triton-lowered kernels are only checked on NVIDIA."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = getattr(jax.devices()[0].client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def resolve_backend(name: str) -> str:
    """Maps ``auto`` to the best backend available on this platform."""
    if name == "auto":
        return "pallas" if accelerator_platform() in VALIDATED_PALLAS_PLATFORMS else "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; available: {sorted(BACKENDS)}, auto")
    return name


def get_ops(name: str) -> Ops:
    return BACKENDS[resolve_backend(name)]


def matmul_precision(dtype, *, allow_tf32: bool = False) -> str | None:
    """``Ops.matmul_precision`` for a model served in ``dtype``: float32 means IEEE float32
    products on every platform unless TF32 is allowed; 16-bit models keep the platform's."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 and not allow_tf32 else None


def unsupported_kernels(
    cfg, kernel_platform: str, *, tp: int = 1, expert_parallel: bool = False
) -> dict[str, str]:
    """``{op field: why}`` for each kernel op that cannot take ``cfg``'s shapes on
    ``kernel_platform`` (``tpu``: the Mosaic kernels, also what ``interpret`` runs; ``cuda`` /
    ``rocm``: the Triton ones). ``tp``: devices the MoE intermediate dim is split over.

    The TPU kernels take each head dim whole as a block, so every shape fits them (the
    interpreter runs head dims 24 and 40); the Triton kernels need power-of-two tiles: the
    family's ``gpu_kernel_rules`` say which of its kernels cannot, and the MoE experts' rule
    (every family's MoE layers call the same op) follows here.
    """
    if kernel_platform not in ("cuda", "rocm"):
        return {}
    rules = family_of(cfg).gpu_kernel_rules(cfg)  # the family's layers' kernels
    if cfg.num_experts:
        f = cfg.moe_intermediate_size // (1 if expert_parallel else tp)
        rules = [*rules, (("moe_experts",), moe_gpu.unsupported_reason(cfg.hidden_size, f))]
    return {field: why for fields, why in rules if why for field in fields}


def ops_for_model(
    name: str,
    cfg,
    dtype,
    *,
    allow_tf32: bool = False,
    tp: int = 1,
    expert_parallel: bool = False,
) -> Ops:
    """The ops of backend ``name`` for one model, decided once at start-up.

    Each kernel that cannot take the model's shapes (:func:`unsupported_kernels`) is replaced
    by its reference op, with one warning naming the op and why, so no request meets a shape
    error mid-serving. ``matmul_precision`` comes from ``dtype`` and ``allow_tf32``
    (:func:`matmul_precision`).
    """
    backend = resolve_backend(name)
    ops = BACKENDS[backend]
    changes: dict = {"matmul_precision": matmul_precision(dtype, allow_tf32=allow_tf32)}
    if backend != "reference":
        kernel_platform = "tpu" if backend == "interpret" else accelerator_platform()
        unsupported = unsupported_kernels(
            cfg, kernel_platform, tp=tp, expert_parallel=expert_parallel
        )
        for field, why in unsupported.items():
            log.warning("%s: reference op instead of the %s kernel: %s", field, backend, why)
            changes[field] = getattr(REFERENCE, field)
    return dataclasses.replace(ops, **changes)
