"""``--state-dtype bfloat16`` end to end on the long-memory tiny Qwen3-Next (test_engine.py's).

The recurrent-state pool is allocated in bfloat16 (the conv windows stay in the model's
dtype), sized from the smaller slot, and prefix caching stays token-identical to no caching.
That holds because every prefill rounds the carried state at each multiple of 64 tokens
(``pallas_kernels.common.slots.ROUND_EVERY``), where every checkpoint lies: a hit on a prompt
checkpoint resumes from the very bf16 state the caching-off run rounded there (without that
rule ``hit_plus_1`` diverges at its second token). A checkpoint written by decode steps (the
multi-turn ``turn2``) is the state rounded after every token, which a caching-off prefill of
the same tokens does not round the same way: its tokens matching here is this workload's
outcome, not a guarantee.
"""

import jax.numpy as jnp
import pytest

from hyjax.cache import state_slot_bytes
from hyjax.tiny import make_tiny_model
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import run_waves
from tests.serving.test_engine import BASE, WAVE1, workload

BF16 = dict(BASE, state_dtype="bfloat16", warmup=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


def test_bf16_state_pools_are_allocated_and_sized_from_the_smaller_slot(model_dir):
    """The same budget holds as many more slots as a slot is smaller: here 1.57x (the tiny
    model's conv windows are 27 % of an f32 slot; at Qwen3-Next-80B shapes 2 %: 1.96x)."""
    budget = dict(BASE, num_checkpoint_slots=None, cache_bytes=1 << 20, warmup=False)
    f32 = LLMEngine(EngineArgs(model=model_dir, **budget))
    bf16 = LLMEngine(EngineArgs(model=model_dir, state_dtype="bfloat16", **budget))
    cfg = f32.model_config
    for engine, state_dtype in ((f32, jnp.float32), (bf16, jnp.bfloat16)):
        caches, memory = engine.runner.caches, engine.runner.memory
        assert {x.dtype for x in caches.ssm} == {jnp.dtype(state_dtype)}
        assert {x.dtype for x in caches.conv} == {jnp.dtype(jnp.float32)}  # the model's dtype
        assert {x.shape[0] for x in caches.ssm + caches.conv} == {memory.num_state_slots}
        assert memory.state_slot_bytes == state_slot_bytes(cfg, jnp.float32, state_dtype)
    m32, m16 = f32.runner.memory, bf16.runner.memory
    ratio = m32.state_slot_bytes / m16.state_slot_bytes
    assert ratio == pytest.approx(1.571, abs=1e-3)
    assert m16.num_checkpoint_slots >= int(m32.num_checkpoint_slots * ratio) - 1
    assert m16.state_bytes <= m32.state_bytes + m16.state_slot_bytes
    assert m16.kv_bytes + m16.state_bytes <= 1 << 20


def test_bf16_state_caching_is_token_identical_and_hits(model_dir):
    on = LLMEngine(EngineArgs(model=model_dir, **BF16))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BF16))
    assert {x.dtype for x in on.runner.caches.ssm} == {jnp.dtype(jnp.bfloat16)}
    want = run_waves(off, workload())
    got = run_waves(on, workload())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    hits = sorted(n for n, o in got.items() if n not in WAVE1 and o.num_cached_tokens > 0)
    assert len(hits) == 12, hits  # as many as with float32 states (test_engine.py)
    for engine in (on, off):
        m = engine.metrics()
        assert m.num_running == 0 and m.kv_usage == 0 and m.state_usage == 0
