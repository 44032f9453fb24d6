"""``hyjax serve`` measured from the client, as users measure a server, against the engine.

Issue 20: the server's output throughput should be within 10 % of the engine's. A well-kept
client does the HTTP side: NVIDIA's ``aiperf`` (``pip install aiperf``; vLLM's ``bench serve``
and SGLang's ``bench_serving`` need their whole serving packages). It sends streaming
``/v1/completions`` of ``--input-len`` tokens (text that the model's tokenizer encodes to
exactly that many: aiperf tokenizes its synthetic prompts with the same tokenizer directory),
``max_tokens`` ``--output-len`` with ``ignore_eos`` and ``temperature`` 0, at most
``--concurrency`` in flight, ``--num-prompts`` of them after a warm-up of ``--concurrency``
requests; token counts are the server's (``usage``). Then the engine runs the very prompts
aiperf sent (its ``inputs.json``) in this process, through ``serving_throughput.drive``, with
the same engine flags, and the JSON holds both and ``server_over_engine``, the ratio of output
tokens per second.

The metrics, by vLLM ``bench serve``'s names: TTFT (aiperf ``time_to_first_token``), ITL (the
gaps between a request's streamed tokens: aiperf ``inter_chunk_latency``, the server streams a
token a chunk) and TPOT (per request, (last - first token) / (tokens - 1): what aiperf calls
``inter_token_latency``); output tok/s is aiperf's ``output_token_throughput``.

The server is started here (``--warmup all``: every step bucket compiled before the port
opens, as the engine compiles its buckets before it is timed) and stopped afterwards, unless
``--url`` names one already running on this machine (then its flags are the user's to match).
The engine flags are ``hyjax serve``'s, with the workload's defaults: ``--max-num-seqs`` the
concurrency, one prefill token bucket (``--min-token-bucket`` the step budget, no mixed row
buckets), prefix caching off, ``--max-model-len`` input + output + 64. aiperf may live in
another environment (``--aiperf PATH``); with a local tokenizer directory it needs no network
(``HF_HUB_OFFLINE`` is dropped from its environment: aiperf 0.13 then refuses local paths).

    JAX_PLATFORMS=cpu python -m benchmarks.http_serving --aiperf VENV/bin/aiperf \\
        --num-prompts 16 --input-len 128 --output-len 64 --concurrency 4 --out RESULT.json
    python -m benchmarks.http_serving --model /tmp/q80b24 --load-format dummy --dtype bfloat16 \\
        --block-size 64 --max-num-batched-tokens 2048 --input-len 1000 --output-len 2000 \\
        --concurrency 8 --num-prompts 8   # a GPU, aiperf's wheels on PYTHONPATH (BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.cold_start import _cpu_name, _gpu_names
from serving.engine.engine_args import EngineArgs, add_engine_args, engine_kwargs, flag_fields
from tests.serving.server_helpers import free_port, request

AIPERF_EXPORT = "profile_export_aiperf.json"


def serve_flags(kwargs: dict) -> list[str]:
    """``hyjax serve`` flags that rebuild ``kwargs`` (``EngineArgs`` fields) on the server's
    side: the in-process engine and the server get the same configuration by construction."""
    flags = []
    for f in flag_fields():
        value, name = kwargs[f.name], "--" + f.name.replace("_", "-")
        if f.name == "compilation_cache_dir" and value is None:
            flags += [name, ""]  # None is "off", which the flag spells ''
        elif value is None:
            continue
        elif f.default is False:  # a store_true flag
            flags += [name] if value else []
        elif isinstance(value, bool):  # a --flag / --no-flag pair
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, str(value)]
    return flags


def cpu_set(spec: str | None) -> set[int] | None:
    """``"0-15"`` or ``"0,2,4-7"`` as a set of CPU ids (None: no pinning)."""
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def core_groups(
    sysfs: str = "/sys/devices/system/cpu", cpus: set[int] | None = None
) -> list[list[int]]:
    """``cpus`` (default: those this process may use), grouped by physical core (SMT siblings
    together), the groups in order of their first CPU; a group a CPU where the topology is not
    readable."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0) if cpus is None else cpus):
        topo = Path(sysfs) / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(),
                   (topo / "core_id").read_text().strip())  # fmt: skip
        except OSError:
            key = ("cpu", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values())


