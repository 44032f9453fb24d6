"""Host time of the n-gram drafter a step (speculative decoding, ``method: ngram``).

``--rows`` requests of ``--context`` random tokens each (random: the worst case, almost every
search finds nothing longer than one token), ``--steps`` steps; each step every row asks for
K drafts and then gains one token, as in decoding. Timed in one process:

- ``baseline``: the drafter before ``520ed55``: the whole token list converted to an array
  every step, then one sliding-window compare per suffix length (``max_n`` down to ``min_n``);
- ``drafter``: ``NgramDrafter`` as the engine runs it (an int32 copy per request, extended in
  place; one compare over the context, then filtering of the candidate positions);
- ``floor``: one vectorized compare over each row's context (what any vectorized search reads).

The two must propose the same drafts (checked every step).

    python -m benchmarks.ngram_drafter --out benchmarks/results/ngram_drafter_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.cold_start import _cpu_name
from serving.core.request import Request
from serving.core.speculative import NgramDrafter


def baseline_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The drafter's search before ``520ed55`` (kept here as the baseline)."""
    n_tok = len(tokens)
    if k < 1 or n_tok < min_n + 1:
        return []
    a = np.asarray(tokens, np.int64)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        win = np.lib.stride_tricks.sliding_window_view(a[: n_tok - 1], n)
        hits = np.flatnonzero((win == a[n_tok - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start : start + k].tolist()
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=4224, help="tokens a row at the start")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--min-n", type=int, default=1)
    p.add_argument("--max-n", type=int, default=3)
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.context).tolist() for _ in range(args.rows)]
    appended = rng.integers(0, args.vocab, (args.steps, args.rows)).tolist()
    drafter = NgramDrafter(args.min_n, args.max_n)

    def run(propose) -> tuple[float, list]:
        reqs = [Request(str(i), p) for i, p in enumerate(prompts)]
        drafts, spent = [], 0.0
        for step in range(args.steps):
            t0 = time.perf_counter()
            drafts.append([propose(r) for r in reqs])
            spent += time.perf_counter() - t0
            for r, tok in zip(reqs, appended[step], strict=True):
                r.all_token_ids.append(tok)
        return spent / args.steps, drafts

    base_s, base_drafts = run(
        lambda r: baseline_propose(r.all_token_ids, args.min_n, args.max_n, args.k)
    )
    new_s, new_drafts = run(lambda r: drafter.propose(r, args.k))
    assert new_drafts == base_drafts, "the drafter and the baseline disagree"
    contexts = [np.asarray(p, np.int32) for p in prompts]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        for a in contexts:
            np.flatnonzero(a[:-1] == a[-1])
    floor_s = (time.perf_counter() - t0) / args.steps

    result = {
        "cpu": _cpu_name(),
        "config": vars(args),
        "baseline_ms_per_step": round(base_s * 1e3, 3),
        "drafter_ms_per_step": round(new_s * 1e3, 3),
        "floor_ms_per_step": round(floor_s * 1e3, 3),
        "speedup": round(base_s / new_s, 1),
        "drafter_over_floor": round(new_s / floor_s, 2),
        "drafts_equal": True,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
