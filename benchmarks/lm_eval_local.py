"""lm-evaluation-harness against ``hyjax serve``: both output types on local docs, no hub.

Starts ``hyjax serve`` on the embedded tiny model (or ``--model``), waits for it, then runs
lm-eval's ``local-completions`` model on ``benchmarks/lm_eval_tasks`` (``hyjax_tiny_mc``:
loglikelihood through ``echo`` + ``logprobs``; ``hyjax_tiny_gen``: ``generate_until``)::

    pip install -e '.[eval]'
    python -m benchmarks.lm_eval_local              # the tiny model, both tasks
    python -m benchmarks.lm_eval_local --model DIR --tasks hyjax_tiny_mc

The tiny model's scores mean nothing; the run checks that the API gives lm-eval what it reads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "benchmarks" / "lm_eval_tasks"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hyjax serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"hyjax serve not ready after {timeout} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the embedded tiny model)")
    ap.add_argument("--tasks", default="hyjax_tiny_mc,hyjax_tiny_gen")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="hyjax-lm-eval-")
    model = args.model
    if model is None:
        from hyjax.tiny import make_tiny_model

        model = make_tiny_model(Path(tmp) / "tiny", seed=0)
    url = f"http://127.0.0.1:{args.port}"
    serve = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", model,
             "--port", str(args.port), "--served-model-name", "hyjax", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(serve, cwd=ROOT, env=dict(os.environ))
    try:
        wait_ready(url, proc, 600)
        model_args = (
            f"model=hyjax,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model},num_concurrent=4,max_retries=1,tokenized_requests=True"
        )
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
               "--model_args", model_args, "--tasks", args.tasks,
               "--include_path", str(TASKS), "--output_path", tmp]  # fmt: skip
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        return subprocess.call(cmd, cwd=ROOT, env=env)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
