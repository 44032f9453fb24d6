"""``hyjax serve`` across two processes (``jax.distributed``), as users start it.

Two CPU processes with 2 simulated devices each run ``--tensor-parallel-size 4`` over both:
process 0 serves HTTP and plans, process 1 mirrors its steps (serving/engine/multihost.py).
Process 1 is given less cache memory: both must size their pools from its budget. The
official ``openai`` client's greedy completions must match a one-process, one-device engine
token for token; SIGTERM on the leader must end both processes with exit code 0. The plan
channel's failure paths are tested on real sockets without JAX.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest

from serving.core.plan import StepPlan, StepShape
from serving.engine.multihost import (
    FatalStepErrors,
    MultihostConfig,
    PlanBroadcaster,
    _encode,
    _recv_frame,
    decode_plan,
    exit_on_lost,
    signature_mismatch,
)
from serving.worker.distributed import smallest_cache_bytes
from tests.serving.server_helpers import free_port, request
from tests.xla_flags import with_devices

# Byte-level tokens: the first two share 70 tokens, past the 64-token checkpoint granularity.
SHARED = "def fibonacci(n):\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in"
PROMPTS = [
    SHARED + " range(n):",
    SHARED + " range(2, n + 1):",
    "import os\nimport sys\nimport re\n",
]
# One sequence at a time, every prefill chunk in one 64-token bucket: two step shapes to warm
# up, with the follower mirroring (a TP = 4 step over two processes compiles for many seconds).
FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--min-token-bucket", "64"]
FLAGS += ["--max-model-len", "128"]
# Checkpoint slots differ by process (as defaults do when only one gets --cache-bytes): all
# plan with the fewest.
CHECKPOINT_SLOTS = {0: "5", 1: "4"}
MAX_TOKENS = 8
# The follower "has less memory": a budget of 10 KV blocks (null included) and 6 state slots
# per device (2048 B/block, 1792 B/slot for this model under TP 4), one block less than the
# leader's CPU default. Both must size their pools from it.
FOLLOWER_CACHE_BYTES = 10 * 2048 + 6 * 1792


def _write_model(out: str) -> str:
    """A tiny Qwen3-Next whose head counts split 4 ways, with the byte-level tokenizer."""
    from hyjax.saver import save_hf_checkpoint
    from hyjax.tiny import byte_level_tokenizer
    from tests.serving.tp_worker import random_model, tp_config

    tok = byte_level_tokenizer()
    cfg = tp_config(vocab_size=tok.get_vocab_size())
    save_hf_checkpoint(random_model(cfg, 2), cfg, out)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out


def _reference(model_dir: str) -> list[str]:
    """The same prompts on one process, one device (the test's own JAX)."""
    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(
        EngineArgs(model=model_dir, max_num_seqs=1, max_num_batched_tokens=64,
                   min_token_bucket=64, max_model_len=128, progress=False, warmup=False)
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)) for p in PROMPTS]
    out = engine.run_to_completion()
    return [out[i].text for i in ids]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Leader and follower subprocesses; yields (leader, follower, url, log paths)."""
    d = tmp_path_factory.mktemp("multihost")
    model_dir = _write_model(str(d / "model"))
    http, coord, plans = free_port(), free_port(), free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=with_devices(2),
    )
    # Not --quiet: the checks read the INFO lines (pool agreement, the follower's shutdown).
    base = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", model_dir]
    base += [
        *FLAGS,
        "--tensor-parallel-size",
        "4",
        "--coordinator-address",
        f"localhost:{coord}",
    ]
    base += ["--num-processes", "2", "--plan-port", str(plans)]
    procs, logs = [], []
    for pid in (0, 1):
        cmd = [*base, "--process-id", str(pid), "--num-checkpoint-slots", CHECKPOINT_SLOTS[pid]]
        cmd += ["--port", str(http)] if pid == 0 else ["--cache-bytes", str(FOLLOWER_CACHE_BYTES)]
        logs.append(d / f"process{pid}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    url = f"http://127.0.0.1:{http}"
    try:
        yield procs, url, logs, model_dir
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _wait_ready(procs, url, logs, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(
                    f"{log.name} exited ({p.returncode}):\n{log.read_text()[-4000:]}"
                )
        try:
            if request("GET", url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("\n".join(log.read_text()[-3000:] for log in logs))


@pytest.fixture(scope="module")
def expected(job):
    return _reference(job[3])  # while the job compiles its buckets


def _pools(log_text: str) -> dict:
    """The memory plan a process logged: its agreed budget, pool lines and entry sizes."""
    agreed = re.search(r"pools sized to the smallest process: (\d+) bytes .* budgets by "
                       r"process: \[(\d+), (\d+)\]", log_text)  # fmt: skip
    kv = re.search(r"KV cache: (\d+) blocks .* \((\d+) B/block\)", log_text)
    state = re.search(r"state cache: (\d+) slots .* \((\d+) B/slot\)", log_text)
    assert agreed and kv and state, log_text[-3000:]
    return dict(
        agreed=int(agreed[1]),
        budgets=[int(agreed[2]), int(agreed[3])],
        lines=(kv[0], state[0]),
        kv_blocks=int(kv[1]) + 1,  # the log counts the usable blocks
        state_slots=int(state[1]) + 1,
        kv_bytes=int(kv[2]),
        slot_bytes=int(state[2]),
    )


def test_a_process_with_less_memory_sizes_every_process_pools(job, expected):
    """The follower's budget is smaller than the leader's: both plan from it, so the pools
    (and the handshake's signature) agree; the serve test below runs on these pools."""
    procs, url, logs, _ = job
    _wait_ready(procs, url, logs)
    leader, follower = (_pools(log.read_text()) for log in logs)
    assert leader["budgets"] == follower["budgets"]
    assert follower["budgets"][1] == FOLLOWER_CACHE_BYTES < leader["budgets"][0]
    assert leader["agreed"] == follower["agreed"] == FOLLOWER_CACHE_BYTES
    assert leader["lines"] == follower["lines"]  # identical KV and state pools
    for log in logs:
        assert "checkpoint slots by process: [5, 4]; all use 4" in log.read_text()
    kv, slot = leader["kv_bytes"], leader["slot_bytes"]
    running = 1 + 1 + 4  # NULL slot, one running sequence, four checkpoints
    assert leader["state_slots"] == running
    assert leader["kv_blocks"] == (FOLLOWER_CACHE_BYTES - running * slot) // kv == 10
    alone = (leader["budgets"][0] - running * slot) // kv  # what the leader would have had
    assert alone > leader["kv_blocks"]


def test_two_process_serve_matches_one_device_and_stops_on_sigterm(job, expected):
    procs, url, logs, model_dir = job
    _wait_ready(procs, url, logs)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    kw = dict(model=name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt=PROMPTS[0], **kw)
    assert first.choices[0].text == expected[0]
    batch = client.completions.create(prompt=PROMPTS, **kw)  # scheduled together
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    assert batch.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)
    # the repeated prompt and its sibling hit the prefix cache (64 tokens each)
    assert batch.usage.prompt_tokens_details.cached_tokens == 128
    time.sleep(1.0)  # idle for a while: the follower waits, nothing times out
    again = client.completions.create(prompt=PROMPTS[2], stream=True, **kw)
    assert "".join(c.choices[0].text for c in again) == expected[2]
    procs[0].terminate()  # SIGTERM to the leader only: it drains, then stops the follower
    codes = [p.wait(60) for p in procs]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "shutdown after" in logs[1].read_text()


