"""The engine: requests in, token and text deltas out, one step at a time.

One engine step reads as three lines (CONVENTIONS.md §3)::

    out = self.scheduler.schedule()
    sampled = self.runner.execute(out.plan)
    updates = self.scheduler.update(out, sampled)

around which the engine detokenizes, checks stop strings (then finishes the request through
the scheduler, which frees its blocks and slot) and reports :class:`RequestOutput` s.

With ``--async-scheduling`` a step overlaps the next one's scheduling with the device::

    out[N+1] = scheduler.schedule()               # step N still runs: its decode rows get
    step[N+1] = runner.submit(plan[N+1], step[N])  #   a token read from step N on the device
    result[N] = runner.fetch(step[N])             # waits for step N only
    updates = scheduler.update(out[N], result[N]) # then detokenize, stop strings, outputs

A request that finishes at step N but already has a row in step N+1 keeps its blocks and slot
until step N+1's ``update``, which drops that row's token (``Scheduler`` docstring).

With ``--dispatch-thread`` as well, ``runner.submit`` runs on a thread of its own (steps in
order): the launch of step N+1, which holds the calling thread for XLA's whole launch sequence
(one launch per collective and CUDA graph segment under tensor parallelism, the GIL released),
overlaps this thread's ``update`` and outputs of step N and its scheduling of step N+2.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hyjax.detokenizer import DetokenizerStream, check_stop_strings
from hyjax.loader import load_model
from hyjax.sharding import ShardingPlan, make_mesh
from hyjax.tokenizer import load_tokenizer
from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.request import EngineRequest, Request
from serving.core.scheduler import Scheduler
from serving.core.scheduler_output import SchedulerOutput
from serving.core.speculative import SpeculativeConfig, describe, make_drafter
from serving.engine.engine_args import EngineArgs
from serving.engine.messages import EngineStats
from serving.worker.pool_sizing import size_pools
from serving.worker.runner import InFlightStep, ModelRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the ``n`` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, its rank (1 = the model's most
    likely token there) and the ``n`` most likely tokens at its position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    """A request's progress after a step (cumulative fields plus this step's deltas)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    error: str | None = None
    delta_logprobs: list[TokenLogprob] | None = None  # per new token, if the request asked
    # Every prompt token's (None for the first), in the request's first output, if it asked.
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclasses.dataclass
class _Tracked:
    req: Request
    detok: DetokenizerStream | None
    text: str = ""  # text decoded so far (stop strings searched here)
    sent: int = 0  # characters of ``text`` already reported
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # Prompt logprobs gathered over the prefill chunks; None once reported (or not asked).
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclasses.dataclass
class StepTiming:
    """Seconds per step spent on the host (schedule, update, detokenize) and on the device
    (``runner.execute``: transfer, step, and the wait for its tokens). With async scheduling,
    ``launch`` sums the seconds in ``runner.submit`` over ``launches`` steps (XLA's launch
    sequence; in ``host`` too unless the dispatch thread runs it)."""

    steps: int = 0
    host: float = 0.0
    device: float = 0.0
    last: tuple[int, bool, float, float] = (0, False, 0.0, 0.0)  # rows, decode_only, host, dev
    launches: int = 0
    launch: float = 0.0

    def add(self, rows: int, decode_only: bool, *, host: float, device: float) -> None:
        self.steps += 1
        self.host += host
        self.device += device
        self.last = (rows, decode_only, host, device)

    def reset(self) -> None:
        self.steps, self.host, self.device = 0, 0.0, 0.0
        self.launches, self.launch = 0, 0.0


def _mixed_row_buckets(flag: bool | None) -> bool:
    """``EngineArgs.mixed_row_buckets``, ``None`` resolved for this platform: on CPU the
    padded rows cost nothing measurable and each compiled bucket holds 25-70 MB."""
    if flag is not None:
        return flag
    import jax

    return jax.devices()[0].platform != "cpu"


