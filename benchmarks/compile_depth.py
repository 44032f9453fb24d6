"""Compile time against depth: the per-layer loop vs one ``lax.scan`` over the repeating group.

For each family and depth, builds the tiny model's shapes at that many layers (Qwen3-Next:
groups of [GDN, GDN, GDN, attention]; Kimi-Linear: a dense KDA layer 0, then groups of
[KDA, KDA, KDA, MLA]) and times ``jit(...).lower(...).compile()`` of one prefill step (64
tokens, 2 rows) and one decode step (2 rows), reference ops, no compilation cache::

    python -m benchmarks.compile_depth --out benchmarks/results/compile_depth_cpu_2core_epyc.json

``--tp N``: the same under tensor parallel (parameters and pools placed by
``hyjax.sharding.ShardingPlan``, the ops under ``shard_map``), e.g. on simulated CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.compile_depth --tp 2
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.cold_start import _cpu_name
from hyjax.cache import init_caches
from hyjax.models.hybrid import layer_groups, stack_caches
from hyjax.models.kimi_linear.config import kimi_linear_tiny
from hyjax.models.kimi_linear.model import KimiLinearForCausalLM
from hyjax.models.qwen3_next.config import qwen3_next_tiny
from hyjax.models.qwen3_next.model import Qwen3NextForCausalLM
from hyjax.ops import get_ops
from hyjax.sharding import ShardingPlan, make_mesh, replicate_tree
from hyjax.testing import SeqChunk, make_batch

BS = 16


def qwen(n: int):
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return qwen3_next_tiny(num_hidden_layers=n, layer_types=(types * n)[:n], mlp_only_layers=[])


def kimi(n: int):
    # 0-based layer i > 0 with i % 4 == 0 is MLA; the config counts layers from 1
    full = [i + 1 for i in range(1, n + 1) if i % 4 == 0]
    kda = [i + 1 for i in range(n + 1) if i + 1 not in full]
    attn = {"full_attn_layers": full, "kda_layers": kda}
    return kimi_linear_tiny(num_hidden_layers=n + 1, linear_attn_config=attn)


FAMILIES = {
    "qwen3_next": (qwen, Qwen3NextForCausalLM),
    "kimi_linear": (kimi, KimiLinearForCausalLM),
}


def compile_seconds(cfg, cls, *, scan: bool, decode_only: bool, tp: int = 1) -> float:
    model = cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    pools = dict(num_blocks=16, block_size=BS, num_slots=4, dtype=jnp.float32)
    ops = get_ops("reference")
    plan = None
    if tp > 1:
        plan = ShardingPlan(make_mesh(tp), cfg)
        model = plan.shard_model(model)
        ops = plan.shard_ops(ops)
        if scan:
            model.stack_layers(plan.sharding)
        caches = plan.init_caches(stacked=scan, **pools)
    else:
        caches = init_caches(cfg, **pools)
        if scan:
            model.stack_layers()
            caches = stack_caches(cfg, caches)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, batch, caches):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    if decode_only:
        rows = [SeqChunk([5], 20, [1, 2], src_slot=1, dst_slot=1),
                SeqChunk([6], 30, [3, 4], src_slot=2, dst_slot=2)]  # fmt: skip
        shape = dict(num_tokens=2, num_seqs=2)
    else:
        rows = [SeqChunk(list(range(3, 43)), 0, [1, 2, 3], dst_slot=1),
                SeqChunk(list(range(3, 23)), 0, [4, 5], dst_slot=2)]  # fmt: skip
        shape = dict(num_tokens=64, num_seqs=2)
    batch, _ = make_batch(rows, block_size=BS, max_blocks=4, **shape)
    if plan is not None:
        batch = replicate_tree(batch, plan.mesh)
    start = time.perf_counter()
    step.lower(state, batch, caches).compile()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--families", nargs="+", default=sorted(FAMILIES))
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    jax.config.update("jax_compilation_cache_dir", None)
    rows = []
    for family in ns.families:
        make_cfg, cls = FAMILIES[family]
        for n in ns.depths:
            cfg = make_cfg(n)
            groups = layer_groups(cfg)
            for decode_only in (False, True):
                row = {"family": family, "layers": cfg.num_hidden_layers,
                       "step": "decode" if decode_only else "prefill",
                       "groups": None if groups is None else vars(groups)}  # fmt: skip
                for scan in (False, True):
                    key = "scan_s" if scan else "loop_s"
                    row[key] = round(
                        compile_seconds(cfg, cls, scan=scan, decode_only=decode_only, tp=ns.tp),
                        2,
                    )
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {"machine": _cpu_name(), "backend": jax.default_backend(), "ops": "reference",
              "tp": ns.tp, "jax": jax.__version__, "rows": rows}  # fmt: skip
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
