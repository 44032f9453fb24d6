"""Random weights built straight into their shards: ``--load-format dummy`` and the full-size
benchmarks (``benchmarks.full_size``).

Qwen3-Next-80B-A3B in bf16 is ~159 GB and Kimi-Linear-48B-A3B ~98 GB: neither is ever whole on
one device or on the host. :func:`random_sharded_model` builds the model abstractly
(``nnx.eval_shape``), asks :class:`hyjax.sharding.ShardingPlan` where each parameter lives on
the chosen mesh, and runs the model's own initialisers in jitted builders whose
``out_shardings`` are those places: with JAX's partitionable threefry every device draws only
its own shard. The engine then takes the model as it is: ``ShardingPlan.shard_model``
re-places only what is not already where its rule puts it, and ``jax.device_put`` of an array
onto its own sharding returns that same array.

With ``stacked=True`` (the engine's ``--scan-layers``) the layers are built in the scanned
form (``group_layers/{j}``, a leading group axis, placed by the plan's group specs), so the
runner's ``stack_layers`` finds them stacked and copies nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from hyjax.config import ModelConfig
from hyjax.models import model_class
from hyjax.models.hybrid import GROUP_LAYERS, layer_groups
from hyjax.sharding import ShardingPlan, path_name


def with_layers(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
    """``cfg`` keeping only its first ``num_layers`` layers (their kinds unchanged)."""
    if num_layers is None or num_layers == cfg.num_hidden_layers:
        return cfg
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"{num_layers=} must be in [1, {cfg.num_hidden_layers}]")
    changes = {"num_hidden_layers": num_layers, "layer_types": cfg.layer_types[:num_layers]}
    if hasattr(cfg, "mlp_layer_types"):  # Kimi-Linear: dense / sparse per layer
        changes["mlp_layer_types"] = cfg.mlp_layer_types[:num_layers]
    if hasattr(cfg, "mlp_only_layers"):  # Qwen3-Next: the dense layers' indices
        changes["mlp_only_layers"] = tuple(i for i in cfg.mlp_only_layers if i < num_layers)
    return dataclasses.replace(cfg, **changes)


def _make(cfg: ModelConfig, dtype, seed: int, stacked: bool) -> nnx.Module:
    model = model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    if stacked:
        model.stack_layers()
    return model


@functools.cache
def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16, stacked: bool = False) -> nnx.Module:
    """The model's shapes and dtypes, nothing allocated."""
    return nnx.eval_shape(lambda: _make(cfg, dtype, 0, stacked))


