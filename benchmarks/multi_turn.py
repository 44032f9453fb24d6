"""Multi-turn agentic trace (issue 20), prefix caching on vs off, in one run on one model.

``--conversations`` conversations of ``--turns`` turns run side by side. Turn 1 of each is a
random ``--first-len``-token prompt; every later turn is the whole conversation so far (every
earlier prompt and generated answer) plus a new random ``--user-len``-token user message. A
conversation sends its next turn as soon as its previous answer (``--output-len`` tokens,
ignore_eos) is done, as an agent loop does. Per turn: the prefix-cache hit rate (cached prompt
tokens / prompt tokens) and TTFT (submission to first token), with caching off and on.

    python -m benchmarks.multi_turn --model bench --out MT.json               # one GPU
    JAX_PLATFORMS=cpu python -m benchmarks.multi_turn --model tiny-qwen3-next --first-len 96 \\
        --user-len 16 --output-len 8 --dtype float32 --block-size 16         # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import numpy as np

from benchmarks.common import device_name
from benchmarks.full_size import add_model_args, build_for_engine
from benchmarks.serving_throughput import add_serving_args, engine_args, percentiles, write
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import LLMEngine


def run(engine: LLMEngine, args, vocab: int, deadline: float) -> dict:
    """Runs the trace; returns per-turn hit rates and TTFTs (``partial`` if cut short)."""
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    history = [rng.integers(0, vocab, args.first_len).tolist() for _ in range(args.conversations)]
    turn = [0] * args.conversations  # the turn each conversation is on (0-based)
    live: dict[str, tuple[int, float, int]] = {}  # request -> (conversation, sent, prompt len)
    ttft: list[list[float]] = [[] for _ in range(args.turns)]
    prompt_tokens = [0] * args.turns
    cached = [0] * args.turns
    answers: dict[str, list[int]] = {}

    def send(c: int) -> None:
        prompt = history[c]
        rid = engine.add_request(EngineRequest(list(prompt), params))
        live[rid] = (c, time.perf_counter(), len(prompt))
        answers[rid] = []

    for c in range(args.conversations):
        send(c)
    start, cut = time.perf_counter(), False
    while live:
        if time.perf_counter() > deadline:
            cut = True
            for rid in list(live):
                engine.abort_request(rid)
            break
        for o in engine.step():
            c, sent, n = live[o.request_id]
            t = turn[c]
            if not answers[o.request_id] and o.delta_token_ids:
                ttft[t].append(time.perf_counter() - sent)
            answers[o.request_id].extend(o.delta_token_ids)
            if not o.finished:
                continue
            del live[o.request_id]
            prompt_tokens[t] += n
            cached[t] += o.num_cached_tokens
            turn[c] += 1
            if turn[c] < args.turns:
                user = rng.integers(0, vocab, args.user_len).tolist()
                history[c] = history[c] + answers.pop(o.request_id) + user
                send(c)
    while engine.has_unfinished_requests():
        engine.step()
    per_turn = [
        {
            "turn": t + 1,
            "prompt_tokens": prompt_tokens[t],
            "cached_tokens": cached[t],
            "hit_rate": round(cached[t] / prompt_tokens[t], 4) if prompt_tokens[t] else None,
            "ttft_ms": percentiles(ttft[t], qs=(50, 90)),
        }
        for t in range(args.turns)
    ]
    total_prompt, total_cached = sum(prompt_tokens), sum(cached)
    return {
        "seconds": round(time.perf_counter() - start, 3),
        "hit_rate": round(total_cached / total_prompt, 4) if total_prompt else None,
        "ttft_ms": percentiles([x for xs in ttft for x in xs]),
        "per_turn": per_turn,
        "partial": cut,
    }


def main() -> None:
    start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    add_serving_args(p)
    p.set_defaults(model="bench")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=2000, help="turn 1's prompt tokens")
    p.add_argument("--user-len", type=int, default=200, help="each later turn's new tokens")
    p.add_argument("--output-len", type=int, default=200)
    args = p.parse_args()
    deadline = start + args.max_seconds
    model, cfg, info = build_for_engine(args, dtype=args.dtype)
    vocab = min(cfg.vocab_size, 150000)
    turns = args.turns
    max_len = args.first_len + (turns - 1) * args.user_len + turns * args.output_len + 64
    trace = ("conversations", "turns", "first_len", "user_len", "output_len")
    results = {
        "device": device_name(),
        "num_devices": jax.device_count(),
        "model": info,
        "trace": {k: getattr(args, k) for k in trace},
    }
    for caching in (False, True):
        if time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        engine = LLMEngine(
            engine_args(
                args,
                args.conversations,
                max_len,
                enable_prefix_caching=caching,
                # Two checkpoints a conversation (the prompt end and the answer's end) and room.
                num_checkpoint_slots=4 * args.conversations,
                # Compiled as met, so also during the first turns: caching off then on pays
                # the same compiles (the off run goes first and compiles most of them).
                min_token_bucket=min(512, args.max_num_batched_tokens),
            ),
            preloaded=(model, cfg),
        )
        r = {"engine_start_s": round(time.perf_counter() - t0, 2)}
        r |= run(engine, args, vocab, deadline)
        key = "on" if caching else "off"
        results[key] = r
        print(key, json.dumps(r), flush=True)
        write(results, args.out)
        del engine
        gc.collect()
    if "on" in results and "off" in results:
        last = [results[k]["per_turn"][-1]["ttft_ms"]["p50"] for k in ("on", "off")]
        if None not in last:
            results["last_turn_ttft_p50_on_over_off"] = round(last[0] / last[1], 4)
    results["total_s"] = round(time.perf_counter() - start, 1)
    write(results, args.out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
