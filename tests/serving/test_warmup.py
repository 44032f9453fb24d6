"""Background warm-up (``hyjax serve``): the engine answers before its buckets are compiled,
its tokens are those of an engine warmed up front, and once the warm-up is done serving
compiles nothing more (XLA reuses what the background thread compiled)."""

import jax
import pytest

from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine

# Four buckets: decode with 1 or 2 rows, a 64-token prefill with 1 or 2 rows.
SMALL = dict(
    max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=128,
    progress=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def _backend_compiles() -> list[str]:
    """A list that grows by one entry per XLA compilation in this process from now on."""
    seen: list[str] = []

    def listener(name: str, _secs: float, **_kw) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen


def _requests(engine, prompts):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, greedy)) for p in prompts]
    out = engine.run_to_completion()
    return [out[i].output_token_ids for i in ids]


ONE = [[5, 6, 7]]  # alone: the 1-row buckets
TWO = [list(range(3, 90)), [9] * 40]  # together: the 2-row buckets


def test_background_warmup(model_dir):
    bg = LLMEngine(EngineArgs(model=model_dir, background_warmup=True, **SMALL))
    # Ready before the four compiles are done (each takes far longer than returning).
    assert not bg.runner._warming[None].done()
    got_one = _requests(bg, ONE)  # its buckets: queued, being compiled, or compiled already
    bg.runner.wait_warm()
    compiles = _backend_compiles()
    got_two = _requests(bg, TWO)  # buckets no step met before: the warm-up compiled them
    assert compiles == [], "serving compiled a bucket the warm-up had compiled"
    sync = LLMEngine(EngineArgs(model=model_dir, **SMALL))
    assert (got_one, got_two) == (_requests(sync, ONE), _requests(sync, TWO))


def test_stopping_the_warmup_drops_what_is_left(model_dir):
    """At shutdown the engine does not wait for the buckets left to compile."""
    other = dict(SMALL, max_model_len=96)  # other block tables: buckets not compiled yet
    engine = LLMEngine(EngineArgs(model=model_dir, background_warmup=True, **other))
    engine.runner.stop_background_warmup()
    engine.runner.wait_warm()  # at most the one compile under way
    futures = engine.runner._warming.values()
    assert sum(f.cancelled() for f in futures) >= len(futures) - 1


def test_warmup_up_front_covers_async_steps(model_dir):
    """A warm-up up front (``hyjax generate``, the benchmarks) compiles each bucket as async
    scheduling then runs it: a step fed by the previous step's tokens on the device takes the
    same argument shardings as the warm-up's first step (a token array not committed to the
    device compiled every bucket a second time on its first fed step)."""
    engine = LLMEngine(EngineArgs(model=model_dir, async_scheduling=True, **SMALL))
    compiles = _backend_compiles()
    _requests(engine, TWO)  # prefill, then decode steps each fed by the one before
    _requests(engine, ONE)
    assert compiles == [], f"serving compiled {len(compiles)} step(s) after the warm-up"
