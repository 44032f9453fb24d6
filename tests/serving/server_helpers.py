"""Starting ``hyjax serve`` as a subprocess and talking raw HTTP to it (stdlib only)."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.xla_flags import TEST_XLA_FLAGS

SMALL = ["--max-num-seqs", "4", "--min-seq-bucket", "4", "--max-num-batched-tokens", "64",
         "--max-model-len", "256"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``hyjax serve`` subprocess on 127.0.0.1 with its log in ``log_path``."""

    def __init__(self, model_dir: str, log_path: Path, *extra: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", model_dir]
        # Buckets compile as requests meet them: a test server meets few of them, and a
        # background warm-up of all of them would take a CI core from the tests (a test that
        # needs another warm-up passes its own --warmup, which wins).
        cmd += ["--port", str(self.port), "--quiet", "--warmup", "none", *SMALL, *extra]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)  # as tests/conftest.py
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if request("GET", self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def request(
    method: str,
    url: str,
    body: bytes | dict | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, dict | str]:
    """One HTTP request; returns (status, parsed JSON body or text)."""
    assert url.startswith("http://127.0.0.1:")
    hostport, _, path = url[len("http://") :].partition("/")
    host, port = hostport.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, "/" + path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read().decode("utf-8", "replace")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, data


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}``, the model_name label left out."""
    status, text = request("GET", url + "/metrics")
    assert status == 200 and isinstance(text, str)
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
            out[key] = float(value)
    return out
