"""The scanned forward (one ``lax.scan`` over the repeating layer group) against the loop.

Same parameters, same caches (stacked into the scan's layout and back): the logits and every
pool entry match the per-layer loop, on a prefill step then a decode step that reads what the
prefill wrote, with a prefix layer and a tail layer outside the groups.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyjax.cache import init_caches
from hyjax.models.hybrid import LayerGroups, layer_groups, stack_caches, unstack_caches
from hyjax.models.kimi_linear.config import kimi_linear_tiny
from hyjax.models.kimi_linear.model import KimiLinearForCausalLM
from hyjax.models.qwen3_next.config import qwen3_next_tiny
from hyjax.models.qwen3_next.model import Qwen3NextForCausalLM
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, make_batch

BS = 16
LIN, FULL = "linear_attention", "full_attention"


def qwen_cfg():
    # dense layer 0 (a prefix), 3 groups of [GDN, GDN, attention], one GDN tail layer
    types = [LIN] + [LIN, LIN, FULL] * 3 + [LIN]
    return qwen3_next_tiny(num_hidden_layers=len(types), layer_types=types, mlp_only_layers=[0])


def kimi_cfg():
    # first_k_dense_replace=1: dense KDA layer 0, then 3 groups of [KDA, MLA]
    n = 7
    full = [i + 1 for i in range(n) if i % 2 == 0 and i > 0]
    kda = [i + 1 for i in range(n) if i + 1 not in full]
    attn = {"full_attn_layers": full, "kda_layers": kda}
    return kimi_linear_tiny(num_hidden_layers=n, linear_attn_config=attn)


CASES = {
    "qwen3_next": (qwen_cfg, Qwen3NextForCausalLM),
    "kimi_linear": (kimi_cfg, KimiLinearForCausalLM),
}


def test_layer_groups_finds_the_longest_repeat():
    assert layer_groups(qwen_cfg()) == LayerGroups(prefix=1, period=3, num_groups=3)
    assert layer_groups(qwen3_next_tiny()) is None  # 4 layers, no group repeats


def _forward(model):
    graphdef, state = nnx.split(model)
    ops = get_ops("reference")

    @functools.partial(jax.jit, static_argnames="decode_only")
    def forward(state, batch, caches, decode_only):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    return lambda batch, caches, decode_only: forward(state, batch, caches, decode_only)


@pytest.mark.parametrize("family", sorted(CASES))
def test_scan_matches_loop(family):
    make_cfg, cls = CASES[family]
    cfg = make_cfg()
    groups = layer_groups(cfg)
    assert groups is not None and groups.num_groups == 3, groups
    loop = cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    scan = cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    scan.stack_layers()
    run_loop, run_scan = _forward(loop), _forward(scan)
    caches = init_caches(cfg, num_blocks=12, block_size=BS, num_slots=4, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, n).tolist() for n in (37, 20)]
    rows = [SeqChunk(prompts[0], 0, [1, 2, 3], dst_slot=1, ckpts=[(32, 3)]),
            SeqChunk(prompts[1], 0, [4, 5], dst_slot=2)]  # fmt: skip
    steps = [(rows, dict(num_tokens=64, num_seqs=2), False)]
    decode = [SeqChunk([7], 37, [1, 2, 3], src_slot=1, dst_slot=1),
              SeqChunk([9], 20, [4, 5], src_slot=2, dst_slot=2)]  # fmt: skip
    steps.append((decode, dict(num_tokens=2, num_seqs=2), True))
    c_loop, c_scan = caches, stack_caches(cfg, caches)
    for step_rows, shape, decode_only in steps:
        batch, _ = make_batch(step_rows, block_size=BS, max_blocks=4, **shape)
        c_loop, want = run_loop(batch, c_loop, decode_only)
        c_scan, got = run_scan(batch, c_scan, decode_only)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        back = unstack_caches(cfg, c_scan)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(c_loop), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_scanned_step_copies_no_pool(decode_only):
    """The scan carries the stacked pools in place: the optimized HLO of a donated step holds
    no copy as large as a pool (as ``tests/serving/test_step_hlo.py`` checks the loop)."""
    cfg = qwen_cfg()
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model.stack_layers()
    # sizes no weight of the model has (the MoE weights' layout copies are not pools)
    caches = stack_caches(
        cfg, init_caches(cfg, num_blocks=13, block_size=BS, num_slots=5, dtype=jnp.float32)
    )
    graphdef, state = nnx.split(model)
    ops = get_ops("reference")

    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, batch, caches):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    n = 1 if decode_only else 64
    batch, _ = make_batch([SeqChunk([5] * (1 if decode_only else 40), 20 if decode_only else 0,
                                    [1, 2, 3], src_slot=1, dst_slot=1)],
                          block_size=BS, num_tokens=n, num_seqs=1, max_blocks=4)  # fmt: skip
    hlo = step.lower(state, batch, caches).compile().as_text()
    sizes = {math.prod(x.shape) for x in jax.tree.leaves(caches)}
    copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
    assert [c for c in copies if math.prod(int(d) for d in c.split(",") if d) in sizes] == []
