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

from serving.logs import setup_logging


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by ``generate`` and ``serve``."""
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory (default: the embedded "
        "qwen3-next-pystdlib-tiny, trained on Python's standard library)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the weights' and activations' type (auto: the checkpoint's; float32 for the "
        "embedded model)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument(
        "--max-num-seqs", type=int, default=32, help="requests running at once (a step's rows)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per step: the prefill chunk budget and the largest token bucket",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--min-token-bucket",
        type=int,
        default=8,
        help="the smallest token capacity of a prefill step: larger means fewer compiles",
    )
    p.add_argument(
        "--mixed-row-buckets",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill steps pad their rows to a power of two (a bucket per row count) instead "
        "of to min(tokens, --max-num-seqs); default: off on CPU (a quarter of the compiles and "
        "their memory), on elsewhere",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks and recurrent-state checkpoints of repeated prefixes",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="granularity of state checkpoints and prefill chunk edges, in tokens (default: "
        "lcm(64, block size))",
    )
    p.add_argument(
        "--retention-interval",
        type=int,
        default=0,
        help="also keep a state checkpoint every this many prompt tokens (0: only at the "
        "prompt end and the latest decode boundary)",
    )
    p.add_argument(
        "--kernel-backend",
        default="auto",
        choices=["auto", "reference", "pallas", "interpret"],
        help="auto: Pallas kernels on GPU / TPU, the pure-JAX reference ops on CPU",
    )
    p.add_argument(
        "--allow-tf32",
        action="store_true",
        help="float32 models: let matmuls use TF32 tensor cores on NVIDIA (bf16 passes on TPU): "
        "faster, ~1e-3 relative error; by default float32 means IEEE float32 products",
    )
    p.add_argument(
        "--num-checkpoint-slots",
        type=int,
        default=None,
        help="state slots kept for prefix-cache checkpoints (default: from the cache budget)",
    )
    p.add_argument(
        "--cache-bytes",
        type=_positive_int,
        default=None,
        help="bytes per device for the KV and state pools (default: 90%% of the free device "
        "memory; on CPU, max-num-seqs full-length requests); with several processes, every "
        "process sizes its pools for the smallest budget of them all",
    )
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed for unseeded requests")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the model is split over (heads, MoE intermediate dim; hyjax.sharding)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the MoE layers by expert instead of by intermediate dim",
    )
    p.add_argument(
        "--compilation-cache-dir",
        default=os.environ.get("HYJAX_COMPILATION_CACHE", "~/.cache/hyjax/jax-compilation"),
        help="JAX's persistent compilation cache: restarts load the compiled buckets from here "
        "('' turns it off; env HYJAX_COMPILATION_CACHE sets the default)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def engine_kwargs(ns: argparse.Namespace, **extra) -> dict:
    """``EngineArgs`` fields from the flags, as a dict (``serve`` sends it to the engine
    process without importing the engine, hence jax, itself)."""
    dtype = ns.dtype
    if ns.model is None and dtype == "auto":
        # The embedded model is stored in bfloat16 to stay small; it runs in float32, which is
        # many times faster on CPU (where bf16 products are emulated) and costs 34 MB.
        dtype = "float32"
    return dict(
        model=resolve_model(ns.model),
        dtype=dtype,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        min_token_bucket=ns.min_token_bucket,
        mixed_row_buckets=ns.mixed_row_buckets,
        enable_prefix_caching=ns.enable_prefix_caching,
        checkpoint_interval=ns.checkpoint_interval,
        retention_interval=ns.retention_interval,
        kernel_backend=ns.kernel_backend,
        allow_tf32=ns.allow_tf32,
        num_checkpoint_slots=ns.num_checkpoint_slots,
        cache_bytes=ns.cache_bytes,
        seed=ns.seed,
        tensor_parallel_size=ns.tensor_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel,
        compilation_cache_dir=ns.compilation_cache_dir or None,
        **extra,
    )


def resolve_model(model: str | None) -> str:
    """``--model`` as given, or the embedded default model's directory when it is omitted."""
    if model is not None:
        return model
    from hyjax.assets import model_dir

    return model_dir()


def engine_args(ns: argparse.Namespace, **extra):
    from serving.engine import EngineArgs

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


def row_request(row: dict, ns: argparse.Namespace):
    """A row's prompt and ``SamplingParams``, validated as the server validates a completion
    request (:class:`serving.protocol.GenerateRow`); ValueError names the bad field."""
    from pydantic import ValidationError

    from serving.protocol import GenerateRow

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
    return prompt, params, req.cache_salt


def cmd_generate(ns: argparse.Namespace) -> int:
    from serving.engine import LLMEngine

    if (ns.input is None) == (not ns.prompt):
        raise SystemExit("hyjax generate: give either --input FILE or --prompt TEXT (not both)")
    if ns.input is not None and ns.output is None:
        raise SystemExit("hyjax generate: --input needs --output")
    rows = read_rows(ns.input) if ns.input is not None else [{"prompt": p} for p in ns.prompt]
    requests: dict[int, tuple] = {}
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):  # checked before the model loads: a typo fails fast
        try:
            requests[i] = row_request(row, ns)
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
    for i, (prompt, params, salt) in requests.items():
        try:
            ids[i] = engine.add_request(prompt, params, request_id=str(i), cache_salt=salt)
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
    from serving.multihost import MultihostConfig

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
    kwargs = engine_kwargs(ns, progress=not ns.quiet, background_warmup=background)
    if multihost is not None and multihost.process_id > 0:
        import signal

        from serving.multihost import run_follower

        # A Ctrl-C sent to the whole group must not kill a follower under the leader's drain;
        # the leader's shutdown message ends it (SIGTERM still does, failing the leader).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = run_follower(kwargs, multihost)
        except BaseException:  # noqa: BLE001  (a failed step: the job cannot go on)
            logging.getLogger("serving.multihost").exception("follower failed")
            code = 1
        if code:  # the job is broken: skip jax.distributed's exit barrier, which would wait
            logging.shutdown()
            os._exit(code)
        return code
    if multihost is not None:
        import dataclasses

        kwargs["multihost"] = dataclasses.asdict(multihost)
    from serving.engine_client import EngineStartError
    from serving.server import serve

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
        "--warmup",
        default="background",
        choices=["background", "all"],
        help="background: answer once the model is loaded, compiling the step buckets in the "
        "background (a request may wait for its bucket); all: compile every bucket before "
        "the port answers (always so with several processes)",
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