def _async_scheduling(flag: bool | None) -> bool:
    """``EngineArgs.async_scheduling``, ``None`` resolved: on for one process on an
    accelerator (a 24-layer Qwen3-Next-80B decoding 8 rows on an H200: 6.0 ms a token against
    8.8 ms with the host's work between steps), off on CPU (host and device share its cores)
    and with several processes (the followers replay the leader's plans, which cannot read a
    step's tokens that only the leader's device holds)."""
    if flag is not None:
        return flag
    import jax

    return jax.devices()[0].platform != "cpu" and jax.process_count() == 1


def _branch_free_step(flag: bool | None, tensor_parallel_size: int) -> bool:
    """``EngineArgs.branch_free_step``, ``None`` resolved: on for tensor parallel on a GPU, where
    every ``lax.cond`` of the step is a conditional node between the collectives' launches
    (two H200s, the 48-layer 80B at TP 2, SGLang's c8 workload: 781 output tok/s against 668
    with the branches, 2546 against 1648 at 8 layers; BENCHMARKS.md), off elsewhere (one GPU's
    step is one CUDA graph whose conditionals cost nothing on the host; TPU and CPU run a
    conditional where it stands)."""
    if flag is not None:
        return flag
    import jax

    return tensor_parallel_size > 1 and jax.devices()[0].platform == "gpu"


def _executable_dir(cache_dir: str | None) -> str | None:
    """Where the runner keeps its compiled steps: beside JAX's persistent compilation cache,
    for one process (several processes each compile their own: none is written)."""
    import jax

    if cache_dir is None or jax.process_count() > 1:
        return None
    # expanded as use_compilation_cache expands it: "~/..." is not a folder named "~" here
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), "hyjax-steps")


