"""Shared by the engine caching tests of both model families (test_engine*.py).

A workload is a list of waves; each wave is a list of ``(name, prompt, params)`` where the
prompt is token ids or a callable of the outputs of the earlier waves (a follow-up turn). A
wave runs to completion before the next one is queued, so the checkpoints a wave writes are
there for the next one to hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from serving.core.request import EngineRequest
from serving.engine.llm_engine import LLMEngine


def run_waves(
    engine: LLMEngine, waves: list, between: Callable[[LLMEngine], None] | None = None
) -> dict:
    """Runs ``waves`` in order; returns ``{name: RequestOutput}``.

    ``between(engine)`` runs after every wave but the last, while no request is running.
    """
    outputs = {}
    for i, wave in enumerate(waves):
        names = {}
        for name, prompt, params in wave:
            if callable(prompt):
                prompt = prompt(outputs)
            names[engine.add_request(EngineRequest(prompt, params))] = name
        for rid, out in engine.run_to_completion().items():
            outputs[names[rid]] = out
        if between is not None and i + 1 < len(waves):
            between(engine)
    return outputs


def zero_state_pool(engine: LLMEngine) -> None:
    """Zeroes every slot of the state pool (conv windows and recurrent states) in place of
    the runner's device caches: every checkpoint written so far now holds the zero state, so a
    later hit resumes as if nothing were cached, with the KV blocks of the hit still cached.

    Only between waves: a running request's slot would be zeroed too. The new arrays keep the
    old ones' shapes, dtypes and placement, so no step compiles again.
    """
    assert engine.metrics().num_running == 0, "zeroing the pool under a running request"
    runner = engine.runner
    caches = runner.caches

    def zeros(x: jax.Array) -> jax.Array:
        return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)

    runner.caches = dataclasses.replace(
        caches,
        conv=tuple(zeros(x) for x in caches.conv),
        ssm=tuple(zeros(x) for x in caches.ssm),
    )


def hit_names(outputs: dict, first_wave_names: set[str]) -> list[str]:
    """Requests after the first wave that resumed from a checkpoint (cached tokens > 0)."""
    return sorted(
        n for n, o in outputs.items() if n not in first_wave_names and o.num_cached_tokens > 0
    )


def assert_resumed_state_matters(
    fresh: LLMEngine, waves: list, want: dict, first_wave_names: set[str], num_hits: int
) -> None:
    """Runs ``waves`` on ``fresh`` (built with ``warmup=False`` beside warm engines of the same
    shapes) with the state pool zeroed between the waves: at least all hits but one must
    change their tokens from ``want`` (the caching-off run), the first wave none, and nothing
    may compile (the warm engines' executables serve)."""
    compiles = fresh.runner.compile_count()
    zeroed = run_waves(fresh, waves, between=zero_state_pool)
    assert fresh.runner.compile_count() == compiles  # shares the warm engines' executables
    hits = hit_names(zeroed, first_wave_names)
    assert len(hits) == num_hits
    changed = [n for n in hits if zeroed[n].output_token_ids != want[n].output_token_ids]
    assert len(changed) >= len(hits) - 1, sorted(set(hits) - set(changed))
    for name in first_wave_names:  # nothing cached was zeroed under the first wave
        assert zeroed[name].output_token_ids == want[name].output_token_ids, name


# The speculative-decoding engine tests' engine (test_engine_spec.py, test_engine_mtp.py).
SPEC_ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=128,
    min_token_bucket=128,  # one token bucket: few compiles
    min_seq_bucket=4,  # one decode (and verify) bucket: padded rows cost nothing on CPU
    max_model_len=512,
    num_checkpoint_slots=24,
    progress=False,
    warmup=False,
)


class OracleDrafter:
    """Proposes the continuation the plain run produced for this prompt, wrong from position
    ``len(tokens) % (K + 2)`` on (so 0..K drafts are right): every number of accepted drafts
    happens, and a wrong slot rotation or rollback resumes from a wrong state."""

    def __init__(self, full: dict[tuple, list[int]]):
        self.full = full  # prompt -> prompt + plain output

    def propose(self, req, k):
        seq = self.full[tuple(req.prompt_token_ids)]
        n = len(req.all_token_ids)
        assert seq[:n] == req.all_token_ids, "the speculating run left the plain tokens"
        out = seq[n : n + k]
        wrong = n % (k + 2)
        return [t if j < wrong else (t + 1) % 256 for j, t in enumerate(out)]


def oracle_drafter(engine: LLMEngine, want: dict) -> None:
    """Makes ``engine``'s host drafter an :class:`OracleDrafter` of the plain outputs ``want``."""
    full = {}
    for o in want.values():
        full[tuple(o.prompt_token_ids)] = o.prompt_token_ids + o.output_token_ids
    engine.scheduler.drafter = OracleDrafter(full)
