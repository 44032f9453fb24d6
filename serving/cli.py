"""The ``hyjax`` command: ``generate`` (batch generation), ``serve`` (an OpenAI-compatible
server) and ``make-tiny-model``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from tqdm import tqdm

ROW_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by ``generate`` and ``serve``."""
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--checkpoint-interval", type=int, default=None)
    p.add_argument("--retention-interval", type=int, default=0)
    p.add_argument(
        "--kernel-backend", default="auto", choices=["auto", "reference", "pallas", "interpret"]
    )
    p.add_argument("--num-checkpoint-slots", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(ns: argparse.Namespace, **extra) -> dict:
    """``EngineArgs`` fields from the flags, as a dict (``serve`` sends it to the engine
    process without importing the engine, hence jax, itself)."""
    return dict(
        model=ns.model,
        dtype=ns.dtype,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        enable_prefix_caching=ns.enable_prefix_caching,
        checkpoint_interval=ns.checkpoint_interval,
        retention_interval=ns.retention_interval,
        kernel_backend=ns.kernel_backend,
        num_checkpoint_slots=ns.num_checkpoint_slots,
        seed=ns.seed,
        **extra,
    )


def engine_args(ns: argparse.Namespace, **extra):
    from serving.engine import EngineArgs

    return EngineArgs(**engine_kwargs(ns, **extra))


def read_rows(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("prompt_token_ids" in row):
                raise SystemExit(f"{path}:{n}: a row needs exactly one of prompt, prompt_token_ids")
            rows.append(row)
    return rows


def row_params(row: dict, defaults: dict):
    from serving.request import SamplingParams

    kw = dict(defaults)
    kw.update({k: row[k] for k in ROW_SAMPLING_KEYS if k in row})
    if "stop" in row:
        kw["stop"] = (row["stop"],) if isinstance(row["stop"], str) else tuple(row["stop"])
    return SamplingParams(**kw)


def cmd_generate(ns: argparse.Namespace) -> int:
    from serving.engine import LLMEngine

    rows = read_rows(ns.input)
    engine = LLMEngine(engine_args(ns, progress=not ns.quiet))
    defaults = {"max_tokens": ns.max_tokens, "temperature": ns.temperature}
    ids: list[str | None] = []
    results: dict[str, object] = {}
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):
        prompt = row.get("prompt", row.get("prompt_token_ids"))
        try:
            ids.append(engine.add_request(prompt, row_params(row, defaults), request_id=str(i)))
        except (ValueError, TypeError) as e:
            ids.append(None)
            errors[i] = str(e)
    start = time.perf_counter()
    bar = tqdm(total=len(rows), desc="generating", disable=ns.quiet, unit="req")
    bar.update(len(errors))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
                bar.update(1)
    bar.close()
    seconds = time.perf_counter() - start
    n_prompt = n_out = n_cached = 0
    with open(ns.output, "w") as f:
        for i, row in enumerate(rows):
            rec = dict(row)
            out = results.get(ids[i]) if ids[i] is not None else None
            if out is None or out.error:
                rec.update(error=errors.get(i) or (out.error if out else "not run"))
                rec.update(finish_reason="error")
            else:
                rec.update(
                    output_token_ids=out.output_token_ids,
                    text=out.text,
                    num_prompt_tokens=len(out.prompt_token_ids),
                    num_cached_tokens=out.num_cached_tokens,
                    finish_reason=out.finish_reason,
                )
                n_prompt += len(out.prompt_token_ids)
                n_out += len(out.output_token_ids)
                n_cached += out.num_cached_tokens
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    hit = n_cached / n_prompt if n_prompt else 0.0
    print(
        f"{len(rows)} requests ({len(errors)} rejected), {n_prompt} prompt tokens, "
        f"{n_out} output tokens in {seconds:.2f} s: {(n_prompt + n_out) / seconds:.1f} tok/s, "
        f"{n_out / seconds:.1f} output tok/s, prefix-cache hit rate {hit:.1%}",
        file=sys.stderr if ns.quiet else sys.stdout,
    )
    return 0


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from hyjax.tiny import make_tiny_model

    print(make_tiny_model(ns.out, seed=ns.seed))
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from serving.engine_client import EngineStartError
    from serving.server import serve

    try:
        return serve(
            engine_kwargs(ns, progress=not ns.quiet),
            host=ns.host,
            port=ns.port,
            served_model_name=ns.served_model_name,
            api_key=ns.api_key,
            max_request_bytes=ns.max_request_bytes,
            shutdown_timeout=ns.shutdown_timeout,
            log_level="warning" if ns.quiet else "info",
        )
    except EngineStartError as e:
        print(f"hyjax serve: the engine failed to start: {e}", file=sys.stderr)
        return 1


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("HYJAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $HYJAX_API_KEY, else none)",
    )
    p.add_argument("--served-model-name", default=None, help="default: the model dir's name")
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="larger bodies: 413")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may finish before they are aborted",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyjax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="batch generation from a JSONL file of prompts")
    add_engine_args(g)
    g.add_argument("--input", required=True, help="JSONL: prompt or prompt_token_ids per row")
    g.add_argument("--output", required=True)
    g.add_argument("--max-tokens", type=int, default=64, help="default per row")
    g.add_argument("--temperature", type=float, default=0.0, help="default per row")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(fn=cmd_generate)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(fn=cmd_serve)
    t = sub.add_parser("make-tiny-model", help="write a tiny random Qwen3-Next (HF layout)")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
