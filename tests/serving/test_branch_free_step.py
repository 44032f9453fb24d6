"""``EngineArgs.branch_free_step``: the step's branches computed and selected instead of
``lax.cond`` (``serving.worker.branches``). The compiled step then holds no conditional (what
lets XLA:GPU keep NCCL collectives in its CUDA graphs under TP), and every request gets what
it gets with the branches: the same tokens, logprobs and prompt logprobs, for a batch that
mixes every branch (greedy, top-k / top-p / min-p sampling, penalties, logit bias, min_tokens,
logprobs, prompt logprobs) and for an all-greedy one (each branch's predicate false)."""

import re

import numpy as np
import pytest

from serving.core.plan import StepPlan
from serving.core.request import EngineRequest, SamplingParams
from serving.worker.runner import _step

ENGINE = dict(
    max_num_seqs=4, min_seq_bucket=4, max_num_batched_tokens=64, min_token_bucket=64,
    max_model_len=256, progress=False, warmup=False, kernel_backend="reference",
)  # fmt: skip
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 200, n).tolist() for n in (40, 23, 70, 9)]
MIXED = [
    SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.8, seed=3),
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3,
                   presence_penalty=0.5, logit_bias={11: 3.0}, min_tokens=6),
    SamplingParams(max_tokens=12, temperature=1.1, min_p=0.05, seed=5, logprobs=1),
]  # fmt: skip
GREEDY = [SamplingParams(max_tokens=12, temperature=0.0)] * 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from hyjax.tiny import make_tiny_model
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, long_memory=True)
    return {
        on: LLMEngine(EngineArgs(model=path, branch_free_step=on, **ENGINE)) for on in (False, True)
    }


def _run(engine, params) -> dict:
    """Every request's tokens, per-token logprobs and prompt logprobs, in request order."""
    ids = [engine.add_request(EngineRequest(p, sp)) for p, sp in zip(PROMPTS, params)]
    got = {i: {"tokens": [], "logprobs": [], "prompt": None} for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            g = got[out.request_id]
            g["tokens"] += out.delta_token_ids
            g["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in out.delta_logprobs or []]
            if out.prompt_logprobs is not None:
                g["prompt"] = out.prompt_logprobs
    return [got[i] for i in ids]


def _logprob_values(r: dict) -> list[float]:
    top = [v for _, lp, tops in r["logprobs"] for v in (lp, *(x for _, x in tops))]
    prompt = [v for p in r["prompt"] or [] if p for v in (p.logprob, *(x for _, x in p.top))]
    return top + prompt


def _logprob_ids(r: dict) -> list:
    top = [(t, [i for i, _ in tops]) for t, _, tops in r["logprobs"]]
    prompt = [p and (p.token_id, p.rank, [i for i, _ in p.top]) for p in r["prompt"] or []]
    return top + prompt


@pytest.mark.parametrize("params", [MIXED, GREEDY], ids=["mixed", "all_greedy"])
def test_branch_free_step_gives_what_the_branches_give(engines, params):
    want, got = _run(engines[False], params), _run(engines[True], params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], f"request {i}"
        # The same log-softmax, fused differently outside a conditional: f32 rounding apart.
        assert _logprob_values(g) == pytest.approx(_logprob_values(w), abs=5e-5), f"request {i}"
        assert _logprob_ids(g) == _logprob_ids(w), f"request {i}"
    assert all(len(r["tokens"]) == 12 for r in got)
    if params is MIXED:  # the features ran: logprobs came back, sampling left the argmax
        assert got[0]["logprobs"] and got[0]["prompt"] and got[3]["logprobs"]


def _conditionals(engine, decode_only: bool) -> int:
    runner = engine.runner
    shape = next(s for s in runner.sched_cfg.step_shapes() if s.decode_only == decode_only)
    hlo = _step.lower(*runner.step_args(StepPlan.empty(shape))).compile().as_text()
    return len(re.findall(r" conditional\(", hlo))


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_branch_free_step_compiles_no_conditional(engines, decode_only):
    assert _conditionals(engines[False], decode_only) > 0  # the branches, as lax.cond
    assert _conditionals(engines[True], decode_only) == 0


def test_branch_free_step_default_is_on_for_tensor_parallel_on_a_gpu(monkeypatch):
    """``None`` resolves on for TP on a GPU only (each ``lax.cond`` there is a conditional
    node between the collectives' launches); an explicit choice always holds."""
    import types

    import jax

    from serving.engine.llm_engine import _branch_free_step

    for platform, tp, want in (("gpu", 2, True), ("gpu", 1, False), ("cpu", 2, False),
                               ("tpu", 4, False)):  # fmt: skip
        fake = [types.SimpleNamespace(platform=platform)]
        monkeypatch.setattr(jax, "devices", lambda *a, fake=fake: fake)
        assert _branch_free_step(None, tp) is want, (platform, tp)
        assert _branch_free_step(not want, tp) is (not want)


def test_branch_free_verify_steps_give_what_the_branches_give(tmp_path):
    """Speculative decoding (n-gram drafts, verify steps and their rejection sampler's branch)
    with the branches computed and selected: the same tokens, greedy and sampled."""
    from hyjax.tiny import make_tiny_model
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    path = make_tiny_model(tmp_path, seed=1, long_memory=True)
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'
    repeats = [list(range(5, 25)) * 3, [7, 8, 9] * 12]  # prompts whose n-grams recur
    params = [SamplingParams(max_tokens=16, temperature=0.0),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=4)]  # fmt: skip
    runs = []
    for on in (False, True):
        engine = LLMEngine(
            EngineArgs(model=path, branch_free_step=on, speculative_config=spec, **ENGINE)
        )
        ids = [engine.add_request(EngineRequest(p, sp)) for p, sp in zip(repeats, params)]
        out = engine.run_to_completion()
        runs.append([out[i].output_token_ids for i in ids])
        assert engine.metrics().spec_num_accepted_tokens > 0  # verify steps ran, accepted
    assert runs[0] == runs[1]
