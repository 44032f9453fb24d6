"""Hugging Face checkpoint loading: safetensors (single file or sharded) into device arrays.

The model is first built abstractly (``nnx.eval_shape``: no memory), then every parameter is
filled from the checkpoint one tensor at a time through a memory map, converted on the host
only as far as its layout needs (transpose, expert stacking), and put on the device. Remote
code is never executed: only ``config.json`` and the tensors are read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from hyjax.config import ModelConfig, load_config
from hyjax.models import model_class
from hyjax.safetensors_io import SafetensorsFile
from hyjax.sharding import ShardingPlan

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Parameters that stay float32 whatever the model dtype.
FLOAT32_PARAMS = ("A_log", "dt_bias", "router", "e_score_correction_bias")
# Checkpoint tensors that are known and deliberately not loaded (multi-token prediction).
IGNORED = re.compile(r"^mtp\.")


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensor and the file."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter path, its layout change, an expert index."""

    path: tuple
    transform: str  # "copy" | "t" (transpose) | "conv" ([C,1,K] -> [C,K]) | "flat"
    expert: int | None = None  # per-expert tensors stack into [E, ...]
    part: slice | None = None  # fused expert tensors: rows taken from the checkpoint


def resolve_dtype(name: str, cfg: ModelConfig) -> jnp.dtype:
    if name == "auto":
        name = cfg.dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32 or bfloat16")
    return DTYPES[name]


def qwen3_next_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Checkpoint name -> parameter, for every tensor a Qwen3-Next checkpoint must hold.

    Experts appear per expert (``experts.{e}.gate_proj.weight``); the fused transformers-5 form
    (``experts.gate_up_proj``) is accepted too, see :func:`_fused_expert_targets`.
    """
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(("embed_tokens",), "copy"),
        "model.norm.weight": Target(("norm", "weight"), "copy"),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target(("lm_head", "weight"), "t")
    for i, kind in enumerate(cfg.layer_types):
        p, L = f"model.layers.{i}.", ("layers", i)
        t[p + "input_layernorm.weight"] = Target(L + ("input_layernorm", "weight"), "copy")
        t[p + "post_attention_layernorm.weight"] = Target(
            L + ("post_attention_layernorm", "weight"), "copy"
        )
        if kind == "full_attention":
            a = L + ("self_attn",)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "t")
            for n in ("q_norm", "k_norm"):
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "copy")
        else:
            g = L + ("linear_attn",)
            for n in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
                t[p + f"linear_attn.{n}.weight"] = Target(g + (n, "weight"), "t")
            t[p + "linear_attn.conv1d.weight"] = Target(g + ("conv1d",), "conv")
            t[p + "linear_attn.A_log"] = Target(g + ("A_log",), "copy")
            t[p + "linear_attn.dt_bias"] = Target(g + ("dt_bias",), "copy")
            t[p + "linear_attn.norm.weight"] = Target(g + ("norm", "weight"), "copy")
        m = L + ("mlp",)
        if cfg.is_moe_layer(i):
            t[p + "mlp.gate.weight"] = Target(m + ("gate", "weight"), "t")
            t[p + "mlp.shared_expert_gate.weight"] = Target(
                m + ("shared_expert_gate", "weight"), "t"
            )
            for n in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.shared_expert.{n}.weight"] = Target(
                    m + ("shared_expert", n, "weight"), "t"
                )
            for e in range(cfg.num_experts):
                for n, dst in (
                    ("gate_proj", "experts_gate"),
                    ("up_proj", "experts_up"),
                    ("down_proj", "experts_down"),
                ):
                    t[p + f"mlp.experts.{e}.{n}.weight"] = Target(m + (dst,), "t", expert=e)
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.{n}.weight"] = Target(m + (n, "weight"), "t")
    return t


def _fused_expert_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """transformers >= 5 may save experts fused: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
    mt = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    if not mt:
        return None
    m = ("layers", int(mt.group(1)), "mlp")
    f = cfg.moe_intermediate_size
    if mt.group(2) == "down_proj":
        return [Target(m + ("experts_down",), "t")]
    return [
        Target(m + ("experts_gate",), "t", part=slice(0, f)),
        Target(m + ("experts_up",), "t", part=slice(f, 2 * f)),
    ]


# Kimi's expert names: w1 = gate, w3 = up, w2 = down.
_KIMI_EXPERTS = (("w1", "experts_gate"), ("w3", "experts_up"), ("w2", "experts_down"))


