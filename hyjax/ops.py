"""Op dispatch: each op of the model by backend (DESIGN.md §6), read from one grid.

:data:`GRID` has a row per op and a column per implementation: ``reference`` (pure JAX: the
CPU path and the oracle), ``tpu`` (the Mosaic kernels) and ``gpu`` (the Triton-lowered Pallas
kernels); an empty kernel cell runs the reference op on that platform. A backend is a column
and a way to run its kernels (:data:`BACKENDS`)::

    backend         column                                 kernels run
    reference       reference                              -
    interpret       tpu                                    by the TPU interpreter, on CPU (CI)
    interpret-gpu   gpu                                    by Pallas' interpreter, on CPU (CI)
    pallas          tpu on TPU, gpu on NVIDIA and ROCm,    compiled
                    reference elsewhere
    auto            pallas on NVIDIA GPUs and TPUs, reference elsewhere (CPU, ROCm)

:func:`get_ops` and :func:`ops_for_model` resolve the platform once, when the ops are built
(at start-up): nothing is decided inside a traced op.

On an H200 (BENCHMARKS.md) every GPU kernel matches the IEEE-f32 reference at Qwen3-Next-80B
shapes (GDN prefill in TF32: output error ratio 1.4e-3; decode 1e-5; fused decode 1e-6) and
beats it (prefill 70x, decode 5x at B >= 16). The TPU kernels pass their interpret-mode tests
and lower through Mosaic for v5e and v6e in CI, but have not run on a TPU: if one misbehaves
there, ``--kernel-backend reference`` is the way out.

The runner takes its ops from :func:`ops_for_model`: a kernel that cannot take the model's
shapes (the Triton kernels' power-of-two tiles; each GPU kernel module's
``unsupported_reason``, gathered by the model's family) is swapped for its reference op with
one warning, and ``Ops.matmul_precision`` makes float32 models compute IEEE float32 products on
every platform (XLA's dots and the Pallas GPU kernels' alike) unless TF32 is allowed
(``--allow-tf32``).
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
from pallas_kernels.common import copy_gpu, multi_decode_gpu
from pallas_kernels.conv1d import gpu as conv1d_gpu
from pallas_kernels.conv1d import tpu as conv1d_tpu
from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_qkvz_reference,
    causal_conv1d_prefill_split_reference,
    causal_conv1d_update_reference,
    packed_inputs,
    packed_qkvz,
)
from pallas_kernels.gdn import fused_decode
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.gdn import tpu as gdn_tpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from pallas_kernels.kda import fused_decode as kda_fused_decode
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda import tpu as kda_tpu
from pallas_kernels.kda.reference import kda_decode_reference, kda_prefill_reference
from pallas_kernels.moe import gpu as moe_gpu
from pallas_kernels.moe.reference import moe_experts_reference

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ops:
    """Every op a layer calls, each with its reference's signature (built from :data:`GRID`)."""

    # A GDN layer's prefill conv, read from its input projection's output (q | k | v
    # interleaved per key head with z) and handed back as q, k, v apart
    conv1d_prefill_qkvz: Callable
    # A KDA layer's prefill conv of its q, k, v projections held apart, handed back apart
    conv1d_prefill_split: Callable
    conv1d_update: Callable
    gdn_prefill: Callable
    gdn_decode: Callable
    conv_gdn_decode: Callable  # decode: conv1d update, then the gated delta rule
    write_kv: Callable
    paged_attention: Callable
    paged_attention_decode: Callable  # decode-only steps: every row is one token
    kda_prefill: Callable
    kda_decode: Callable
    conv_kda_decode: Callable  # decode: conv1d update, then KDA
    # Verify-shaped steps (every row at most ``max_tokens`` tokens: a decode row and its
    # drafts): the prefills' signature plus the static ``max_tokens=``; the state after each
    # token goes to the row's checkpoint slots, as in the prefill.
    gdn_multi_decode: Callable
    kda_multi_decode: Callable
    write_latent: Callable
    mla_prefill: Callable
    mla_decode: Callable
    # The routed experts of a MoE layer (called inside the TP/EP shard_map of the experts, on
    # each device's share).
    moe_experts: Callable
    # The logits whole on every device before sampling (identity on one device). Under TP the
    # lm_head leaves them split by vocab, and XLA then partitions the sampler's sort and cumsum:
    # on two H100s that cumsum became a 75 968-trip while loop, ~1.5 s a step.
    gather_logits: Callable
    # The LM head's logits pinned where the head leaves them (identity on one device; split
    # by vocab under TP). Unpinned, XLA's sharding propagation carries ``gather_logits``'
    # "whole" back up to the LM head, which then gathers its [D, V] weight on every step
    # instead of the [S, V] logits where the sampler asks (hyjax.sharding).
    head_logits: Callable
    # The sampler's token tables whole on every device, as the step takes them (identity on
    # one device): pinned, so that propagation from the split logits does not split the
    # tables the step returns (donated: another sharding out than in compiles again).
    whole_tables: Callable
    # ``(buf, blank=(n, ...)) -> (buf, i32[n], ...)``: the step's packed plan, then a buffer
    # of each size for the step's results to be written into. On NVIDIA one kernel at the
    # start of the step makes them all (the plan copied), so the results' buffers are live
    # from the start and XLA places none of the step's temporaries in them
    # (serving.worker.runner._step_body says why that matters); elsewhere zeros.
    step_buffers: Callable
    # The precision of every matmul of the step that does not pin its own, XLA's and the
    # Pallas GPU kernels' alike (``jax_default_matmul_precision`` while the step is traced):
    # None is the platform's default (f32 products in TF32 on NVIDIA, in bf16 passes on TPU),
    # "highest" is IEEE f32. :func:`ops_for_model` picks it from the model's dtype.
    matmul_precision: str | None = None