def split_cores(groups: list[list[int]]) -> tuple[set[int], set[int]]:
    """The first half of the physical cores (with their SMT siblings) for the server, the
    rest for the client: a client on the siblings of the engine's cores would slow the
    engine's launch thread as no remote client does."""
    if len(groups) < 2:
        raise ValueError(f"--split-cpus needs two physical cores or more, found {groups}")
    half = len(groups) // 2
    return {c for g in groups[:half] for c in g}, {c for g in groups[half:] for c in g}


def _pinned(cpus: set[int] | None):
    """A ``preexec_fn`` that pins the child (and what it spawns) to ``cpus``."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def start_server(
    kwargs: dict, timeout: float, log_path: Path, cpus: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """``hyjax serve`` on a free local port, every bucket compiled before it answers; returns
    the process and its URL once ``/health`` answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--port", str(port),
           "--warmup", "all", "--quiet", *serve_flags(kwargs)]  # fmt: skip
    print("server:", shlex.join(cmd[1:]), flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pinned(cpus))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hyjax serve exited ({proc.returncode}):\n{log_path.read_text()}")
        try:
            if request("GET", url + "/health", timeout=2)[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"hyjax serve not ready after {timeout} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def step_figures(
    steps: int, host_s: float, device_s: float, seconds: float, loop_s: float | None = None
) -> dict:
    """The engine's steps over a run: host and device-wait ms a step, and the share of the
    run's wall time they cover (the rest: the loop between steps, idle waiting for work);
    in the server, the engine loop's ms a step around them (requests in, deltas out)."""
    n, t = max(steps, 1), max(seconds, 1e-9)
    out = {"steps": steps, "host_ms_per_step": round(1e3 * host_s / n, 3),
           "device_ms_per_step": round(1e3 * device_s / n, 3),
           "steps_per_s": round(steps / t, 1),
           "busy_share": round((host_s + device_s) / t, 3)}  # fmt: skip
    if loop_s is not None:
        out["loop_ms_per_step"] = round(1e3 * loop_s / n, 3)
    return out


STEP_COUNTERS = (
    "engine_steps", "engine_step_host_seconds", "engine_step_device_seconds",
    "engine_loop_seconds",
)  # fmt: skip


def scrape_steps(url: str) -> list[float]:
    """The server's engine step counters (``STEP_COUNTERS``), then the time read."""
    status, text = request("GET", url + "/metrics")
    assert status == 200 and isinstance(text, str), status
    got = {}
    for line in text.splitlines():
        for name in STEP_COUNTERS:
            if line.startswith(f"hyjax:{name}_total"):
                got[name] = float(line.rpartition(" ")[2])
    return [got.get(name, 0.0) for name in STEP_COUNTERS] + [time.monotonic()]


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """``py-spy record`` of ``pid`` for ``seconds`` (collapsed stacks, text, at ``out``), in the
    background; None when py-spy is not installed."""
    found = [Path(p) / "bin" / "py-spy" for p in sys.path]  # pip install --target's bin/
    exe = shutil.which("py-spy") or next((str(f) for f in found if f.exists()), None)
    if exe is None:
        print("py-spy not found: no host profile", flush=True)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
           "--nonblocking", "--format", "raw", "--output", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "w"))


def spy_once_stepping(
    url: str, steps_before: float, pid: int, seconds: float, out: Path
) -> subprocess.Popen | None:
    """Starts py-spy on the server's engine once it steps (aiperf's own start-up takes
    seconds, during which the engine waits idle and py-spy, which skips idle threads, would
    record nothing)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if scrape_steps(url)[0] > steps_before:
            return py_spy(pid, seconds, out)
        time.sleep(0.2)
    return None


def engine_pid(server: subprocess.Popen) -> int | None:
    """The server's engine process (its spawned multiprocessing child)."""
    try:
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    return None


