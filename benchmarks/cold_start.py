"""How soon a cold ``hyjax serve`` answers: the embedded model (or ``--model``), no persistent
compilation cache, one process.

Measures from the command's start: the port answering ``/health``, the first chat completion
(16 tokens, greedy) done, and the background warm-up's end (its log line). The same start
with every bucket compiled before the port answers (``--warmup all``, the behaviour before) is
the baseline, run by the same script one after the other::

    python -m benchmarks.cold_start --out benchmarks/results/cold_start_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from tests.serving.server_helpers import free_port, request


def one_start(model: str | None, *, sync_warmup: bool, timeout: float) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--port", str(port),
           "--compilation-cache-dir", ""]  # fmt: skip
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd += ["--warmup", "all" if sync_warmup else "background"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    out: dict = {"sync_warmup": sync_warmup}
    try:
        while "health_s" not in out:
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(open(log.name).read()[-3000:])
            try:
                if request("GET", url + "/health", timeout=2)[0] == 200:
                    out["health_s"] = time.monotonic() - start
            except OSError:
                time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Write is_prime(n)."}],
                "max_tokens": 16, "temperature": 0}  # fmt: skip
        status, reply = request("POST", url + "/v1/chat/completions", body, timeout=timeout)
        assert status == 200, reply
        out["first_reply_s"] = time.monotonic() - start
        while "compiled" not in (text := open(log.name).read()):
            if time.monotonic() - start > timeout:
                break
            time.sleep(0.5)
        out["all_buckets_s"] = time.monotonic() - start
        out["log_tail"] = [line for line in text.splitlines() if "compiled" in line]
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    runs = [one_start(ns.model, sync_warmup=s, timeout=ns.timeout) for s in (False, True)]
    write_report(runs, ns.model, ns.out)


def write_report(runs: list[dict], model: str | None, out: str | None) -> None:
    """Prints the CPU runs' report (machine, model, runs) and writes it to ``out``."""
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "cpu": _cpu_name(),
        "model": model or "embedded qwen3-next-pystdlib-tiny",
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
