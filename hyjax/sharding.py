"""Tensor and expert parallelism with ``jax.sharding``: meshes, partition rules, sharded ops.

One mesh axis, ``"model"``, over ``--tensor-parallel-size`` devices. A :class:`ShardingPlan`
says, for one model on one mesh:

- where each parameter lives: the family's table of ``(path regex, PartitionSpec)`` rules
  (first match wins, no match = replicated). Projections into heads are split by
  output columns, projections out of heads by input rows (Megatron's column / row parallel),
  so XLA's SPMD partitioner inserts one all-reduce after each row-parallel matmul;
- where each cache pool lives: KV blocks, conv windows and recurrent states split by head
  (Kimi's MLA latent, which every head reads, replicated);
- which ops run under ``jax.shard_map`` (the Pallas kernels, and the reference ops in their
  place, see per-device heads: every head is independent, so no op needs a collective);
- the static settings the layers read (the family's ``configure``: e.g.
  ``GatedDeltaNet.conv_shards``, ``GatedAttention.kv_repeat``, the MoE layers' ``expert_mesh``).

Each family's rules and its layout diagram are in ``hyjax/models/<family>/sharding.py``;
:mod:`hyjax.partition` holds what they are written in and the rules every family shares.
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
from hyjax.models import family_of
from hyjax.models.hybrid import GROUP_LAYERS, stack_caches
from hyjax.partition import MODEL_AXIS, FamilySharding, M, R


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
        self.family.check(self.cfg, self.tp, self.expert_parallel)

    @property
    def family(self) -> FamilySharding:
        return family_of(self.cfg).sharding

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @functools.cached_property
    def _rules(self) -> list[tuple[re.Pattern, P]]:
        rules = self.family.rules(self.cfg, self.tp, self.expert_parallel)
        return [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec(self, path: tuple) -> P:
        """The parameter's PartitionSpec: the first rule whose regex matches its whole path.

        A parameter of the scanned form (``group_layers/{j}/...``, stacked to ``[G, ...]`` by
        ``HybridForCausalLM.stack_layers``) takes its layer's rule behind a leading unsplit
        group axis: the scan slices one group's layer, placed as the loop's would be.
        """
        if self.tp == 1:
            return R
        name = path_name(path)
        spec = next((spec for rx, spec in self._rules if rx.fullmatch(name)), R)
        if path and path[0] == GROUP_LAYERS and spec != R:
            return P(None, *spec)
        return spec

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
        """The config the pools are shaped from: e.g. kv heads repeated where the mesh needs."""
        return self.family.pool_config(self.cfg, self.tp)

    def pool_bytes(self, block_size: int, dtype, state_dtype="float32") -> tuple[int, int]:
        """``(KV block bytes, state slot bytes)`` on one device."""
        cfg = self.cache_config()
        kv = kv_block_bytes(cfg, block_size, dtype)
        slot = state_slot_bytes(cfg, dtype, state_dtype)
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

    def init_caches(self, *, stacked: bool = False, **kwargs) -> Caches:
        """:func:`hyjax.cache.init_caches`, each pool allocated straight into its shards.

        ``stacked``: in the scanned forward's layout (:func:`hyjax.models.hybrid.stack_caches`:
        a group position's pools end to end along the block / slot axis, which no spec splits),
        so the same specs hold and every device keeps its heads of every group.
        """
        cfg = self.cache_config()
        make = functools.partial(init_caches, cfg, **kwargs)
        if stacked:
            per_layer = make

            def make():
                return stack_caches(cfg, per_layer())

        shardings = self.cache_shardings(jax.eval_shape(make))
        return jax.jit(make, out_shardings=shardings)()

    # -- ops

    def logits_spec(self) -> P:
        """The LM head's logits ``[S, V]``: split by vocab where its weight's columns are."""
        if self.cfg.tie_word_embeddings:  # the head is embed_tokens.T: vocab is its first axis
            spec = self.spec(("embed_tokens",))
            vocab = spec[0] if spec else None
        else:  # lm_head/weight [D, V]
            spec = self.spec(("lm_head", "weight"))
            vocab = spec[1] if len(spec) > 1 else None
        return P(None, vocab)

    def shard_ops(self, ops):
        """``ops`` with this family's head-parallel ops wrapped in ``jax.shard_map``, and the
        logits pinned: split by vocab as the LM head leaves them, whole where gathered."""
        if self.tp == 1:
            return ops
        return _sharded_ops(ops, self.mesh, self.family, self.logits_spec())


@functools.cache
def _sharded_ops(ops, mesh: Mesh, family: FamilySharding, logits_spec: P):
    """One wrapped ``Ops`` per (ops, mesh, family, logits split): equal static arguments of the
    jitted step, so a second runner on the same mesh reuses the compiled executables."""
    tp = mesh.shape[MODEL_AXIS]
    wrapped = {
        name: _shard_op(getattr(ops, name), mesh, in_specs, out_specs, tp)
        for name, (in_specs, out_specs) in family.ops.items()
    }
    whole, head = NamedSharding(mesh, P()), NamedSharding(mesh, logits_spec)
    wrapped["gather_logits"] = lambda x: jax.lax.with_sharding_constraint(x, whole)
    wrapped["whole_tables"] = lambda tables: jax.lax.with_sharding_constraint(tables, whole)
    # Without this pin, propagation runs the gather's "whole" back into the LM head's dot,
    # which then all-gathers its [D, V] weight every step (bf16 151936 x 2048: 622 MB).
    wrapped["head_logits"] = lambda x: jax.lax.with_sharding_constraint(x, head)

    # The plan and the results' buffers are whole on every device; each makes its own (a
    # Pallas kernel under jit's partitioner would need a rule of its own).
    def step_buffers(buf, blank=()):
        fn = functools.partial(ops.step_buffers, blank=blank)
        return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(buf)

    wrapped["step_buffers"] = step_buffers
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
    """``model``'s state with what its family's ``configure`` permuted (the GDN conv rows)
    back in checkpoint order, for saving; ``model`` itself is left as it is."""
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables
    family_of(model.config).sharding.checkpoint_layout(clone)
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
    "MODEL_AXIS",
    "ShardingPlan",
    "checkpoint_layout_state",
    "initialize_distributed",
    "local_shapes",
    "make_mesh",
    "path_name",
    "replicate_tree",
]