# ------------------------------------------------------------------------------ no JAX


def _broadcaster(num_processes=2, on_lost=None):
    port = free_port()
    cfg = MultihostConfig(f"127.0.0.1:{port - 1}", num_processes, 0, plan_port=port)
    return cfg, PlanBroadcaster(cfg, on_lost or (lambda reason: None))


def _follower(cfg: MultihostConfig, pid: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", cfg.channel_port), timeout=10)
    s.sendall(_encode({"kind": "hello", "process_id": pid}))
    return s


def test_plans_travel_intact_and_a_lost_follower_is_reported():
    lost = []
    cfg, b = _broadcaster(on_lost=lost.append)
    stranger = socket.create_connection(("127.0.0.1", cfg.channel_port), timeout=10)
    stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")  # turned away, not waited for
    f = _follower(cfg, 1)
    b.accept({"num_kv_blocks": 7}, timeout=10)
    hello, _ = _recv_frame(f)
    assert hello == {"kind": "hello", "num_kv_blocks": 7}
    try:  # closed with its bytes unread: a reset, or an orderly end
        assert stranger.recv(1) == b""
    except ConnectionResetError:
        pass
    stranger.close()
    plan = StepPlan.empty(StepShape(8, 2, 4, 1, False))
    plan.input_ids[:] = np.arange(8)
    plan.sampling.seeds[:] = [2**32 - 1, 5]
    plan.num_seqs[...] = 2
    b.send(plan)
    got = decode_plan(*_recv_frame(f))
    assert got.shape == plan.shape
    for k, v in plan.arrays().items():
        assert got.arrays()[k].dtype == v.dtype and np.array_equal(got.arrays()[k], v), k
    f.close()  # the follower dies
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "follower process 1 of 2 left" in lost[0]
    b.close()


def test_a_follower_that_differs_tells_the_leader_why():
    lost = []
    cfg, b = _broadcaster(on_lost=lost.append)
    f = _follower(cfg, 1)
    b.accept({"num_kv_blocks": 11}, timeout=10)
    assert _recv_frame(f)[0] == {"kind": "hello", "num_kv_blocks": 11}
    why = "process 1's engine differs from the leader's (num_kv_blocks: 10 here, 11 on the leader)"
    f.sendall(_encode({"kind": "error", "reason": why}))  # what run_follower writes, then exits
    f.close()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [f"follower process 1 of 2 left the multi-host job ({why}); every step "
                    "needs all processes, so the engine stops"]  # fmt: skip
    b.close()


def test_shutdown_reaches_every_follower_and_a_missing_one_is_named():
    cfg, b = _broadcaster(num_processes=3)
    f1 = _follower(cfg, 2)
    with pytest.raises(TimeoutError, match=r"followers \[1\] did not connect"):
        b.accept({}, timeout=1.0)
    f1.close()
    b.close()
    cfg, b = _broadcaster(num_processes=3)
    followers = [_follower(cfg, 1), _follower(cfg, 2)]
    b.accept({}, timeout=10)
    closer = threading.Thread(target=b.close)
    closer.start()
    for f in followers:
        assert _recv_frame(f)[0]["kind"] == "hello"
        assert _recv_frame(f)[0] == {"kind": "shutdown"}
        assert _recv_frame(f) is None  # the leader closed its end
        f.close()
    closer.join(10)
    assert not closer.is_alive()


def _lose_follower(outbox) -> None:
    from serving.engine.messages import Failed

    exit_on_lost(outbox, Failed)("follower process 1 of 2 left")


def test_a_lost_follower_ends_the_engine_process_with_its_reason():
    """The watchdog's reaction: the HTTP process learns why, the engine process exits 1."""
    ctx = multiprocessing.get_context("spawn")
    outbox = ctx.Queue()
    proc = ctx.Process(target=_lose_follower, args=(outbox,))
    proc.start()
    (msg,) = outbox.get(timeout=30)
    proc.join(30)
    assert proc.exitcode == 1
    assert msg.message == "follower process 1 of 2 left"


def test_a_failed_leader_step_ends_the_job():
    class Broken:
        vocab_size = 7

        def step(self):
            raise RuntimeError("out of memory")

    lost = []
    engine = FatalStepErrors(Broken(), lost.append)
    assert engine.vocab_size == 7
    with pytest.raises(RuntimeError):
        engine.step()
    assert lost == ["the leader's step failed (RuntimeError('out of memory')); the followers "
                    "cannot go on"]  # fmt: skip


def test_a_differing_engine_is_named_with_both_values():
    mine = {"num_kv_blocks": 10, "num_state_slots": 6, "step_shapes": [{"num_tokens": 64}]}
    assert signature_mismatch(mine, dict(mine, kind="hello")) is None
    leader = dict(mine, num_kv_blocks=11, step_shapes=[{"num_tokens": 8}])
    assert signature_mismatch(mine, leader) == (
        "num_kv_blocks: 10 here, 11 on the leader; "
        "step_shapes: [{'num_tokens': 64}] here, [{'num_tokens': 8}] on the leader"
    )
    del leader["num_state_slots"]  # an older leader
    assert "num_state_slots: 6 here, (missing) on the leader" in signature_mismatch(mine, leader)


def test_the_budget_survives_the_int32_collective_and_a_bad_one_is_named():
    """One process (the collective runs all the same): budgets past 2**31 bytes come back
    whole, a non-positive one is an error naming the process."""
    assert smallest_cache_bytes(70 * 2**30 + 12345) == 70 * 2**30 + 12345
    assert smallest_cache_bytes(31232) == 31232
    with pytest.raises(ValueError, match="process 0's cache budget of 0 bytes must be positive"):
        smallest_cache_bytes(0)
    with pytest.raises(ValueError, match="budget of -5 bytes must be positive"):
        smallest_cache_bytes(-5)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        MultihostConfig("localhost", 2, 0)
    with pytest.raises(ValueError, match="num_processes=1"):
        MultihostConfig("h:1", 1, 0)
    with pytest.raises(ValueError, match="process_id=2"):
        MultihostConfig("h:1", 2, 2)
    assert MultihostConfig("h:1234", 2, 1).channel_port == 1235


def test_serve_flags_for_several_processes_are_checked():
    from serving.entrypoints.cli import main

    with pytest.raises(SystemExit, match="needs --coordinator-address, --process-id too"):
        main(["serve", "--num-processes", "2"])
    with pytest.raises(SystemExit, match="process_id=5 must be in"):
        main(["serve", "--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "5"])