def use_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at ``path`` (made if missing) for every
    compile from now on in this process, those under a second included (CPU buckets)."""
    import jax

    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("compilation cache: %s", path)


class LLMEngine:
    """Args: ``args``; ``preloaded``: an already built ``(model, config)`` (benchmarks), in which
    case ``args.model`` is only searched for a tokenizer."""

    def __init__(self, args: EngineArgs, preloaded=None):
        self.args = args
        self.async_scheduling = _async_scheduling(args.async_scheduling)
        # With async scheduling and --dispatch-thread, steps are launched from this thread.
        self._dispatch = None
        if self.async_scheduling and args.dispatch_thread:
            self._dispatch = ThreadPoolExecutor(1, thread_name_prefix="hyjax-dispatch")
        if args.compilation_cache_dir:
            use_compilation_cache(args.compilation_cache_dir)
        mesh = None
        if args.tensor_parallel_size > 1 or args.enable_expert_parallel:
            mesh = make_mesh(args.tensor_parallel_size)
        self.spec_config = SpeculativeConfig.parse(args.speculative_config)
        mtp = self.spec_config is not None and self.spec_config.device_drafts
        if preloaded is None:
            model, self.model_config = load_model(
                args.model, dtype=args.dtype, mesh=mesh,
                expert_parallel=args.enable_expert_parallel, mtp=mtp,
                load_format=args.load_format, stacked=args.scan_layers,
            )  # fmt: skip
        else:
            model, self.model_config = preloaded
        sharding = None
        if mesh is not None:
            sharding = ShardingPlan(mesh, self.model_config, args.enable_expert_parallel)
        self.tokenizer = load_tokenizer(args.model, dummy=args.load_format == "dummy")
        max_len = args.max_model_len or min(self.model_config.max_position_embeddings, 4096)
        num_spec = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.sched_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            checkpoint_interval=args.checkpoint_interval,
            retention_interval=args.retention_interval,
            min_token_bucket=args.min_token_bucket,
            min_seq_bucket=args.min_seq_bucket,
            mixed_row_buckets=_mixed_row_buckets(args.mixed_row_buckets),
            max_prompt_logprobs=args.max_prompt_logprobs,
            num_speculative_tokens=num_spec,
            verify_buckets=args.verify_buckets,
            spec_disable_batch_size=getattr(self.spec_config, "disable_by_batch_size", None) or 0,
            scheduling_policy=args.scheduling_policy,
        )
        memory = size_pools(
            self.model_config,
            self.sched_config,
            model.dtype,
            cache_bytes=args.cache_bytes,
            num_checkpoint_slots=args.num_checkpoint_slots,
            sharding=sharding,
            state_dtype=args.state_dtype,
            mtp_layers=getattr(self.model_config, "num_mtp_layers", 0) if mtp else 0,
        )
        self.runner = ModelRunner(
            model,
            self.model_config,
            self.sched_config,
            memory=memory,
            kernel_backend=args.kernel_backend,
            sharding=sharding,
            allow_tf32=args.allow_tf32,
            state_dtype=args.state_dtype,
            scan_layers=args.scan_layers,
            num_mtp_drafts=num_spec if mtp else 0,
            executable_dir=_executable_dir(args.compilation_cache_dir),
            branch_free_step=_branch_free_step(args.branch_free_step, args.tensor_parallel_size),
        )
        cache_cfg = CacheConfig(
            self.runner.memory.num_kv_blocks, self.runner.memory.num_state_slots
        )
        self.scheduler = Scheduler(
            self.sched_config,
            cache_cfg,
            rng_seed=args.seed,
            async_scheduling=self.async_scheduling,
            drafter=make_drafter(self.spec_config) if self.spec_config else None,
        )
        if self.spec_config is not None:
            log.info("speculative decoding: %s", self.spec_config)
        # Async scheduling: dispatched steps not yet updated, oldest first (at most two); with
        # the dispatch thread, each step's handle is a future of it.
        self._in_flight: collections.deque[tuple[SchedulerOutput, InFlightStep | Future]] = (
            collections.deque()
        )
        self.vocab_size = self.model_config.vocab_size
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self._tracked: dict[str, _Tracked] = {}
        self._grammars = None  # GrammarCompiler, at the first structured-output request
        self.timing = StepTiming()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        if args.warmup and args.background_warmup:
            self.runner.start_background_warmup()
        elif args.warmup:
            self.runner.warmup(progress=args.progress)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> str:
        """Validates and queues ``request``; returns its id. Raises ValueError with a message
        for the client."""
        request.validate()
        params = dataclasses.replace(request.sampling_params)  # the caller's stays as it was
        if isinstance(request.prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt token ids")
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = [int(t) for t in request.prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params.validate_token_ids(self.vocab_size)
        if not params.ignore_eos and self.eos_token_ids:
            extra = [e for e in self.eos_token_ids[1:] if e not in params.stop_token_ids]
            params.stop_token_ids = tuple(params.stop_token_ids) + tuple(extra)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        req = Request.from_engine_request(request, ids, params, eos)
        if params.structured is not None:
            req.grammar = self._compile_grammar(params.structured)
        self.scheduler.add_request(req)  # raises ValueError for what the scheduler rejects
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(
                context_ids=ids, skip_special_tokens=params.skip_special_tokens
            )
        tracked = self._tracked[req.request_id] = _Tracked(req, detok)
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None]  # the first token has no context
        self.prompt_tokens += len(ids)
        return req.request_id

    def _compile_grammar(self, spec):
        """The request's matcher (llguidance, imported at the first constrained request).
        Raises ValueError naming the API field for a constraint that does not compile."""
        if self.tokenizer is None:
            raise ValueError(f"{spec.param}=...: structured outputs need the model's tokenizer")
        if self.runner.on_execute is not None:
            raise ValueError(f"{spec.param}=...: structured outputs with several hosts")
        if self._grammars is None:
            from serving.core.structured.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.compile(spec)

    def abort_request(self, request_id: str) -> None:
        """Stops a request wherever it is; its blocks and slot are freed."""
        self.scheduler.finish_request(request_id, "abort")
        self._tracked.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the requests that made progress or finished."""
        if self.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out is None:
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(out.plan) if out.plan is not None else None
        t2 = time.perf_counter()
        self._take_prompt_logprobs(out, result)
        updates = self._update(out, result)
        rows = {rid: i for i, rid in enumerate(out.request_ids)}
        outputs = [o for o in (self._process(u, result, rows) for u in updates) if o is not None]
        self.timing.add(
            out.num_rows,
            out.plan is not None and out.plan.shape.decode_only,
            host=(t1 - t0) + (time.perf_counter() - t2),
            device=t2 - t1,
        )
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Dispatches the next step (two when none is in flight), then waits for the oldest
        one in flight and reports it: the host schedules step N+1 while the device runs step N.

        Only decode steps run ahead: a step with prefill tokens is reported before the next
        one is scheduled. There the host's work is small against the device's, and on an H200
        running ahead of them cost first tokens (TTFT p50 214 ms against 124 ms sync, 24-layer
        80B, 8 prompts of 1000 tokens; not yet traced why) while decode gained 1.46x."""
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        if not self._in_flight:
            self._launch(outputs)
        if self._in_flight and self._in_flight[-1][0].plan.shape.decode_only:
            self._launch(outputs)
        if not self._in_flight:
            return outputs
        t1 = time.perf_counter()
        out, handle = self._in_flight.popleft()
        result = self.runner.fetch(handle.result() if self._dispatch else handle)
        t2 = time.perf_counter()
        outputs += self._report(out, result)
        self.timing.add(
            out.num_rows,
            out.plan.shape.decode_only,
            host=(t1 - t0) + (time.perf_counter() - t2),
            device=t2 - t1,
        )
        return outputs

    def _launch(self, outputs: list[RequestOutput]) -> None:
        """Schedules a step and dispatches it after the ones in flight (a step without a plan,
        only rejections to report, is reported at once)."""
        out = self.scheduler.schedule()
        if out is None:
            return
        if out.plan is None:
            outputs += self._report(out, None)
            return
        prev = self._in_flight[-1][1] if self._in_flight else None
        if self._dispatch is None:
            handle = self._submit(out.plan, prev, out.from_prev)
        else:  # a future of the step's handle: this thread goes on to report the step before
            handle = self._dispatch.submit(self._submit_after, out.plan, prev, out.from_prev)
        self._in_flight.append((out, handle))

    def _submit_after(self, plan, prev: Future | None, from_prev) -> InFlightStep:
        """The dispatch thread's submit. It runs the steps in order, so ``prev`` (the step
        before, its future) is done."""
        return self._submit(plan, prev.result() if prev is not None else None, from_prev)

    def _submit(self, plan, prev: InFlightStep | None, from_prev) -> InFlightStep:
        start = time.perf_counter()
        step = self.runner.submit(plan, prev=prev, from_prev=from_prev)
        self.timing.launches += 1
        self.timing.launch += time.perf_counter() - start
        return step

    def _report(self, out: SchedulerOutput, result) -> list[RequestOutput]:
        self._take_prompt_logprobs(out, result)
        updates = self._update(out, result)
        rows = {rid: i for i, rid in enumerate(out.request_ids)}
        return [o for o in (self._process(u, result, rows) for u in updates) if o is not None]

    def _update(self, out: SchedulerOutput, result) -> list:
        """The scheduler takes the step's tokens (and the MTP drafter's drafts, if any)."""
        if result is None:
            return self.scheduler.update(out, np.empty(0))
        return self.scheduler.update(out, result.tokens, result.draft_tokens)

    def _take_prompt_logprobs(self, out: SchedulerOutput, result) -> None:
        """Appends the prompt positions the step scored to their requests' lists."""
        for rid, first, offset, count in out.prompt_logprobs:
            tr = self._tracked.get(rid)
            if tr is None or tr.prompt_logprobs is None:  # aborted meanwhile
                continue
            n, ids = tr.req.sampling_params.prompt_logprobs, tr.req.prompt_token_ids
            sl = slice(offset, offset + count)
            lps, ranks = result.prompt_logprobs[sl].tolist(), result.prompt_ranks[sl].tolist()
            top_ids = result.prompt_top_ids[sl, :n].tolist()
            top_lps = result.prompt_top_logprobs[sl, :n].tolist()
            assert len(tr.prompt_logprobs) == first + 1, (rid, first, len(tr.prompt_logprobs))
            for j in range(count):
                top = list(zip(top_ids[j], top_lps[j], strict=True))
                tr.prompt_logprobs.append(PromptLogprob(ids[first + j + 1], lps[j], ranks[j], top))

    def _process(self, u, result, rows: dict[str, int]) -> RequestOutput | None:
        tr = self._tracked.get(u.request_id)
        if tr is None:  # aborted while in flight
            return None
        params = tr.req.sampling_params
        logprobs = None
        if params.logprobs is not None and u.new_token_ids and result is not None:
            r, n = rows[u.request_id], params.logprobs
            top = list(zip(result.top_ids[r, :n].tolist(), result.top_logprobs[r, :n].tolist()))
            logprobs = [TokenLogprob(u.new_token_ids[-1], float(result.logprobs[r]), top)]
        finished, reason = u.finished, u.finish_reason
        new_ids = list(u.new_token_ids)
        visible_ids = new_ids
        if finished and reason == "stop" and new_ids and not params.ignore_eos:
            # The stop token itself is not part of the output text.
            if new_ids[-1] == tr.req.eos_token_id or new_ids[-1] in params.stop_token_ids:
                visible_ids = new_ids[:-1]
        if params.stop and tr.detok is not None and len(visible_ids) > 1:
            # A verified run may complete a stop string before its last token: cut it there.
            for i, tok in enumerate(visible_ids):
                tr.text += tr.detok.step(tok)
                if check_stop_strings(tr.text, params.stop).stopped:
                    if i + 1 < len(visible_ids):
                        new_ids = new_ids[: i + 1]
                        finished, reason = False, None  # finished below, by the stop string
                    break
            visible_ids = []
        self.generation_tokens += len(new_ids)
        tr.output_ids.extend(new_ids)
        if tr.detok is not None:
            tr.text += tr.detok.extend(visible_ids)
            if finished:
                tr.text += tr.detok.flush()
        visible = len(tr.text)
        if params.stop and tr.detok is not None:
            check = check_stop_strings(tr.text, params.stop)
            visible = check.visible_len
            if check.stopped and not finished:
                self.scheduler.finish_request(u.request_id, "stop")
                finished, reason = True, "stop"
            if check.stopped:
                tr.text = tr.text[:visible]
            elif finished:
                visible = len(tr.text)
        delta = tr.text[tr.sent : visible]
        tr.sent = max(tr.sent, visible)
        if finished:
            del self._tracked[u.request_id]
        prompt_logprobs = tr.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) == tr.req.num_prompt_tokens:
            tr.prompt_logprobs = None  # reported once, complete
        else:
            prompt_logprobs = None
        return RequestOutput(
            request_id=u.request_id,
            prompt_token_ids=tr.req.prompt_token_ids,
            # a snapshot while the request runs; its last output keeps the list (no more
            # tokens come: the request is no longer tracked)
            output_token_ids=tr.output_ids if finished else list(tr.output_ids),
            text=tr.text[: tr.sent] if not finished else tr.text,
            delta_token_ids=new_ids,
            delta_text=delta,
            finished=finished,
            finish_reason=reason,
            num_cached_tokens=max(u.num_cached_tokens, 0),
            error=u.error,
            delta_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    # ------------------------------------------------------------------ observability

    def metrics(self) -> EngineStats:
        st = self.scheduler.stats()
        c = st.cache
        return EngineStats(
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            kv_usage=st.kv_usage,
            state_usage=st.state_usage,
            num_preemptions=st.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            kv_query_tokens=c.kv_query_tokens,
            kv_hit_tokens=c.kv_hit_tokens,
            state_query_tokens=c.state_query_tokens,
            state_hit_tokens=c.state_hit_tokens,
            effective_hit_tokens=c.effective_hit_tokens,
            spec_num_drafts=st.spec.num_drafts,
            spec_num_draft_tokens=st.spec.num_draft_tokens,
            spec_num_accepted_tokens=st.spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(st.spec.accepted_per_pos),
            steps=self.timing.steps,
            step_host_seconds=self.timing.host,
            step_device_seconds=self.timing.device,
        )

    def spec_summary(self) -> str | None:
        """A line on speculative decoding's acceptance so far (None when it is off)."""
        if self.spec_config is None:
            return None
        return describe(self.scheduler.stats().spec)

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Steps until every request has finished; returns each request's final output."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return final
