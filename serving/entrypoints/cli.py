"""The ``hyjax`` command: ``generate`` (batch generation), ``serve`` (an OpenAI-compatible
server) and ``make-tiny-model``. Without ``--model`` both use the model shipped in the package
(:mod:`hyjax.assets`), so they work offline on a fresh machine."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from tqdm import tqdm

from serving.core.request import EngineRequest
from serving.engine.engine_args import EngineArgs, add_engine_args, engine_kwargs
from serving.engine.logs import setup_logging
from serving.entrypoints.reasoning_parsers import REASONING_PARSERS
from serving.entrypoints.tool_parsers import TOOL_PARSERS


def engine_args(ns: argparse.Namespace, **extra) -> EngineArgs:
    return EngineArgs(**engine_kwargs(ns, **extra))


def read_rows(path: str) -> list[dict]:
    """The JSON objects of a JSONL file (blank lines skipped); a line that is not one stops
    the command, naming the line."""
    rows = []
    try:
        f = open(path)
    except OSError as e:
        raise SystemExit(f"hyjax generate: --input {path}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: a row is a JSON object")
            rows.append(row)
    return rows


def row_request(row: dict, ns: argparse.Namespace, request_id: str) -> EngineRequest:
    """A row's engine request, validated as the server validates a completion request
    (:class:`serving.entrypoints.protocol.GenerateRow`); ValueError names the bad field."""
    from pydantic import ValidationError

    from serving.entrypoints.protocol import GenerateRow

    try:
        req = GenerateRow.model_validate(row)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "row"
        raise ValueError(f"{where}: {err['msg']}") from None
    bad = req.unsupported_fields()
    if bad:
        raise ValueError(f"{bad[0]} is not supported by hyjax generate")
    max_tokens = ns.max_tokens if req.max_tokens is None else req.max_tokens
    params = req.to_sampling_params(max_tokens, default_temperature=ns.temperature)
    prompt = req.prompt if req.prompt is not None else req.prompt_token_ids
    return req.to_engine_request(prompt, params, request_id)


def cmd_generate(ns: argparse.Namespace) -> int:
    from serving.engine.llm_engine import LLMEngine

    if (ns.input is None) == (not ns.prompt):
        raise SystemExit("hyjax generate: give either --input FILE or --prompt TEXT (not both)")
    if ns.input is not None and ns.output is None:
        raise SystemExit("hyjax generate: --input needs --output")
    rows = read_rows(ns.input) if ns.input is not None else [{"prompt": p} for p in ns.prompt]
    requests: dict[int, EngineRequest] = {}
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):  # checked before the model loads: a typo fails fast
        try:
            requests[i] = row_request(row, ns, request_id=str(i))
        except ValueError as e:
            errors[i] = str(e)
    if ns.distributed or ns.coordinator_address or ns.num_processes:
        from hyjax.sharding import initialize_distributed

        initialize_distributed(ns.coordinator_address, ns.num_processes, ns.process_id)
    try:
        # Each bucket compiles when a step first meets it: a batch job meets only some.
        engine = LLMEngine(engine_args(ns, progress=not ns.quiet, warmup=False))
    except (OSError, ValueError) as e:  # no such directory, not a checkpoint, bad flags
        raise SystemExit(f"hyjax generate: cannot start the engine: {e}") from None
    ids: list[str | None] = [None] * len(rows)
    results: dict[str, object] = {}
    for i, request in requests.items():
        try:
            ids[i] = engine.add_request(request)
        except ValueError as e:  # what the engine rejects: too long, ids outside the vocab
            errors[i] = str(e)
    compiling = _compile_seconds()
    start = time.perf_counter()
    bar = tqdm(total=len(rows), desc="generating", disable=ns.quiet, unit="req")
    bar.update(len(errors))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
                bar.update(1)
    bar.close()
    # Throughput without the compiles of the buckets met on the way (reported apart).
    compile_s = sum(compiling)
    seconds = max(time.perf_counter() - start - compile_s, 1e-9)
    n_prompt = n_out = n_cached = 0
    failed: list[tuple[int, str]] = []
    with open(ns.output or os.devnull, "w") as f:
        for i, row in enumerate(rows):
            rec = dict(row)
            out = results.get(ids[i]) if ids[i] is not None else None
            if out is None or out.error:
                rec.update(error=errors.get(i) or (out.error if out else "not run"))
                rec.update(finish_reason="error")
                failed.append((i, rec["error"]))
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
            if ns.prompt:  # --prompt: the completions themselves go to stdout
                text = rec.get("text", f"[error: {rec.get('error')}]")
                print(("" if i == 0 else "\n" + "-" * 40 + "\n") + rec["prompt"] + text)
    hit = n_cached / n_prompt if n_prompt else 0.0
    n_failed = len(failed) - len(errors)
    print(
        f"{len(rows)} requests ({len(errors)} rejected, {n_failed} failed), {n_prompt} prompt "
        f"tokens, {n_out} output tokens in {seconds:.2f} s: "
        f"{(n_prompt + n_out) / seconds:.1f} tok/s, {n_out / seconds:.1f} output tok/s, "
        f"prefix-cache hit rate {hit:.1%} (and {compile_s:.1f} s compiling step shapes)",
        file=sys.stderr if ns.quiet or ns.prompt else sys.stdout,
    )
    if failed:  # the good rows' output is written; the exit code says not all of it is
        where = ns.input or "--prompt"
        for i, msg in failed[:10]:
            print(f"hyjax generate: {where} row {i + 1}: {msg}", file=sys.stderr)
        if len(failed) > 10:
            print(f"hyjax generate: ... and {len(failed) - 10} more", file=sys.stderr)
        return 1
    return 0


def _compile_seconds() -> list[float]:
    """A list that collects the seconds JAX spends tracing, lowering and compiling from now."""
    import jax

    phases = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
    seconds: list[float] = []

    def listener(event: str, secs: float, **_kw) -> None:
        if event.startswith("/jax/core/compile/") and event.endswith(phases):
            seconds.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seconds


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from hyjax.tiny import make_tiny_model

    print(make_tiny_model(ns.out, seed=ns.seed))
    return 0


def cmd_convert(ns: argparse.Namespace) -> int:
    from hyjax.loader import load_model, save_converted

    model, cfg = load_model(ns.model, dtype=ns.dtype)
    print(save_converted(model, cfg, ns.model, ns.out))
    return 0


def multihost_config(ns: argparse.Namespace):
    """``serve`` across processes: a ``MultihostConfig``, or None on one process."""
    if not (ns.coordinator_address or ns.num_processes or ns.process_id):
        return None
    from serving.engine.multihost import MultihostConfig

    given = dict(coordinator_address=ns.coordinator_address, num_processes=ns.num_processes,
                 process_id=ns.process_id)  # fmt: skip
    missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
    if missing:
        raise SystemExit(f"hyjax serve on several processes needs {', '.join(missing)} too")
    try:
        return MultihostConfig(**given, plan_port=ns.plan_port)
    except ValueError as e:
        raise SystemExit(f"hyjax serve: {e}") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    multihost = multihost_config(ns)
    # One process: answer as soon as the model is loaded, compiling the buckets in the
    # background. Several: every process warms up in step (the warm-up steps are collective).
    background = ns.warmup == "background" and multihost is None
    lazy = ns.warmup == "none" and multihost is None  # each bucket compiles when first met
    kwargs = engine_kwargs(ns, progress=not ns.quiet, background_warmup=background, warmup=not lazy)
    if multihost is not None and multihost.process_id > 0:
        import signal

        from serving.engine.multihost import run_follower

        # A Ctrl-C sent to the whole group must not kill a follower under the leader's drain;
        # the leader's shutdown message ends it (SIGTERM still does, failing the leader).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = run_follower(kwargs, multihost)
        except BaseException:  # noqa: BLE001  (a failed step: the job cannot go on)
            logging.getLogger("serving.engine.multihost").exception("follower failed")
            code = 1
        if code:  # the job is broken: skip jax.distributed's exit barrier, which would wait
            logging.shutdown()
            os._exit(code)
        return code
    if multihost is not None:
        import dataclasses

        kwargs["multihost"] = dataclasses.asdict(multihost)
    from serving.engine.engine_client import EngineStartError
    from serving.entrypoints.chat_output import ChatParsing
    from serving.entrypoints.server import serve

    try:
        chat_parsing = ChatParsing(
            tool_call_parser=ns.tool_call_parser,
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            reasoning_parser=ns.reasoning_parser,
        )
    except ValueError as e:
        raise SystemExit(f"hyjax serve: {e}") from None

    try:
        return serve(
            kwargs,
            host=ns.host,
            port=ns.port,
            served_model_name=ns.served_model_name,
            api_key=ns.api_key if ns.api_key is not None else os.environ.get("HYJAX_API_KEY"),
            max_request_bytes=ns.max_request_bytes,
            shutdown_timeout=ns.shutdown_timeout,
            log_level="warning" if ns.quiet else "info",
            chat_parsing=chat_parsing,
        )
    except EngineStartError as e:
        print(f"hyjax serve: the engine failed to start: {e}", file=sys.stderr)
        return 1


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the HTTP port")
    p.add_argument(
        "--api-key",
        default=None,  # not $HYJAX_API_KEY here: --help prints the defaults
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
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="parse the tool calls of chat outputs in this format into message.tool_calls",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="put the <think> reasoning of chat outputs into message.reasoning_content",
    )
    p.add_argument(
        "--warmup",
        default="background",
        choices=["background", "all", "none"],
        help="background: answer once the model is loaded, compiling the step buckets in the "
        "background (a request may wait for its bucket); all: compile every bucket before "
        "the port answers (always so with several processes); none: compile each bucket when "
        "a step first meets it (a short-lived or test server that meets few)",
    )
    p.add_argument(
        "--coordinator-address",
        default=None,
        help="several processes: HOST:PORT of process 0 (jax.distributed); process 0 serves "
        "HTTP, the others (same flags, their own --process-id) mirror its steps",
    )
    p.add_argument("--num-processes", type=int, default=None, help="several processes: how many")
    p.add_argument("--process-id", type=int, default=None, help="several processes: this one's")
    p.add_argument(
        "--plan-port",
        type=int,
        default=None,
        help="several processes: the port on process 0's host where followers fetch each "
        "step's plan (default: the coordinator's port + 1)",
    )


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless it has no default or says its own."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyjax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    defaults = {"formatter_class": _DefaultsHelp}
    g = sub.add_parser("generate", help="batch generation from a JSONL file of prompts", **defaults)
    add_engine_args(g)
    g.add_argument("--input", help="JSONL: prompt or prompt_token_ids per row")
    g.add_argument("--output", help="JSONL results (needed with --input)")
    g.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt (repeatable), instead of --input: completions are printed",
    )
    g.add_argument("--max-tokens", type=int, default=64, help="default per row")
    g.add_argument("--temperature", type=float, default=0.0, help="default per row")
    g.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="several hosts: HOST:PORT of process 0 (jax.distributed.initialize); every "
        "process runs the same command with its own --process-id",
    )
    g.add_argument("--num-processes", type=int, default=None, help="several hosts: how many")
    g.add_argument("--process-id", type=int, default=None, help="several hosts: this one's")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="jax.distributed.initialize() with what JAX detects (Cloud TPU, SLURM, ...)",
    )
    g.set_defaults(fn=cmd_generate)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server", **defaults)
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(fn=cmd_serve)
    t = sub.add_parser(
        "make-tiny-model", help="write a tiny random Qwen3-Next (HF layout)", **defaults
    )
    t.add_argument("out", help="the directory to write")
    t.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    t.set_defaults(fn=cmd_make_tiny_model)
    c = sub.add_parser(
        "convert",
        help="save a checkpoint's converted parameters (orbax) for fast, sharded start-up",
        **defaults,
    )
    c.add_argument("model", help="a Hugging Face checkpoint directory")
    c.add_argument("out", help="the directory to write (then use it as --model)")
    c.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the type to save the parameters in (auto: the checkpoint's)",
    )
    c.set_defaults(fn=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    setup_logging(getattr(ns, "quiet", False))
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
