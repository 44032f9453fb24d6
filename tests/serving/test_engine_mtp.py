"""Speculative decoding with the model's MTP drafter (``{"method": "mtp", ...}``): the step
drafts on device, and greedy output stays token-identical to greedy without speculation.

On the embedded model (its trained MTP head) the drafts are good, so the acceptance counters
show the drafter is really wired (the right hidden row, the right next token, its KV kept
across steps): two mutations of the drafter's inputs leave the tokens equal but drop the
acceptance. On a random tiny model with a random MTP layer acceptance is low, and the
equality must hold all the same, with prefix caching on and off, over nested prefixes and
follow-up turns.
"""

import os

import jax
import jax.numpy as jnp
import pytest

import hyjax.models.qwen3_next.mtp as mtp_module
from hyjax.testing import make_tiny_kimi_linear_model
from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import SPEC_ENGINE, run_waves

EMBEDDED = "hyjax/assets/qwen3-next-pystdlib-tiny"
MTP2 = '{"method": "mtp", "num_speculative_tokens": 2}'
BASE = SPEC_ENGINE
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

CODE = (
    "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
    "        return [line.rstrip() for line in f]\n\n\ndef write_lines(path, lines):\n"
    "    with open(path, 'w') as f:\n        for line in lines:\n"
    "            f.write(line + '\\n')\n\n\ndef count_words(lines):\n    counts = {}\n"
    "    for line in lines:\n        for word in line.split():\n"
    "            counts[word] = counts.get(word, 0) + 1\n    return counts\n\n\n"
    "def main():\n    "
)
STACK = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"


def code_workload():
    """Python prompts; then a nested prefix of one and a follow-up turn over its answer."""
    wave1 = [("code", CODE, GREEDY), ("stack", STACK, GREEDY)]
    wave2 = [
        ("nested", CODE + "args = sys.argv[1:]\n    ", GREEDY),
        ("turn2", lambda outs: CODE + outs["code"].text + "\n\n\ndef helper(x):\n", GREEDY),
        ("stack_again", STACK, GREEDY),
    ]
    return [wave1, wave2]


def _engine(model, caching, spec=MTP2, **kw):
    return LLMEngine(
        EngineArgs(model=model, enable_prefix_caching=caching, speculative_config=spec,
                   **{**BASE, **kw})
    )  # fmt: skip


def _assert_same(got, want):
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name


def _mean_acceptance(engine) -> float:
    m = engine.metrics()
    return 1 + m.spec_num_accepted_tokens / max(m.spec_num_drafts, 1)


@pytest.fixture(scope="module")
def want():
    return run_waves(_engine(EMBEDDED, False, spec=None), code_workload())


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no_caching"])
def test_mtp_greedy_is_token_identical_with_real_acceptance(want, caching):
    e = _engine(EMBEDDED, caching)
    got = run_waves(e, code_workload())
    _assert_same(got, want)
    m = e.metrics()
    assert m.spec_num_drafts > 20
    assert _mean_acceptance(e) > 1.6, e.spec_summary()  # measured 2.1 (K = 2)
    assert all(n > 0 for n in m.spec_accepted_per_pos), e.spec_summary()
    if caching:
        assert got["nested"].num_cached_tokens > 0 and got["turn2"].num_cached_tokens > 0
    assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0


def _mutated(monkeypatch, wrap):
    """An engine whose step runs ``propose`` through ``wrap`` (jit caches cleared around it,
    so the step is traced again with the mutation and, afterwards, without it)."""
    real = mtp_module.propose
    monkeypatch.setattr(mtp_module, "propose", wrap(real))
    jax.clear_caches()


