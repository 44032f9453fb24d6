"""A restart loads its compiled buckets from the compilation cache directory.

Two fresh processes build the same engine over one cache directory and serve the same request:
the first compiles what it meets (cache misses, entries written), the second gets all of it from
the cache (no misses, no new entries) and generates the same tokens. The step's buckets come
back as the runner's serialized executables (``serving.worker.executables``), so the second
process never traces the step; the rest (the pools' initialisation, table writes) from JAX's
persistent cache. JAX's monitoring events and the runner's counts are the witnesses.
"""

import json
import os
import subprocess
import sys

from hyjax.tiny import make_tiny_model

SCRIPT = r"""
import json, sys
import jax
from jax import monitoring

events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
from serving.engine.llm_engine import EngineArgs, LLMEngine
from serving.core.request import EngineRequest, SamplingParams

engine = LLMEngine(EngineArgs(
    **json.loads(sys.argv[3]), model=sys.argv[1], compilation_cache_dir=sys.argv[2],
    max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, num_checkpoint_slots=4,
    progress=False,
    warmup=False,  # only the buckets this request meets: the same ones in both processes
))
params = SamplingParams(max_tokens=6, ignore_eos=True)
rid = engine.add_request(EngineRequest(list(range(1, 40)), params))
out = engine.run_to_completion()[rid]
print(json.dumps({
    "hits": events.count("/jax/compilation_cache/cache_hits"),
    "misses": events.count("/jax/compilation_cache/cache_misses"),
    "tokens": out.output_token_ids,
    "steps_compiled": engine.runner.executables.compiled,
    "steps_loaded": engine.runner.executables.loaded,
    "steps_traced": __import__("serving.worker.runner").worker.runner._step._cache_size(),
}))
"""


def _run(model, cache, devices: int = 1, **engine_args):
    env = dict(os.environ, HYJAX_COMPILATION_CACHE="")
    if devices > 1:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(cache), json.dumps(engine_args)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def _steps(cache) -> list[str]:
    """The runner's kept executables: one folder (this engine's fingerprint) of buckets."""
    return sorted(
        os.path.join(os.path.basename(d), f)
        for d, _, files in os.walk(cache / "hyjax-steps")
        for f in files
    )


def test_second_start_loads_its_compiled_buckets_from_the_cache(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cache = tmp_path / "jax-cache"
    first = _run(model, cache)
    entries = sorted(os.listdir(cache)), _steps(cache)
    assert first["steps_compiled"] >= 2 and first["steps_loaded"] == 0, first  # prefill, decode
    assert len(entries[1]) == first["steps_compiled"], entries
    assert first["misses"] >= first["steps_compiled"], first
    second = _run(model, cache)
    assert second["misses"] == 0, (first, second)
    assert second["steps_loaded"] == first["steps_compiled"], second
    assert second["steps_compiled"] == second["steps_traced"] == 0, second
    assert second["hits"] + second["steps_loaded"] >= first["misses"], (first, second)
    assert (sorted(os.listdir(cache)), _steps(cache)) == entries
    assert second["tokens"] == first["tokens"]

    for name in entries[1]:  # torn writes, or another jaxlib's entries: compiled again
        with open(cache / "hyjax-steps" / name, "wb") as f:
            f.write(b"not an executable")
    third = _run(model, cache)
    assert (third["steps_loaded"], third["steps_compiled"]) == (0, first["steps_compiled"])
    assert "compiling it again" in third["stderr"]
    assert _steps(cache) == entries[1]  # rewritten in place, no temporary left
    assert third["tokens"] == first["tokens"]


def test_the_executables_sit_beside_the_expanded_cache(tmp_path, monkeypatch):
    """``--compilation-cache-dir ~/...`` (the CLI's default) puts the compiled steps under the
    home folder, next to JAX's cache, not under a folder named "~" in the working directory."""
    from serving.engine.llm_engine import _executable_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    got = _executable_dir("~/.cache/hyjax/jax-compilation")
    assert got == str(tmp_path / "home" / ".cache/hyjax/jax-compilation/hyjax-steps")
    assert _executable_dir("rel") == str(tmp_path / "rel" / "hyjax-steps")


def test_a_kept_step_that_loads_but_does_not_run_is_compiled_again(tmp_path, monkeypatch, caplog):
    """An executable from an earlier start that deserializes but fails when run (seen on CPU:
    "NOT_FOUND: Function ... not found") does not stop the start: the warm-up drops it, starts
    from fresh pools, compiles and writes the bucket again, and the engine generates as the
    first one did."""
    import logging

    import jax
    from jax.experimental import serialize_executable

    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    kw = dict(
        model=str(model), compilation_cache_dir=str(tmp_path / "cache"), max_num_seqs=2,
        max_num_batched_tokens=64, max_model_len=128, num_checkpoint_slots=4, progress=False,
    )  # fmt: skip

    def generate(engine):
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        rid = engine.add_request(EngineRequest(list(range(1, 40)), params))
        return engine.run_to_completion()[rid].output_token_ids

    first = LLMEngine(EngineArgs(**kw))
    buckets = first.runner.executables.compiled
    assert buckets >= 2 and first.runner.executables.loaded == 0
    want = generate(first)
    del first

    load = serialize_executable.deserialize_and_load

    def broken(*args, **kwargs):
        real = load(*args, **kwargs)  # the file itself reads

        def run(*a, **k):
            real(*a, **k)  # runs, and takes the donated pools with it
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found (type id: 1)")

        return run

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", broken)
    with caplog.at_level(logging.WARNING, logger="serving.worker.runner"):
        second = LLMEngine(EngineArgs(**kw))
    ex = second.runner.executables
    assert ex.loaded == buckets and ex.compiled == buckets and not ex.from_disk
    assert sum("does not run" in r.getMessage() for r in caplog.records) == buckets
    assert generate(second) == want


def test_a_step_served_by_jax_cache_is_not_kept_on_disk(tmp_path):
    """JAX's persistent cache holds the steps, the runner's kept files do not (a deleted or
    pruned folder; before the "~" fix, another working directory). On CPU an executable that
    JAX's cache served serializes into a file that loads, then fails to run ("NOT_FOUND:
    Function ... not found"). So such a step is kept in memory only: the next start gets it
    from JAX's cache again, and runs."""
    import shutil

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cache = tmp_path / "jax-cache"
    first = _run(model, cache)
    shutil.rmtree(cache / "hyjax-steps")
    second = _run(model, cache)
    assert second["steps_compiled"] == first["steps_compiled"] and second["misses"] == 0, second
    assert _steps(cache) == [], "a cache-served step was written"
    third = _run(model, cache)  # crashed when the second start wrote its steps
    assert third["misses"] == 0 and third["steps_compiled"] == first["steps_compiled"], third
    assert third["tokens"] == second["tokens"] == first["tokens"]
