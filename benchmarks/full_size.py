"""Full-size random models for the serving benchmarks (issues 20 and 23), built on the devices.

Qwen3-Next-80B-A3B in bf16 is ~159 GB and Kimi-Linear-48B-A3B ~98 GB: neither is ever whole on
one device or on the host. :func:`random_sharded_model` builds the model abstractly
(``nnx.eval_shape``), asks :class:`hyjax.sharding.ShardingPlan` where each parameter lives on
the chosen mesh, and runs the model's own initialisers in one ``jax.jit`` whose
``out_shardings`` are those places: with JAX's partitionable threefry every device draws only
its own shard. The engine then takes the model as it is (``LLMEngine(..., preloaded=(model,
cfg))``): ``ShardingPlan.shard_model`` re-places only what is not already where its rule puts
it, and ``jax.device_put`` of an array onto its own sharding returns that same array.

With ``stacked=True`` (the engine's ``--scan-layers``, one device) the layers are stacked
inside the same jit, so the engine's ``stack_layers`` finds them stacked and copies nothing.

Configs (``--model``): ``qwen3-next-80b`` and ``kimi-linear-48b`` (the presets with the real
``config.json`` values), ``bench`` (the 80B's layer shapes, 8 layers, 64 experts: what the
older benchmarks use) and ``tiny-qwen3-next`` / ``tiny-kimi-linear`` (CPU dry runs). ``--layers``
keeps the first N layers of any of them (e.g. 24 of the 80B's 48 on 80 GB cards).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from hyjax.config import ModelConfig
from hyjax.models import model_class
from hyjax.models.kimi_linear.config import kimi_linear_48b_a3b, kimi_linear_tiny
from hyjax.models.qwen3_next.config import qwen3_next_80b_a3b, qwen3_next_tiny
from hyjax.sharding import ShardingPlan, make_mesh, path_name

GB = 1e9


def _bench() -> ModelConfig:
    from benchmarks.common import bench_config

    return bench_config()


def _tiny_qwen3_next() -> ModelConfig:
    # The test model's structure (GDN, attention, MoE with a shared expert) at sizes that split
    # over 8 devices: 8 GDN key heads x 2 value heads each, 8 query / 2 kv heads, 16 experts.
    return qwen3_next_tiny(
        hidden_size=64,
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        intermediate_size=32,
        mlp_only_layers=[],
        vocab_size=512,
    )


def _tiny_kimi_linear() -> ModelConfig:
    return kimi_linear_tiny(
        hidden_size=64,
        num_hidden_layers=5,
        linear_attn_config={
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3, 5],
            "num_heads": 8,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        num_attention_heads=8,
        num_experts=16,
        num_expert_group=1,
        topk_group=1,
        num_experts_per_token=4,
        moe_intermediate_size=16,
        intermediate_size=32,
        vocab_size=512,
    )


MODELS = {
    "qwen3-next-80b": qwen3_next_80b_a3b,
    "kimi-linear-48b": kimi_linear_48b_a3b,
    "bench": _bench,
    "tiny-qwen3-next": _tiny_qwen3_next,
    "tiny-kimi-linear": _tiny_kimi_linear,
}


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


def model_config(name: str, num_layers: int | None = None) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return with_layers(MODELS[name](), num_layers)


def sharding_plan(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ShardingPlan | None:
    """The plan ``LLMEngine`` makes for these flags (None: one device, nothing sharded)."""
    if tp == 1 and not expert_parallel:
        return None
    return ShardingPlan(make_mesh(tp), cfg, expert_parallel)


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

    ``plan``: the mesh and rules (:func:`sharding_plan`); None puts it on the first device.
    ``stacked``: the layers in the engine's ``--scan-layers`` layout (one device only).
    The model comes back configured for the plan's mesh (``ShardingPlan.configure``: the MoE
    layers' mesh, the GDN conv filter's channel order), as ``hyjax.loader.load_model`` returns
    a checkpoint's.

    Compile time does not grow with depth: one jitted build per layer kind (mixer, dense or
    MoE MLP), called once per layer with that layer's key (vmapped over the groups when
    stacked), and one for the embedding, final norm and LM head (the model cut to one layer).
    Every layer draws from its own key: the values differ from ``Model(cfg, rngs=Rngs(seed))``.
    """
    if stacked and plan is not None:
        raise ValueError("stacked layers (--scan-layers) run on one device only")
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

    def layer_paths(i: int) -> list[tuple]:
        return [p[2:] for p in flat if p[:2] == ("layers", i)]

    @functools.cache
    def layer_builder(rep: int, num: int | None):
        """Jitted ``key -> values`` of a layer of ``rep``'s kind (``num`` stacked copies)."""
        layer = nnx.eval_shape(lambda: cls.layer_class(cfg, rep, dtype=dtype, rngs=nnx.Rngs(0)))
        rel = sorted(p for p, _ in nnx.to_flat_state(nnx.state(layer)))

        def one(key):
            state = nnx.state(cls.layer_class(cfg, rep, dtype=dtype, rngs=nnx.Rngs(key)))
            got = dict(nnx.to_flat_state(state))
            return [got[r].get_value() for r in rel]

        if num is None:
            out = [place(("layers", rep, *r)) for r in rel]
            return rel, jax.jit(one, out_shardings=out)
        out = [SingleDeviceSharding(device)] * len(rel)
        return rel, jax.jit(jax.vmap(one), out_shardings=out)

    def kind_of(i: int) -> int:
        return kinds[(cfg.layer_types[i], cfg.is_moe_layer(i))]

    # The unrolled layers: all of them, or (stacked) the prefix and tail before / after groups.
    groups = None
    if stacked:
        from hyjax.models.hybrid import layer_groups

        groups = layer_groups(cfg)
    unrolled = list(range(cfg.num_hidden_layers))
    if groups is not None:
        unrolled = list(range(groups.prefix)) + list(range(groups.end, cfg.num_hidden_layers))
    for k, i in enumerate(unrolled):  # k: the index in the built model's ``layers``
        rel, build = layer_builder(kind_of(i), None)
        assert sorted(layer_paths(k)) == rel, (k, i)
        for r, value in zip(rel, build(keys[i]), strict=True):
            flat[("layers", k, *r)].set_value(value)
    if groups is not None:
        for j in range(groups.period):
            members = list(groups.members(j))
            rel, build = layer_builder(kind_of(members[0]), len(members))
            for r, value in zip(rel, build(keys[np.array(members)]), strict=True):
                flat[("group_layers", j, *r)].set_value(value)

    # Everything outside the layers: from the model cut to one layer.
    rest = [p for p in flat if p[0] not in ("layers", "group_layers")]
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


