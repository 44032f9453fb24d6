"""Tensor-parallel checks that need 8 (simulated) devices, run in a fresh interpreter.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, and
pytest runs every test in one process, so ``test_tensor_parallel.py`` starts this script (once)
and asserts on the JSON it prints. Run by hand::

    python -m tests.serving.tp_worker all         # prints one JSON object
    python -m tests.serving.tp_worker distributed PROCESS_ID PORT   (one of two processes)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    count = 4 if mode == "distributed" else 8
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hyjax.batch import Batch  # noqa: E402
from hyjax.config import Qwen3NextConfig  # noqa: E402
from hyjax.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from hyjax.sharding import ShardingPlan, make_mesh  # noqa: E402


def tp_config(vocab_size: int = 256) -> Qwen3NextConfig:
    """Tiny, with every head count divisible by 8 but 2 kv heads (so TP 4 / 8 repeat them)."""
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention"] * 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 8,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "max_position_embeddings": 512,
            "eos_token_id": vocab_size - 1,
            "torch_dtype": "float32",
        }
    )


def _batches(cfg, block_size: int = 16):
    """A prefill of two sequences (5 and 11 tokens, a checkpoint write at 4), then a decode."""
    rng = np.random.default_rng(0)
    lens = (5, 11)
    t = 16
    ids = rng.integers(0, cfg.vocab_size, size=sum(lens)).astype(np.int32)
    qsl = np.array([0, lens[0], sum(lens)], np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    blocks = np.array([[1], [2]], np.int32)
    slot_map = np.concatenate(
        [blocks[i, 0] * block_size + np.arange(n) for i, n in enumerate(lens)]
    )
    pad = t - sum(lens)

    def arrays(**kw):
        return {k: np.asarray(v) for k, v in kw.items()}

    prefill = arrays(
        input_ids=np.pad(ids, (0, pad)),
        positions=np.pad(pos, (0, pad)),
        slot_mapping=np.pad(slot_map, (0, pad)).astype(np.int32),
        query_start_loc=qsl,
        seq_lens=np.array(lens, np.int32),
        num_seqs=np.int32(2),
        block_tables=blocks,
        src_slot=np.array([0, 0], np.int32),
        dst_slot=np.array([1, 2], np.int32),
        ckpt_offsets=np.array([[0], [4]], np.int32),
        ckpt_slots=np.array([[0], [3]], np.int32),
        logits_indices=qsl[1:] - 1,
    )
    nxt = rng.integers(0, cfg.vocab_size, size=2).astype(np.int32)
    decode = arrays(
        input_ids=nxt,
        positions=np.array(lens, np.int32),
        slot_mapping=(blocks[:, 0] * block_size + np.array(lens)).astype(np.int32),
        query_start_loc=np.array([0, 1, 2], np.int32),
        seq_lens=np.array(lens, np.int32) + 1,
        num_seqs=np.int32(2),
        block_tables=blocks,
        src_slot=np.array([1, 2], np.int32),
        dst_slot=np.array([1, 2], np.int32),
        ckpt_offsets=np.zeros((2, 1), np.int32),
        ckpt_slots=np.zeros((2, 1), np.int32),
        logits_indices=np.array([0, 1], np.int32),
    )
    return prefill, decode


def forward_logits(model, cfg, tp: int, *, expert_parallel: bool = False, backend="reference"):
    """Prefill logits, decode logits and the checkpoint state (slot 3) on ``tp`` devices."""
    from serving.config import SchedulerConfig
    from serving.runner import ModelRunner

    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    plan = ShardingPlan(make_mesh(tp), cfg, expert_parallel) if tp > 1 else None
    runner = ModelRunner(
        model, cfg, sched, kernel_backend=backend, cache_bytes=None, num_checkpoint_slots=2,
        sharding=plan,
    )  # fmt: skip

    @jax.jit
    def fwd(state, caches, arrays, decode_only):
        m = nnx.merge(runner.graphdef, state)
        return m(Batch.from_arrays(arrays), caches, runner.ops, decode_only=decode_only)

    fwd = jax.jit(fwd.__wrapped__, static_argnums=3)
    caches = runner.caches
    out = []
    for arrays, decode_only in zip(_batches(cfg), (False, True)):
        caches, logits = fwd(runner.state, caches, arrays, decode_only)
        out.append(np.asarray(logits))
    ssm = np.asarray(caches.ssm[0][3])  # the checkpoint after 4 tokens of sequence 2
    shards = {str(s.data.shape) for s in caches.ssm[0].addressable_shards}
    return out, ssm, shards


def check_logits() -> dict:
    cfg = tp_config()
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ref, ref_ssm, _ = forward_logits(nnx.merge(graphdef, state), cfg, 1)
    result = {}
    cases = [(2, False), (4, False), (8, False), (2, True), (8, True)]
    for tp, ep in cases:
        m = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # fresh modules
        (pre, dec), ssm, shards = forward_logits(m, cfg, tp, expert_parallel=ep)
        result[f"tp={tp}{' ep' if ep else ''}"] = {
            "prefill": float(np.max(np.abs(pre - ref[0]))),
            "decode": float(np.max(np.abs(dec - ref[1]))),
            "checkpoint": float(np.max(np.abs(ssm - ref_ssm))),
            "ssm_shard_shapes": sorted(shards),
            "logit_scale": float(np.max(np.abs(ref[0]))),
        }
    return result


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    if mode == "logits":
        print(json.dumps({"logits": check_logits()}))
    elif mode == "all":
        out = {"logits": check_logits()}
        with tempfile.TemporaryDirectory() as d:
            del d
        print(json.dumps(out))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
