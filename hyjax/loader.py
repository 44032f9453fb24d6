"""Hugging Face checkpoint loading: safetensors (single file or sharded) into device arrays.

The model is first built abstractly (``nnx.eval_shape``: no memory), then every parameter is
filled from the checkpoint one tensor at a time through a memory map, converted on the host
only as far as its layout needs (transpose, expert stacking), and put on the device. Remote
code is never executed: only ``config.json`` and the tensors are read.

``load_format="dummy"`` (vLLM's name) reads ``config.json`` only and draws random weights
straight into their shards (:mod:`hyjax.random_init`): a full-size model's serving path, with
no checkpoint on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from hyjax.config import ModelConfig
from hyjax.models import family_of, load_config
from hyjax.models.family import Target
from hyjax.safetensors_io import SafetensorsFile
from hyjax.sharding import ShardingPlan

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# ``--load-format``: the checkpoint's tensors (safetensors, or a converted orbax directory), or
# random weights from config.json alone.
LOAD_FORMATS = ("auto", "dummy")
# Checkpoint tensors loaded only when asked for (multi-token prediction: ``load_model(mtp=)``).
IGNORED = re.compile(r"^mtp\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensor and the file."""


def resolve_dtype(name: str, cfg: ModelConfig) -> jnp.dtype:
    if name == "auto":
        name = cfg.dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32 or bfloat16")
    return DTYPES[name]


def fused_expert_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """transformers >= 5 may save experts fused: gate_up_proj [E, 2F, D], down_proj [E, D, F].

    The names are those of the MoE layer's parameters (``mlp.experts_*``), whatever the family.
    """
    mt = re.fullmatch(r"(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    if not mt:
        return None
    m = ("layers", int(mt.group(2)), "mlp")
    if mt.group(1) == "mtp":
        m = ("mtp",) + m
    f = cfg.moe_intermediate_size
    if mt.group(3) == "down_proj":
        return [Target(m + ("experts_down",), "t")]
    return [
        Target(m + ("experts_gate",), "t", part=slice(0, f)),
        Target(m + ("experts_up",), "t", part=slice(f, 2 * f)),
    ]


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
    mtp: bool = False,
    load_format: str = "auto",
    stacked: bool = False,
) -> tuple[nnx.Module, ModelConfig]:
    """Builds the model of ``model_dir/config.json`` and fills it from the checkpoint.

    ``load_format``: ``auto`` (the checkpoint) or ``dummy`` (random weights, each drawn in
    its shard; ``stacked`` then builds the layers in the ``--scan-layers`` form at once, so a
    full-size model is never held in both forms).

    ``mtp`` builds and loads the multi-token prediction layers (``mtp.*``) too: as many as the
    config declares, else as many as the checkpoint holds (Qwen3-Next's config.json names
    none); the returned config says how many (``num_mtp_layers``). Without it the ``mtp.*``
    tensors are skipped unread and the config comes back with ``num_mtp_layers=0``.

    With a ``mesh`` every device reads only its own shard of each tensor from the memory map
    (``jax.make_array_from_callback``), as :class:`hyjax.sharding.ShardingPlan` places it, and
    the model comes back configured for that mesh. A directory written by ``hyjax convert``
    (an orbax checkpoint in ``ORBAX_DIR``) is restored straight into the shards instead.
    """
    model_dir = os.fspath(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; one of {', '.join(LOAD_FORMATS)}")
    cfg = load_config(model_dir)
    if load_format == "dummy":
        return _dummy_model(model_dir, cfg, dtype, mesh, expert_parallel, mtp, stacked)
    converted = os.path.isdir(os.path.join(model_dir, ORBAX_DIR))
    files = {} if converted else checkpoint_files(model_dir)
    cfg = _with_mtp_layers(cfg, files, mtp)
    jdtype = resolve_dtype(dtype, cfg)
    family = family_of(cfg)
    cls = family.model_class
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    plan = ShardingPlan(mesh, cfg, expert_parallel) if mesh is not None else None
    if converted:
        return _restore_converted(model_dir, abstract, cfg, plan), cfg
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    targets = family.targets(cfg)
    skip_mtp = not getattr(cfg, "num_mtp_layers", 0)
    alias = family.checkpoint_name
    stored = {alias(k): k for k in files}  # our name -> the file's name
    files = {alias(k): v for k, v in files.items()}

    # Group checkpoint tensors by the parameter they fill.
    by_param: dict[tuple, list[tuple[str, Target]]] = {}
    unexpected = []
    for name in files:
        if skip_mtp and IGNORED.match(name):
            continue
        tl = [targets[name]] if name in targets else fused_expert_targets(name, cfg)
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
        want_dtype = jnp.float32 if path[-1] in family.float32_params else var.get_value().dtype
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


def _dummy_model(
    model_dir: str,
    cfg: ModelConfig,
    dtype: str,
    mesh: Mesh | None,
    expert_parallel: bool,
    mtp: bool,
    stacked: bool,
) -> tuple[nnx.Module, ModelConfig]:
    """Random weights for ``cfg`` (``load_format="dummy"``), each drawn in its shard."""
    from hyjax.random_init import random_sharded_model

    if mtp:
        raise ValueError("load_format='dummy' builds no multi-token prediction layers")
    if "num_mtp_layers" in {f.name for f in dataclasses.fields(cfg)}:
        cfg = dataclasses.replace(cfg, num_mtp_layers=0)
    jdtype = resolve_dtype(dtype, cfg)
    plan = ShardingPlan(mesh, cfg, expert_parallel) if mesh is not None else None
    model = random_sharded_model(cfg, plan, dtype=jdtype, stacked=stacked)
    log.info(
        "built %s (%s) with random weights from %s/config.json (--load-format dummy)",
        cfg.model_type, jnp.dtype(jdtype).name, model_dir,
    )  # fmt: skip
    return model, cfg


def _with_mtp_layers(cfg: ModelConfig, files: dict[str, str], mtp: bool) -> ModelConfig:
    """``cfg`` with the number of MTP layers to build: 0 unless asked for; when asked for,
    the config's own number or else the checkpoint's (``mtp.layers.{j}.*``)."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    if "num_mtp_layers" not in fields:
        if mtp:
            raise ValueError(f"{cfg.model_type} has no multi-token prediction layers")
        return cfg
    if not mtp:
        return dataclasses.replace(cfg, num_mtp_layers=0)
    if cfg.num_mtp_layers:
        return cfg
    found = {int(m.group(1)) for m in map(_MTP_LAYER.match, files) if m}
    if not found:
        where = sorted(set(files.values())) or "a converted checkpoint (declare it in config.json)"
        raise CheckpointError(f"mtp=True but no mtp.layers.* tensors in {where}")
    return dataclasses.replace(cfg, num_mtp_layers=max(found) + 1)


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
