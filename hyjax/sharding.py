"""Tensor and expert parallelism with ``jax.sharding``: meshes, partition rules, sharded ops.

One mesh axis, ``"model"``, over ``--tensor-parallel-size`` devices. A :class:`ShardingPlan`
says, for one model on one mesh:

- where each parameter lives: a table of ``(path regex, PartitionSpec)`` rules per model
  family (first match wins, no match = replicated). Projections into heads are split by
  output columns, projections out of heads by input rows (Megatron's column / row parallel),
  so XLA's SPMD partitioner inserts one all-reduce after each row-parallel matmul;
- where each cache pool lives: KV blocks, conv windows and recurrent states split by head
  (Kimi's MLA latent, which every head reads, replicated);
- which ops run under ``jax.shard_map`` (the Pallas kernels, and the reference ops in their
  place, see per-device heads: every head is independent, so no op needs a collective);
- the static settings the layers read (``GatedDeltaNet.conv_shards``,
  ``KimiDeltaAttention.conv_shards``, ``GatedAttention.kv_repeat``, the MoE layers'
  ``expert_mesh``).

Qwen3-Next, on ``n`` devices::

    GDN   in_proj_qkvz [D, Hk*(2Dk+2rDv)]  columns: Hk/n key-head groups (q_g|k_g|v|z) each
          in_proj_ba   [D, Hk*2r]          columns, same groups
          conv1d       [C, K]              rows, permuted to q_s|k_s|v_s per device
          A_log, dt_bias [Hv]              split;  out_proj [Hv*Dv, D]  rows
          state pool: conv [slots, K-1, C] on C, ssm [slots, Hv, Dk, Dv] on Hv
    attn  q_proj (rows [q_h | gate_h] per head) columns, o_proj rows; k_proj / v_proj columns
          when n divides Hkv, else replicated and each kv head repeated n/Hkv times;
          KV pool [NB, bs, Hkv', D] on Hkv'
    MoE   experts [E, D, F] on F (tensor parallel) or on E (--enable-expert-parallel);
          shared expert and dense MLPs column / row; router replicated
    embed replicated; lm_head [D, V] columns (when n divides V)

Kimi-Linear, on ``n`` devices::

    KDA   q_proj / k_proj / v_proj [D, H*Dk]  columns;  q_conv1d / k_conv1d / v_conv1d [H*Dk, K]
          rows, packed at trace time to q_s|k_s|v_s per device;  f_b_proj / g_b_proj [Dk, H*Dk]
          and b_proj [D, H] columns (f_a_proj / g_a_proj, rank Dk, replicated);
          A_log [H], dt_bias [H*Dk] split;  o_proj [H*Dk, D] rows
          state pool: conv [slots, K-1, 3*H*Dk] on channels, ssm [slots, H, Dk, Dk] on H
    MLA   q_proj / q_b_proj [., H*(Dn+R)] columns (q_a_proj, q_a_layernorm replicated);
          kv_b_proj [L, H*(Dn+Dv)] columns (by head); o_proj [H*Dv, D] rows;
          kv_a_proj_with_mqa replicated. Latent pool [NB, bs, L+R] replicated: every head
          reads the whole latent, so each device keeps all of it (a KV block costs the same
          on every device as on one).
    MoE   as Qwen3-Next (SigmoidMoe); shared experts and dense MLPs column / row
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hyjax.cache import Caches, init_caches, kv_block_bytes, state_slot_bytes
from hyjax.config import ModelConfig

MODEL_AXIS = "model"
M = MODEL_AXIS
R = P()  # replicated

Rules = list[tuple[str, P]]


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("model",)`` mesh over the first ``tensor_parallel_size`` devices.

    With several processes (``jax.distributed.initialize``), ``jax.devices()`` lists every
    process's devices, so the mesh spans hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"{tensor_parallel_size=} must be at least 1")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"{tensor_parallel_size=} exceeds the {len(devices)} devices available "
            f"({devices[0].platform}); on CPU, simulate more with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Joins this process to a multi-host job (``jax.distributed.initialize``); call it before
    anything else touches JAX. Afterwards ``jax.devices()`` lists every host's devices and
    :func:`make_mesh` spans them. Arguments left ``None`` are auto-detected where JAX can
    (``JAX_COORDINATOR_ADDRESS``, SLURM, Cloud TPU, ...)."""
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


