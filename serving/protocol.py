"""OpenAI-shaped request and response bodies (pydantic), and the error body.

Requests accept the OpenAI fields hyjax implements plus vLLM-style extras (``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids``); unknown fields are ignored, as the OpenAI
clients send new fields before servers know them. Fields that would change the output in a way
hyjax does not implement yet (``echo``, penalties, ``logit_bias`` ...) are
rejected with a 400 rather than silently dropped (``unsupported_fields``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from serving.request import SamplingParams

MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ----------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None = None,
        *,
        default_temperature: float = 1.0,
    ) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ValueError naming the first bad field."""
        stop = self.stop if self.stop is not None else ()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        params.validate()
        if any(s == "" for s in params.stop):
            raise ValueError(f"stop={list(params.stop)!r} must not hold an empty string")
        return params

    def unsupported_fields(self) -> list[str]:
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


TokenIds = list[StrictInt]
PromptInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.echo:
            bad.append("echo")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class GenerateRow(_SamplingFields):
    """One input row of ``hyjax generate``: one prompt (text or token ids) and the sampling
    fields of a completion request, validated alike. Other keys are kept (and written back)."""

    model_config = ConfigDict(extra="allow")

    prompt: StrictStr | None = None
    prompt_token_ids: TokenIds | None = None
    max_tokens: int | None = None  # None: the command's --max-tokens

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRow:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("a row needs exactly one of prompt (a string), prompt_token_ids")
        return self

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.n != 1:
            bad.append("n")  # one completion a row
        return bad


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``tool_calls`` ...) reach the chat template as is."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_logprobs(self) -> int | None:
        """How many top logprobs to report (None: no logprobs)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


# ---------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hyjax"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
