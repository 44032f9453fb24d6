"""The OpenAI completions and chat completions endpoints, on top of ``EngineClient``.

One HTTP request becomes ``len(prompts) * n`` engine requests (choice ``i * n + j`` is the
``j``-th sample of prompt ``i``; sample ``j > 0`` gets a seed derived from the given one). All
of them are added first, so a rejected one turns the whole HTTP request into a 400 before any
byte is streamed; their deltas then share one queue, from which the response is streamed (SSE)
or collected. Whatever ends a response early (a client that disconnects, a cancelled task)
aborts the engine requests still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyjax.chat_template import template_variables
from hyjax.tokenizer import ChatTemplateError, Tokenizer
from serving.core.request import SamplingParams
from serving.core.structured import StructuredOutput, tool_call_grammar
from serving.engine.engine_client import EngineClient, EngineDeadError, RequestRejected
from serving.engine.messages import Delta
from serving.entrypoints.chat_output import ChatOutputParser, ChatParsing
from serving.entrypoints.http_metrics import ServerMetrics
from serving.entrypoints.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
    _SamplingFields,
    error_body,
)
from serving.entrypoints.reasoning_parsers import REASONING_PARSERS
from serving.entrypoints.tool_parsers import (
    KEEPS_SPECIAL_TOKENS,
    TOOL_PARSERS,
    ToolCall,
    ToolParser,
)

MAX_CHOICES = 256  # engine requests per HTTP request (prompts x n)
SEED_STRIDE = 0x9E3779B9  # sample j of n gets seed + j * stride (mod 2**32)
ENCODE_IN_THREAD_CHARS = 20_000  # longer texts are tokenized off the event loop


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), status_code=self.status
        )


def engine_unavailable(e: Exception) -> ApiError:
    return ApiError(503, str(e), "service_unavailable_error", code="engine_unavailable")


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    text: list[str] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None  # (Delta.prompt_logprobs), when asked


class _Group:
    """The engine requests of one HTTP request, and their shared delta queue."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics, prefix: str, n: int):
        self.client = client
        self.metrics = metrics
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.by_id: dict[str, _Choice] = {}
        self.unfinished: set[str] = set()

    async def add_all(
        self, body: _SamplingFields, prompts: list[list[int]], params: SamplingParams
    ) -> None:
        """Adds ``len(prompts) * n`` requests; on any rejection aborts the rest and raises."""
        for i, _ in enumerate(prompts):
            for j in range(self.n):
                c = _Choice(i * self.n + j, f"{self.id}-{i * self.n + j}")
                self.choices.append(c)
                self.by_id[c.request_id] = c
        adds = []
        for c in self.choices:
            p = dataclasses.replace(params)
            j = c.index % self.n
            if j and params.seed is not None:
                p.seed = (params.seed + j * SEED_STRIDE) % 2**32
            request = body.to_engine_request(prompts[c.index // self.n], p, c.request_id)
            adds.append(self.client.add(request, self.queue))
        results = await asyncio.gather(*adds, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        self.unfinished = {
            c.request_id for c, r in zip(self.choices, results) if not isinstance(r, BaseException)
        }
        if errors:
            self.abort()
            e = errors[0]
            if isinstance(e, RequestRejected):
                if e.client_error:
                    raise ApiError(400, str(e), param=_param_of(str(e)))
                raise ApiError(500, str(e), "server_error", code="engine_error")
            if isinstance(e, EngineDeadError):
                raise engine_unavailable(e)
            raise e

    def abort(self) -> None:
        for rid in self.unfinished:
            self.client.abort(rid)
        self.unfinished.clear()

    async def deltas(self) -> AsyncIterator[tuple[_Choice, Delta]]:
        """Yields each choice's deltas as they come, until every choice has finished."""
        try:
            while self.unfinished:
                d = await self.queue.get()
                if isinstance(d, BaseException):
                    raise engine_unavailable(d) if isinstance(d, EngineDeadError) else d
                c = self.by_id[d.request_id]
                self._account(c, d)
                if d.finished:
                    self.unfinished.discard(d.request_id)
                yield c, d
        finally:
            self.abort()

    def _account(self, c: _Choice, d: Delta) -> None:
        now = time.perf_counter()
        c.num_prompt_tokens = max(c.num_prompt_tokens, d.num_prompt_tokens)
        c.num_cached_tokens = max(c.num_cached_tokens, d.num_cached_tokens)
        if d.token_ids:
            if c.first_token_at is None:
                c.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
                rest = len(d.token_ids) - 1
            else:
                rest = len(d.token_ids)
            if rest and c.last_token_at is not None:
                gap = (now - c.last_token_at) / rest
                for _ in range(rest):
                    self.metrics.itl.observe(gap)
            c.last_token_at = now
            c.num_tokens += len(d.token_ids)
        if d.text:
            c.text.append(d.text)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            c.finish_reason = d.finish_reason
            self.metrics.finished(d.finish_reason)
            self.metrics.e2e.observe(now - self.arrival)

    def usage(self) -> Usage:
        first = [c for c in self.choices if c.index % self.n == 0]  # one per prompt
        prompt = sum(c.num_prompt_tokens for c in first)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": sum(c.num_cached_tokens for c in first)},
        )


def _param_of(message: str) -> str | None:
    """``"max_tokens=0 must be ..."`` -> ``"max_tokens"``: the field an engine message names."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() and head != message else None


def _error_of(d: Delta) -> ApiError:
    if d.client_error:
        return ApiError(400, d.error or "request failed")
    return ApiError(500, d.error or "engine error", "server_error", code="engine_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """Closes its body iterator however the response ends, so the ``finally`` that aborts
    the engine requests runs at once (not when the generator is garbage collected)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """The two generation endpoints; built once per server."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer | None,
        model_name: str,
        metrics: ServerMetrics,
        chat_parsing: ChatParsing | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.chat_parsing = chat_parsing or ChatParsing()

    # ------------------------------------------------------------------ inputs

    def check_model(self, req: _SamplingFields) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        bad = req.unsupported_fields()
        if bad:
            raise ApiError(
                400, f"{bad[0]} is not supported yet", param=bad[0], code="unsupported_parameter"
            )

    def sampling_params(
        self,
        req: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        encode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        try:
            return req.to_sampling_params(
                max_tokens, logprobs, prompt_logprobs=prompt_logprobs, encode=encode
            )
        except ValueError as e:
            raise ApiError(400, str(e), param=_param_of(str(e))) from None

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send prompt token ids")
        return self.tokenizer

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self._require_tokenizer()
        if len(text) > ENCODE_IN_THREAD_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [await self._encode(p)]
        elif p and isinstance(p[0], str):
            prompts = [await self._encode(s) for s in p]
        elif p and isinstance(p[0], list):
            prompts = [list(ids) for ids in p]
        else:
            prompts = [list(p)]
        if not prompts or not all(prompts):
            raise ApiError(
                400, "the prompt is empty: at least one token is required", param="prompt"
            )
        return prompts

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids."""
        tok = self._require_tokenizer()
        try:
            if req.tools:
                source = tok.chat_template_source(tools=req.tools)
                if "tools" not in template_variables(source):
                    raise ApiError(
                        400,
                        "this model's chat template does not render tools",
                        param="tools",
                        code="tools_not_supported",
                    )
            text = tok.apply_chat_template(
                [m.template_dict() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                **(req.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise ApiError(400, f"chat template error: {e}", param="messages") from None
        except TypeError as e:  # a chat_template_kwargs key that clashes with an argument
            raise ApiError(400, str(e), param="chat_template_kwargs") from None
        return text, await self._encode(text, add_special_tokens=False)

    def tool_parser(self, req: ChatCompletionRequest) -> ToolParser | None:
        """The request's tool-call parser (None: its output is not parsed for calls).

        ``required`` and a named ``tool_choice`` are enforced while decoding by
        ``forced_tool_calls``' grammar, so their output always parses as calls.
        """
        try:
            req.check_tools()
        except ValueError as e:
            field, _, message = str(e).partition(": ")
            raise ApiError(400, message, param=field) from None
        choice = req.tool_choice
        if not req.tools or choice == "none":
            return None
        name = self.chat_parsing.tool_call_parser
        if choice in (None, "auto") and not self.chat_parsing.enable_auto_tool_choice:
            raise ApiError(
                400,
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        if name is None:
            raise ApiError(
                400, "tool calls need the server started with --tool-call-parser",
                param="tool_choice",
            )  # fmt: skip
        return TOOL_PARSERS[name](req.tools)

    def forced_tool_calls(self, req: ChatCompletionRequest) -> StructuredOutput | None:
        """The grammar of the calls ``tool_choice`` requires (``required``: one or more of any
        tool, one when ``parallel_tool_calls`` is false; a named function: one call of it),
        in the format of ``--tool-call-parser``; None when the choice leaves the model free.
        Call after ``tool_parser`` (which checks the tool fields)."""
        choice = req.tool_choice
        if not req.tools or not (choice == "required" or isinstance(choice, dict)):
            return None
        function = choice["function"]["name"] if isinstance(choice, dict) else None
        try:
            text = tool_call_grammar(
                self.chat_parsing.tool_call_parser,
                req.tools,
                function=function,
                parallel=req.parallel_tool_calls is not False,
            )
        except ValueError as e:
            raise ApiError(400, str(e), param="tool_choice") from None
        return StructuredOutput("grammar", text, param="tool_choice")

    def after_reasoning(
        self, req: ChatCompletionRequest, spec: StructuredOutput, prompt: str
    ) -> StructuredOutput:
        """``spec`` starting after the reasoning block, as vLLM does, when the server parses
        reasoning and the request thinks (``start_after``: the end marker's token ids, one
        special token in Qwen3's and Kimi's tokenizers); ``spec`` itself otherwise."""
        name = self.chat_parsing.reasoning_parser
        if name is None or not REASONING_PARSERS[name].may_reason(prompt, req.chat_template_kwargs):
            return spec
        end = self._require_tokenizer().encode(REASONING_PARSERS[name].end, False)
        return dataclasses.replace(spec, start_after=tuple(end))

    def chat_output_parser(
        self, req: ChatCompletionRequest, tools: ToolParser | None, prompt: str, constrained: bool
    ) -> ChatOutputParser:
        """``constrained``: a grammar owns the output from its first token, so it is read as
        content (and calls), not as the reasoning a prompt may have opened (a grammar that
        starts after the reasoning is not ``constrained``: the reasoning comes first)."""
        name = self.chat_parsing.reasoning_parser
        reasoning = REASONING_PARSERS[name] if name is not None else None
        return ChatOutputParser(
            reasoning,
            tools,
            in_reasoning=reasoning is not None
            and not constrained
            and reasoning.starts_in_reasoning(prompt),
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    async def _start(
        self, prefix: str, body: _SamplingFields, prompts: list[list[int]], params: SamplingParams
    ) -> _Group:
        n = body.n
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(
                400, f"{len(prompts)} prompts x n={n} exceeds {MAX_CHOICES} choices", param="n"
            )
        group = _Group(self.client, self.metrics, prefix, n)
        try:
            await group.add_all(body, prompts, params)
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        return group

    # ------------------------------------------------------------------ endpoints

    async def completions(self, req: CompletionRequest, raw: Request):
        """``echo``: each choice's text (and logprobs) starts with the prompt's (the first
        prompt token has no logprob: null). ``max_tokens: 0`` with ``echo``: only that (the
        engine samples one token, as the prompt's last logits are computed anyway, and it is
        dropped here)."""
        self.check_model(req)
        nothing_new = req.returns_nothing_new
        plp = req.prompt_logprobs
        if req.echo and req.logprobs is not None and (plp is None or 0 <= plp < req.logprobs):
            plp = req.logprobs  # the echoed prompt's logprobs, with as many top ones
        max_tokens = 1 if nothing_new else req.max_tokens
        params = self.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs=plp)
        prompts = await self.completion_prompts(req)
        texts = self._prompt_texts(req, prompts) if req.echo else None
        group = await self._start("cmpl", req, prompts, params)
        wants = params.logprobs is not None
        echoed: set[int] = set()  # streamed choices whose prompt went out

        def new_part(c: _Choice, text: str, entries: list | None) -> tuple[str, dict | None]:
            """A choice's text and logprobs object, the echoed prompt first where it goes."""
            if nothing_new:
                text, entries, c.num_tokens = "", [], 0
            prompt_entries = None
            if texts is not None and c.index not in echoed:
                echoed.add(c.index)
                text = texts[c.index // group.n] + text
                if wants:
                    prompt_entries = (prompts[c.index // group.n], c.prompt_logprobs)
            if not wants:
                return text, None
            return text, self._completion_logprobs(entries or [], prompt_entries)

        def plp_field(c: _Choice, d: Delta | None = None) -> list | None:
            if req.prompt_logprobs is None:
                return None
            entries = c.prompt_logprobs if d is None else d.prompt_logprobs
            return self._vllm_prompt_logprobs(entries, req.prompt_logprobs)

        def chunk(c: _Choice | None, d: Delta | None) -> dict:
            choices = []
            if c is not None and d is not None:
                text, logprobs = new_part(c, d.text, d.logprobs)
                reason = d.finish_reason if d.finished else None
                if nothing_new and d.finished:
                    reason = "length"
                choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                                finish_reason=reason,
                                                prompt_logprobs=plp_field(c, d)))  # fmt: skip
            body = CompletionResponse(id=group.id, created=group.created, model=self.model_name,
                                      choices=choices)  # fmt: skip
            return body.model_dump(exclude={"usage"})  # streamed: usage only where asked

        def final() -> dict:
            choices = []
            for c in group.choices:
                text, logprobs = new_part(c, "".join(c.text), c.logprobs)
                choices.append(CompletionChoice(
                    index=c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason="length" if nothing_new else c.finish_reason,
                    prompt_logprobs=plp_field(c),
                ))  # fmt: skip
            return CompletionResponse(
                id=group.id, created=group.created, model=self.model_name, choices=choices,
                usage=group.usage(),
            ).model_dump()  # fmt: skip

        return await self._respond(req, raw, group, chunk, final, first=None)

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req)
        if req.prompt_logprobs is not None and req.stream:
            raise ApiError(
                400, "prompt_logprobs is not supported with stream in chat completions yet",
                param="prompt_logprobs", code="unsupported_parameter",
            )  # fmt: skip
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        try:
            n_logprobs = req.requested_logprobs()
        except ValueError as e:
            raise ApiError(400, str(e), param="top_logprobs") from None
        params = self.sampling_params(req, max_tokens, n_logprobs)
        tools = self.tool_parser(req)
        if tools is not None and self.chat_parsing.tool_call_parser in KEEPS_SPECIAL_TOKENS:
            params.skip_special_tokens = False  # its call markers are special tokens
        forced = self.forced_tool_calls(req)
        if forced is not None:
            if params.structured is not None:
                raise ApiError(
                    400,
                    f"{params.structured.param} cannot be combined with tool_choice "
                    f"{req.tool_choice!r}",
                    param=params.structured.param,
                )
            params.structured = forced
        prompt_text, prompt = await self.chat_prompt(req)
        if params.structured is not None:
            params.structured = self.after_reasoning(req, params.structured, prompt_text)
        group = await self._start("chatcmpl", req, [prompt], params)
        wants = params.logprobs is not None
        # Constrained from the first token: no reasoning to parse out of the output.
        constrained = params.structured is not None and not params.structured.start_after
        parsers = {
            c.index: self.chat_output_parser(req, tools, prompt_text, constrained)
            for c in group.choices
        }
        called: set[int] = set()  # choices that made a tool call

        def finish_reason(c: _Choice, reason: str | None) -> str | None:
            return "tool_calls" if reason == "stop" and c.index in called else reason

        def chunk(c: _Choice | None, d: Delta | None, role: bool = False) -> list[dict]:
            def body(delta: DeltaMessage, logprobs=None, reason=None) -> dict:
                choices = []
                if c is not None:
                    choices.append(ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                   finish_reason=reason))  # fmt: skip
                out = ChatCompletionChunk(id=group.id, created=group.created,
                                          model=self.model_name, choices=choices)  # fmt: skip
                return out.model_dump(exclude={"usage"})  # streamed: usage only where asked

            if c is None or role:
                return [
                    body(DeltaMessage(role="assistant", content="") if role else DeltaMessage())
                ]
            assert d is not None
            parser = parsers[c.index]
            parsed = parser.feed(d.text or "")
            if d.finished:
                parsed += parser.finish()
            deltas = []
            if parsed.reasoning:
                deltas.append(DeltaMessage(reasoning_content=parsed.reasoning))
            if parsed.content:
                deltas.append(DeltaMessage(content=parsed.content))
            first_index = parser.num_calls - len(parsed.tool_calls)
            for k, call in enumerate(parsed.tool_calls):
                called.add(c.index)
                deltas += _tool_call_deltas(call, first_index + k)
            logprobs = self._chat_logprobs(d.logprobs)
            reason = finish_reason(c, d.finish_reason) if d.finished else None
            if not deltas and (logprobs or reason):
                deltas.append(DeltaMessage())
            return [
                body(delta, logprobs if k == 0 else None, reason if k == len(deltas) - 1 else None)
                for k, delta in enumerate(deltas)
            ]

        def first() -> list[dict]:
            return [b for c in group.choices for b in chunk(c, None, role=True)]

        def final() -> dict:
            choices = []
            for c in group.choices:
                parsed = parsers[c.index].parse("".join(c.text))
                if parsed.tool_calls:
                    called.add(c.index)
                message = ChatCompletionMessage(
                    content=parsed.content or (None if parsed.tool_calls else ""),
                    reasoning_content=parsed.reasoning or None,
                    tool_calls=[t.to_openai() for t in parsed.tool_calls] or None,
                )
                choices.append(ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(c.logprobs if wants else None),
                    finish_reason=finish_reason(c, c.finish_reason),
                ))  # fmt: skip
            plp = None
            if req.prompt_logprobs is not None:
                plp = self._vllm_prompt_logprobs(
                    group.choices[0].prompt_logprobs, req.prompt_logprobs
                )
            return ChatCompletionResponse(
                id=group.id, created=group.created, model=self.model_name, choices=choices,
                usage=group.usage(), prompt_logprobs=plp,
            ).model_dump()  # fmt: skip

        return await self._respond(req, raw, group, chunk, final, first=first)

    # ------------------------------------------------------------------ logprobs

    def _piece(self, token_id: int) -> str:
        return (
            self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""
        )

    def _prompt_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What ``echo`` prepends: each prompt as sent (text), or its ids decoded."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], str):
            return list(p)
        if self.tokenizer is None:
            return ["" for _ in prompts]
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

    def _completion_logprobs(
        self, entries: list | None, prompt: tuple[list[int], list | None] | None = None
    ) -> dict | None:
        """The completions ``logprobs`` object: tokens, token_logprobs, top_logprobs,
        text_offset. ``prompt``: the echoed prompt's ids and ``Delta.prompt_logprobs``, put
        first (the first token's logprob and top ones null; a prompt token's top ones hold
        itself, as vLLM's do)."""
        if not entries and prompt is None:
            return None
        tokens, lps, tops = [], [], []
        if prompt is not None:
            ids, plp = prompt
            for j, t in enumerate(ids):
                tokens.append(self._piece(t))
                e = plp[j] if plp is not None and j < len(plp) else None
                if e is None:
                    lps.append(None)
                    tops.append(None)
                    continue
                top = self._top_by_text(e[3])
                top.setdefault(tokens[-1], e[1])
                lps.append(e[1])
                tops.append(top)
        for t, lp, top in entries or ():
            tokens.append(self._piece(t))
            lps.append(lp)
            tops.append(self._top_by_text(top))
        offsets, pos = [], 0
        for piece in tokens:
            offsets.append(pos)
            pos += len(piece)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def _top_by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """Top tokens keyed by their text, best first; tokens of one text (bytes of a split
        character) keep the best one's logprob."""
        out: dict[str, float] = {}
        for i, v in top:
            out.setdefault(self._piece(i), v)
        return out

    def _vllm_prompt_logprobs(self, entries: list | None, n: int) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or a mapping token id
        -> ``{logprob, rank, decoded_token}`` of the token itself and the ``n`` top ones."""
        if entries is None:
            return None
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            token, lp, rank, top = e
            d = {str(token): {"logprob": lp, "rank": rank, "decoded_token": self._piece(token)}}
            for j, (i, v) in enumerate(top[:n]):
                d.setdefault(str(i), {"logprob": v, "rank": j + 1,
                                      "decoded_token": self._piece(i)})  # fmt: skip
            out.append(d)
        return out

    def _chat_logprobs(self, entries: list | None) -> dict | None:
        """The chat ``logprobs`` object: one entry per content token, with its top tokens."""
        if not entries:
            return None

        def item(token_id: int, lp: float) -> dict:
            piece = self._piece(token_id)
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

        return {
            "content": [
                {**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                for t, lp, top in entries
            ]
        }

    # ------------------------------------------------------------------ responses

    async def _respond(
        self,
        req: _SamplingFields,
        raw: Request,
        group: _Group,
        chunk: Callable,
        final: Callable[[], dict],
        first: Callable[[], list[dict]] | None,
    ):
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(
                self._stream(group, chunk, first, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = asyncio.ensure_future(self._collect(group))
        gone = asyncio.ensure_future(_until_disconnected(raw))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we are cancelled): stop generating
                collect.cancel()
                group.abort()
        if collect.cancelled():
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
        error = collect.result()
        if error is not None:
            return error.response()
        return JSONResponse(final())

    async def _collect(self, group: _Group) -> ApiError | None:
        error = None
        async for _, d in group.deltas():
            if d.finished and d.finish_reason == "error" and error is None:
                error = _error_of(d)
        return error

    async def _stream(
        self,
        group: _Group,
        chunk: Callable,
        first: Callable[[], list[dict]] | None,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def with_usage(body: dict) -> dict:
            if include_usage:
                body["usage"] = None
            return body

        try:
            for body in first() if first else []:
                yield _sse(with_usage(body))
            async for c, d in group.deltas():
                if d.finished and d.finish_reason == "error":
                    yield _sse(error_body(*_error_fields(_error_of(d))))
                    continue
                if d.text or d.finished:
                    bodies = chunk(c, d)  # a chat chunk may hold text back, or split
                    for body in bodies if isinstance(bodies, list) else [bodies]:
                        yield _sse(with_usage(body))
            if include_usage:
                body = chunk(None, None)
                body = body[0] if isinstance(body, list) else body
                body["usage"] = group.usage().model_dump()
                yield _sse(body)
        except ApiError as e:  # the engine went away mid-stream
            yield _sse(error_body(*_error_fields(e)))
        finally:
            group.abort()  # a no-op unless the client left mid-stream
        yield "data: [DONE]\n\n"


def _tool_call_deltas(call: ToolCall, index: int) -> list[DeltaMessage]:
    """A call as the OpenAI SDK accumulates it: index, id, type and name first, then the
    arguments (one fragment: a call is emitted once its block is closed)."""
    head = {"index": index, "id": call.id, "type": "function"}
    head["function"] = {"name": call.name, "arguments": ""}
    rest = {"index": index, "function": {"arguments": call.arguments}}
    return [DeltaMessage(tool_calls=[head]), DeltaMessage(tool_calls=[rest])]


def _error_fields(e: ApiError) -> tuple[str, str, str | None, str | None]:
    return e.message, e.type, e.param, e.code
