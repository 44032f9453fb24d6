"""Correctness on a GPU, in one run: ``python -m benchmarks.gpu_check --out report.json``.

With ``--kernel-backend auto`` (the Pallas GPU kernels on NVIDIA) and ``--dtype float32``:

1. **Parity with transformers.** Tiny random Qwen3-Next and Kimi-Linear checkpoints that
   transformers saved (``hyjax.testing``) serve greedy requests through the engine; each
   generated token's logprob is compared with transformers' float64 forward over the same
   tokens, and each token with its greedy choice. The error is relative to the largest logit
   (the CPU parity tests' bar, 1e-4): IEEE float32 lands far under it, TF32 products do not.
   The Qwen3-Next model also runs with ``--allow-tf32``, reported beside it (not a check).
2. **Caching on/off token identity** on the long-memory tiny models (gates that keep the state
   for hundreds of tokens, so a wrong resumed state changes greedy tokens): shared prefixes,
   nested prefixes, a prompt of exactly two checkpoint granules and its neighbours, a
   multi-turn follow-up. Caching must hit, and every request's tokens must equal the
   caching-off engine's.
3. **Odd head dims.** Qwen3-Next with head dims 24 / 40 (the GDN and attention kernels cannot
   take them: their ops fall back to the reference, one warning each), Qwen3-Next with
   Dv = 24 (the GDN kernels tile it by 8), Kimi-Linear with KDA head dim 24 and a 24-wide
   latent: each must serve without error and match transformers as in 1.

Prints a JSON report (also written to ``--out``) and exits 1 if any check fails. Each check
compiles its own engine's steps (most of its time on a GPU): ``--jobs 8`` runs them in worker
processes at once, to fit one device call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

RTOL = 1e-4  # |logprob error| / max |logit|, as tests/hyjax/parity_helpers.py
TIE = 1e-4  # a greedy token may differ from transformers' where its top-2 margin is below this
# A bf16 engine's bars (its weights rounded to 8 bits: logprob errors of ~1e-2 of the largest
# logit on the tiny models); a wrong kernel is off by O(1)
BF16_RTOL, BF16_TIE = 5e-2, 5e-2
ENGINE = dict(
    dtype="float32",
    max_num_seqs=4,
    max_num_batched_tokens=128,
    max_model_len=512,
    min_token_bucket=64,
    warmup=False,  # compile only the step shapes the checks use
    num_checkpoint_slots=24,
    cache_bytes=256 * 2**20,
    progress=False,
    compilation_cache_dir=None,
)


class _Warnings(logging.Handler):
    """Collects hyjax.ops' warnings (the ops that fell back to the reference)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _engine(model_dir, backend: str, **kw):
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    handler = _Warnings()
    logger = logging.getLogger("hyjax.ops")
    logger.addHandler(handler)
    try:
        start = time.perf_counter()
        engine = LLMEngine(
            EngineArgs(model=str(model_dir), kernel_backend=backend, **{**ENGINE, **kw})
        )
        return engine, handler.messages, time.perf_counter() - start
    finally:
        logger.removeHandler(handler)


def _generate(engine, prompts, max_tokens: int):
    """Greedy outputs of ``prompts`` (one wave): token ids and each token's logprob."""
    from serving.core.request import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
    logprobs = {rid: [] for rid in ids}
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += [t.logprob for t in out.delta_logprobs or []]
            if out.finished:
                tokens[out.request_id] = out.output_token_ids
    return [(tokens[r], logprobs[r]) for r in ids]


def parity(
    model_dir, prompts, *, backend: str, max_tokens: int = 12, rtol: float = RTOL,
    tie: float = TIE, **kw,
) -> dict:  # fmt: skip
    """Greedy generations vs transformers' float64 forward over prompt + generated tokens:
    each token's logprob within ``rtol`` of the largest logit, each token the greedy choice
    where its top-2 margin is ``tie`` or more."""
    from hyjax.testing import hf_logits

    engine, fallbacks, startup = _engine(model_dir, backend, **kw)
    outs = _generate(engine, prompts, max_tokens)
    worst, mismatches, ties = 0.0, 0, 0
    for prompt, (tokens, lps) in zip(prompts, outs, strict=True):
        assert len(lps) == len(tokens) == max_tokens, (len(lps), len(tokens))
        ref = hf_logits(model_dir, list(prompt) + tokens[:-1]).astype(np.float64)
        ref = ref[len(prompt) - 1 :]  # the logits that chose each generated token
        top = ref.max(-1, keepdims=True)
        ref_lp = ref - top - np.log(np.exp(ref - top).sum(-1, keepdims=True))
        got = np.asarray(lps)
        want = ref_lp[np.arange(len(tokens)), tokens]
        worst = max(worst, float(np.abs(got - want).max() / np.abs(ref).max()))
        for row, tok in zip(ref, tokens, strict=True):
            top2 = np.sort(row)[-2:]
            if tok != int(row.argmax()):
                if top2[1] - top2[0] < tie:
                    ties += 1
                else:
                    mismatches += 1
    return {
        "ok": worst < rtol and mismatches == 0,
        "logprob_rel_err": worst,
        "greedy_mismatches": mismatches,
        "greedy_ties": ties,
        "tokens": sum(len(t) for t, _ in outs),
        "fallbacks": fallbacks,
        "startup_s": round(startup, 1),
    }