def tokenizer_dir(model_dir: str) -> str:
    """The directory whose tokenizer the server uses: the model's, or (random weights from a
    bare ``config.json``) the embedded model's."""
    if (Path(model_dir) / "tokenizer_config.json").exists():
        return model_dir
    from hyjax.assets import model_dir as embedded_dir

    return embedded_dir()


def aiperf_command(args, model_name: str, url: str, tokenizer: str, out_dir: str) -> list[str]:
    extra = json.dumps({"ignore_eos": True, "temperature": 0.0})
    return [
        *shlex.split(args.aiperf), "profile", "--model", model_name, "--url", url,
        "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
        "--prompt-input-tokens-mean", str(args.input_len), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_len),
        "--prompt-output-tokens-stddev", "0", "--extra-inputs", extra,
        "--concurrency", str(args.concurrency), "--request-count", str(args.num_prompts),
        "--warmup-request-count", str(args.concurrency), "--random-seed", str(args.random_seed),
        "--use-server-token-count", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
        "--output-artifact-dir", out_dir, *shlex.split(args.aiperf_args),
    ]  # fmt: skip


def run_aiperf(cmd: list[str], out_dir: str, timeout: float, cpus: set[int] | None = None) -> dict:
    """Runs aiperf; returns its JSON export. Its console output goes to ``aiperf.log`` there."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    print("client:", shlex.join(cmd), flush=True)
    log_path = Path(out_dir) / "aiperf.log"
    with open(log_path, "w") as log:
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
            preexec_fn=_pinned(cpus),
        )  # fmt: skip
    export = Path(out_dir) / AIPERF_EXPORT
    if code.returncode or not export.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise SystemExit(f"aiperf failed ({code.returncode}):\n{tail}")
    return json.loads(export.read_text())


def _stats(export: dict, tag: str) -> dict:
    """aiperf's ``{"avg", "p50", ...}`` of one metric as ``percentiles`` writes them."""
    m = export.get(tag) or {}
    out = {q: round(m[q], 3) if m.get(q) is not None else None for q in ("p50", "p90", "p99")}
    return out | {"mean": round(m["avg"], 3) if m.get("avg") is not None else None}


def aiperf_summary(export: dict) -> dict:
    """The client's view, keyed like ``serving_throughput.metrics``."""

    def avg(tag: str) -> float | None:
        return (export.get(tag) or {}).get("avg")

    tok_s = avg("output_token_throughput")
    return {
        "requests": int(avg("request_count") or 0),
        "errors": sum(e.get("count", 0) for e in export.get("error_summary") or []),
        "seconds": round(avg("benchmark_duration"), 3),
        "output_tokens": int(avg("total_output_tokens") or 0),
        "output_tok_per_s": round(tok_s, 2) if tok_s is not None else None,
        "mean_input_tokens": avg("input_sequence_length"),
        "mean_output_tokens": avg("output_sequence_length"),
        "ttft_ms": _stats(export, "time_to_first_token"),
        "itl_ms": _stats(export, "inter_chunk_latency"),
        "tpot_ms": _stats(export, "inter_token_latency"),
    }


def sent_prompts(out_dir: str) -> list[str]:
    """The prompts aiperf's dataset held (``inputs.json``): its warm-up takes the first ones,
    its measured requests all of them in turn."""
    data = json.loads((Path(out_dir) / "inputs.json").read_text())["data"]
    return [turn["prompt"] for entry in data for turn in entry["payloads"]]


