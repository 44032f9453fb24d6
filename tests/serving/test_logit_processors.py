"""Penalties, logit bias, bad words and min_tokens: the sampler against a numpy oracle, and
the engine end to end (the token tables rebuilt exactly under prefix caching and preemption)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.core.plan import SamplingArrays, TableInit
from serving.core.request import EngineRequest, SamplingParams
from serving.worker.sampler import (
    count_inputs,
    init_token_tables,
    process_logits,
    set_table_row,
    table_row_values,
)

V = 16
R = 4  # table rows


def _oracle(logits, history, prompt_len, sp: SamplingParams, position, stop_ids=()):
    """vLLM / OpenAI semantics, one row, plain numpy."""
    x = np.array(logits, np.float64)
    out = np.bincount(np.asarray(history[prompt_len:], int), minlength=V)
    seen = (out > 0) | (np.bincount(np.asarray(history[:prompt_len], int), minlength=V) > 0)
    rep = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - sp.frequency_penalty * out - sp.presence_penalty * (out > 0)
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    x[list(sp.bad_words_token_ids)] = -np.inf
    if position < prompt_len + sp.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def _run(logits, rows, hit):
    """Rows given as (history, prompt_len, params, stop_ids): each row's tables start from
    ``history[:hit]`` (a cache hit) and a step feeds the rest, as the runner does."""
    s = len(rows)
    sampling = SamplingArrays.empty(s)
    tables = init_token_tables(R, V)
    ids, pos, qsl = [], [], [0]
    for i, (history, prompt_len, sp, stop) in enumerate(rows):
        sampling.table_row[i] = R - 1 - i  # plan rows and table rows differ
        sampling.uses_tables[i] = sp.uses_token_tables
        sampling.prompt_len[i] = prompt_len
        sampling.presence_penalty[i] = sp.presence_penalty
        sampling.frequency_penalty[i] = sp.frequency_penalty
        sampling.repetition_penalty[i] = sp.repetition_penalty
        sampling.min_tokens_until[i] = prompt_len + sp.min_tokens if sp.min_tokens else 0
        bias = dict(sp.logit_bias or {}) | {t: -np.inf for t in sp.bad_words_token_ids}
        if not sp.uses_token_tables:  # the row's tables hold a finished request's values
            bias, stop = {3: 50.0}, (1, 2)
        init = TableInit(tuple(history[:hit]), prompt_len, tuple(stop), tuple(bias.items()))
        tables = set_table_row(tables, np.int32(R - 1 - i), table_row_values(init, V))
        ids += history[hit:]
        pos += list(range(hit, len(history)))
        qsl.append(len(ids))
    t = 32
    arr = lambda a, n: jnp.asarray(np.pad(np.asarray(a, np.int32), (0, n - len(a))))  # noqa: E731
    qsl = qsl + [qsl[-1]] * 0
    tables = count_inputs(
        tables, jax.tree.map(jnp.asarray, sampling), arr(ids, t), arr(pos, t),
        jnp.asarray(qsl, jnp.int32), jnp.int32(s),
    )  # fmt: skip
    positions = jnp.asarray([len(r[0]) for r in rows], jnp.int32)
    return np.asarray(process_logits(jnp.asarray(logits), sampling, positions, tables))


RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(3, V)).astype(np.float32) * 3


@pytest.mark.parametrize("hit", [0, 3, 5, 9])
def test_processors_match_the_oracle(hit):
    history = [1, 2, 2, 5, 7, 7, 7, 3, 1]  # prompt 5 tokens, outputs 7 7 7 3 1
    rows = [
        (history, 5, SamplingParams(presence_penalty=0.5, frequency_penalty=0.7), ()),
        (
            history,
            5,
            SamplingParams(
                repetition_penalty=1.7, logit_bias={4: 3.0, 9: -2.0}, bad_words_token_ids=(0,)
            ),
            (),
        ),  # fmt: skip
        (history, 5, SamplingParams(min_tokens=5, max_tokens=9, repetition_penalty=1.5), (7, 8)),
    ]
    got = _run(LOGITS, rows, hit)  # padding tokens (id 0) must not count: 0 is not in history
    for i, (h, p, sp, stop) in enumerate(rows):
        np.testing.assert_allclose(got[i], _oracle(LOGITS[i], h, p, sp, len(h), stop), rtol=1e-6)
    assert np.isinf(got[2][[7, 8]]).all()  # 4 outputs < min_tokens 5: stops banned


def test_table_init_starts_from_the_cache_hit():
    from serving.core.request import Request

    sp = SamplingParams(min_tokens=2, stop_token_ids=(9,), logit_bias={4: 1.0},
                        bad_words_token_ids=(6,), max_tokens=8)  # fmt: skip
    req = Request("r", [1, 2, 3], sp, eos_token_id=8)
    req.all_token_ids += [5, 5]
    req.num_computed_tokens = 4
    init = TableInit.of(req)
    assert init.token_ids == (1, 2, 3, 5) and init.prompt_len == 3
    assert set(init.stop_ids) == {8, 9} and dict(init.bias) == {4: 1.0, 6: -np.inf}
    sp.ignore_eos, sp.min_tokens = True, 0
    assert TableInit.of(req).stop_ids == ()


def test_min_tokens_lifts_the_ban_once_reached():
    history = [1, 2, 7, 7, 7, 7, 7]
    got = _run(LOGITS[:1], [(history, 2, SamplingParams(min_tokens=5, max_tokens=9), (7,))], 0)
    np.testing.assert_allclose(got[0], LOGITS[0])


def test_rows_without_processors_are_untouched():
    """Whatever their table rows hold, alone or beside a row that uses its tables."""
    history = [1, 2, 3]
    rows = [(history, 2, SamplingParams(), ()), (history, 2, SamplingParams(), ())]
    np.testing.assert_array_equal(_run(LOGITS[:2], rows, 0), LOGITS[:2])
    rows[0] = (history, 2, SamplingParams(repetition_penalty=2.0, min_tokens=3), (1,))
    got = _run(LOGITS[:2], rows, 0)
    np.testing.assert_array_equal(got[1], LOGITS[1])
    assert (got[0] != LOGITS[0]).any()


# ------------------------------------------------------------------------- engine end to end

ENGINE = dict(
    max_num_seqs=4,
    min_seq_bucket=4,  # one decode bucket
    max_num_batched_tokens=128,
    min_token_bucket=128,
    max_model_len=512,
    num_checkpoint_slots=8,
    progress=False,
    warmup=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hyjax.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=model_dir, **ENGINE))


def _generate(engine, prompts, **params):
    sp = SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **params})
    ids = [engine.add_request(EngineRequest(list(p), sp)) for p in prompts]
    out = engine.run_to_completion()
    return [out[i].output_token_ids for i in ids]


REPETITIVE = [5, 6, 7, 8] * 20


def test_logit_bias_forces_and_bans(engine):
    (plain,) = _generate(engine, [REPETITIVE])
    (forced,) = _generate(engine, [REPETITIVE], logit_bias={11: 100.0})
    assert forced == [11] * 24
    top = plain[0]
    (banned,) = _generate(engine, [REPETITIVE], logit_bias={top: -100.0})
    assert top not in banned
    (bad,) = _generate(engine, [REPETITIVE], bad_words_token_ids=(top,))
    assert top not in bad


def test_penalties_change_greedy_output_in_their_direction(engine):
    (plain,) = _generate(engine, [REPETITIVE])
    assert _generate(engine, [REPETITIVE], presence_penalty=0.0, frequency_penalty=0.0) == [plain]
    assert _generate(engine, [REPETITIVE], repetition_penalty=1.0) == [plain]
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        (pen,) = _generate(engine, [REPETITIVE], **kw)
        assert len(set(pen)) > len(set(plain)), kw  # fewer repeats of what was generated
        assert max(np.bincount(pen)) < max(np.bincount(plain)), kw
    (neg,) = _generate(engine, [REPETITIVE], frequency_penalty=-2.0)
    assert len(set(neg)) <= len(set(plain))
    # repetition: also over the prompt, so the prompt's tokens recede.
    (rep,) = _generate(engine, [REPETITIVE], repetition_penalty=2.0)
    in_prompt = lambda out: sum(t in set(REPETITIVE) for t in out)  # noqa: E731
    assert in_prompt(rep) < in_prompt(plain)


def test_min_tokens_keeps_eos_away(engine):
    eos = engine.eos_token_ids[0]
    bias = {eos: 100.0}
    (now,) = _generate(engine, [REPETITIVE], ignore_eos=False, logit_bias=bias)
    assert now == [eos]
    (later,) = _generate(engine, [REPETITIVE], ignore_eos=False, logit_bias=bias, min_tokens=5)
    assert len(later) == 6 and later[-1] == eos and eos not in later[:5]
    (stop,) = _generate(
        engine, [REPETITIVE], logit_bias={9: 100.0}, stop_token_ids=(9,), min_tokens=3
    )
    assert len(stop) == 4 and stop[-1] == 9


def test_token_tables_exact_under_prefix_caching_and_preemption(model_dir):
    """Penalised requests sharing prefixes (hits skip the shared tokens' steps) and a pool small
    enough to preempt (re-prefill): the tokens equal those of an engine without caching."""
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    rng = np.random.default_rng(1)
    base = rng.integers(0, 200, 140).tolist()
    prompts = [base + rng.integers(0, 200, n).tolist() for n in (1, 80, 100, 120)]
    kw = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
              max_tokens=120)  # fmt: skip
    tiny = dict(ENGINE, cache_bytes=45 * 4096 + 9 * 16896, num_checkpoint_slots=4)
    on = LLMEngine(EngineArgs(model=model_dir, **tiny))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **ENGINE))
    first = _generate(on, prompts[:1], **kw)
    got = first + _generate(on, prompts[1:], **kw)
    want = _generate(off, prompts[:1], **kw) + _generate(off, prompts[1:], **kw)
    assert got == want
    assert on.metrics().effective_hit_tokens > 0
    assert on.metrics().num_preemptions > 0


def test_table_inits_reach_multihost_followers():
    """A follower's tables must start its rows as the leader's do: the plan frame carries them."""
    import socket

    from serving.core.plan import StepPlan, StepShape
    from serving.engine import multihost

    plan = StepPlan.empty(StepShape(8, 2, 4, 1, False))
    init = TableInit((1, 2, 3), 2, (7,), ((4, 1.5), (6, float("-inf"))))
    plan.sampling.table_inits[3] = init
    a, b = socket.socketpair()
    with a, b:
        a.sendall(multihost.encode_plan(plan))
        header, arrays = multihost._recv_frame(b, 1 << 20)
    assert multihost.decode_plan(header, arrays).sampling.table_inits == {3: init}


def _has(seq, word):
    n = len(word)
    return any(tuple(seq[i : i + n]) == tuple(word) for i in range(len(seq) - n + 1))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_multi_token_bad_words_are_never_generated(model_dir, async_scheduling):
    """A bias makes three tokens nearly all the model may pick (sampled): the two- and
    three-token words appear without the ban; with it they never do, and their last tokens
    still appear elsewhere (only the word's end after its prefix is banned)."""
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    eng = LLMEngine(EngineArgs(model=model_dir, async_scheduling=async_scheduling, **ENGINE))
    a, b, c = 21, 22, 23
    kw = dict(logit_bias={a: 100.0, b: 100.0, c: 100.0}, temperature=1.0, max_tokens=96)
    words = ((a, b), (b, c, a))
    seeds = range(3)
    free = [_generate(eng, [REPETITIVE], seed=s, **kw)[0] for s in seeds]
    assert all(_has(out, w) for out in free for w in words)
    banned = [
        _generate(eng, [REPETITIVE], seed=s, bad_word_sequences=words, **kw)[0] for s in seeds
    ]
    for out in banned:
        assert set(out) <= {a, b, c}
        assert not any(_has(out, w) for w in words), out
        assert b in out and a in out  # banned only as a word's end


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    """Kimi's tool-call markers are special tokens: a request that keeps special tokens
    (``skip_special_tokens=False``, set by the chat layer for the kimi_k2 parser) sees them
    in its text; the default drops them. Token 257 is the tiny tokenizer's <|im_start|>."""
    texts = {}
    for skip in (True, False):
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                            logit_bias={257: 100.0}, skip_special_tokens=skip)  # fmt: skip
        rid = engine.add_request(EngineRequest(list(REPETITIVE), sp))
        out = engine.run_to_completion()[rid]
        assert out.output_token_ids == [257] * 3
        texts[skip] = out.text
    assert "<|im_start|>" not in texts[True]
    assert texts[False].count("<|im_start|>") == 3