def _caching_waves(seed: int = 0):
    rng = np.random.default_rng(seed)

    def rand(n):
        return rng.integers(0, 256, size=n).tolist()

    shared, long, turn1 = rand(150), rand(260), rand(100)
    wave1 = [shared + rand(9), long[:200], long[:128], turn1, rand(1), rand(63)]
    wave2 = [
        shared + rand(20), shared + rand(3), long, long[:70], long[:128], long[:129],
        long[:127],
    ]  # fmt: skip
    return wave1, wave2, turn1, rand(11)


def caching_identity(model_dir, *, backend: str, max_tokens: int = 24) -> dict:
    """Caching on vs off: every request's greedy tokens identical, and the hits happen."""
    from serving.core.request import EngineRequest, SamplingParams

    wave1, wave2, turn1, follow = _caching_waves()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results, cached = {}, 0
    for caching in (True, False):
        engine, _, _ = _engine(model_dir, backend, enable_prefix_caching=caching)
        outs = []
        for wave in (wave1, wave2):
            if wave is wave2:  # multi-turn: the first turn's answer and a new message
                wave = wave + [turn1 + outs[3].output_token_ids + follow]
            ids = [engine.add_request(EngineRequest(p, params)) for p in wave]
            done = engine.run_to_completion()
            outs += [done[r] for r in ids]
        results[caching] = [o.output_token_ids for o in outs]
        if caching:
            cached = sum(o.num_cached_tokens for o in outs)
    differ = [i for i, (a, b) in enumerate(zip(results[True], results[False])) if a != b]
    return {
        "ok": not differ and cached > 0,
        "requests": len(results[True]),
        "differing_requests": differ,
        "cached_prompt_tokens": cached,
    }


# The Qwen3-Next kernel ops by group, for --diagnose-tf32.
KERNEL_GROUPS = {
    "gdn": ("gdn_prefill", "gdn_decode", "conv_gdn_decode"),
    "attention": ("paged_attention", "paged_attention_decode"),
    "moe": ("moe_experts",),
}


def _only_kernels(fields, fn):
    """``fn()`` with the backends' kernels limited to ``fields`` (the other ops are the
    reference ones)."""
    import hyjax.ops

    full = hyjax.ops.backend_ops
    others = {f for g in KERNEL_GROUPS.values() for f in g} - set(fields)

    @functools.cache
    def limited(backend, platform):
        ops = full(backend, platform)
        return dataclasses.replace(ops, **{f: getattr(hyjax.ops.REFERENCE, f) for f in others})

    hyjax.ops.backend_ops = limited
    try:
        return fn()
    finally:
        hyjax.ops.backend_ops = full


