"""Full-size random models for the serving benchmarks (issues 20 and 23), built on the devices.

The build itself is the library's (:mod:`hyjax.random_init`, what ``--load-format dummy``
runs): every parameter drawn straight into its shard, the layers stacked where
``--scan-layers`` asks. The engine then takes the model as it is (``LLMEngine(...,
preloaded=(model, cfg))``). This module holds the presets and the benchmarks' flags.

Configs (``--model``): ``qwen3-next-80b`` and ``kimi-linear-48b`` (the presets with the real
``config.json`` values), ``bench`` (the 80B's layer shapes, 8 layers, 64 experts: what the
older benchmarks use) and ``tiny-qwen3-next`` / ``tiny-kimi-linear`` (CPU dry runs). ``--layers``
keeps the first N layers of any of them (e.g. 24 of the 80B's 48 on 80 GB cards).

A preset as a model directory for ``hyjax serve --load-format dummy`` (its ``config.json``)::

    python -m benchmarks.full_size --write-config /tmp/q80b --model qwen3-next-80b [--layers N]
    hyjax serve --model /tmp/q80b --load-format dummy --tensor-parallel-size 2 --scan-layers
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.config import ModelConfig
from hyjax.models.kimi_linear.config import kimi_linear_48b_a3b, kimi_linear_tiny
from hyjax.models.qwen3_next.config import qwen3_next_80b_a3b, qwen3_next_tiny
from hyjax.random_init import (  # noqa: F401  (misplaced, with_layers: the benchmarks' API)
    misplaced,
    param_bytes_per_device,
    random_sharded_model,
    with_layers,
)
from hyjax.sharding import ShardingPlan, make_mesh

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


def model_config(name: str, num_layers: int | None = None) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return with_layers(MODELS[name](), num_layers)


def sharding_plan(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ShardingPlan | None:
    """The plan ``LLMEngine`` makes for these flags (None: one device, nothing sharded)."""
    if tp == 1 and not expert_parallel:
        return None
    return ShardingPlan(make_mesh(tp), cfg, expert_parallel)


def build_for_engine(args, dtype="bfloat16") -> tuple[nnx.Module, ModelConfig, dict]:
    """The model the shared benchmark flags ask for (``add_model_args``), and a report."""
    cfg = model_config(args.model, args.layers)
    plan = sharding_plan(cfg, args.tp, args.expert_parallel)
    stacked = bool(args.scan_layers)
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
        help="one lax.scan over the layer groups (built stacked, in their shards under --tp)",
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


def write_config(out_dir: str, name: str, num_layers: int | None = None) -> str:
    """Writes the preset's ``config.json`` (Hugging Face format) to ``out_dir``: a model
    directory for ``hyjax serve --model DIR --load-format dummy`` (random weights, no
    checkpoint; the embedded model's tokenizer). A vocabulary smaller than that tokenizer's
    (the tiny presets') is raised to it, so text prompts encode inside the model's. Returns
    the file's path."""
    import json
    import os

    from hyjax.assets import model_dir
    from hyjax.tokenizer import Tokenizer

    cfg = model_config(name, num_layers)
    vocab = Tokenizer.from_dir(model_dir()).vocab_size
    if cfg.vocab_size < vocab:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    return path


def main(argv: list[str] | None = None) -> None:
    """``--write-config DIR``: a dummy model directory for a preset; else the memory table."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--write-config",
        metavar="DIR",
        default=None,
        help="write the preset's config.json into DIR (for --load-format dummy)",
    )
    p.add_argument("--model", default="qwen3-next-80b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ns = p.parse_args(argv)  # fmt: skip
    if ns.write_config:
        path = write_config(ns.write_config, ns.model, ns.layers)
        print(f"wrote {path}: hyjax serve --model {ns.write_config} --load-format dummy ...")
        return
    print(json.dumps(memory_table(), indent=1))


if __name__ == "__main__":
    main()
