"""What a bfloat16 recurrent-state pool (``--state-dtype bfloat16``) costs in accuracy.

On the long-memory tiny test models of both families (``make_tiny_model`` /
``make_tiny_kimi_linear_model`` with ``long_memory=True``: state decays of 0.9-0.9997 a token,
so the state carries hundreds of tokens and its rounding matters as much as it can at these
sizes), float32 vs bfloat16 state, everything else equal (f32 weights and activations,
reference ops, prefix caching off):

- greedy agreement: ``--num-prompts`` random prompts, ``--max-tokens`` greedy tokens each; per
  prompt the tokens identical before the first divergence and identical position by position;
- logits: one sequence run by hand, a prompt prefilled in 128-token steps through its slot
  (``prefill``), then teacher-forced decode steps of the same tokens (``decode``): max abs
  logit difference and the max over logits of both runs' magnitudes, per phase.

    python -m benchmarks.state_dtype_accuracy --out benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import device_name
from hyjax.cache import init_caches
from hyjax.loader import load_model
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, make_batch, make_tiny_kimi_linear_model
from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine

FAMILIES = {
    "qwen3_next": lambda d: make_tiny_model(d, seed=0, long_memory=True),
    "kimi_linear": lambda d: make_tiny_kimi_linear_model(d, seed=0, long_memory=True),
}
BS = 16


def greedy_agreement(model_dir: str, args) -> dict:
    """Greedy tokens of the same prompts under float32 and bfloat16 states."""
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(16, args.max_prompt_len + 1, size=args.num_prompts)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in lens]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for state_dtype in ("float32", "bfloat16"):
        engine = LLMEngine(
            EngineArgs(
                model=model_dir,
                state_dtype=state_dtype,
                enable_prefix_caching=False,
                max_num_seqs=args.num_prompts,
                max_num_batched_tokens=256,
                min_token_bucket=64,
                max_model_len=args.max_prompt_len + args.max_tokens,
                kernel_backend="reference",
                warmup=False,
                progress=False,
            )
        )
        ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
        done = engine.run_to_completion()
        outs[state_dtype] = [done[i].output_token_ids for i in ids]
    per_prompt = []
    for a, b in zip(outs["float32"], outs["bfloat16"]):
        same = np.asarray(a) == np.asarray(b)
        first = int(np.argmin(same)) if not same.all() else len(a)
        per_prompt.append({"first_divergence": first, "identical": int(same.sum())})
    n = args.max_tokens * len(prompts)
    return {
        "prompt_lens": [int(x) for x in lens],
        "per_prompt": per_prompt,
        "identical_before_first_divergence": sum(p["first_divergence"] for p in per_prompt) / n,
        "identical_overall": sum(p["identical"] for p in per_prompt) / n,
        "prompts_fully_identical": sum(p["identical"] == args.max_tokens for p in per_prompt),
    }


def logit_differences(model_dir: str, args) -> dict:
    """One sequence by hand: a prefill in 128-token steps, then teacher-forced decode."""
    model, cfg = load_model(model_dir)
    graphdef, state = nnx.split(model)
    ops = get_ops("reference")

    @functools.partial(jax.jit, static_argnames="decode_only")
    def forward(state, batch, caches, decode_only=False):
        return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

    rng = np.random.default_rng(args.seed + 1)
    n_prefill, n_decode = args.logit_prompt_len, args.logit_decode_steps
    tokens = rng.integers(3, 250, size=n_prefill + n_decode).tolist()
    max_blocks = -(-(n_prefill + n_decode) // BS)
    blocks = list(range(1, max_blocks + 1))
    logits = {}
    for state_dtype in (jnp.float32, jnp.bfloat16):
        caches = init_caches(
            cfg, num_blocks=max_blocks + 1, block_size=BS, num_slots=2,
            dtype=jnp.float32, state_dtype=state_dtype,
        )  # fmt: skip
        out = []
        for pos in range(0, n_prefill, 128):
            size = min(128, n_prefill - pos)
            row = SeqChunk(tokens[pos : pos + size], pos, blocks, src_slot=1 if pos else 0,
                           dst_slot=1, all_logits=True)  # fmt: skip
            batch, (idx,) = make_batch([row], block_size=BS, num_tokens=128, num_seqs=1,
                                       max_blocks=max_blocks, num_logits=128)  # fmt: skip
            caches, lg = forward(state, batch, caches)
            out.append(np.asarray(lg)[idx])
        for pos in range(n_prefill, n_prefill + n_decode):
            row = SeqChunk(tokens[pos : pos + 1], pos, blocks, src_slot=1, dst_slot=1)
            batch, (idx,) = make_batch([row], block_size=BS, num_tokens=1, num_seqs=1,
                                       max_blocks=max_blocks)  # fmt: skip
            caches, lg = forward(state, batch, caches, decode_only=True)
            out.append(np.asarray(lg)[idx])
        logits[jnp.dtype(state_dtype).name] = np.concatenate(out)
    a, b = logits["float32"], logits["bfloat16"]
    diff = np.abs(a - b).max(axis=-1)  # per token

    def phase(sl):
        return {
            "max_abs_logit_diff": float(diff[sl].max()),
            "mean_of_per_token_max_abs_diff": float(diff[sl].mean()),
            "max_abs_logit": float(np.abs(a[sl]).max()),
            "argmax_agreement": float((a[sl].argmax(-1) == b[sl].argmax(-1)).mean()),
        }

    return {
        "prefill_tokens": n_prefill,
        "decode_steps": n_decode,
        "prefill": phase(slice(0, n_prefill)),
        "decode": phase(slice(n_prefill, None)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--logit-prompt-len", type=int, default=512)
    p.add_argument("--logit-decode-steps", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    result = {
        "benchmark": "state_dtype_accuracy",
        "device": device_name(),
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "args": vars(args),
        "families": {},
    }
    for family in args.families:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            model_dir = FAMILIES[family](d)
            result["families"][family] = {
                "greedy": greedy_agreement(model_dir, args),
                "logits": logit_differences(model_dir, args),
                "seconds": round(time.perf_counter() - start, 1),
            }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
