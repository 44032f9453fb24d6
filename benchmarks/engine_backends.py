"""The engine end to end with the kernels against the engine with the reference ops, on one card.

The embedded model (``hyjax/assets``, float32) serves the same greedy requests with
``--kernel-backend reference`` and with ``auto`` (the Pallas kernels on CUDA / TPU), prefix
caching off, and ``auto`` again with caching on. Prompts are slices of Python's own standard
library source (what the model was trained on) of 40 to ~1500 tokens, so the batch mixes long
chunked prefills with decode rows; half of them share a long prefix, so the cached run hits.

Reported per pair of runs: requests whose tokens are identical, the first position where any
differs, and the largest difference of the chosen tokens' logprobs over the common prefix
(kernel numerics, TF32 on GPU, move logprobs by ~1e-3; a greedy tie can then flip a token, after
which the texts differ legitimately). Also the wall time of each run (second pass, compiled).

    python -m benchmarks.engine_backends --out ENGINE.json
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import time

import jax
import numpy as np

from benchmarks.common import device_name
from hyjax.assets import model_dir
from hyjax.tokenizer import Tokenizer
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Slices of stdlib sources: n // 2 share one long prefix, the rest are independent."""
    import collections
    import json as json_mod
    import textwrap

    sources = [inspect.getsource(m) for m in (collections, json_mod.decoder, textwrap)]
    ids = [tokenizer.encode(s) for s in sources]
    rng = np.random.default_rng(seed)
    shared = ids[0][:1024]
    out = []
    for i in range(n):
        if i % 2 == 0:
            tail = ids[1 + i % 2]
            start = int(rng.integers(0, len(tail) - 200))
            out.append(shared + tail[start : start + int(rng.integers(8, 200))])
        else:
            src = ids[1 + (i // 2) % 2]
            length = int(rng.integers(40, 1500))
            start = int(rng.integers(0, max(1, len(src) - length)))
            out.append(src[start : start + length])
    return out


def run(backend: str, caching: bool, requests: list[list[int]], args) -> dict:
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            dtype="float32",
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=2048,
            enable_prefix_caching=caching,
            kernel_backend=backend,
            progress=False,
            warmup=False,  # pass 0 compiles what it meets (all buckets: minutes per engine)
        )
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)  # fmt: skip
    passes = []
    for _ in range(2):  # the first pass compiles the buckets it meets
        ids = [engine.add_request(EngineRequest(r, params)) for r in requests]
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                logprobs[o.request_id] += [t.logprob for t in o.delta_logprobs or []]
                if o.finished:
                    tokens[o.request_id] = o.output_token_ids
        passes.append(
            {
                "seconds": round(time.perf_counter() - start, 3),
                "tokens": [tokens[i] for i in ids],
                "logprobs": [logprobs[i] for i in ids],
                "effective_hit_tokens": engine.metrics().effective_hit_tokens,
            }
        )
    del engine
    gc.collect()
    return passes


def compare(a: dict, b: dict) -> dict:
    identical, first_diff, max_lp = 0, [], 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if n is None and len(ta) == len(tb):
            identical += 1
        else:
            first_diff.append(n if n is not None else min(len(ta), len(tb)))
        common = n if n is not None else min(len(la), len(lb))
        if common:
            max_lp = max(max_lp, float(np.max(np.abs(np.subtract(la[:common], lb[:common])))))
    return {
        "identical_requests": f"{identical}/{len(a['tokens'])}",
        "first_divergence_positions": sorted(first_diff),
        "max_abs_logprob_diff_before_divergence": max_lp,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--precision",
        choices=["default", "highest"],
        default="default",
        help="jax_default_matmul_precision: 'highest' turns TF32 off on GPU, so what is left of "
        "a cached/uncached difference is not matmul rounding",
    )
    p.add_argument(
        "--cached-reference", action="store_true", help="also the reference ops with caching on"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.model = args.model or model_dir()
    if args.precision != "default":
        jax.config.update("jax_default_matmul_precision", args.precision)
    requests = prompts(Tokenizer.from_dir(args.model), args.num_requests, args.seed)
    runs = {
        "reference_uncached": run("reference", False, requests, args),
        "auto_uncached": run("auto", False, requests, args),
        "auto_cached": run("auto", True, requests, args),
    }
    if args.cached_reference:
        runs["reference_cached"] = run("reference", True, requests, args)
    summary = {
        "device": device_name(),
        "precision": args.precision,
        "prompt_tokens": [len(r) for r in requests],
        # pass 0 compiles; pass 1 repeats the requests (cached: the first pass's prefixes hit)
        "seconds_pass1": {k: v[1]["seconds"] for k, v in runs.items()},
        "effective_hit_tokens": {
            k: [p["effective_hit_tokens"] for p in v] for k, v in runs.items()
        },
        "auto_vs_reference": compare(runs["auto_uncached"][1], runs["reference_uncached"][1]),
        "cached_vs_uncached_cold": compare(runs["auto_cached"][0], runs["auto_uncached"][1]),
        "cached_vs_uncached_warm": compare(runs["auto_cached"][1], runs["auto_uncached"][1]),
    }
    if args.cached_reference:
        ref_on, ref_off = runs["reference_cached"], runs["reference_uncached"][1]
        summary["reference_cached_vs_uncached_cold"] = compare(ref_on[0], ref_off)
        summary["reference_cached_vs_uncached_warm"] = compare(ref_on[1], ref_off)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