# The mutation check of the acceptance assertion above (each mutation keeps the tokens and
# loses acceptance), kept runnable but out of the CI's budget (~3 min):
# HYJAX_MUTATION_TESTS=1 python -m pytest tests/serving/test_engine_mtp.py
@pytest.mark.skipif(
    not os.environ.get("HYJAX_MUTATION_TESTS"), reason="mutation check: HYJAX_MUTATION_TESTS=1"
)
@pytest.mark.parametrize("mutation", ["hidden_row", "kv_write"])
def test_mutated_drafter_keeps_tokens_but_loses_acceptance(want, monkeypatch, mutation):
    if mutation == "hidden_row":  # each row drafts from its predecessor's hidden state

        def wrap(real):
            return lambda model, batch, hidden, *a, **k: real(
                model, batch, jnp.roll(hidden, 1, axis=0), *a, **k
            )
    else:  # the MTP KV of a step is dropped: later steps attend to stale (zero) entries

        def wrap(real):
            def propose(model, batch, hidden, next_ids, rows, caches, ops, **k):
                _, draft = real(model, batch, hidden, next_ids, rows, caches, ops, **k)
                return caches, draft

            return propose

    _mutated(monkeypatch, wrap)
    try:
        e = _engine(EMBEDDED, False)
        got = run_waves(e, code_workload())
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    _assert_same(got, want)
    print(mutation, e.spec_summary())
    assert _mean_acceptance(e) < 1.5, e.spec_summary()


def _run(engine, prompt, params):
    rid = engine.add_request(EngineRequest(prompt, params))
    return engine.run_to_completion()[rid]


def test_stop_string_and_max_tokens_inside_an_mtp_run(want):
    full = want["code"]
    e = _engine(EMBEDDED, True)
    stop = full.text[len(full.text) // 2 :][:3]
    params = SamplingParams(**{**GREEDY.__dict__, "stop": (stop,)})
    plain = _engine(EMBEDDED, True, spec=None)
    expect = _run(plain, CODE, params)
    out = _run(e, CODE, params)
    assert out.finish_reason == "stop" == expect.finish_reason
    assert out.output_token_ids == expect.output_token_ids and out.text == expect.text
    for max_tokens in (1, 2, 5, 8):
        params = SamplingParams(**{**GREEDY.__dict__, "max_tokens": max_tokens})
        out = _run(e, CODE, params)
        assert out.output_token_ids == full.output_token_ids[:max_tokens]
        assert out.finish_reason == "length"
    assert e.metrics().spec_num_accepted_tokens > 0
    assert e.metrics().kv_usage == 0 and e.metrics().state_usage == 0


# ----------------------------------------------------------------- random tiny model


@pytest.fixture(scope="module")
def random_mtp_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mtp"), seed=0, long_memory=True, mtp=True)


def tiny_workload():
    import numpy as np

    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    pat = rng.integers(0, 256, 10).tolist()
    long = rng.integers(0, 256, 260).tolist()
    turn = rng.integers(0, 256, 90).tolist()
    wave1 = [
        ("repeat", pat * 8, params),
        ("nested_200", long[:200], params),
        ("turn1", turn, params),
    ]
    wave2 = [
        ("nested_130", long[:130], params),
        ("nested_260", long, params),
        ("turn2", lambda outs: turn + outs["turn1"].output_token_ids + pat, params),
    ]
    return [wave1, wave2]


@pytest.mark.parametrize("caching", [True], ids=["caching"])  # off: the embedded model's test
def test_random_mtp_greedy_is_token_identical(random_mtp_dir, caching):
    want = run_waves(_engine(random_mtp_dir, False, spec=None), tiny_workload())
    e = _engine(random_mtp_dir, caching, spec='{"method": "mtp", "num_speculative_tokens": 3}')
    got = run_waves(e, tiny_workload())
    _assert_same(got, want)
    assert e.metrics().spec_num_draft_tokens > 0
    if caching:
        assert got["nested_260"].num_cached_tokens > 0 and got["turn2"].num_cached_tokens > 0


# ----------------------------------------------------------------- errors


def test_mtp_needs_a_checkpoint_with_mtp_layers(tmp_path):
    d = make_tiny_model(tmp_path / "plain", seed=0)
    with pytest.raises(ValueError, match="mtp.layers"):
        _engine(d, False)


def test_mtp_on_kimi_is_a_clear_error(tmp_path):
    d = make_tiny_kimi_linear_model(tmp_path / "kimi", seed=0)
    with pytest.raises(ValueError, match="no multi-token prediction"):
        _engine(d, False)
