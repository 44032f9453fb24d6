"""OpenAI-shaped request and response bodies (pydantic), and the error body.

Requests accept the OpenAI fields hyjax implements plus vLLM-style extras (``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens``,
``bad_words``, ``prompt_logprobs``); unknown fields are ignored, as the OpenAI clients send
new fields before servers know them. Fields that would change the output in a way hyjax does
not implement yet (``length_penalty``, ``allowed_token_ids`` ...) are rejected with a 400
naming the field rather than silently dropped (``unsupported_fields``). Structured outputs
(``response_format``, vLLM's ``structured_outputs`` and older ``guided_*`` fields) become one
``StructuredOutput`` in the sampling parameters (``serving/core/structured/spec.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_serializer,
    model_validator,
)

from serving.core.request import EngineRequest, SamplingParams
from serving.core.structured.spec import StructuredOutput, from_fields, from_response_format

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
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys) -> bias
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    bad_words: list[StrictStr] | None = None
    user: str | None = None
    # Prefix caching: requests share cached blocks and states only with requests of the same
    # salt (vLLM's field), so one tenant cannot time another's prompts.
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = None
    # Structured outputs (``structured_output``): OpenAI's, vLLM's extra and its older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Fields that would change the output and are not implemented yet (OpenAI's, and the
    # extras vLLM users send): parsed so that ``unsupported_fields`` can name them in a 400,
    # never silently dropped. Their "off" values pass.
    length_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    logits_processors: Any = None

    def structured_output(self) -> StructuredOutput | None:
        """The request's one output constraint, if any; raises ValueError ``"FIELD=...: why"``
        for a malformed one or for two of them."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        a = from_response_format(self.response_format)
        b = from_fields(self.structured_outputs, guided)
        if a is not None and b is not None:
            raise ValueError(f"response_format=...: cannot be combined with {b.param}")
        return a or b

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None = None,
        *,
        prompt_logprobs: int | None = None,
        default_temperature: float = 1.0,
        encode: Callable[[str], list[int]] | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ValueError naming the first bad field.

        ``encode`` tokenizes ``bad_words`` (each word as is and after a space, as it reads
        mid-text, as vLLM does); a one-token variant is banned everywhere, a longer one where
        the tokens generated just before equal all of it but its last token.
        ``prompt_logprobs``: overrides the field (completions' ``echo`` with ``logprobs``)."""
        stop = self.stop if self.stop is not None else ()
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except ValueError:
                raise ValueError(f"logit_bias={key!r}: keys must be token ids") from None
        bad_ids: list[int] = []
        bad_seqs: list[tuple[int, ...]] = []
        for word in self.bad_words or ():
            if encode is None:
                raise ValueError("bad_words=... needs the model's tokenizer")
            word = word.lstrip()
            for ids in (encode(word), encode(" " + word)):
                if len(ids) == 1 and ids[0] not in bad_ids:
                    bad_ids.append(ids[0])
                elif len(ids) > 1 and tuple(ids) not in bad_seqs:
                    bad_seqs.append(tuple(ids))
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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=bias or None,
            min_tokens=self.min_tokens or 0,
            bad_words_token_ids=tuple(bad_ids),
            structured=self.structured_output(),
            skip_special_tokens=self.skip_special_tokens,
            bad_word_sequences=tuple(bad_seqs),
            prompt_logprobs=prompt_logprobs
            if prompt_logprobs is not None
            else self.prompt_logprobs,
        )
        params.validate()
        if any(s == "" for s in params.stop):
            raise ValueError(f"stop={list(params.stop)!r} must not hold an empty string")
        return params

    def to_engine_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> EngineRequest:
        """The engine's request for one prompt of this body (``params`` from
        ``to_sampling_params``): where a per-request field of the API reaches the engine."""
        return EngineRequest(prompt, params, request_id, cache_salt=self.cache_salt)

    def unsupported_fields(self) -> list[str]:
        """The fields set to a value that would change the output in a way not implemented."""
        on = {
            "length_penalty": self.length_penalty not in (None, 1.0),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "use_beam_search": self.use_beam_search,
            "logits_processors": self.logits_processors is not None,
        }
        return [name for name, is_set in on.items() if is_set]


TokenIds = list[StrictInt]
PromptInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def returns_nothing_new(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt (and its logprobs) back, no tokens."""
        return self.echo and self.max_tokens == 0

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
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
        if self.prompt_logprobs is not None:
            bad.append("prompt_logprobs")  # not written to the output rows
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
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_call_for_template(c) for c in d["tool_calls"]]
        return d


def _call_for_template(call: Any) -> Any:
    """An OpenAI tool call as templates read it: ``arguments`` as a mapping (Qwen3-Coder's
    template iterates over it; Qwen3's writes a mapping or a string as is)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = call["function"]
    if isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_names(self) -> list[str]:
        return [
            t["function"]["name"]
            for t in self.tools or ()
            if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        ]

    def check_tools(self) -> None:
        """Raises ValueError ``"FIELD: message"`` for inconsistent tool fields."""
        for i, tool in enumerate(self.tools or ()):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tools: tools[{i}] must be a function tool")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools: tools[{i}].function.name must be a non-empty string")
        choice = self.tool_choice
        if choice is not None and not self.tools and choice != "none":
            raise ValueError(f"tool_choice: tool_choice={choice!r} needs tools")
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: {choice!r} is not none, auto, required or a function")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError(
                    'tool_choice: expected {"type": "function", "function": {"name": ...}}'
                )
            if name not in self.tool_names():
                raise ValueError(f"tool_choice: function {name!r} is not in tools")
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            extra = m.model_extra or {}
            if m.role == "assistant":
                for call in extra.get("tool_calls") or ():
                    if isinstance(call, dict) and isinstance(call.get("id"), str):
                        called.add(call["id"])
            elif m.role == "tool":
                call_id = extra.get("tool_call_id")
                if call_id not in called:
                    raise ValueError(
                        f"messages: messages[{i}] (role tool) has tool_call_id={call_id!r}, "
                        "which no earlier assistant tool call has"
                    )

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
    """``prompt_logprobs`` (vLLM's extra) is left out unless the request asked for it."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler) -> dict:
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionMessage(BaseModel):
    """``reasoning_content`` and ``tool_calls`` are left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_extras(self, handler) -> dict:
        d = handler(self)
        return {k: v for k, v in d.items() if k == "content" or v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """``prompt_logprobs`` (vLLM's extra, the prompt's: one list for every choice) is left
    out unless the request asked for it."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler) -> dict:
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class DeltaMessage(BaseModel):
    """A chunk's delta: only what it carries (``{}`` for a chunk that only finishes)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


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