def _run_in_workers(names: list[str], args, report: dict) -> None:
    """Each check of ``names`` in its own ``gpu_check --only NAME`` process, ``args.jobs`` at
    a time; their results into ``report`` (a worker that wrote none is a failed check)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    # Several JAX processes on one GPU: none may take 75 % of its memory up front.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    with tempfile.TemporaryDirectory() as tmp:

        def work(name: str) -> dict:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--only", name, "--out",
                   str(out), "--kernel-backend", args.kernel_backend]  # fmt: skip
            if args.diagnose_tf32:
                cmd.append("--diagnose-tf32")
            start = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            try:
                result = json.loads(out.read_text())["checks"][name]
            except (OSError, KeyError, ValueError):
                result = {"ok": False, "error": f"worker exited {proc.returncode}: "
                                                f"{proc.stderr[-1500:]}"}  # fmt: skip
            result.setdefault("seconds", round(time.perf_counter() - start, 1))
            return result

        with ThreadPoolExecutor(args.jobs) as pool:
            for name, result in zip(names, pool.map(work, names)):
                report["checks"][name] = result
                print(name, json.dumps(result), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, size=n).tolist() for n in (150, 70, 5)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks (by name)")
    p.add_argument(
        "--jobs", type=int, default=1,
        help="run the checks in this many worker processes at once (each compiles its own "
        "steps: most of a check's time; the workers allocate GPU memory as they need it)",
    )  # fmt: skip
    p.add_argument(
        "--diagnose-tf32",
        action="store_true",
        help="instead: the Qwen3-Next parity with TF32 allowed, one kernel group at a time",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # The oracle is transformers' own torch code in float64 on the CPU. Where FLA is installed
    # (the GPU machine's wheels for the kernel benchmarks) and CUDA is present, transformers
    # routes the delta rule through FLA's Triton kernels instead, which reject CPU tensors
    # ("Pointer argument ... cannot be accessed from Triton"): hide FLA from this process.
    if "fla" not in sys.modules:
        sys.modules["fla"] = None
    if args.jobs > 1:  # this process starts JAX too (the report's device): leave the workers room
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

    import jax

    from benchmarks.common import device_name
    from hyjax.ops import resolve_backend
    from hyjax.testing import (
        make_tiny_kimi_linear_model,
        save_tiny_kimi_linear,
        save_tiny_qwen3_next,
    )
    from hyjax.tiny import make_tiny_model

    backend = args.kernel_backend
    report = {
        "device": device_name(),
        "jax": jax.__version__,
        "kernel_backend": f"{backend} -> {resolve_backend(backend)}",
        "checks": {},
    }
    kimi_odd = dict(
        linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2,
                            "head_dim": 24, "short_conv_kernel_size": 4},
        kv_lora_rank=24,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def saved(name, save, **overrides):
            if not (tmp / name).exists():
                save(tmp / name, seed=0, **overrides)
            return tmp / name

        prompts = _prompts(128)
        checks = {
            "qwen3_next_parity": lambda: parity(
                saved("qwen", save_tiny_qwen3_next), prompts, backend=backend
            ),
            "qwen3_next_parity_tf32": lambda: parity(
                saved("qwen", save_tiny_qwen3_next), prompts, backend=backend, allow_tf32=True
            ),
            "kimi_linear_parity": lambda: parity(
                saved("kimi", save_tiny_kimi_linear), prompts, backend=backend
            ),
            "qwen3_next_caching_long_memory": lambda: caching_identity(
                make_tiny_model(tmp / "qwen_long", long_memory=True), backend=backend
            ),
            "kimi_linear_caching_long_memory": lambda: caching_identity(
                make_tiny_kimi_linear_model(tmp / "kimi_long", long_memory=True), backend=backend
            ),
            "qwen3_next_odd_head_dims_24_40": lambda: parity(
                saved(
                    "qwen_odd",
                    save_tiny_qwen3_next,
                    linear_key_head_dim=24,
                    linear_value_head_dim=40,
                    head_dim=24,
                ),
                prompts,
                backend=backend,
            ),  # fmt: skip
            "qwen3_next_value_dim_24": lambda: parity(
                saved("qwen_dv24", save_tiny_qwen3_next, linear_value_head_dim=24),
                prompts,
                backend=backend,
            ),  # fmt: skip
            "kimi_linear_odd_head_dims_24": lambda: parity(
                saved("kimi_odd", save_tiny_kimi_linear, **kimi_odd), prompts, backend=backend
            ),
            # a bf16 model with GDN head dims of 64: the GPU prefill's default path for bf16
            # (the fold, its scratch by gdn.intra_mgpu, the Mosaic GPU serial launch), which
            # the f32 checks above never take; bf16's bar (weights and activations rounded)
            "qwen3_next_bf16_gdn_dims_64": lambda: parity(
                saved(
                    "qwen_d64",
                    save_tiny_qwen3_next,
                    linear_key_head_dim=64,
                    linear_value_head_dim=64,
                ),
                prompts,
                backend=backend,
                dtype="bfloat16",
                rtol=BF16_RTOL,
                tie=BF16_TIE,
            ),  # fmt: skip
        }
        if args.diagnose_tf32:  # where the TF32 error comes from (reported, not checked)
            qwen = functools.partial(saved, "qwen", save_tiny_qwen3_next)
            tf32 = functools.partial(parity, prompts=prompts, allow_tf32=True)
            q16 = functools.partial(
                saved, "qwen16", save_tiny_qwen3_next, linear_value_head_dim=16,
                moe_intermediate_size=16,
            )  # fmt: skip
            checks = {
                "tf32_xla_only": lambda: tf32(qwen(), backend="reference"),
                **{
                    f"tf32_only_{group}_kernel": functools.partial(
                        _only_kernels, fields, lambda: tf32(qwen(), backend=backend)
                    )
                    for group, fields in KERNEL_GROUPS.items()
                },
                "tf32_tiles_of_16": lambda: tf32(q16(), backend=backend),
                "ieee_tiles_of_16": lambda: parity(q16(), prompts, backend=backend),
            }
        selected = [n for n in checks if args.only is None or n in args.only]
        if args.jobs > 1 and len(selected) > 1:
            checks = {}  # each runs in a worker process instead
            _run_in_workers(selected, args, report)
        for name, check in checks.items():
            if name not in selected:
                continue
            start = time.perf_counter()
            try:
                result = check()
            except Exception as e:  # a crash is a failed check, reported with the others
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
                traceback.print_exc()
            result["seconds"] = round(time.perf_counter() - start, 1)
            report["checks"][name] = result
            print(name, json.dumps(result), flush=True)
            if args.out:  # after each check: a run stopped at its time limit keeps what it did
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    # The TF32 run is reported for comparison, not checked (its error may exceed RTOL), but it
    # must not crash.
    failed = [
        n for n, r in report["checks"].items()
        if not r["ok"] and (not (n.endswith("_tf32") or args.diagnose_tf32) or "error" in r)
    ]  # fmt: skip
    report["failed"] = failed
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