def param_bytes_per_device(cfg: ModelConfig, plan: ShardingPlan | None, dtype=jnp.bfloat16) -> int:
    """The parameters' bytes on the most loaded device of ``plan`` (all of them without one)."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg, dtype))):
        v = var.get_value()
        shape = plan.sharding(path).shard_shape(v.shape) if plan is not None else v.shape
        total += int(np.prod(shape)) * v.dtype.itemsize
    return total


def random_sharded_model(
    cfg: ModelConfig,
    plan: ShardingPlan | None,
    *,
    dtype=jnp.bfloat16,
    seed: int = 0,
    stacked: bool = False,
) -> nnx.Module:
    """A randomly initialised model whose every parameter is created in its final place.

    ``plan``: the mesh and rules; None puts it on the first device. ``stacked``: the layers in
    the engine's ``--scan-layers`` layout (nothing changes when no layer group repeats). The
    model comes back configured for the plan's mesh (``ShardingPlan.configure``: the MoE
    layers' mesh, the GDN conv filter's channel order), as ``hyjax.loader.load_model`` returns
    a checkpoint's.

    Compile time does not grow with depth: one jitted build per layer kind (mixer, dense or
    MoE MLP), called once per layer with that layer's key (vmapped over the groups when
    stacked), and one for the embedding, final norm and LM head (the model cut to one layer).
    Every layer draws from its own key: the values differ from ``Model(cfg, rngs=Rngs(seed))``.
    """
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, stacked))
    flat = dict(nnx.to_flat_state(abstract))
    device = jax.local_devices()[0]

    def place(path: tuple):
        return plan.sharding(path) if plan is not None else SingleDeviceSharding(device)

    cls = model_class(cfg)
    keys = jax.random.split(jax.random.key(seed), cfg.num_hidden_layers + 1)
    kinds: dict[tuple, int] = {}  # layer kind -> the first layer of that kind
    for i in range(cfg.num_hidden_layers):
        kinds.setdefault((cfg.layer_types[i], cfg.is_moe_layer(i)), i)

    def layer_paths(prefix: tuple) -> list[tuple]:
        return sorted(p[2:] for p in flat if p[:2] == prefix)

    @functools.cache
    def layer_builder(rep: int, num: int | None, out: tuple):
        """Jitted ``key -> values`` of a layer of ``rep``'s kind (``num`` stacked copies),
        each value landing in its sharding of ``out``."""
        layer = nnx.eval_shape(lambda: cls.layer_class(cfg, rep, dtype=dtype, rngs=nnx.Rngs(0)))
        rel = sorted(p for p, _ in nnx.to_flat_state(nnx.state(layer)))

        def one(key):
            state = nnx.state(cls.layer_class(cfg, rep, dtype=dtype, rngs=nnx.Rngs(key)))
            got = dict(nnx.to_flat_state(state))
            return [got[r].get_value() for r in rel]

        return rel, jax.jit(one if num is None else jax.vmap(one), out_shardings=list(out))

    def kind_of(i: int) -> int:
        return kinds[(cfg.layer_types[i], cfg.is_moe_layer(i))]

    # The unrolled layers: all of them, or (stacked) the prefix and tail before / after groups.
    groups = layer_groups(cfg) if stacked else None
    unrolled = list(range(cfg.num_hidden_layers))
    if groups is not None:
        unrolled = list(range(groups.prefix)) + list(range(groups.end, cfg.num_hidden_layers))
    for k, i in enumerate(unrolled):  # k: the index in the built model's ``layers``
        rel = layer_paths(("layers", k))
        out = tuple(place(("layers", k, *r)) for r in rel)
        built, build = layer_builder(kind_of(i), None, out)
        assert built == rel, (k, i)
        for r, value in zip(rel, build(keys[i]), strict=True):
            flat[("layers", k, *r)].set_value(value)
    if groups is not None:
        for j in range(groups.period):
            members = list(groups.members(j))
            rel = layer_paths((GROUP_LAYERS, j))
            out = tuple(place((GROUP_LAYERS, j, *r)) for r in rel)
            built, build = layer_builder(kind_of(members[0]), len(members), out)
            assert built == rel, (j, members)
            for r, value in zip(rel, build(keys[np.array(members)]), strict=True):
                flat[(GROUP_LAYERS, j, *r)].set_value(value)

    # Everything outside the layers: from the model cut to one layer.
    rest = [p for p in flat if p[0] not in ("layers", GROUP_LAYERS)]
    one_layer = with_layers(cfg, 1)

    def build_rest(key):
        got = dict(nnx.to_flat_state(nnx.state(cls(one_layer, dtype=dtype, rngs=nnx.Rngs(key)))))
        return [got[p].get_value() for p in rest]

    values = jax.jit(build_rest, out_shardings=[place(p) for p in rest])(keys[-1])
    for path, value in zip(rest, values, strict=True):
        flat[path].set_value(value)
    missing = [
        path_name(p) for p, v in flat.items() if isinstance(v.get_value(), jax.ShapeDtypeStruct)
    ]
    assert not missing, missing
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if plan is not None:
        # The layers' static settings for the mesh; the GDN conv rows (a few KB a layer) are
        # permuted into the mesh's channel order and put back in their place.
        model = plan.shard_model(model)
    return model


def misplaced(model: nnx.Module, plan: ShardingPlan | None) -> list[str]:
    """The parameters not where ``plan`` (or, without one, the first device) puts them."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if plan is None:
            ok = value.sharding.device_set == {jax.local_devices()[0]}
        else:
            ok = value.sharding.is_equivalent_to(plan.sharding(path), value.ndim)
        if not ok:
            out.append(f"{path_name(path)}: {value.sharding} (rule: {plan and plan.spec(path)})")
    return out
