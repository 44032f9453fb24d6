"""The sampler's full-vocabulary ops at a 152k vocabulary, in one process.

A branch-free step (``--branch-free-step``, the default for tensor parallelism on a GPU)
computes the top-k / top-p thresholds and the top-20 log-probs in every step, so their cost is
paid by every decode step whatever the requests ask. This times:

- ``threshold_sort``: ``sampler._sorted_threshold`` (a sort of [S, V], a softmax, a cumsum);
- ``threshold_search{2,4,16}``: ``sampler._searched_threshold`` (the sampler's, 4 ways since
  the 2026-11-28 H200 run), a search for the same threshold over the 2^32 f32 order keys,
  ``ways - 1`` split points a pass (each its own row reduction of the count and the mass
  above it, which XLA may fuse as siblings), 32 / 16 / 8 passes; ``kept_equal`` says each
  keeps the sort's tokens on the timed rows. (A first search, one reduction of a broadcast
  [S, V, 15] comparison a pass, was exact and 7x slower than the sort at 256 rows on an H200: XLA
  materialized the comparison. BENCHMARKS.md.)
- ``top20``: ``lax.top_k(x, 20)`` against ``sampler.blocked_top_k`` (a top-k of the 128-wide
  blocks' maxima, then one of the 20 chosen blocks), and whether they agree.

Each as one jitted program of 10 chained calls with every output consumed
(``benchmarks.common.time_chained``).

    python -m benchmarks.sampler_ops --rows 8 64 256 --out RESULT.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_name, time_chained
from serving.worker.sampler import _searched_threshold, _sorted_threshold, blocked_top_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ways", type=int, nargs="*", default=[2, 4, 16], help="search candidates")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    results = {"device": device_name(), "jax": jax.__version__, "vocab": args.vocab, "rows": []}
    for s in args.rows:
        x = jnp.asarray(rng.normal(size=(s, args.vocab)) * 3, jnp.float32)
        k = jnp.asarray(rng.integers(1, 100, s), jnp.int32)
        top_p = jnp.asarray(rng.uniform(0.5, 0.99, s), jnp.float32)
        row = {"rows": s}
        row["threshold_sort_us"] = round(
            1e6 * time_chained(_sorted_threshold, (x, k, top_p), args.iters), 1
        )
        want = (np.asarray(x) >= np.asarray(_sorted_threshold(x, k, top_p))).sum(1)
        for ways in args.ways:
            fn = functools.partial(_searched_threshold, ways=ways)
            row[f"threshold_search{ways}_us"] = round(
                1e6 * time_chained(fn, (x, k, top_p), args.iters), 1
            )
            got = (np.asarray(x) >= np.asarray(jax.jit(fn)(x, k, top_p))).sum(1)
            row[f"threshold_search{ways}_kept_equal"] = bool((got == want).all())
        for name, fn in [
            ("top20_lax_us", lambda x: jax.lax.top_k(x, 20)[0]),
            ("top20_blocked_us", lambda x: blocked_top_k(x, 20)[0]),
        ]:
            row[name] = round(1e6 * time_chained(fn, (x,), args.iters), 1)
        # the same ids (the tests' oracle, here on the timed shapes)
        a, b = blocked_top_k(x, 20)[1], jax.lax.top_k(x, 20)[1]
        row["top20_equal"] = bool((np.asarray(a) == np.asarray(b)).all())
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
