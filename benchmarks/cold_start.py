"""How soon ``hyjax serve`` answers, cold and warm.

Measures from the command's start: the port answering ``/health``, the first completion (16
tokens, greedy) done, and every bucket compiled (the warm-up's log line). Two comparisons:

- default: the embedded model (or ``--model``), no persistent compilation cache, the
  background warm-up (``--warmup background``, serve's default) against compiling every bucket
  before the port opens (``--warmup all``, the behaviour before)::

      python -m benchmarks.cold_start --out benchmarks/results/cold_start_cpu.json

- ``--cache-runs``: the same command twice with one persistent compilation cache directory
  (``--compilation-cache-dir``, fresh and empty for the first start): cold, then warm. The
  first completion is a token-id prompt (a random model's text means nothing, and a dummy
  model dir may have no tokenizer). JAX's compile log (``JAX_LOG_COMPILES=1``) is counted:
  executables requested, served by the persistent cache, and compiled, in all and for the
  step function (``serving.worker.runner._step``); a warm start that compiles a step bucket
  says the cache did not serve it (a Pallas / Triton custom call, a ``shard_map``, ...).
  The issue-20 targets: cold start of the 48-layer 80B-shaped model at most 180 s to the
  first token, warm at most 30 s. CPU dry run of the tiny preset on two simulated devices::

      python -m benchmarks.full_size --write-config /tmp/tiny-q --model tiny-qwen3-next
      JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
          python -m benchmarks.cold_start --model /tmp/tiny-q --cache-runs \\
          --serve-args "--load-format dummy --tensor-parallel-size 2 --scan-layers"

  The GPU run (2 x H200: the 80B's 48 layers in bf16 are ~80 GB a card at TP 2, beyond an
  80 GB H100), scanned and then the per-layer loop as the baseline::

      python -m benchmarks.full_size --write-config /tmp/q80b --model qwen3-next-80b
      python -m benchmarks.cold_start --model /tmp/q80b --cache-runs --timeout 1800 \\
          --serve-args "--load-format dummy --tensor-parallel-size 2 --scan-layers" \\
          --out benchmarks/results/cold_start_h200x2_q80b_48layers_tp2_scan.json
      python -m benchmarks.cold_start --model /tmp/q80b --cache-runs --timeout 1800 \\
          --serve-args "--load-format dummy --tensor-parallel-size 2" \\
          --out benchmarks/results/cold_start_h200x2_q80b_48layers_tp2_loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from tests.serving.server_helpers import free_port, request

BUCKETS_DONE = re.compile(r"compiled (\d+) buckets")
# The step function in JAX's compile log: "jit(_step)" (compiles), "jit__step" (cache hits).
STEP_NAME = re.compile(r"jit\(_step\)|jit__step\b")


def one_start(
    model: str | None,
    *,
    sync_warmup: bool | None = False,
    timeout: float,
    cache_dir: str = "",
    serve_args: tuple[str, ...] = (),
    prompt_ids: list[int] | None = None,
    env: dict | None = None,
    keep_log: bool = False,
    wait_all: bool = True,
) -> dict:
    """One ``hyjax serve`` start, timed; the server is stopped after. ``sync_warmup``: None
    leaves ``--warmup`` to ``serve_args`` (or serve's default). ``prompt_ids``: the first
    request is a completion of these token ids (else a chat completion). ``keep_log``: the
    server's log file is kept (its path in the result), else removed. ``wait_all`` False: the
    server is stopped after the first reply (every bucket of a deep model takes many minutes;
    ``all_buckets_s`` is then None)."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--port", str(port),
           "--compilation-cache-dir", cache_dir]  # fmt: skip
    if model:
        cmd += ["--model", model]
    if sync_warmup is not None:
        cmd += ["--warmup", "all" if sync_warmup else "background"]
    cmd += list(serve_args)
    if env is None:
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    out: dict = {"command": shlex.join(cmd[1:])}
    if sync_warmup is not None:
        out["sync_warmup"] = sync_warmup
    try:
        while "health_s" not in out:
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(open(log.name).read()[-3000:])
            try:
                if request("GET", url + "/health", timeout=2)[0] == 200:
                    out["health_s"] = time.monotonic() - start
            except OSError:
                time.sleep(0.2)
        if prompt_ids is None:
            body = {"messages": [{"role": "user", "content": "Write is_prime(n)."}],
                    "max_tokens": 16, "temperature": 0}  # fmt: skip
            path = "/v1/chat/completions"
        else:
            body = {"prompt": prompt_ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            path = "/v1/completions"
        status, reply = request("POST", url + path, body, timeout=timeout)
        assert status == 200, reply
        out["first_reply_s"] = time.monotonic() - start
        while wait_all and not BUCKETS_DONE.search(text := open(log.name).read()):
            if time.monotonic() - start > timeout or proc.poll() is not None:
                break
            time.sleep(0.5)
        out["all_buckets_s"] = time.monotonic() - start if wait_all else None
        text = open(log.name).read()
        out["log_tail"] = [line for line in text.splitlines() if BUCKETS_DONE.search(line)]
        out["compiles"] = compile_counts(text)
    finally:
        proc.terminate()
        proc.wait(60)
        if keep_log:
            out["log"] = log.name
        else:
            os.unlink(log.name)
    return out


def compile_counts(log_text: str) -> dict:
    """JAX's compile log (``JAX_LOG_COMPILES=1``) counted: every executable jax asked for
    (``Finished XLA compilation``, cache hits included), those the persistent cache served,
    and the difference, compiled by XLA; in all and for the step function's buckets."""
    lines = log_text.splitlines()

    def count(pattern: str, step: bool) -> int:
        return sum(1 for ln in lines if pattern in ln and (not step or STEP_NAME.search(ln)))

    out = {}
    for scope, step in (("all", False), ("step", True)):
        requested = count("Finished XLA compilation of", step)
        hits = count("Persistent compilation cache hit", step)
        out[scope] = {"requested": requested, "cache_hits": hits, "compiled": requested - hits}
    return out


def cache_runs(
    model: str | None,
    serve_args: tuple[str, ...],
    timeout: float,
    keep_logs: bool = False,
    wait_all: bool = True,
) -> list[dict]:
    """A cold start on an empty persistent compilation cache directory, then a warm start on
    it; the directory is removed after."""
    cache_dir = tempfile.mkdtemp(prefix="hyjax-cold-start-cache-")
    env = dict(os.environ, JAX_LOG_COMPILES="1")
    prompt = list(range(1, 33))
    runs = []
    try:
        for name in ("cold", "warm"):
            r = one_start(model, sync_warmup=None, timeout=timeout, cache_dir=cache_dir,
                          serve_args=serve_args, prompt_ids=prompt, env=env,
                          keep_log=keep_logs, wait_all=wait_all)  # fmt: skip
            files = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs]
            r["cache_entries"] = len(files)
            r["cache_mb"] = round(sum(os.path.getsize(f) for f in files) / 2**20, 1)
            runs.append({"start": name, **r})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "log_tail"}), flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--cache-runs",
        action="store_true",
        help="cold then warm start on one persistent compilation cache (else: background "
        "against synchronous warm-up, no cache)",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help='more hyjax serve flags, one string (e.g. "--load-format dummy '
        '--tensor-parallel-size 2 --scan-layers")',
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' log files")
    p.add_argument(
        "--first-reply-only",
        action="store_true",
        help="stop each server after its first reply (do not wait for every bucket)",
    )
    ns = p.parse_args()
    serve_args = tuple(shlex.split(ns.serve_args))
    if ns.cache_runs:
        runs = cache_runs(
            ns.model, serve_args, ns.timeout, ns.keep_logs, wait_all=not ns.first_reply_only
        )
    else:
        runs = [
            one_start(
                ns.model,
                sync_warmup=s,
                timeout=ns.timeout,
                serve_args=serve_args,
                keep_log=ns.keep_logs,
            )  # fmt: skip
            for s in (False, True)
        ]
    write_report(runs, ns.model, ns.out)


def write_report(runs: list[dict], model: str | None, out: str | None) -> None:
    """Prints the runs' report (machine, devices, model, runs) and writes it to ``out``."""
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "cpu": _cpu_name(),
        "gpus": _gpu_names(),
        "model": model or "embedded qwen3-next-pystdlib-tiny",
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


def _gpu_names() -> list[str]:
    """``nvidia-smi``'s GPU names (empty without one); this process never starts JAX."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
