"""Load test for ``hyjax serve``: N concurrent streaming clients for M seconds, localhost only.

Each client loops: a streaming completion (a random prompt, a third of them sharing a long
prefix so the prefix cache works; random ``max_tokens``), and now and then a request that
must fail (400) or a stream it drops halfway (the server must abort it). At the end it
reports errors (anything unexpected: must be 0), p50/p99 time to first token and
inter-token latency as the clients saw them, token throughput, and whether the server's KV
and state pools are fully free again (``/metrics``). Either starts a server (``--model``)
or uses one (``--url``); a server it started is stopped with SIGTERM and must exit 0.

    python -m benchmarks.load_test --model /tmp/hyjax-tiny --clients 16 --duration 60
    python -m benchmarks.load_test --url http://127.0.0.1:8000 --clients 8 --duration 30

Exit status 0 only if there were no errors and the pools were free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

MAX_CLIENTS = 256
MAX_DURATION_S = 900
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
PREFIX = "You are a load test. Answer every question in exactly one sentence, please. " * 2


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.ok = 0
        self.rejected_as_expected = 0
        self.dropped = 0
        self.tokens = 0
        self.errors: list[str] = []


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader):
    """Decodes a chunked body, one chunk at a time."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def one_request(host: str, port: int, body: dict, headers: dict, drop_after: int | None):
    """Returns (status, ttft, chunk times, usage, done, error body)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{head}Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        t0 = time.perf_counter()
        status, hdrs = await _read_head(reader)
        if status != 200:
            return status, None, [], None, False, await reader.read()
        times: list[float] = []
        usage, done, buf = None, False, b""
        async for chunk in _chunks(reader):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    done = True
                    continue
                msg = json.loads(payload)
                if "error" in msg:
                    return status, None, times, None, False, payload
                if msg.get("usage"):
                    usage = msg["usage"]
                if msg["choices"] and msg["choices"][0]["text"]:
                    times.append(time.perf_counter())
                if drop_after is not None and len(times) >= drop_after:
                    return status, t0, times, None, False, None  # drop the connection
        ttft = times[0] - t0 if times else None
        return status, ttft, times, usage, done, None
    finally:
        writer.close()


async def client_loop(i: int, args, host: str, port: int, stats: Stats, end: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    while time.monotonic() < end:
        r = rng.random()
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x"]) for _ in range(8))
        prompt = (PREFIX if rng.random() < 1 / 3 else "") + f"Question {i}: {words}?"
        body = {
            "prompt": prompt,
            "max_tokens": rng.randint(args.max_tokens // 4, args.max_tokens),
            "temperature": 0.8,
            "top_p": 0.95,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        expect_bad = r < args.bad_fraction
        if expect_bad:
            body["temperature"] = -1.0
        drop = (
            rng.randint(1, 4)
            if args.bad_fraction <= r < args.bad_fraction + args.drop_fraction
            else None
        )
        try:
            status, ttft, times, usage, done, err = await asyncio.wait_for(
                one_request(host, port, body, headers, drop), timeout=args.request_timeout
            )
        except Exception as e:  # noqa: BLE001  (every failure is counted, none stops the run)
            stats.errors.append(f"{type(e).__name__}: {e}")
            continue
        if expect_bad:
            if status == 400:
                stats.rejected_as_expected += 1
            else:
                stats.errors.append(f"bad request answered {status}")
            continue
        if status != 200 or err is not None:
            stats.errors.append(f"status {status}: {err!r:.200}")
            continue
        if drop is not None:
            stats.dropped += 1
            continue
        if not done or usage is None:
            stats.errors.append("stream ended without usage and [DONE]")
            continue
        stats.ok += 1
        stats.tokens += usage["completion_tokens"]
        if ttft is not None:
            stats.ttft.append(ttft)
        stats.itl.extend(b - a for a, b in zip(times, times[1:]))


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[re.sub(r"\{.*\}", "", key) if "pool" not in key else key] = float(value)
    return out


def wait_pools_free(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        free = all(
            m.get(k, 1) == 0
            for k in (
                "hyjax:num_requests_running",
                "hyjax:num_requests_waiting",
                "hyjax:kv_cache_usage_perc",
                "hyjax:state_cache_usage_perc",
            )
        )
        if free or time.monotonic() > deadline:
            m["pools_free"] = float(free)
            return m
        time.sleep(0.2)


def start_server(args) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", args.model]
    cmd += ["--quiet", "--port", str(port), *args.server_args.split()]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready")


async def run(args, url: str) -> Stats:
    u = urllib.parse.urlparse(url)
    stats = Stats()
    end = time.monotonic() + args.duration
    await asyncio.gather(
        *(client_loop(i, args, u.hostname, u.port or 80, stats, end) for i in range(args.clients))
    )
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="start a server on this checkpoint")
    src.add_argument("--url", help="use a running server (localhost only)")
    p.add_argument(
        "--server-args",
        default="--max-num-seqs 8 --max-num-batched-tokens 128 --max-model-len 512",
        help="extra flags for a server this script starts",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bad-fraction", type=float, default=0.05, help="requests that must get 400")
    p.add_argument("--drop-fraction", type=float, default=0.05, help="streams dropped midway")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here too")
    args = p.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.duration <= MAX_DURATION_S:
        p.error(f"--clients must be in [1, {MAX_CLIENTS}], --duration in (0, {MAX_DURATION_S}]")
    proc = None
    if args.model:
        proc, url = start_server(args)
    else:
        url = args.url.rstrip("/")
        if urllib.parse.urlparse(url).hostname not in LOCAL_HOSTS:
            p.error("--url must point at this machine (127.0.0.1 / localhost)")
    try:
        before = scrape(url)
        t0 = time.monotonic()
        stats = asyncio.run(run(args, url))
        wall = time.monotonic() - t0
        after = wait_pools_free(url)
    finally:
        exit_code = None
        if proc is not None:
            proc.terminate()
            exit_code = proc.wait(120)
    gen = after["hyjax:generation_tokens_total"] - before["hyjax:generation_tokens_total"]
    result = {
        "clients": args.clients,
        "duration_s": round(wall, 1),
        "completed": stats.ok,
        "rejected_as_expected": stats.rejected_as_expected,
        "dropped_midway": stats.dropped,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:5],
        "ttft_p50_ms": round(percentile(stats.ttft, 50) * 1e3, 1),
        "ttft_p99_ms": round(percentile(stats.ttft, 99) * 1e3, 1),
        "itl_p50_ms": round(percentile(stats.itl, 50) * 1e3, 2),
        "itl_p99_ms": round(percentile(stats.itl, 99) * 1e3, 2),
        "itl_mean_ms": round(statistics.fmean(stats.itl) * 1e3, 2) if stats.itl else None,
        "completion_tokens_per_s": round(stats.tokens / wall, 1),
        "server_generated_tokens_per_s": round(gen / wall, 1),
        "preemptions": after["hyjax:num_preemptions_total"] - before["hyjax:num_preemptions_total"],
        "pools_free_after": bool(after["pools_free"]),
        "server_exit_code": exit_code,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    good = not stats.errors and result["pools_free_after"] and exit_code in (None, 0)
    return 0 if good else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # for a server this script starts
    sys.exit(main())