def kimi_linear_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Checkpoint name -> parameter for Kimi-Linear, in the original checkpoint's names.

    transformers (>= 5.17) saves these names too, except that it may write the dense first
    layer as ``block_sparse_moe.{gate,up,down}_proj``: :func:`kimi_linear_name` maps that back.
    """
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(("embed_tokens",), "copy"),
        "model.norm.weight": Target(("norm", "weight"), "copy"),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target(("lm_head", "weight"), "t")
    for i, kind in enumerate(cfg.layer_types):
        p, L = f"model.layers.{i}.", ("layers", i)
        a = L + ("self_attn",)
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + f"{n}.weight"] = Target(L + (n, "weight"), "copy")
        if kind == "full_attention":
            linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
            norms = ["kv_a_layernorm"]
            if cfg.q_lora_rank is None:
                linears.append("q_proj")
            else:
                linears += ["q_a_proj", "q_b_proj"]
                norms.append("q_a_layernorm")
            for n in linears:
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "t")
            for n in norms:
                t[p + f"self_attn.{n}.weight"] = Target(a + (n, "weight"), "copy")
        else:
            for n in ("q", "k", "v", "f_a", "f_b", "b", "g_a", "g_b", "o"):
                t[p + f"self_attn.{n}_proj.weight"] = Target(a + (f"{n}_proj", "weight"), "t")
            for n in ("q", "k", "v"):
                t[p + f"self_attn.{n}_conv1d.weight"] = Target(a + (f"{n}_conv1d",), "conv")
            t[p + "self_attn.A_log"] = Target(a + ("A_log",), "flat")  # [1, 1, H, 1] -> [H]
            t[p + "self_attn.dt_bias"] = Target(a + ("dt_bias",), "copy")
            t[p + "self_attn.o_norm.weight"] = Target(a + ("o_norm", "weight"), "copy")
        m = L + ("mlp",)
        if cfg.is_moe_layer(i):
            q = p + "block_sparse_moe."
            t[q + "gate.weight"] = Target(m + ("router",), "t")
            t[q + "gate.e_score_correction_bias"] = Target(m + ("e_score_correction_bias",), "copy")
            if cfg.num_shared_experts:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    t[q + f"shared_experts.{n}.weight"] = Target(
                        m + ("shared_experts", n, "weight"), "t"
                    )
            for e in range(cfg.num_experts):
                for n, dst in _KIMI_EXPERTS:
                    t[q + f"experts.{e}.{n}.weight"] = Target(m + (dst,), "t", expert=e)
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.{n}.weight"] = Target(m + (n, "weight"), "t")
    return t


_KIMI_DENSE_ALIAS = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.)"
)


def kimi_linear_name(name: str) -> str:
    """A dense layer saved under ``block_sparse_moe.*`` (transformers) is ``mlp.*``."""
    return _KIMI_DENSE_ALIAS.sub(r"\1.mlp.\2", name)


TARGETS: dict[str, Callable[[ModelConfig], dict[str, Target]]] = {
    "qwen3_next": qwen3_next_targets,
    "kimi_linear": kimi_linear_targets,
}
# model_type -> a map from other spellings of a checkpoint name to the one TARGETS uses.
NAME_ALIASES: dict[str, Callable[[str], str]] = {"kimi_linear": kimi_linear_name}


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> file, from ``model.safetensors.index.json`` or the single file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return {k: single for k in SafetensorsFile(single).keys()}
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir!r}"
    )


def _convert(arr: np.ndarray, target: Target) -> np.ndarray:
    if target.part is not None:
        arr = arr[:, target.part, :]
    if target.transform == "t":
        arr = np.swapaxes(arr, -1, -2)
    elif target.transform == "conv":
        arr = arr[:, 0, :]
    elif target.transform == "flat":
        arr = arr.reshape(-1)
    return arr


def load_model(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "auto",
    mesh: Mesh | None = None,
    expert_parallel: bool = False,
) -> tuple[nnx.Module, ModelConfig]:
    """Builds the model of ``model_dir/config.json`` and fills it from the checkpoint.

    With a ``mesh`` every device reads only its own shard of each tensor from the memory map
    (``jax.make_array_from_callback``), as :class:`hyjax.sharding.ShardingPlan` places it, and
    the model comes back configured for that mesh. A directory written by ``hyjax convert``
    (an orbax checkpoint in ``ORBAX_DIR``) is restored straight into the shards instead.
    """
    model_dir = os.fspath(model_dir)
    cfg = load_config(model_dir)
    jdtype = resolve_dtype(dtype, cfg)
    cls = model_class(cfg)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    plan = ShardingPlan(mesh, cfg, expert_parallel) if mesh is not None else None
    if os.path.isdir(os.path.join(model_dir, ORBAX_DIR)):
        return _restore_converted(model_dir, abstract, cfg, plan), cfg
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    targets = TARGETS[cfg.model_type](cfg)
    files = checkpoint_files(model_dir)
    alias = NAME_ALIASES.get(cfg.model_type)
    stored = {alias(k): k for k in files} if alias else {}  # our name -> the file's name
    files = {alias(k): v for k, v in files.items()} if alias else files

    # Group checkpoint tensors by the parameter they fill.
    by_param: dict[tuple, list[tuple[str, Target]]] = {}
    unexpected = []
    for name in files:
        if IGNORED.match(name):
            continue
        tl = [targets[name]] if name in targets else _fused_expert_targets(name, cfg)
        if tl is None:
            unexpected.append(name)
            continue
        for tg in tl:
            by_param.setdefault(tg.path, []).append((name, tg))
    if unexpected:
        name = sorted(unexpected)[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"unexpected tensor {name!r} in {files[name]}{more}")
    fused = {tg.path for src in by_param.values() for name, tg in src if name not in targets}
    missing = [n for n, tg in targets.items() if n not in files and tg.path not in fused]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = sorted(set(files.values()))
        raise CheckpointError(f"missing tensor {missing[0]!r}{more}; looked in {where}")

    opened: dict[str, SafetensorsFile] = {}
    device = jax.local_devices()[0]

    def read(name: str) -> np.ndarray:
        path = files[name]
        if path not in opened:
            opened[path] = SafetensorsFile(path)
        try:
            return opened[path].get(stored.get(name, name))
        except KeyError:
            msg = f"tensor {name!r} listed in the index is not in {path}"
            raise CheckpointError(msg) from None

    for path, sources in by_param.items():
        var = params[path]
        want_shape = tuple(var.get_value().shape)
        want_dtype = jnp.float32 if path[-1] in FLOAT32_PARAMS else var.get_value().dtype
        views: dict[int | None, np.ndarray] = {}  # expert (None: whole tensor) -> host view
        for name, tg in sources:
            arr = _convert(read(name), tg)  # a view of the map: nothing is read yet
            want = want_shape[1:] if tg.expert is not None else want_shape
            if tuple(arr.shape) != want:
                raise CheckpointError(
                    f"tensor {name!r} in {files[name]} has shape {tuple(read(name).shape)}, "
                    f"expected {_hf_shape(tg, want)}"
                )
            views[tg.expert] = arr
        if _stacked(sources) and len(views) != want_shape[0]:
            raise CheckpointError(
                f"missing experts for {'.'.join(map(str, path))}: "
                f"got {len(views)} of {want_shape[0]}"
            )
        sharding = plan.sharding(path) if plan is not None else SingleDeviceSharding(device)
        var.set_value(
            jax.make_array_from_callback(
                want_shape, sharding, functools.partial(_read_block, views, want_dtype)
            )
        )
        views.clear()
    opened.clear()  # the maps close once the last view is gone
    model = nnx.merge(graphdef, nnx.from_flat_state(params))
    if plan is not None:
        plan.configure(model)  # layers' static settings; permutes the (small) GDN conv rows
    log.info("loaded %s (%s) from %s", cfg.model_type, jnp.dtype(jdtype).name, model_dir)
    return model, cfg


def _read_block(
    views: dict[int | None, np.ndarray], dtype, index: tuple[slice, ...] | None
) -> np.ndarray:
    """One device's block of a parameter, read from the map (its experts only, if stacked)."""
    if index is None:
        index = ()
    if None in views:
        return np.array(views[None][index], dtype=dtype)  # a copy: nothing aliases the map
    experts = range(len(views))[index[0] if index else slice(None)]
    rest = tuple(index[1:])
    return np.stack([np.asarray(views[e][rest], dtype=dtype) for e in experts])


