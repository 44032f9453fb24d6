"""The HTTP front end's delivery rate: ``hyjax serve`` over a fake engine that steps on a clock.

Issue 20: the server streamed ~16 % fewer tokens a second than the engine in-process on an
H200 (``benchmarks.http_serving``), in bursts. This separates the front end (uvicorn, the
OpenAI layer, the engine client's reader thread) and the process boundary (the outbox queue)
from the engine: the engine process runs the real ``EngineLoop`` over a fake engine that emits
one token per live request every ``--step-ms``, of which ``--host-ms`` are spent in Python
holding the GIL (the engine's host work) and the rest sleeping with it released (the device).
A client streams ``--streams`` completions of ``--tokens`` tokens at once and reports the
chunks a second against the fake engine's rate, and the gaps between a stream's chunks.

    python -m benchmarks.frontend_rate --step-ms 4 --host-ms 1 --streams 1 8 --out RATE.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from serving.engine.llm_engine import RequestOutput


class ClockedEngine:
    """One token per live request per step; a step holds the GIL for ``host_s`` and ends
    ``step_s`` after the previous one (sleeping, GIL released, for the rest)."""

    def __init__(self, step_s: float, host_s: float) -> None:
        self.step_s, self.host_s = step_s, host_s
        self.reqs: dict[str, list] = {}
        self.next_t = time.perf_counter()

    def add_request(self, request) -> str:
        self.reqs[request.request_id] = [list(request.prompt), request.sampling_params.max_tokens]
        return request.request_id

    def abort_request(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.next_t = max(self.next_t + self.step_s, time.perf_counter())
        busy_until = time.perf_counter() + self.host_s
        while time.perf_counter() < busy_until:  # host work: Python, the GIL held
            pass
        time.sleep(max(0.0, self.next_t - time.perf_counter()))  # the device
        outs = []
        for rid, r in list(self.reqs.items()):
            r[1] -= 1
            done = r[1] <= 0
            outs.append(
                RequestOutput(rid, r[0], [], "", [7], " x", done, "length" if done else None, 0)
            )
            if done:
                del self.reqs[rid]
        return outs

    def metrics(self):
        from serving.engine.messages import EngineStats

        zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{**zeros, "num_running": len(self.reqs)})


def _clocked_engine_main(
    step_s: float, host_s: float, engine_kwargs: dict, inbox, outbox, log_level: int
) -> None:
    """The engine process's target (``engine_main``'s arguments after the clock's): the real
    loop over the clocked fake engine."""
    from serving.engine.engine_process import EngineLoop
    from serving.engine.messages import EngineInfo, Ready

    outbox.put([Ready(EngineInfo(4096, 2048, 256, 1000, 300))])
    EngineLoop(ClockedEngine(step_s, host_s), inbox, outbox).run()


def _server(port: int, step_s: float, host_s: float) -> None:
    """``hyjax serve``'s own ``serve()``, its engine process running the clocked engine."""
    import functools

    import serving.engine.engine_client as engine_client
    from hyjax.assets import model_dir
    from serving.entrypoints.server import serve

    # The spawned process finds its target by reference: a module-level partial.
    engine_client._engine_main = functools.partial(_clocked_engine_main, step_s, host_s)
    serve({"model": model_dir()}, port=port, log_level="warning")


async def _streams(url: str, n: int, tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        name = (await c.get(url + "/v1/models")).json()["data"][0]["id"]
        body = {"model": name, "prompt": list(range(100, 1100)), "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

        async def one() -> list[float]:
            times = []
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and "[DONE]" not in line:
                        times.append(time.perf_counter())
            return times

        t0 = time.perf_counter()
        runs = await asyncio.gather(*[one() for _ in range(n)])
        seconds = time.perf_counter() - t0
    chunks = sum(len(r) for r in runs)
    gaps = sorted(b - a for r in runs for a, b in itertools.pairwise(r))
    return {
        "streams": n,
        "tokens_each": tokens,
        "seconds": round(seconds, 3),
        "chunks": chunks,
        "chunks_per_s": round(chunks / seconds, 1),
        "gap_ms": {
            q: round(gaps[min(len(gaps) - 1, int(len(gaps) * q / 100))] * 1e3, 3)
            for q in (50, 90, 99)
        },  # fmt: skip
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-ms", type=float, default=4.0)
    p.add_argument("--host-ms", type=float, default=1.0)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--out", default=None)
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    step_s, host_s = args.step_ms / 1e3, args.host_ms / 1e3
    if args.serve_port is not None:  # the server subprocess
        _server(args.serve_port, step_s, host_s)
        return
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "benchmarks.frontend_rate", "--serve-port", str(port),
           "--step-ms", str(args.step_ms), "--host-ms", str(args.host_ms)]  # fmt: skip
    srv = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/v1/models")
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        runs = []
        for n in args.streams:
            r = asyncio.run(_streams(url, n, args.tokens))
            r["engine_tok_per_s"] = n / step_s
            r["delivered_over_engine"] = round(r["chunks_per_s"] / r["engine_tok_per_s"], 3)
            print(json.dumps(r), flush=True)
            runs.append(r)
    finally:
        srv.terminate()
        srv.wait()
    from benchmarks.common import device_name

    result = {"host": device_name(), "step_ms": args.step_ms, "host_ms": args.host_ms,
              "runs": runs}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