@dataclasses.dataclass(frozen=True)
class Composed:
    """A kernel cell made of other kernels: ``build(*kernels)``, each kernel run the way its
    column's kernels run (compiled, or interpreted)."""

    build: Callable[..., Callable]
    kernels: tuple[Callable, ...]


Kernel = Callable | Composed


@dataclasses.dataclass(frozen=True)
class Row:
    """One op: its reference and, per platform, the kernel that replaces it (None: none)."""

    reference: Callable
    tpu: Kernel | None = None
    gpu: Kernel | None = None

    def cell(self, column: str | None, run: Callable[[Callable], Callable]) -> Callable:
        """The op of ``column`` (None: the reference), each kernel wrapped by ``run``."""
        kernel = getattr(self, column) if column else None
        if kernel is None:
            return self.reference
        if isinstance(kernel, Composed):
            return kernel.build(*map(run, kernel.kernels))
        return run(kernel)


def _whole(x: jax.Array) -> jax.Array:
    return x


def _step_buffers(buf: jax.Array, blank: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    return (buf, *(jnp.zeros(n, jnp.int32) for n in blank))


# Decode-only steps on NVIDIA: the attention kernel without its (empty) prefill launch (~8 us
# per layer call at 4k context on an H100).
GPU_DECODE_ATTENTION = functools.partial(attention_gpu.ragged_paged_attention, decode_only=True)

# The GDN prefill on NVIDIA follows ``Ops.matmul_precision`` (precision None) where its
# products are f32: for bfloat16 models the chunk's scores, W and U are bf16 MMAs and its
# inverse TF32 (gdn.gpu.default_intra_form, as FLA rounds them; the TF32 path before it: output
# error ratio 1.4e-3 against the IEEE f32 reference on an H200, FLA's bar 5e-3); float32 models
# get IEEE f32 dots (~40x slower in the chunk), or TF32 with --allow-tf32.
GPU_GDN_PREFILL = functools.partial(gdn_gpu.gdn_prefill, precision=None)

# The KDA prefill on NVIDIA likewise (its dots: the off-diagonal blocks of Akk / Aqk, the UT
# inverse, W, U and the recurrence; the per-channel decays of the diagonal blocks are
# elementwise f32 either way).
GPU_KDA_PREFILL = functools.partial(kda_gpu.kda_prefill, precision=None)


def _prefill_as_multi_decode(prefill: Callable) -> Callable:
    """A prefill op in a multi-decode cell: it takes rows of any length, so the static
    ``max_tokens`` (the caller's promise that rows are short) is not needed."""

    @functools.wraps(prefill)
    def op(*args, max_tokens: int, **kwargs):
        del max_tokens
        return prefill(*args, **kwargs)

    return op


# The grid: one row per op (the fields of ``Ops``), columns reference | tpu | gpu.
GRID: dict[str, Row] = {
    "conv1d_prefill_qkvz": Row(
        reference=causal_conv1d_prefill_qkvz_reference,  # XLA packs q | k | v around the conv
        tpu=Composed(packed_qkvz, (conv1d_tpu.causal_conv1d_prefill,)),
        # q | k | v read in place, written apart (the conv kernel, faster than XLA's fusion of
        # the reference: 1.74x / 1.74x / 2.12x on packed channels, BENCHMARKS.md):
        # 95.5 / 271.9 / 495.8 us against the packed
        # path's 136.4 / 416.2 / 807.7 (XLA's packing, the kernel, XLA's slices) at B=1 T=4096,
        # B=1 T=16384, B=8 T=4096 on an H200 (benchmarks.conv1d_kernels --qkvz-only, one
        # process); heads no power-of-two run of >= 8 divides take the packed path
        gpu=conv1d_gpu.causal_conv1d_prefill_qkvz,
    ),
    "conv1d_prefill_split": Row(
        reference=causal_conv1d_prefill_split_reference,  # XLA concatenates around the conv
        tpu=Composed(packed_inputs, (conv1d_tpu.causal_conv1d_prefill,)),
        # each input read in place, each output written apart: no concatenation before the
        # kernel nor slices after it (the same two passes the in-place GDN conv saves above)
        gpu=conv1d_gpu.causal_conv1d_prefill_split,
    ),
    "conv1d_update": Row(
        reference=causal_conv1d_update_reference,
        tpu=conv1d_tpu.causal_conv1d_update,
        gpu=None,  # decode steps run conv_gdn_decode / conv_kda_decode instead
    ),
    "gdn_prefill": Row(
        reference=gdn_prefill_reference,
        tpu=gdn_tpu.gdn_prefill,
        gpu=GPU_GDN_PREFILL,
    ),
    "gdn_decode": Row(
        reference=gdn_decode_reference,
        tpu=gdn_tpu.gdn_decode,
        gpu=gdn_gpu.gdn_decode,
    ),
    "conv_gdn_decode": Row(
        reference=fused_decode.conv_gdn_decode_reference,
        # the two Mosaic kernels in turn (a fused TPU kernel is still to come)
        tpu=Composed(
            fused_decode.composed_conv_gdn_decode,
            (conv1d_tpu.causal_conv1d_update, gdn_tpu.gdn_decode),
        ),
        # the Pallas conv update (q, k, v handed back apart), then gdn_decode: on an H200 this
        # pair beat the one-pass fused_decode.conv_gdn_decode (its second launch shifts the q /
        # k windows) at 64 and 256 rows, 83.5 / 311 us against 91.3 / 337 us (KDA: 89.7 / 329
        # against 97.0 / 352; benchmarks.decode_variants, one process)
        gpu=fused_decode.two_kernel_conv_gdn_decode,
    ),
    "write_kv": Row(
        reference=write_kv_reference,  # everywhere: XLA's scatter, in place on the donated pool
    ),
    "paged_attention": Row(
        reference=ragged_paged_attention_reference,
        tpu=attention_tpu.ragged_paged_attention,
        gpu=attention_gpu.ragged_paged_attention,
    ),
    "paged_attention_decode": Row(
        reference=ragged_paged_attention_reference,
        tpu=attention_tpu.ragged_paged_attention,
        gpu=GPU_DECODE_ATTENTION,
    ),
    "kda_prefill": Row(
        reference=kda_prefill_reference,
        tpu=kda_tpu.kda_prefill,
        gpu=GPU_KDA_PREFILL,
    ),
    "kda_decode": Row(
        reference=kda_decode_reference,
        tpu=kda_tpu.kda_decode,
        gpu=kda_gpu.kda_decode,
    ),
    "conv_kda_decode": Row(
        reference=kda_fused_decode.conv_kda_decode_reference,
        tpu=Composed(
            kda_fused_decode.composed_conv_kda_decode,
            (conv1d_tpu.causal_conv1d_update, kda_tpu.kda_decode),
        ),
        gpu=kda_fused_decode.two_kernel_conv_kda_decode,  # as conv_gdn_decode's
    ),
    # Speculative verify steps: the decode recurrence token by token, a state store per token
    # (pallas_kernels/common/multi_decode_gpu.py); elsewhere the chunked prefill, whose
    # arguments they share. The oracle is the prefill reference.
    "gdn_multi_decode": Row(
        reference=_prefill_as_multi_decode(gdn_prefill_reference),
        tpu=Composed(_prefill_as_multi_decode, (gdn_tpu.gdn_prefill,)),
        gpu=multi_decode_gpu.gdn_multi_decode,
    ),
    "kda_multi_decode": Row(
        reference=_prefill_as_multi_decode(kda_prefill_reference),
        tpu=Composed(_prefill_as_multi_decode, (kda_tpu.kda_prefill,)),
        gpu=multi_decode_gpu.kda_multi_decode,
    ),
    "write_latent": Row(
        reference=write_latent_reference,  # everywhere, as write_kv
    ),
    # MLA: latent attention with absorbed weights, decode rows and prefill chunks in one call
    # (H100: matches the IEEE-f32 reference at Kimi-Linear-48B shapes, BENCHMARKS.md).
    "mla_prefill": Row(
        reference=mla_prefill_reference,
        tpu=mla_tpu.mla_prefill,
        gpu=mla_gpu.mla_prefill,
    ),
    "mla_decode": Row(
        reference=mla_decode_reference,
        tpu=mla_tpu.mla_decode,
        gpu=mla_gpu.mla_decode,
    ),
    "moe_experts": Row(
        # ragged_dot: grouped on TPU and CPU, expanded to dense matmuls over every expert on
        # NVIDIA GPUs, where the grouped-matmul kernel runs instead
        reference=moe_experts_reference,
        tpu=None,
        gpu=moe_gpu.moe_experts,
    ),
    "gather_logits": Row(
        reference=_whole,  # hyjax.sharding swaps in the gather under tensor parallelism
    ),
    "head_logits": Row(
        reference=_whole,  # hyjax.sharding swaps in the vocab split under tensor parallelism
    ),
    "whole_tables": Row(
        reference=_whole,  # hyjax.sharding swaps in the constraint under tensor parallelism
    ),
    "step_buffers": Row(reference=_step_buffers, gpu=copy_gpu.copy_flat),
}


def _compiled(kernel: Callable) -> Callable:
    return kernel


def _tpu_interpreted(kernel: Callable) -> Callable:
    return functools.partial(kernel, interpret=pltpu.InterpretParams())


def _gpu_interpreted(kernel: Callable) -> Callable:
    return functools.partial(kernel, interpret=True)


# The platforms whose kernels ``pallas`` compiles: their grid column.
PLATFORM_COLUMNS = {"tpu": "tpu", "cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A ``--kernel-backend``: the grid column it runs on a platform, and how its kernels run."""

    column: Callable[[str], str | None]  # platform -> "tpu" | "gpu" | None (the reference)
    run: Callable[[Callable], Callable]


BACKENDS: dict[str, Backend] = {
    "reference": Backend(column=lambda platform: None, run=_compiled),
    "interpret": Backend(column=lambda platform: "tpu", run=_tpu_interpreted),
    "interpret-gpu": Backend(column=lambda platform: "gpu", run=_gpu_interpreted),
    "pallas": Backend(column=PLATFORM_COLUMNS.get, run=_compiled),
}


@functools.cache
def _column_ops(column: str | None, run: Callable[[Callable], Callable]) -> Ops:
    """One ``Ops`` per (column, way to run): jitted steps see the same static argument."""
    return Ops(**{op: row.cell(column, run) for op, row in GRID.items()})


REFERENCE = _column_ops(None, _compiled)


def backend_ops(backend: str, platform: str) -> Ops:
    """The ops ``backend`` (not ``auto``) runs on ``platform`` (:func:`accelerator_platform`)."""
    spec = BACKENDS[backend]
    return _column_ops(spec.column(platform), spec.run)


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
    """The ops of backend ``name`` on this platform (resolved now, once)."""
    return backend_ops(resolve_backend(name), accelerator_platform())


def matmul_precision(dtype, *, allow_tf32: bool = False) -> str | None:
    """``Ops.matmul_precision`` for a model served in ``dtype``: float32 means IEEE float32
    products on every platform unless TF32 is allowed; 16-bit models keep the platform's."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 and not allow_tf32 else None


def unsupported_kernels(
    cfg, column: str | None, *, tp: int = 1, expert_parallel: bool = False
) -> dict[str, str]:
    """``{op field: why}`` for each kernel op of grid ``column`` that cannot take ``cfg``'s
    shapes. ``tp``: devices the MoE intermediate dim is split over.

    The TPU kernels take each head dim whole as a block, so every shape fits them (the
    interpreter runs head dims 24 and 40); the Triton kernels need power-of-two tiles: the
    family's ``gpu_kernel_rules`` say which of its kernels cannot, and the MoE experts' rule
    (every family's MoE layers call the same op) follows here.
    """
    if column != "gpu":
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
    platform = accelerator_platform()
    ops = backend_ops(backend, platform)
    changes: dict = {"matmul_precision": matmul_precision(dtype, allow_tf32=allow_tf32)}
    column = BACKENDS[backend].column(platform)
    unsupported = unsupported_kernels(cfg, column, tp=tp, expert_parallel=expert_parallel)
    for field, why in unsupported.items():
        log.warning("%s: reference op instead of the %s kernel: %s", field, backend, why)
        changes[field] = getattr(REFERENCE, field)
    return dataclasses.replace(ops, **changes)