def build_for_engine(args, dtype="bfloat16") -> tuple[nnx.Module, ModelConfig, dict]:
    """The model the shared benchmark flags ask for (``add_model_args``), and a report."""
    cfg = model_config(args.model, args.layers)
    plan = sharding_plan(cfg, args.tp, args.expert_parallel)
    stacked = bool(args.scan_layers) and plan is None
    t0 = time.perf_counter()
    model = random_sharded_model(cfg, plan, dtype=jnp.dtype(dtype), seed=args.seed, stacked=stacked)
    jax.block_until_ready(nnx.state(model))
    info = {
        "model": args.model,
        "num_layers": cfg.num_hidden_layers,
        "num_experts": getattr(cfg, "num_experts", None),
        "tensor_parallel_size": args.tp,
        "expert_parallel": bool(args.expert_parallel),
        "scan_layers": stacked,
        "dtype": dtype,
        "param_gb_per_device": round(param_bytes_per_device(cfg, plan, jnp.dtype(dtype)) / GB, 2),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    return model, cfg, info


def add_model_args(p) -> None:
    """``--model``, ``--layers``, ``--tp``, ``--expert-parallel``, ``--scan-layers``, ``--seed``."""
    p.add_argument("--model", default="qwen3-next-80b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--expert-parallel", action="store_true", help="split the MoE by expert")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="one lax.scan over the layer groups (one device only: ignored with --tp > 1)",
    )
    p.add_argument("--seed", type=int, default=0)


def memory_table(names=("qwen3-next-80b", "kimi-linear-48b"), tps=(1, 2, 4, 8)) -> list[dict]:
    """Parameter GB per device for each model, layer count and mesh (no device memory used)."""
    rows = []
    for name in names:
        cfg = model_config(name)
        for tp in tps:
            for ep in (False, True) if tp > 1 else (False,):
                abstract_plan = ShardingPlan(_fake_mesh(tp), cfg, ep) if tp > 1 else None
                rows.append(
                    {
                        "model": name,
                        "layers": cfg.num_hidden_layers,
                        "tp": tp,
                        "expert_parallel": ep,
                        "param_gb_per_device": round(
                            param_bytes_per_device(cfg, abstract_plan) / GB, 2
                        ),
                    }
                )
    return rows


def _fake_mesh(tp: int):
    """A mesh of ``tp`` abstract devices: shard shapes without that many real devices."""
    from jax.sharding import AbstractMesh

    return AbstractMesh((tp,), ("model",))


if __name__ == "__main__":
    import json

    print(json.dumps(memory_table(), indent=1))
