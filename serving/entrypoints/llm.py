"""The offline Python API, in the spirit of vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int


class LLM:
    """Loads a model once; ``generate`` runs a batch to completion with continuous batching.

    Keyword arguments are :class:`serving.engine.EngineArgs` fields (``dtype``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``kernel_backend``, ...).
    """

    def __init__(self, model: str, **kwargs):
        kwargs.setdefault("progress", False)
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Returns one output per prompt, in order. Raises ValueError for a bad prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)=} does not match {len(prompts)=}")
        ids = [
            self.engine.add_request(EngineRequest(p, sp)) for p, sp in zip(prompts, sampling_params)
        ]
        final = self.engine.run_to_completion()
        return [
            GenerationOutput(
                request_id=rid,
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=final[rid].prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        0, final[rid].text, final[rid].output_token_ids, final[rid].finish_reason
                    )
                ],
                num_cached_tokens=final[rid].num_cached_tokens,
            )
            for rid, p in zip(ids, prompts)
        ]
