"""Tensor-parallel checks that need 8 (simulated) devices, run in a fresh interpreter.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, and
pytest runs every test in one process, so ``test_tensor_parallel.py`` starts this script (once)
and asserts on the JSON it prints. Run by hand::

    python -m tests.serving.tp_worker all         # prints one JSON object
    python -m tests.serving.tp_worker kimi        # Kimi-Linear (run beside ``all``)
    python -m tests.serving.tp_worker scan        # --scan-layers under TP (Qwen3-Next)
    python -m tests.serving.tp_worker collectives # the compiled TP 4 step's collectives
    python -m tests.serving.tp_worker distributed PROCESS_ID PORT   (one of two processes)

Every float comparison is reported as the largest absolute difference and the largest absolute
value of the reference it is taken against (``*_scale``): the test bounds their ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    count = 4 if mode in ("distributed", "collectives") else 8
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hyjax.batch import Batch  # noqa: E402
from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from hyjax.sharding import ShardingPlan, make_mesh, replicate_tree  # noqa: E402
from hyjax.testing import _numpy_init  # noqa: E402


def tp_config(vocab_size: int = 256, layer_types=None, **overrides) -> Qwen3NextConfig:
    """Tiny, with every head count divisible by 8 but 2 kv heads (so TP 4 / 8 repeat them)."""
    layer_types = layer_types or ["linear_attention", "full_attention"]
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "num_hidden_layers": len(layer_types),
            "layer_types": layer_types,
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
            **overrides,
        }
    )


def random_model(cfg, seed: int, *, long_memory: bool = False) -> Qwen3NextForCausalLM:
    """Filled from numpy: compiling the random initialisers would cost seconds per process.

    ``long_memory``: GDN gates that keep the state for hundreds of tokens, so a prefix hit
    resumed from a wrong state changes the greedy tokens (``hyjax.testing._numpy_init``).
    """
    return _numpy_init(Qwen3NextForCausalLM, cfg, seed, long_memory=long_memory)


def compare(got, ref) -> tuple[float, float]:
    """``(max |got - ref|, max |ref|)``: the test bounds the ratio (a relative error)."""
    got, ref = np.asarray(got), np.asarray(ref)
    return float(np.max(np.abs(got - ref))), float(np.max(np.abs(ref)))


def logits_report(pre, dec, ssm, ref, ref_ssm) -> dict:
    """Prefill and decode logits and the mid-prefill checkpoint against the one-device ones."""
    out = {}
    for name, got, want in (("prefill", pre, ref[0]), ("decode", dec, ref[1]),
                            ("checkpoint", ssm, ref_ssm)):  # fmt: skip
        out[name], out[f"{name}_scale"] = compare(got, want)
    return out


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
    """Prefill logits, decode logits, the checkpoint state (slot 3) and the caches."""
    from serving.core.config import SchedulerConfig
    from serving.worker.pool_sizing import size_pools
    from serving.worker.runner import ModelRunner

    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    plan = ShardingPlan(make_mesh(tp), cfg, expert_parallel) if tp > 1 else None
    memory = size_pools(cfg, sched, model.dtype, num_checkpoint_slots=2, sharding=plan)
    runner = ModelRunner(
        model, cfg, sched, memory=memory, kernel_backend=backend, sharding=plan
    )  # fmt: skip

    def fwd(state, caches, arrays, decode_only):
        m = nnx.merge(runner.graphdef, state)
        caches, logits = m(Batch.from_arrays(arrays), caches, runner.ops, decode_only=decode_only)
        if plan is not None:  # gathered, so every process can read it
            logits = jax.lax.with_sharding_constraint(logits, plan.replicated())
        return caches, logits

    fwd = jax.jit(fwd, static_argnums=3, donate_argnums=1)
    caches = runner.caches
    out = []
    for arrays, decode_only in zip(_batches(cfg), (False, True)):
        if plan is not None:
            arrays = replicate_tree(arrays, plan.mesh)
        caches, logits = fwd(runner.state, caches, arrays, decode_only)
        if not logits.is_fully_addressable:  # TP across processes: gather the vocab shards
            from jax.experimental import multihost_utils

            logits = multihost_utils.process_allgather(logits, tiled=True)
        out.append(np.asarray(logits))
    ssm = caches.ssm[0]
    if ssm.is_fully_addressable:
        ssm = np.asarray(ssm[3])  # the checkpoint after 4 tokens of sequence 2
    else:
        ssm = None
    return out, ssm, caches


def shard_shapes(x: jax.Array) -> list[str]:
    """The distinct shapes of ``x``'s shards on this process's devices."""
    return sorted({str(s.data.shape) for s in x.addressable_shards})


def check_logits() -> dict:
    """TP 2 and 4 (expert parallel) with the reference ops, and TP 2 with the Pallas kernels
    (run by the TPU interpreter on CPU), against one device with the reference ops. TP 8 is
    checked across two processes (``check_distributed``) against these one-device logits."""
    cfg = tp_config()
    model = random_model(cfg, 0, long_memory=True)
    graphdef, state = nnx.split(model)
    ref, ref_ssm, _ = forward_logits(nnx.merge(graphdef, state), cfg, 1)
    result = {"tp=1": {"prefill": ref[0].tolist(), "decode": ref[1].tolist()}}
    # EP on 4: 2 experts per device.
    cases = [(2, False, "reference"), (4, True, "reference"), (2, False, "interpret")]
    for tp, ep, backend in cases:
        m = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # fresh modules
        (pre, dec), ssm, caches = forward_logits(m, cfg, tp, expert_parallel=ep, backend=backend)
        name = f"tp={tp}{' ep' if ep else ''}{' interpret' if backend == 'interpret' else ''}"
        result[name] = {
            **logits_report(pre, dec, ssm, ref, ref_ssm),
            "ssm_shard_shapes": shard_shapes(caches.ssm[0]),
        }
    return result


def kimi_tp_config():
    """Tiny Kimi-Linear (KDA + dense MLP, MLA + MoE) with 8 KDA and 8 MLA heads, q_lora."""
    from hyjax.models.kimi_linear import KimiLinearConfig
    from hyjax.testing import tiny_kimi_linear_config

    attn = {"full_attn_layers": [2], "kda_layers": [1], "num_heads": 8, "head_dim": 8,
            "short_conv_kernel_size": 4}  # fmt: skip
    return KimiLinearConfig.from_hf(
        tiny_kimi_linear_config(
            num_hidden_layers=2, linear_attn_config=attn, num_attention_heads=8,
            num_key_value_heads=8, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, moe_intermediate_size=16,
        )
    )  # fmt: skip


def check_kimi() -> dict:
    """Kimi-Linear on 2, 4 (expert parallel) and 8 devices against one: KDA and MLA by head."""
    from hyjax.models.kimi_linear import KimiLinearForCausalLM

    cfg = kimi_tp_config()
    graphdef, state = nnx.split(_numpy_init(KimiLinearForCausalLM, cfg, 0, long_memory=True))
    ref, ref_ssm, _ = forward_logits(nnx.merge(graphdef, state), cfg, 1)
    out = {}
    for tp, ep in [(2, False), (4, True), (8, False)]:
        fresh = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        (pre, dec), ssm, caches = forward_logits(fresh, cfg, tp, expert_parallel=ep)
        kda, mla = fresh.layers[0].self_attn, fresh.layers[1].self_attn
        out[f"kimi tp={tp}{' ep' if ep else ''}"] = {
            **logits_report(pre, dec, ssm, ref, ref_ssm),
            "ssm_shards": shard_shapes(caches.ssm[0]),
            "conv_shards": shard_shapes(caches.conv[0]),
            "latent_shards": shard_shapes(caches.kv[0][0]),
            "latent_shape": str(caches.kv[0][0].shape),
            "kda_q_proj_shards": shard_shapes(kda.q_proj.weight[...]),
            "kda_o_proj_shards": shard_shapes(kda.o_proj.weight[...]),
            "mla_q_b_proj_shards": shard_shapes(mla.q_b_proj.weight[...]),
            "mla_kv_b_proj_shards": shard_shapes(mla.kv_b_proj.weight[...]),
            "mla_kv_a_shards": shard_shapes(mla.kv_a_proj_with_mqa.weight[...]),
            "experts_up_shards": shard_shapes(fresh.layers[1].mlp.experts_up[...]),
            "pool_bytes": ShardingPlan(make_mesh(tp), cfg, ep).pool_bytes(16, np.float32),
        }
    out["kimi tp=1 pool_bytes"] = ShardingPlan(make_mesh(1), cfg).pool_bytes(16, np.float32)
    # The KDA and MLA Pallas kernels (TPU interpreter) under shard_map on two devices.
    fresh = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    (pre, dec), ssm, _ = forward_logits(fresh, cfg, 2, backend="interpret")
    out["kimi tp=2 interpret"] = logits_report(pre, dec, ssm, ref, ref_ssm)
    return out


def _run_waves(engine, waves) -> dict:
    """Runs each wave to completion before adding the next (so its checkpoints are cached);
    a wave may be a function of the outputs so far (a follow-up turn)."""
    from serving.core.request import EngineRequest

    outputs = {}
    for wave in waves:
        if callable(wave):
            wave = wave(outputs)
        names = {engine.add_request(EngineRequest(p, params)): name for name, p, params in wave}
        for rid, out in engine.run_to_completion().items():
            outputs[names[rid]] = out
    return outputs


def _workload() -> list:
    """Three waves over a 216-token shared prefix (checkpoint granularity 64); the test names
    the hits it expects.

    ::

        wave 1   a  = S[:216] + 3          ckpts 128 (junction with n) and 192 (prompt end)
                 n  = S[:140] + 3          waits for 128, hits it
                 m  = 100 own tokens       40 greedy tokens: decode ckpt at 128
        wave 2   a_again, hit1 .. hit40    hit 192 (hit1 .. hit40: S[:192] + 1, 2, 7, 40)
                 c (top-p), d, short       sampled / unfiltered / cold
        wave 3   m_turn2 = m + answer + 5  hits the decode ckpt at 128
    """
    from serving.core.request import SamplingParams

    rng = np.random.default_rng(3)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    answer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    # No filter: drawn on the vocab-split logits, without the gather the sort needs.
    unfiltered = SamplingParams(max_tokens=8, temperature=0.8, seed=11)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, 250, size=n).tolist()  # below every eos / special id

    shared, m = tokens(216), tokens(100)
    waves = [
        [("a", shared + [1, 2, 3], greedy), ("n", shared[:140] + [9, 9, 9], greedy),
         ("m", m, answer)],
        [("a_again", shared + [1, 2, 3], greedy)]
        + [(f"hit{k}", shared[:192] + tokens(k), greedy) for k in (1, 2, 7, 40)]
        + [("c", shared + [4], sampled), ("d", [7, 7, 1, 9], unfiltered),
           ("short", [5, 6, 7], greedy)],
    ]  # fmt: skip
    turn = tokens(5)

    def follow_up(outputs):
        return [("m_turn2", m + outputs["m"].output_token_ids + turn, greedy)]

    return [*waves, follow_up]


@contextlib.contextmanager
def hits_resume_from_zero():
    """The control: every prefix hit reads the zero state (slot 0) instead of its checkpoint,
    the KV prefix still reused. What a lost or misaddressed checkpoint would do."""
    from serving.core.scheduler import Scheduler

    add_row = Scheduler._add_row

    def zero_src(self, b, req, start, n, src, **kw):
        if src != self.cache.alloc(req.request_id).running_slot:  # a hit's first row
            src = 0
        add_row(self, b, req, start, n, src, **kw)

    Scheduler._add_row = zero_src
    try:
        yield
    finally:
        Scheduler._add_row = add_row


def check_engine(model_dir: str) -> dict:
    """Greedy tokens and hits of the engine under TP = 2 with caching on, against TP = 1 and
    caching off; and a TP = 1 control whose hits resume from the zero state."""
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    base = dict(
        model=model_dir, max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64,
        max_model_len=256, num_checkpoint_slots=12, progress=False, warmup=False,
    )  # fmt: skip
    # The second engine of a kind reuses the first one's compiled buckets. TP = 1 runs one
    # sequence a step: half the buckets to compile (decode and prefill of one row), and its
    # tokens must not depend on which requests share a step either. Its pools are sized in
    # bytes (the CPU default follows max_num_seqs: 21 KV blocks would evict the prefixes).
    tp1 = dict(max_num_seqs=1, cache_bytes=1 << 20)
    runs = {
        "tp2_on": dict(tensor_parallel_size=2),
        "tp2_off": dict(tensor_parallel_size=2, enable_prefix_caching=False),
        "tp1_on": tp1,
        "tp1_zero_resume": tp1,
    }
    out = {}
    logs, logger = _LogLines(), logging.getLogger("serving.worker.runner")
    level = logger.level
    logger.addHandler(logs)
    logger.setLevel(logging.INFO)
    for name, kw in runs.items():
        control = hits_resume_from_zero() if name == "tp1_zero_resume" else contextlib.nullcontext()
        with control:
            engine = LLMEngine(EngineArgs(**{**base, **kw}))
            res = _run_waves(engine, _workload())
        out[name] = {k: v.output_token_ids for k, v in res.items()}
        out[name + "_cached"] = {k: v.num_cached_tokens for k, v in res.items()}
        if name != "tp2_on":
            continue
        out[name + "_compiles"] = engine.runner.compile_count()
        out[name + "_kv_shards"] = shard_shapes(engine.runner.caches.kv[0][0])
        out[name + "_conv_shards"] = shard_shapes(engine.runner.caches.conv[0])
        found = compiled_step_findings(engine.runner)
        out[name + "_pool_copies"] = found["pool_copies"]
        out[name + "_vocab_collectives"] = found["vocab_collectives"]
        out[name + "_logits_gathers"] = found["logits_gathers"]
    logger.removeHandler(logs)
    logger.setLevel(level)
    out["pool_log"] = [line for line in logs.lines if line.startswith("pools per device")]
    return out


LIN, FULL = "linear_attention", "full_attention"


def scan_tp_config() -> Qwen3NextConfig:
    """``tp_config`` 8 layers deep: a dense GDN layer 0 (a prefix), 3 groups of [GDN,
    attention], a GDN tail layer."""
    types = [LIN] + [LIN, FULL] * 3 + [LIN]
    return tp_config(layer_types=types, mlp_only_layers=[0], intermediate_size=32)


def scan_kimi_config():
    """``kimi_tp_config`` 7 layers deep: a dense KDA layer 0, then 3 groups of [KDA, MLA]."""
    from hyjax.models.kimi_linear import KimiLinearConfig
    from hyjax.testing import tiny_kimi_linear_config

    attn = {"full_attn_layers": [3, 5, 7], "kda_layers": [1, 2, 4, 6], "num_heads": 8,
            "head_dim": 8, "short_conv_kernel_size": 4}  # fmt: skip
    return KimiLinearConfig.from_hf(
        tiny_kimi_linear_config(
            num_hidden_layers=7, linear_attn_config=attn, num_attention_heads=8,
            num_key_value_heads=8, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, moe_intermediate_size=16, intermediate_size=32, vocab_size=256,
            eos_token_id=255, torch_dtype="float32",
        )
    )  # fmt: skip


def _scan_workload() -> list:
    """A prompt that writes a state checkpoint at 128, one that hits it, and a cold one."""
    from serving.core.request import SamplingParams

    rng = np.random.default_rng(5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shared = rng.integers(0, 250, size=130).tolist()
    return [
        [("a", shared + [1, 2, 3], greedy), ("short", [5, 6, 7], greedy)],
        [("hit", shared[:128] + [9, 8], greedy)],
    ]


def check_scan(families: str = "qwen3_next") -> dict:
    """``--scan-layers`` under TP: greedy tokens of the scanned TP = 2 and TP = 4 (expert
    parallel) engines against the per-layer loop on one device (the TP loop's own tests hold
    it to that too), Qwen3-Next by default (``families``: "qwen3_next,kimi_linear" adds
    Kimi-Linear; in CI one family, its scan on one device is tests/hyjax/test_layer_scan.py);
    and the scanned TP step's compiled HLO (no KV pool copied: the stacked pools donated)."""
    from hyjax.models.hybrid import layer_groups
    from hyjax.models.kimi_linear import KimiLinearForCausalLM
    from hyjax.saver import save_hf_checkpoint
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    out = {}
    families = {
        name: make()
        for name, make in {
            "qwen3_next": lambda: (scan_tp_config(), Qwen3NextForCausalLM),
            "kimi_linear": lambda: (scan_kimi_config(), KimiLinearForCausalLM),
        }.items()
        if name in families.split(",")
    }
    runs = {
        "tp1_loop": dict(max_num_seqs=1, cache_bytes=1 << 20),
        "tp2_scan": dict(tensor_parallel_size=2, scan_layers=True),
        "tp4_ep_scan": dict(tensor_parallel_size=4, enable_expert_parallel=True,
                            scan_layers=True),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for family, (cfg, cls) in families.items():
            groups = layer_groups(cfg)
            model_dir = os.path.join(tmp, family)
            save_hf_checkpoint(_numpy_init(cls, cfg, 2, long_memory=True), cfg, model_dir)
            base = dict(
                model=model_dir, max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64,
                max_model_len=256, num_checkpoint_slots=8, progress=False, warmup=False,
                scan_layers=False,
            )  # fmt: skip
            report = {"groups": [groups.prefix, groups.period, groups.num_groups]}
            for name, kw in runs.items():
                start = time.perf_counter()
                engine = LLMEngine(EngineArgs(**{**base, **kw}))
                res = _run_waves(engine, _scan_workload())
                report[name] = {k: v.output_token_ids for k, v in res.items()}
                report[name + "_cached"] = {k: v.num_cached_tokens for k, v in res.items()}
                report[name + "_s"] = round(time.perf_counter() - start, 1)
                runner = engine.runner
                report[name + "_scanned"] = runner.scan_layers
                if name == "tp2_scan":
                    report[name + "_pool_copies"] = compiled_step_findings(runner)["pool_copies"]
                    report[name + "_ssm_shards"] = shard_shapes(runner.caches.ssm[-1])
                    report[name + "_kv_shards"] = shard_shapes(runner.caches.kv[-1][0])
                    layers = runner.state["group_layers"][0]
                    report[name + "_group_specs"] = sorted(
                        {str(v.get_value().sharding.spec) for _, v in nnx.to_flat_state(layers)}
                    )
                del engine, runner
            out[family] = report
    return out


def compiled_step_findings(runner) -> dict[str, list[str]]:
    """What the compiled TP step (a decode and a prefill bucket) must not do, and must do.

    ``pool_copies``: copies of a whole per-device KV pool. The pools are donated and updated in
    place; a copy of one is a pass over gigabytes on every step (a reshape-scatter-reshape under
    ``shard_map`` with one KV head per device did it).
    ``vocab_collectives``: collectives that move vocab-wide rows between devices other than
    the gathers the sampler asks for: an all-to-all anywhere, or a collective whose result has
    a vocab-shard dim. Left split by vocab, a partitioned sort and cumsum did that (two
    all-to-alls and a while loop of vocab / 2 trips, ~1.5 s a step on two H100s); argmax, max
    and the Gumbel draw are partitioned with a few scalars per row crossing devices.
    ``logits_gathers``: all-gathers of whole-vocab rows (the sort's and the log-probs', inside
    the branches that need them).
    """
    import re

    from serving.core.plan import StepPlan
    from serving.worker.runner import _step

    # The KV pools (the state pools' gather + in-place update still gets copied by XLA's CPU
    # backend, TP or not: a separate, open problem noted in BENCHMARKS.md).
    pools = {tuple(x.addressable_data(0).shape) for x in jax.tree.leaves(runner.caches.kv)}
    vocab = runner.cfg.vocab_size
    shard = vocab // runner.sharding.mesh.size
    shapes = runner.sched_cfg.step_shapes()
    picked = [next(s for s in shapes if s.decode_only == d) for d in (True, False)]
    collective = re.compile(r"(all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter)")
    found = {"pool_copies": [], "vocab_collectives": [], "logits_gathers": []}
    for shape in picked:
        compiled = _step.lower(*runner.step_args(StepPlan.empty(shape))).compile()
        for line in compiled.as_text().splitlines():
            m = re.search(r"= \w+\[([\d,]+)\]\S* copy\(", line)
            if m and tuple(int(d) for d in m.group(1).split(",")) in pools:
                found["pool_copies"].append(line.strip()[:160])
            if "=" not in line or not collective.search(line.split("=", 2)[1]):
                continue
            result = re.search(r"= \(?\w+\[([\d,]*)\]", line)
            dims = {int(d) for d in result.group(1).split(",") if d} if result else set()
            if "all-gather" in line and vocab in dims:
                found["logits_gathers"].append(line.strip()[:160])
            elif "all-to-all" in line or shard in dims or vocab in dims:
                found["vocab_collectives"].append(line.strip()[:160])
    return found


def step_collectives(hlo: str) -> list[dict]:
    """Every collective of an optimized HLO module: ``op``, its operands' shapes (``[[T, D],
    ...]``: XLA combines independent ones into one op) and ``where``: ``entry`` (runs every
    step) or ``branch`` (in a ``conditional``'s branch, runs in the steps that take it)."""
    import re

    collective = re.compile(
        r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
    )
    branches = set()
    for m in re.finditer(r"branch_computations=\{([^}]*)\}", hlo):
        branches.update(name.strip() for name in m.group(1).split(","))
    found, where = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            where = "entry" if line.startswith("ENTRY") else name
        m = collective.search(line)
        if m is None:
            continue
        shapes = [[int(d) for d in dims.split(",") if d]
                  for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]  # fmt: skip
        if where != "entry":
            where = "branch" if where in branches else where
        found.append({"op": m.group(2), "shapes": shapes, "where": where})
    return found


def check_collectives() -> dict:
    """The compiled TP = 4 step of ``tp_config``'s two layers (GDN + MoE, attention + MoE):
    every collective of a decode and of a prefill bucket, with the logits gathered whole before
    sampling (as up to ``WHOLE_LOGITS_BYTES``) and left split (``_split``: past it), the shapes
    of the parameters (none may be gathered), and whether the token tables leave the step as
    they came in."""
    from serving.core.config import SchedulerConfig
    from serving.core.plan import StepPlan
    from serving.worker import runner as runner_module
    from serving.worker.pool_sizing import size_pools
    from serving.worker.runner import ModelRunner, _step

    cfg = tp_config()
    model = random_model(cfg, 0)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    plan = ShardingPlan(make_mesh(4), cfg)
    memory = size_pools(cfg, sched, model.dtype, num_checkpoint_slots=2, sharding=plan)
    runner = ModelRunner(model, cfg, sched, memory=memory, kernel_backend="reference",
                         sharding=plan)  # fmt: skip
    out = {
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "layers": cfg.num_hidden_layers,
        "params": sorted({tuple(x.shape) for x in jax.tree.leaves(runner.state)}),
    }
    shapes = sched.step_shapes()
    picked = [next(s for s in shapes if s.decode_only == d) for d in (True, False)]
    whole = runner_module.WHOLE_LOGITS_BYTES
    # "_split": the logits past the bound gathered whole before sampling (many rows)
    for shape, suffix in [(s, "") for s in picked] + [(s, "_split") for s in picked]:
        name = ("decode" if shape.decode_only else "prefill") + suffix
        runner_module.WHOLE_LOGITS_BYTES = 0 if suffix else whole
        jax.clear_caches()  # the bound is read when the step is traced
        args = runner.step_args(StepPlan.empty(shape))
        compiled = _step.lower(*args).compile()
        out[name] = {"rows": shape.num_seqs, "tokens": shape.num_tokens,
                     "collectives": step_collectives(compiled.as_text())}  # fmt: skip
        tables_out = jax.tree.leaves(compiled.output_shardings[1])
        tables_in = jax.tree.leaves(runner.tables)
        out[name]["tables_keep_sharding"] = all(
            o.is_equivalent_to(i.sharding, i.ndim)
            for o, i in zip(tables_out, tables_in, strict=True)
        )
    runner_module.WHOLE_LOGITS_BYTES = whole
    # The decode step with its branches selected (EngineArgs.branch_free_step), where XLA:GPU
    # may keep every collective inside one CUDA graph: no conditional at all.
    runner.branch_free, runner._static = True, {}
    hlo = _step.lower(*runner.step_args(StepPlan.empty(picked[0]))).compile().as_text()
    out["decode_branch_free"] = {
        "rows": picked[0].num_seqs, "tokens": picked[0].num_tokens,
        "collectives": step_collectives(hlo), "conditionals": hlo.count(" conditional("),
    }  # fmt: skip
    return out


class _LogLines(logging.Handler):
    """Keeps the messages logged while attached (the runner's pool lines)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def check_loading(model_dir: str, tmp: str) -> dict:
    """Loading straight into shards, and the orbax convert / sharded restore round trip."""
    from hyjax.loader import load_model, save_converted
    from hyjax.sharding import checkpoint_layout_state

    def flat(model):  # twice: the model is left as it was
        checkpoint_layout_state(model)
        state = checkpoint_layout_state(model)
        return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}

    ref_model, cfg = load_model(model_dir)
    ref = flat(ref_model)
    sharded, _ = load_model(model_dir, mesh=make_mesh(4))
    qkvz = sharded.layers[0].linear_attn.in_proj_qkvz.weight[...]
    experts = sharded.layers[0].mlp.experts_down[...]
    got = flat(sharded)
    diffs = {str(k): float(np.max(np.abs(got[k] - ref[k]))) for k in ref}
    out = {
        "qkvz_shards": sorted({str(s.data.shape) for s in qkvz.addressable_shards}),
        "experts_down_spec": str(experts.sharding.spec),
        "load_max_diff": max(diffs.values()),
        "load_worst": max(diffs, key=diffs.get),
    }
    converted = save_converted(ref_model, cfg, model_dir, os.path.join(tmp, "converted"))
    restored, _ = load_model(converted, mesh=make_mesh(2, jax.devices()[2:]), expert_parallel=True)
    experts = restored.layers[0].mlp.experts_down[...]
    out["restored_experts_spec"] = str(experts.sharding.spec)
    out["restored_devices"] = sorted(d.id for d in experts.sharding.device_set)
    got = flat(restored)
    diffs = {str(k): float(np.max(np.abs(got[k] - ref[k]))) for k in ref}
    out["restore_max_diff"] = max(diffs.values())
    out["restore_worst"] = max(diffs, key=diffs.get)
    return out


def check_errors() -> dict:
    out = {}
    cfg, kimi = tp_config(), kimi_tp_config()
    for name, make in {
        "tp3": lambda: ShardingPlan(make_mesh(3), cfg),
        "tp16": lambda: make_mesh(16),
        "ep16_experts": lambda: ShardingPlan(
            make_mesh(8), dataclasses.replace(cfg, num_experts=4), True
        ),
        "kimi_tp3": lambda: ShardingPlan(make_mesh(3), kimi),
        "kimi_mla_heads": lambda: ShardingPlan(
            make_mesh(8), dataclasses.replace(kimi, num_attention_heads=4)
        ),
        "kimi_expert_dim": lambda: ShardingPlan(
            make_mesh(8), dataclasses.replace(kimi, moe_intermediate_size=12)
        ),
        "kimi_ep_experts": lambda: ShardingPlan(
            make_mesh(8), dataclasses.replace(kimi, num_experts=4, num_expert_group=1), True
        ),
    }.items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def check_distributed(process_id: int, port: int) -> dict:
    """One of two processes with 4 CPU devices each: TP = 8 spans both processes."""
    from hyjax.sharding import initialize_distributed

    initialize_distributed(f"localhost:{port}", 2, process_id)
    cfg = tp_config()
    model = random_model(cfg, 0, long_memory=True)
    (pre, dec), _, caches = forward_logits(model, cfg, 8)
    return {  # the test compares the logits with the one-device ones of ``check_logits``
        "process_index": jax.process_index(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "local_ssm_shards": shard_shapes(caches.ssm[0]),
        "prefill": pre.tolist(),
        "decode": dec.tolist(),
    }


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    if mode == "distributed":
        print(json.dumps(check_distributed(int(sys.argv[2]), int(sys.argv[3]))))
        jax.distributed.shutdown()
        return
    out = {}
    start = time.perf_counter()

    def lap(name):
        cpu = time.process_time()
        print(f"{name}: {time.perf_counter() - start:.1f} s ({cpu:.1f} s CPU)", file=sys.stderr)

    if mode in ("all", "logits"):
        out["logits"] = check_logits()
        lap("logits")
    if mode in ("all", "engine", "loading"):
        from hyjax.saver import save_hf_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = os.path.join(tmp, "tp_model")
            cfg = tp_config()
            save_hf_checkpoint(random_model(cfg, 1, long_memory=True), cfg, model_dir)
            if mode in ("all", "loading"):
                out["loading"] = check_loading(model_dir, tmp)
                lap("loading")
            if mode in ("all", "engine"):
                out["engine"] = check_engine(model_dir)
                lap("engine")
    if mode == "kimi":  # a process of its own, beside "all": CI has two cores
        from hyjax.testing import make_tiny_kimi_linear_model

        out["kimi_logits"] = check_kimi()
        lap("kimi logits")
        with tempfile.TemporaryDirectory() as tmp:
            kimi_dir = os.path.join(tmp, "kimi")
            make_tiny_kimi_linear_model(kimi_dir, long_memory=True)  # 2 KDA + 2 MLA heads
            out["kimi_engine"] = check_engine(kimi_dir)
            lap("kimi engine")
    if mode == "scan":  # a process of its own: scanned layers under TP (Qwen3-Next)
        out["scan"] = check_scan()
        lap("scan")
    if mode == "collectives":  # a process of its own, on 4 devices
        out["collectives"] = check_collectives()
    if mode in ("all", "errors"):
        out["errors"] = check_errors()
    if not out:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
