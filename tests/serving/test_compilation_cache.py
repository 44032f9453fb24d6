"""A restart loads its compiled buckets from the persistent compilation cache.

Two fresh processes build the same engine over one cache directory and serve the same request:
the first compiles what it meets (cache misses, entries written), the second gets all of it from
the cache (hits, no misses, no new entries) and generates the same tokens. JAX's own monitoring
events are the witness. Also under tensor parallel with the scanned layers (two simulated
devices): the ``shard_map`` of the ops inside the ``lax.scan`` is served from the cache too.
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
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_start_loads_its_compiled_buckets_from_the_cache(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cache = tmp_path / "jax-cache"
    first = _run(model, cache)
    entries = sorted(os.listdir(cache))
    assert first["misses"] >= 2 and len(entries) >= 2, first  # a prefill and a decode bucket
    second = _run(model, cache)
    assert second["misses"] == 0 and second["hits"] >= first["misses"], (first, second)
    assert sorted(os.listdir(cache)) == entries  # nothing new compiled
    assert second["tokens"] == first["tokens"]