# What a config field counts, for the error message (the checkpoint may spell it otherwise).
_WHAT = {
    "linear_num_key_heads": "GDN key heads",
    "linear_num_value_heads": "GDN value heads",
    "linear_num_heads": "KDA heads, linear_attn_config.num_heads",
    "num_attention_heads": "query heads",
    "num_experts": "experts, split by --enable-expert-parallel",
    "moe_intermediate_size": "each expert's intermediate dim, split without expert parallel",
}


def _divides(tp: int, **sizes: int) -> None:
    for name, size in sizes.items():
        if size % tp:
            what = f" ({_WHAT[name]})" if name in _WHAT else ""
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={size}{what}")


# ----------------------------------------------------------------------------- Qwen3-Next


def _qwen3_next_check(cfg, tp: int, expert_parallel: bool) -> None:
    _divides(
        tp,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        num_attention_heads=cfg.num_attention_heads,
    )
    hkv = cfg.num_key_value_heads
    if hkv % tp and tp % hkv:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide or be a multiple of num_key_value_heads={hkv}"
        )
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        if expert_parallel:
            _divides(tp, num_experts=cfg.num_experts)
        else:
            _divides(tp, moe_intermediate_size=cfg.moe_intermediate_size)
        _divides(tp, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        _divides(tp, intermediate_size=cfg.intermediate_size)


def _mlp_rules(prefix: str) -> Rules:
    return [
        (rf"{prefix}/(gate_proj|up_proj)/weight", P(None, M)),
        (rf"{prefix}/down_proj/weight", P(M, None)),
    ]


def _expert_rules(expert_parallel: bool) -> Rules:
    if expert_parallel:
        return [(r".*/mlp/experts_(gate|up|down)", P(M, None, None))]
    return [
        (r".*/mlp/experts_(gate|up)", P(None, None, M)),
        (r".*/mlp/experts_down", P(None, M, None)),
    ]


def _lm_head_rules(cfg, tp: int) -> Rules:
    return [(r"lm_head/weight", P(None, M) if cfg.vocab_size % tp == 0 else R)]


def _qwen3_next_rules(cfg, tp: int, expert_parallel: bool) -> Rules:
    kv = P(None, M) if cfg.num_key_value_heads % tp == 0 else R
    return [
        (r".*/linear_attn/(in_proj_qkvz|in_proj_ba)/weight", P(None, M)),
        (r".*/linear_attn/conv1d", P(M, None)),
        (r".*/linear_attn/(A_log|dt_bias)", P(M)),
        (r".*/linear_attn/out_proj/weight", P(M, None)),
        (r".*/self_attn/q_proj/weight", P(None, M)),
        (r".*/self_attn/(k_proj|v_proj)/weight", kv),
        (r".*/self_attn/o_proj/weight", P(M, None)),
        *_expert_rules(expert_parallel),
        *_mlp_rules(r".*/mlp/shared_expert"),
        *_mlp_rules(r".*/mlp"),
        *_lm_head_rules(cfg, tp),
    ]


def _qwen3_next_configure(model: nnx.Module, plan: ShardingPlan) -> None:
    from hyjax.layers.conv_channels import conv_channel_order
    from hyjax.models.qwen3_next.model import GatedAttention, GatedDeltaNet

    tp, cfg = plan.tp, plan.cfg
    for _, m in model.iter_modules():
        if isinstance(m, GatedDeltaNet) and m.conv_shards != tp:
            heads = ((m.hk, m.dk), (m.hv, m.dv))
            # current -> checkpoint order -> this mesh's order
            to_ckpt = np.argsort(conv_channel_order(*heads, m.conv_shards))
            idx = to_ckpt[conv_channel_order(*heads, tp)]
            m.conv1d.set_value(m.conv1d[...][idx])
            m.conv_shards = tp
        elif isinstance(m, GatedAttention):
            m.kv_repeat = max(1, tp // cfg.num_key_value_heads)
    _configure_experts(model, plan)


def _configure_experts(model: nnx.Module, plan: ShardingPlan) -> None:
    from hyjax.layers.moe import SigmoidMoe, SparseMoe

    for _, m in model.iter_modules():
        if isinstance(m, (SparseMoe, SigmoidMoe)):
            m.expert_mesh = plan.mesh if plan.tp > 1 else None
            m.expert_axis = MODEL_AXIS
            m.expert_parallel = plan.expert_parallel


H1, H2, H3 = P(M), P(None, M), P(None, M, None)  # split on the head axis (channels for conv)
CONV_STATE, SSM, KV = P(None, None, M), P(None, M, None, None), P(None, None, M, None)

# op name -> (in_specs of its positional args, out_specs). Every other input is replicated.
# SLOTS: the StateSlots pytree (one spec for its five arrays), the same on every device.
SLOTS = R
_QWEN3_NEXT_OPS: dict[str, tuple[tuple, object]] = {
    "conv1d_prefill": ((H2, P(M, None), CONV_STATE, R, SLOTS), (H2, CONV_STATE)),
    "conv1d_update": ((H2, P(M, None), CONV_STATE, SLOTS), (H2, CONV_STATE)),
    "gdn_prefill": ((H3, H3, H3, H2, H2, H1, H1, SSM, R, SLOTS), (H3, SSM)),
    "gdn_decode": ((H3, H3, H3, H2, H2, H1, H1, SSM, SLOTS), (H3, SSM)),
    "conv_gdn_decode": (
        (H2, P(M, None), CONV_STATE, H2, H2, H1, H1, SSM, SLOTS),
        (H3, CONV_STATE, SSM),
    ),
    "write_kv": ((H3, H3, KV, KV, R), (KV, KV)),
    "paged_attention": ((H3, KV, KV, R, R, R, R), H3),
    "paged_attention_decode": ((H3, KV, KV, R, R, R, R), H3),
}


# ----------------------------------------------------------------------------- Kimi-Linear


def _kimi_linear_check(cfg, tp: int, expert_parallel: bool) -> None:
    heads = {}
    if cfg.linear_layers:
        heads["linear_num_heads"] = cfg.linear_num_heads  # KDA
    if cfg.attention_layers:
        heads["num_attention_heads"] = cfg.num_attention_heads  # MLA
    _divides(tp, **heads)
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        if expert_parallel:
            _divides(tp, num_experts=cfg.num_experts)
        else:
            _divides(tp, moe_intermediate_size=cfg.moe_intermediate_size)
        _divides(tp, shared_experts_dim=cfg.moe_intermediate_size * cfg.num_shared_experts)
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        _divides(tp, intermediate_size=cfg.intermediate_size)


def _kimi_linear_rules(cfg, tp: int, expert_parallel: bool) -> Rules:
    # KDA and MLA layers are both ``self_attn``; q_proj / o_proj are column / row in each.
    # Unmatched (replicated): f_a_proj, g_a_proj, o_norm, q_a_proj, kv_a_proj_with_mqa, norms.
    attn = r".*/self_attn"
    return [
        (rf"{attn}/(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj)/weight", P(None, M)),
        (rf"{attn}/(q_conv1d|k_conv1d|v_conv1d)", P(M, None)),
        (rf"{attn}/(A_log|dt_bias)", P(M)),
        (rf"{attn}/(q_b_proj|kv_b_proj)/weight", P(None, M)),
        (rf"{attn}/o_proj/weight", P(M, None)),
        *_expert_rules(expert_parallel),
        *_mlp_rules(r".*/mlp/shared_experts"),
        *_mlp_rules(r".*/mlp"),
        *_lm_head_rules(cfg, tp),
    ]


def _kimi_linear_configure(model: nnx.Module, plan: ShardingPlan) -> None:
    from hyjax.models.kimi_linear.model import KimiDeltaAttention

    for _, m in model.iter_modules():
        if isinstance(m, KimiDeltaAttention):
            m.conv_shards = plan.tp  # the filters are packed at trace time: nothing to permute
    _configure_experts(model, plan)


LATENT = R  # [NB, bs, L+R]: one latent per token, read by every head


_KIMI_LINEAR_OPS: dict[str, tuple[tuple, object]] = {
    "conv1d_prefill": _QWEN3_NEXT_OPS["conv1d_prefill"],
    "conv1d_update": _QWEN3_NEXT_OPS["conv1d_update"],
    # q, k, v, g [T, H, D]; b [T, H]; A_log [H]; dt_bias [H, Dk]; state by head
    "kda_prefill": ((H3, H3, H3, H3, H2, H1, P(M, None), SSM, R, SLOTS), (H3, SSM)),
    "kda_decode": ((H3, H3, H3, H3, H2, H1, P(M, None), SSM, SLOTS), (H3, SSM)),
    # Every device writes the same latent into its own copy of the pool (no collective);
    # under shard_map so a Pallas writer would run per device too.
    "write_latent": ((R, LATENT, R), LATENT),
    # q [T, H, Dn+R], latent, w_kv_b [L, H, Dn+Dv], then the batch's (replicated) tables.
    "mla_prefill": ((H3, LATENT, H3, R, R, R, R), H3),
    "mla_decode": ((H3, LATENT, H3, R, R, R), H3),
}


@dataclasses.dataclass(frozen=True)
class FamilySharding:
    """How one model family is split: parameter rules, pools, ops under shard_map."""

    check: Callable[[ModelConfig, int, bool], None]
    rules: Callable[[ModelConfig, int, bool], Rules]
    configure: Callable[[nnx.Module, ShardingPlan], None]
    kv_spec: P  # each array of a KV-pool layer
    conv_spec: P
    ssm_spec: P
    ops: dict[str, tuple[tuple, object]]
    kv_pool: str = "split by kv head"  # how the KV pool is laid out, for the start-up log


# model_type -> its sharding. New families register here.
FAMILIES: dict[str, FamilySharding] = {
    "qwen3_next": FamilySharding(
        _qwen3_next_check,
        _qwen3_next_rules,
        _qwen3_next_configure,
        KV,
        CONV_STATE,
        SSM,
        _QWEN3_NEXT_OPS,
    ),
    "kimi_linear": FamilySharding(
        _kimi_linear_check,
        _kimi_linear_rules,
        _kimi_linear_configure,
        LATENT,
        CONV_STATE,
        SSM,
        _KIMI_LINEAR_OPS,
        kv_pool="replicated: the MLA latent is read by every head",
    ),
}


def path_name(path: tuple) -> str:
    """``("layers", 3, "mlp", "experts_up")`` -> ``"layers/3/mlp/experts_up"``."""
    return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """One model on one mesh. See the module docstring."""

    mesh: Mesh
    cfg: ModelConfig
    expert_parallel: bool = False

    def __post_init__(self):
        if self.cfg.model_type not in FAMILIES:
            raise ValueError(f"no sharding rules for model_type={self.cfg.model_type!r}")
        self.family.check(self.cfg, self.tp, self.expert_parallel)

    @property
    def family(self) -> FamilySharding:
        return FAMILIES[self.cfg.model_type]

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @functools.cached_property
    def _rules(self) -> list[tuple[re.Pattern, P]]:
        rules = self.family.rules(self.cfg, self.tp, self.expert_parallel)
        return [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec(self, path: tuple) -> P:
        """The parameter's PartitionSpec: the first rule whose regex matches its whole path."""
        if self.tp == 1:
            return R
        name = path_name(path)
        return next((spec for rx, spec in self._rules if rx.fullmatch(name)), R)

    def sharding(self, path: tuple) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(path))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, R)

    # -- parameters

    def configure(self, model: nnx.Module) -> None:
        """Sets the layers' static settings for this mesh (and permutes GDN conv weights)."""
        self.family.configure(model, self)

    def shard_model(self, model: nnx.Module) -> nnx.Module:
        """``model`` with every parameter placed by its rule. Already placed ones stay."""
        self.configure(model)
        graphdef, state = nnx.split(model)
        params = dict(nnx.to_flat_state(state))
        multi_process = jax.process_count() > 1
        for path, var in params.items():
            value, sharding = var.get_value(), self.sharding(path)
            if multi_process and value.is_fully_addressable and value.sharding != sharding:
                value = np.asarray(value)  # the same host copy on every process
            var.set_value(jax.device_put(value, sharding))
        return nnx.merge(graphdef, nnx.from_flat_state(params))

    # -- pools

    def cache_config(self) -> ModelConfig:
        """The config the pools are shaped from: kv heads repeated where the mesh needs."""
        cfg = self.cfg
        if self.cfg.model_type == "qwen3_next" and self.tp > cfg.num_key_value_heads:
            return dataclasses.replace(cfg, num_key_value_heads=self.tp)
        return cfg

    def pool_bytes(self, block_size: int, dtype) -> tuple[int, int]:
        """``(KV block bytes, state slot bytes)`` on one device."""
        cfg = self.cache_config()
        kv = kv_block_bytes(cfg, block_size, dtype)
        slot = state_slot_bytes(cfg, dtype)
        kv_split, slot_split = self.pool_splits()
        return kv // kv_split, slot // slot_split

    def pool_splits(self) -> tuple[int, int]:
        """``(KV pool, state pool)``: the ways each pool array is split across devices."""
        kv_split = self.tp if M in self.family.kv_spec else 1
        slot_split = self.tp if M in self.family.ssm_spec else 1
        return kv_split, slot_split

    def describe_pools(self) -> str:
        """The log line above the memory plan: the sizes that follow are per device."""
        return (
            f"pools per device, {self.tp} devices (hyjax.sharding): KV pool "
            f"{self.family.kv_pool}; state pool split by head"
        )

    def cache_shardings(self, caches: Caches) -> Caches:
        f, mesh = self.family, self.mesh
        return Caches(
            kv=tuple(tuple(NamedSharding(mesh, f.kv_spec) for _ in layer) for layer in caches.kv),
            conv=tuple(NamedSharding(mesh, f.conv_spec) for _ in caches.conv),
            ssm=tuple(NamedSharding(mesh, f.ssm_spec) for _ in caches.ssm),
        )

    def init_caches(self, **kwargs) -> Caches:
        """:func:`hyjax.cache.init_caches`, each pool allocated straight into its shards."""
        cfg = self.cache_config()
        make = functools.partial(init_caches, cfg, **kwargs)
        shardings = self.cache_shardings(jax.eval_shape(make))
        return jax.jit(make, out_shardings=shardings)()

    # -- ops

    def shard_ops(self, ops):
        """``ops`` with this family's head-parallel ops wrapped in ``jax.shard_map``."""
        if self.tp == 1:
            return ops
        return _sharded_ops(ops, self.mesh, self.cfg.model_type)


@functools.cache
def _sharded_ops(ops, mesh: Mesh, model_type: str):
    """One wrapped ``Ops`` per (ops, mesh, family): equal static arguments of the jitted step,
    so a second runner on the same mesh reuses the compiled executables."""
    tp = mesh.shape[MODEL_AXIS]
    wrapped = {
        name: _shard_op(getattr(ops, name), mesh, in_specs, out_specs, tp)
        for name, (in_specs, out_specs) in FAMILIES[model_type].ops.items()
    }
    whole = NamedSharding(mesh, P())
    wrapped["gather_logits"] = lambda x: jax.lax.with_sharding_constraint(x, whole)
    return dataclasses.replace(ops, **wrapped)


def _shard_op(fn: Callable, mesh: Mesh, in_specs: tuple, out_specs, tp: int) -> Callable:
    """``fn`` run per device on its heads. ``num_k_heads=`` becomes the per-device count."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if len(args) != len(in_specs):
            raise TypeError(
                f"{getattr(fn, '__name__', fn)} under shard_map takes {len(in_specs)} positional "
                f"arrays, got {len(args)}"
            )
        if "num_k_heads" in kwargs:
            kwargs["num_k_heads"] //= tp
        body = functools.partial(fn, **kwargs)
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )(*args)

    return op


def checkpoint_layout_state(model: nnx.Module) -> nnx.State:
    """``model``'s state with the GDN conv rows back in checkpoint order (for saving);
    ``model`` itself is left as it is."""
    from hyjax.layers.conv_channels import conv_channel_order
    from hyjax.models.qwen3_next.model import GatedDeltaNet

    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables
    for _, m in clone.iter_modules():
        if isinstance(m, GatedDeltaNet) and m.conv_shards != 1:
            order = conv_channel_order((m.hk, m.dk), (m.hv, m.dv), m.conv_shards)
            m.conv1d.set_value(m.conv1d[...][np.argsort(order)])
            m.conv_shards = 1
    return nnx.split(clone)[1]


def replicate_tree(tree, mesh: Mesh):
    """Host arrays (a step's plan) as arrays replicated over ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, R))


def local_shapes(plan: ShardingPlan, state: nnx.State) -> dict[str, tuple[int, ...]]:
    """Each parameter's per-device shape (for logs and tests)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        sharding = plan.sharding(path)
        out[path_name(path)] = sharding.shard_shape(tuple(var.get_value().shape))
    return out


__all__ = [
    "FAMILIES",
    "MODEL_AXIS",
    "FamilySharding",
    "ShardingPlan",
    "checkpoint_layout_state",
    "initialize_distributed",
    "local_shapes",
    "make_mesh",
    "path_name",
    "replicate_tree",
]
