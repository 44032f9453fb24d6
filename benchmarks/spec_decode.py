"""Speculative decoding with the MTP drafter on the embedded model: acceptance and decode speed.

For K = 0 (no speculation), 1, 2, 3 the engine generates greedy completions of a few Python
prompts (the embedded model was trained on Python's standard library), one engine per K,
the workload run once untimed (it compiles the buckets it meets), then again, timed. It
reports, per K:

- ``mean_acceptance_length``: tokens a verify row yields on average (1 + accepted drafts);
- ``acceptance_per_position``: the fraction of verify rows whose draft ``j`` was accepted
  (draft ``j`` counts only when drafts ``1 .. j - 1`` were: vLLM's per-position rate);
- ``decode_tok_s``: generated tokens over the wall time of the decode phase (the steps after
  every prompt's prefill), and ``equal_to_k0``: greedy tokens identical to K = 0.

Decode steps with drafts run in the verify-shaped buckets (the k-token decode kernels), as the
engine does by default; ``--no-verify-buckets`` runs them in the prefill-shaped buckets instead,
for comparison. Acceptance does not depend on the hardware (greedy drafts and tokens, float32
model); the speed does. It prints one JSON object (and writes it to ``--out``)::

    python -m benchmarks.spec_decode --out benchmarks/results/spec_decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax

from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine

MODEL = "hyjax/assets/qwen3-next-pystdlib-tiny"
PROMPTS = [
    "import os\nimport sys\n\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    'def read_config(path):\n    """Read a configuration file."""\n    with open(path) as f:\n',
    "import re\n\n\ndef tokenize(text):\n    ",
]


def run(k: int, args) -> dict:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k}) if k else None
    engine = LLMEngine(
        EngineArgs(
            model=args.model, speculative_config=spec, max_num_seqs=len(PROMPTS),
            max_num_batched_tokens=256, max_model_len=1024, progress=False, warmup=False,
            enable_prefix_caching=False, verify_buckets=args.verify_buckets,
        )
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _generate(engine, params)  # compiles the buckets this workload meets
    m0 = engine.metrics()
    decoded, seconds, tokens = _generate(engine, params)
    m = engine.metrics()
    rows = max(m.spec_num_drafts - m0.spec_num_drafts, 1)
    accepted = m.spec_num_accepted_tokens - m0.spec_num_accepted_tokens
    per_pos = [a - b for a, b in zip(m.spec_accepted_per_pos, m0.spec_accepted_per_pos)]
    return {
        "k": k,
        "decode_tokens": decoded,
        "decode_seconds": round(seconds, 3),
        "decode_tok_s": round(decoded / seconds, 1),
        "verify_rows": m.spec_num_drafts - m0.spec_num_drafts,
        "draft_tokens": m.spec_num_draft_tokens - m0.spec_num_draft_tokens,
        "accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / rows, 3) if k else 1.0,
        "acceptance_per_position": [round(n / rows, 3) for n in per_pos],
        "_tokens": tokens,
    }


def _generate(engine: LLMEngine, params: SamplingParams) -> tuple[int, float, list[list[int]]]:
    """Every prompt's completion: ``(tokens decoded after each prompt's first, their
    seconds, each prompt's tokens)``; the prefills and first tokens run untimed."""
    ids = [engine.add_request(EngineRequest(p, params)) for p in PROMPTS]
    seen: dict[str, int] = {}
    while len(seen) < len(ids):
        for o in engine.step():
            seen[o.request_id] = len(o.output_token_ids)
    start = time.perf_counter()
    outs = engine.run_to_completion()
    seconds = time.perf_counter() - start
    tokens = [outs[r].output_token_ids for r in ids]
    return sum(map(len, tokens)) - sum(seen.values()), seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--ks", default="0,1,2,3")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--verify-buckets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps with drafts in verify-shaped buckets (the engine's default); "
        "--no-verify-buckets: in the prefill-shaped buckets, as before them",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [run(int(k), args) for k in args.ks.split(",")]
    base = next((r["_tokens"] for r in results if r["k"] == 0), None)
    for r in results:
        toks = r.pop("_tokens")
        r["equal_to_k0"] = None if base is None else toks == base
    summary = {
        "benchmark": "spec_decode",
        "model": args.model,
        "device": f"{jax.devices()[0].platform}:{getattr(jax.devices()[0], 'device_kind', '?')}",
        "cpu": platform.processor() or platform.machine(),
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "verify_buckets": args.verify_buckets,
        "results": results,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
