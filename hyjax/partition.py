"""What partition rules are written in: the mesh axis, spec shorthands, the interface a family's
rules fill in (:class:`FamilySharding`), and the rules every family shares (MoE experts, MLPs,
the LM head). Each family's own rules live in ``hyjax/models/<family>/sharding.py``;
:mod:`hyjax.sharding` applies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from flax import nnx
from jax.sharding import PartitionSpec as P

from hyjax.layers.moe import SigmoidMoe, SparseMoe

if TYPE_CHECKING:
    from hyjax.config import ModelConfig
    from hyjax.sharding import ShardingPlan

MODEL_AXIS = "model"
M = MODEL_AXIS
R = P()  # replicated

Rules = list[tuple[str, P]]  # (path regex, spec): the first whose regex matches the whole path
# op name -> (in_specs of its positional args, out_specs). Every other input is replicated.
OpSpecs = dict[str, tuple[tuple, object]]

# Shorthands of the op specs: split on the head axis (channels for conv) of a 1-, 2- or 3-D
# array; the state pool's conv windows [slots, K-1, C] and recurrent states [slots, H, Dv, Dk].
H1, H2, H3 = P(M), P(None, M), P(None, M, None)
CONV_STATE, SSM = P(None, None, M), P(None, M, None, None)
SLOTS = R  # the StateSlots pytree (one spec for its five arrays), the same on every device

# The short convolution's decode update: x [S, C], weight [C, K], the conv pool (the prefill's
# ops take each family's own layout of q, k, v: conv1d_prefill_qkvz, conv1d_prefill_split).
CONV1D_OPS: OpSpecs = {
    "conv1d_update": ((H2, P(M, None), CONV_STATE, SLOTS), (H2, CONV_STATE)),
}


def _no_change(cfg: ModelConfig, tp: int) -> ModelConfig:
    return cfg


def _nothing_to_undo(model: nnx.Module) -> None:
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class FamilySharding:
    """How one model family is split: parameter rules, pools, ops under shard_map."""

    # Raises, naming the config field, where ``tp`` devices cannot split the model.
    check: Callable[[ModelConfig, int, bool], None]  # (cfg, tp, expert_parallel)
    rules: Callable[[ModelConfig, int, bool], Rules]
    # Sets the layers' static settings for the plan's mesh (may permute parameters to match).
    configure: Callable[[nnx.Module, ShardingPlan], None]
    kv_spec: P  # each array of a KV-pool layer
    conv_spec: P
    ssm_spec: P
    ops: OpSpecs  # the head-parallel ops, run per device under shard_map
    kv_pool: str = "split by kv head"  # how the KV pool is laid out, for the start-up log
    # The config the pools are shaped from on ``tp`` devices (e.g. kv heads repeated).
    pool_config: Callable[[ModelConfig, int], ModelConfig] = _no_change
    # Undoes, in place, what ``configure`` permuted: parameters back in checkpoint order.
    checkpoint_layout: Callable[[nnx.Module], None] = _nothing_to_undo


# What a config field counts, for the error message (the checkpoint may spell it otherwise).
_WHAT = {
    "num_attention_heads": "query heads",
    "num_experts": "experts, split by --enable-expert-parallel",
    "moe_intermediate_size": "each expert's intermediate dim, split without expert parallel",
}


def divides(tp: int, what: Mapping[str, str] | None = None, **sizes: int) -> None:
    """Raises unless ``tp`` divides every size; ``what`` names a family's own fields."""
    what = {**_WHAT, **(what or {})}
    for name, size in sizes.items():
        if size % tp:
            note = f" ({what[name]})" if name in what else ""
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={size}{note}")


def check_mlps(cfg: ModelConfig, tp: int, expert_parallel: bool, **shared: int) -> None:
    """The MoE experts (split by expert or by intermediate dim), the shared experts (``shared``:
    their intermediate dim by its config name) and the dense MLPs."""
    layers = range(cfg.num_hidden_layers)
    if any(cfg.is_moe_layer(i) for i in layers):
        if expert_parallel:
            divides(tp, num_experts=cfg.num_experts)
        else:
            divides(tp, moe_intermediate_size=cfg.moe_intermediate_size)
        divides(tp, **shared)
    if not all(cfg.is_moe_layer(i) for i in layers):
        divides(tp, intermediate_size=cfg.intermediate_size)


def mlp_rules(prefix: str) -> Rules:
    """A SwiGLU MLP under ``prefix``: column parallel in, row parallel out."""
    return [
        (rf"{prefix}/(gate_proj|up_proj)/weight", P(None, M)),
        (rf"{prefix}/down_proj/weight", P(M, None)),
    ]


def expert_rules(expert_parallel: bool) -> Rules:
    """The stacked experts [E, D, F] / [E, F, D]: by expert, or by intermediate dim."""
    if expert_parallel:
        return [(r".*/mlp/experts_(gate|up|down)", P(M, None, None))]
    return [
        (r".*/mlp/experts_(gate|up)", P(None, None, M)),
        (r".*/mlp/experts_down", P(None, M, None)),
    ]


def lm_head_rules(cfg: ModelConfig, tp: int) -> Rules:
    return [(r"lm_head/weight", P(None, M) if cfg.vocab_size % tp == 0 else R)]


def configure_experts(model: nnx.Module, plan: ShardingPlan) -> None:
    """The MoE layers' mesh: their experts run under shard_map on each device's share."""
    for _, m in model.iter_modules():
        if isinstance(m, (SparseMoe, SigmoidMoe)):
            m.expert_mesh = plan.mesh if plan.tp > 1 else None
            m.expert_axis = MODEL_AXIS
            m.expert_parallel = plan.expert_parallel