def run_engine(kwargs: dict, prompts: list[str], args, out_dir: str) -> dict:
    """The same workload through ``LLMEngine`` in this process: every bucket and a short pass
    compiled first (``serving_throughput.run_one``'s warm-up), then timed by ``drive``."""
    # jax initialises its devices here, after the server (which held them) has exited.
    from benchmarks.common import device_name
    from benchmarks.serving_throughput import drive, metrics
    from serving.core.request import SamplingParams
    from serving.engine.llm_engine import LLMEngine

    deadline = time.perf_counter() + args.max_seconds
    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(**kwargs))
    res = {"device": device_name(), "engine_start_s": round(time.perf_counter() - t0, 2)}
    t0 = time.perf_counter()
    engine.runner.warmup(progress=False)
    warm = SamplingParams(max_tokens=args.warmup_output_len, temperature=0.0, ignore_eos=True)
    drive(engine, prompts[: args.concurrency], warm, args.concurrency, deadline)
    res["compile_s"] = round(time.perf_counter() - t0, 2)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    compiles, prompt_tokens = engine.runner.compile_count(), engine.prompt_tokens
    engine.timing.reset()
    spy = None
    if args.py_spy:
        spy = py_spy(os.getpid(), args.py_spy, Path(out_dir) / "py_spy_engine.txt")
    traces, seconds, cut = drive(engine, prompts, params, args.concurrency, deadline)
    if spy is not None:
        spy.wait()
    res |= metrics(traces, seconds)
    res["engine_steps"] = step_figures(
        engine.timing.steps, engine.timing.host, engine.timing.device, seconds
    )
    res["mean_input_tokens"] = (engine.prompt_tokens - prompt_tokens) / max(len(prompts), 1)
    res["partial"] = cut
    res["compiles_while_measured"] = engine.runner.compile_count() - compiles
    return res


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)  # hyjax serve's engine flags, for both sides
    # The workload's engine: one token bucket for prefill steps, no prefix reuse (random text).
    p.set_defaults(max_num_seqs=None, min_token_bucket=None, mixed_row_buckets=False,
                   enable_prefix_caching=False)  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16, help="measured requests")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--random-seed", type=int, default=0, help="aiperf's prompt seed")
    p.add_argument("--url", default=None, help="a running server (http://127.0.0.1:PORT)")
    p.add_argument("--aiperf", default=shutil.which("aiperf") or f"{sys.executable} -m aiperf")
    p.add_argument("--aiperf-args", default="", help="more aiperf profile flags")
    p.add_argument("--tokenizer", default=None, help="for aiperf (default: the server's)")
    p.add_argument("--no-engine", action="store_true", help="measure the server alone")
    p.add_argument("--warmup-output-len", type=int, default=4, help="the engine's short pass")
    p.add_argument("--server-timeout", type=float, default=1200.0, help="s to /health")
    p.add_argument("--max-seconds", type=float, default=900.0, help="aiperf's and the engine's")
    p.add_argument("--artifact-dir", default=None, help="keep aiperf's files here")
    p.add_argument(
        "--server-cpus",
        default=None,
        help="pin the server (HTTP and engine processes) to these CPUs, e.g. 0-7; with "
        "--client-cpus on others, aiperf's dozen processes do not take the engine loop's cores",
    )
    p.add_argument("--client-cpus", default=None, help="pin aiperf to these CPUs, e.g. 8-15")
    p.add_argument(
        "--split-cpus",
        action="store_true",
        help="the server on the first half of the physical cores, aiperf on the other half, "
        "SMT siblings with their core (instead of --server-cpus / --client-cpus)",
    )
    p.add_argument(
        "--py-spy",
        type=float,
        default=0.0,
        help="seconds of py-spy (collapsed stacks) of the server's engine process from aiperf's "
        "start, and of this process's in-process engine run, into the artifact dir",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.url and not args.url.startswith("http://127.0.0.1:"):
        p.error("--url must be a server on this machine (http://127.0.0.1:PORT)")
    if args.split_cpus:
        if args.server_cpus or args.client_cpus:
            p.error("--split-cpus replaces --server-cpus and --client-cpus")
        try:
            split = split_cores(core_groups())
        except ValueError as e:
            p.error(str(e))
        args.server_cpus, args.client_cpus = (",".join(map(str, sorted(c))) for c in split)
    budget = args.max_num_batched_tokens
    kwargs = engine_kwargs(args, warmup=False, progress=False)
    kwargs["max_num_seqs"] = args.max_num_seqs or args.concurrency
    kwargs["min_token_bucket"] = args.min_token_bucket or budget
    kwargs["max_model_len"] = args.max_model_len or args.input_len + args.output_len + 64
    return args, kwargs


def main(argv: list[str] | None = None) -> dict:
    args, kwargs = parse_args(argv)
    out_dir = args.artifact_dir or tempfile.mkdtemp(prefix="hyjax-http-bench-")
    os.makedirs(out_dir, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    results: dict = {
        "commit": commit.stdout.strip() or None,
        "cpu": f"{_cpu_name()}, {os.cpu_count()} cores",
        "gpus": _gpu_names(),
        "engine_args": kwargs,
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "concurrency": args.concurrency,
                     "ignore_eos": True, "temperature": 0.0, "endpoint": "/v1/completions",
                     "stream": True, "warmup_requests": args.concurrency,
                     "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
                     "physical_cores": core_groups()},
    }  # fmt: skip
    proc, url = None, args.url
    if url is None:
        t0 = time.monotonic()
        proc, url = start_server(
            kwargs, args.server_timeout, Path(out_dir) / "server.log", cpu_set(args.server_cpus)
        )
        results["server_start_s"] = round(time.monotonic() - t0, 1)
    try:
        status, models = request("GET", url + "/v1/models")
        assert status == 200, models
        model = models["data"][0]
        tokenizer = args.tokenizer or tokenizer_dir(model.get("root") or kwargs["model"])
        cmd = aiperf_command(args, model["id"], url, tokenizer, out_dir)
        before = scrape_steps(url)
        spy: list = []
        watch = None
        if args.py_spy and proc is not None and (pid := engine_pid(proc)) is not None:
            out = Path(out_dir) / "py_spy_server_engine.txt"
            watch = threading.Thread(
                target=lambda: spy.append(spy_once_stepping(url, before[0], pid, args.py_spy, out)),
                daemon=True,
            )
            watch.start()
        export = run_aiperf(cmd, out_dir, args.max_seconds, cpu_set(args.client_cpus))
        if watch is not None:
            watch.join()
        for p in spy:
            if p is not None:
                p.wait()
        after = scrape_steps(url)
        # the engine process inside the server, over aiperf's whole run (its warm-up included)
        steps, host, device, loop, seconds = (a - b for a, b in zip(after, before, strict=True))
        results["server_engine_steps"] = step_figures(int(steps), host, device, seconds, loop)
    finally:
        if proc is not None:
            results["server_exit_code"] = stop_server(proc)
    results["tool"] = {"name": "aiperf", "version": export.get("aiperf_version"),
                       "command": shlex.join(cmd)}  # fmt: skip
    results["server"] = aiperf_summary(export)
    print("server:", json.dumps(results["server"]), flush=True)
    print("server's engine steps:", json.dumps(results.get("server_engine_steps")), flush=True)
    if not args.no_engine:
        if (cpus := cpu_set(args.server_cpus)) is not None:
            os.sched_setaffinity(0, cpus)  # the engine on the server's cores
        results["engine"] = run_engine(kwargs, sent_prompts(out_dir), args, out_dir)
        print("engine:", json.dumps(results["engine"]), flush=True)
        server_tps, engine_tps = (results[k]["output_tok_per_s"] for k in ("server", "engine"))
        results["server_over_engine"] = round(server_tps / engine_tps, 3)
        print(f"server / engine output tok/s: {server_tps} / {engine_tps} = "
              f"{results['server_over_engine']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.artifact_dir is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