# Where ``hyjax convert`` puts the converted parameters (an orbax checkpoint).
ORBAX_DIR = "hyjax_params"


def save_converted(model: nnx.Module, cfg: ModelConfig, model_dir: str, out_dir: str) -> str:
    """Writes ``model``'s parameters (checkpoint layout: transposed, experts stacked, GDN conv
    channels in checkpoint order) as an orbax checkpoint, plus ``model_dir``'s config and
    tokenizer files, so :func:`load_model` later restores them sharded with no conversion."""
    import shutil

    import orbax.checkpoint as ocp

    from hyjax.sharding import checkpoint_layout_state

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if name.endswith((".json", ".txt", ".model", ".tiktoken", ".py", ".jinja")) and (
            "safetensors" not in name
        ):
            shutil.copy(os.path.join(model_dir, name), os.path.join(out_dir, name))
    state = nnx.to_pure_dict(checkpoint_layout_state(model))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out_dir, ORBAX_DIR), state)
    log.info("saved the converted %s parameters to %s", cfg.model_type, out_dir)
    return out_dir


def _restore_converted(
    model_dir: str, abstract: nnx.Module, cfg: ModelConfig, plan: ShardingPlan | None
) -> nnx.Module:
    import orbax.checkpoint as ocp

    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    device = jax.local_devices()[0]
    for path, var in params.items():
        sharding = plan.sharding(path) if plan is not None else SingleDeviceSharding(device)
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
    target = nnx.to_pure_dict(nnx.from_flat_state(params))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.join(model_dir, ORBAX_DIR), target)
    state = nnx.from_flat_state(params)
    nnx.replace_by_pure_dict(state, restored)
    model = nnx.merge(graphdef, state)
    if plan is not None:
        model = plan.shard_model(model)  # permutes the GDN conv rows for this mesh
    log.info("restored converted %s parameters from %s", cfg.model_type, model_dir)
    return model


def _stacked(sources: list[tuple[str, Target]]) -> bool:
    return any(tg.expert is not None for _, tg in sources)


def _hf_shape(tg: Target, want: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint-side shape that would have been accepted (for error messages)."""
    if tg.transform == "t":
        return want[:-2] + (want[-1], want[-2])
    if tg.transform == "conv":
        return (want[0], 1, want[1])
    return want
