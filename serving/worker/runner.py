"""The model runner: the only owner of ``jax.jit`` and device arrays (DESIGN.md §5).

``step(params, caches, plan) -> (caches, sampled)`` is one jitted function per bucket
(:class:`serving.core.plan.StepShape`); caches are donated, and a step costs one host-to-device
transfer of the plan's arrays. Every bucket is compiled at start-up (``warmup``), or, for a
server that should answer at once, in a background thread while it serves
(``start_background_warmup``): a step whose bucket is not compiled yet compiles it then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from hyjax.batch import Batch
from hyjax.cache import Caches, init_caches
from hyjax.config import ModelConfig
from hyjax.models.hybrid import layer_groups, stack_caches
from hyjax.ops import Ops, ops_for_model
from hyjax.sharding import ShardingPlan, replicate_tree
from serving.core.config import SchedulerConfig
from serving.core.memory_planner import MemoryPlan
from serving.core.plan import PlanLayout, SamplingArrays, StepPlan, StepShape, mask_words
from serving.worker import branches
from serving.worker.executables import (
    StepExecutables,
    describe_args,
    environment_fingerprint,
    source_fingerprint,
)
from serving.worker.sampler import (
    MAX_LOGPROBS,
    apply_token_mask,
    count_inputs,
    init_token_tables,
    prompt_token_logprobs,
    sample,
    set_table_row,
    table_row_values,
    token_logprobs,
)
from serving.worker.spec_decode import verify_sample

log = logging.getLogger(__name__)


class _Static:
    """A static jit argument hashed once. jit hashes its static arguments on every call, and an
    nnx ``GraphDef``'s hash walks the whole module graph (~0.7 ms a step on a CPU host)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Static):
            return False
        return self.value is other.value or self.value == other.value


# The most bytes of a step's logits gathered whole on every device before sampling, under
# tensor parallelism: 110 rows of Qwen3-Next's 151936-token vocabulary in f32 (see ``_step``).
WHOLE_LOGITS_BYTES = 64 << 20


def _unpack(buf: jax.Array, layout: PlanLayout) -> dict[str, jax.Array]:
    """The plan's arrays as static slices (and bitcasts) of ``StepPlan.packed``'s buffer."""
    out, offset = {}, 0
    for name, dtype, shape in layout:
        n = math.prod(shape)
        x = buf[offset : offset + n]
        if np.dtype(dtype) != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        out[name] = x.reshape(shape)
        offset += n
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6, 7))
def _step(static: _Static, ops: Ops, decode_only: bool, max_row_tokens: int, *args):
    """:func:`_step_body`, jitted, its branches as ``static`` says (``branches.selecting``)."""
    with branches.selecting(static.value[4]):
        return _step_body(static, ops, decode_only, max_row_tokens, *args)


def _step_body(
    static: _Static,
    ops: Ops,
    decode_only: bool,
    max_row_tokens: int,  # a verify-shaped step's K + 1 (``StepShape.max_row_tokens``), else 0
    state_leaves: list,
    caches: Caches,
    tables,
    mtp_caches: tuple,  # the MTP drafter's KV pools (``init_mtp_caches``), () without it
    buf,  # i32[plan + 2R]: the packed plan, then the splice (token index [R], prev row [R])
    prev,  # i32[R]: the previous step's sampled tokens, padded to R = max_num_seqs
    token_mask,  # i32[S, ceil(V / 32)]: structured outputs' bitmask (rows with uses_grammar)
):
    """The whole step on device: forward over the ragged batch, then sampling.

    Async scheduling: the plan's input ids at the splice's token indices are replaced by the
    previous step's tokens at its rows, read from that step's output on the device, which the
    host has not seen yet (an index past the tokens is padding: nothing is replaced).

    ``static`` holds the model's graphdef, its state's treedef and the plan's layout: the state
    travels as a flat list of arrays and the plan as one packed int32 buffer, so a dispatch
    flattens no nnx pytree and the host makes one transfer (the Python side of a step's
    dispatch was ~2 ms on a CPU host with 19 plan arrays and an nnx State).

    With the MTP drafter (``static``'s ``num_mtp_drafts`` = K > 0) the step then drafts each
    row's next K tokens on device (:func:`_mtp_drafts`), returned as a fifth output."""
    graphdef, treedef, layout, num_mtp_drafts, _ = static.value
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
    # The step's results go into two buffers made by the step's first kernel (on NVIDIA,
    # ``ops.step_buffers``). Under async scheduling the results of step N are still held when
    # step N + 1 runs, so its result buffers are at other addresses than the last step's;
    # before launching a CUDA graph XLA:GPU re-records each of its nodes that touches a
    # buffer that moved (host work a node, a conditional's whole branches), and XLA's buffer
    # assignment placed dozens of the step's small temporaries (every layer's route-plan
    # scalars, the sampler's) in the result buffers whenever they were made last (H200, the
    # bench model at 8 layers, c8: 65 nodes a step, 0.42-0.69 ms of host,
    # benchmarks.cmdbuf_updates). Made first, they are live for the whole step and hold
    # nothing else; each has a word more than it is written, so XLA cannot replace the
    # in-place update with a new buffer.
    shapes = {name: shape for name, _, shape in layout}
    s_rows, num_spec = shapes["seq_lens"][0], shapes["draft_ids"][1]
    p_rows = 0 if decode_only else shapes["prompt_lp_targets"][0]
    (r,) = prev.shape
    r -= 1  # the guard word
    words = result_words(s_rows, num_spec, p_rows, MAX_LOGPROBS)
    buf, results, next_prev = ops.step_buffers(buf, blank=(words + 1, r + 1))
    arrays = _unpack(buf, layout)
    at, rows = buf[buf.shape[0] - 2 * r : buf.shape[0] - r], buf[buf.shape[0] - r :]
    arrays["input_ids"] = arrays["input_ids"].at[at].set(prev[rows], mode="drop")
    batch = Batch.from_arrays(arrays, max_row_tokens=max_row_tokens)
    # Every matmul traced here that pins no precision of its own (XLA's and the Pallas GPU
    # kernels') gets the ops' one: "highest" (IEEE f32) for float32 models, else the default.
    precision = ops.matmul_precision
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        caches, h = model.hidden_states(batch, caches, ops, decode_only=decode_only)
        logits = ops.head_logits(model.head(h[batch.logits_indices]))  # f32[S, V]
    # Under TP the LM head leaves the logits split by vocab (pinned by ``head_logits``: left to
    # propagation, the head gathered its weight instead). Up to WHOLE_LOGITS_BYTES they are
    # gathered whole here, on every step, so that no ``lax.cond`` below holds a collective:
    # XLA:GPU keeps a conditional whose branch holds one out of its CUDA graphs, and such a
    # conditional copies its predicate to the host, which waits there for every kernel before
    # it (two per step on two H200s: the sampler's sort, the log-probs). Past the bound (many
    # rows) they stay split, where XLA partitions argmax, max and the Gumbel draw with a few
    # scalars a row crossing devices, and the sort and the log-probs gather them themselves.
    if math.prod(logits.shape) * logits.dtype.itemsize <= WHOLE_LOGITS_BYTES:
        logits = ops.gather_logits(logits)
    sampling = SamplingArrays.from_arrays(arrays)
    # The token tables see this step's inputs before its rows sample (sampler.TokenTables).
    tables = branches.cond(  # count_inputs() writes nothing for rows without tables
        jnp.any(sampling.uses_tables > 0),
        lambda: count_inputs(
            tables,
            sampling,
            arrays["input_ids"],
            arrays["positions"],
            arrays["query_start_loc"],
            arrays["num_seqs"],
        ),
        lambda: tables,
        masked=True,
    )
    tables = ops.whole_tables(tables)  # out as they came in (donated; no second compile)
    positions = arrays["seq_lens"]  # of the tokens sampled
    num_spec = arrays["draft_ids"].shape[1]  # static: K of a step with verify rows, else 0
    if num_spec:  # logits at K + 1 positions a row; every row's new tokens, -1 after them
        # Rows with a grammar verify no drafts; their K + 1 logits rows are their one row
        # repeated, each masked like the row.
        logits = apply_token_mask(
            logits,
            jnp.repeat(sampling.uses_grammar, num_spec + 1),
            jnp.repeat(token_mask, num_spec + 1, axis=0),
        )
        all_tokens = verify_sample(
            logits,
            sampling,
            positions,
            arrays["draft_ids"],
            arrays["num_drafts"],
            gather=ops.gather_logits,
            tables=tables,
        )
        # a row without drafts has its one logits row at every position: the first one
        logits = logits.reshape(all_tokens.shape[0], num_spec + 1, -1)[:, 0]
        tokens = all_tokens[:, 0]
    else:
        tokens = sample(
            logits, sampling, positions, gather=ops.gather_logits, tables=tables,
            token_mask=token_mask,
        )  # fmt: skip
        all_tokens = tokens
    # Log-probabilities (a log-softmax and a top-k over the vocabulary) only in steps where
    # some row reports them; elsewhere zeros the host never reads.
    k = min(MAX_LOGPROBS, logits.shape[-1])
    s = tokens.shape[0]
    none = (jnp.zeros(s, jnp.float32), jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32))
    logprobs = branches.cond(
        jnp.any(sampling.logprobs >= 0),
        lambda: token_logprobs(ops.gather_logits(logits), tokens),
        lambda: none,
    )
    # Prompt logprobs: the LM head over the P gathered rows only, in steps that score some.
    targets = arrays["prompt_lp_targets"]  # i32[P]  -1: padding
    p = targets.shape[0]
    if p and not decode_only:
        none = (jnp.zeros(p, jnp.float32), jnp.zeros(p, jnp.int32),
                jnp.zeros((p, k), jnp.int32), jnp.zeros((p, k), jnp.float32))  # fmt: skip

        def score():
            with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
                rows = ops.head_logits(model.head(h[arrays["prompt_lp_indices"]]))  # f32[P, V]
            return prompt_token_logprobs(ops.gather_logits(rows), jnp.maximum(targets, 0))

        prompt = branches.cond(jnp.any(targets >= 0), score, lambda: none)
    else:
        prompt = ()
    assert s <= r, f"{s=} rows exceed the splice's {r=}"
    row_tokens = jnp.zeros(r, jnp.int32).at[:s].set(tokens)
    next_prev = jax.lax.dynamic_update_slice(next_prev, row_tokens, (0,))
    packed = jnp.concatenate([_as_words(x) for x in (all_tokens, *logprobs, *prompt)])
    assert packed.shape[0] <= words, (packed.shape, words)
    results = jax.lax.dynamic_update_slice(results, packed, (0,))
    drafts = None
    if num_mtp_drafts:
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            mtp_caches, drafts = _mtp_drafts(
                model, batch, h, all_tokens, arrays, mtp_caches, ops,
                num_draft=num_mtp_drafts, decode_only=decode_only,
            )  # fmt: skip
    return caches, tables, mtp_caches, results, next_prev, drafts


def _as_words(x: jax.Array) -> jax.Array:
    """``x`` (int32 or float32) as flat int32 words."""
    if x.dtype != jnp.int32:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return x.reshape(-1)


@functools.cache  # one per bucket: asked again at every step's submit
def result_fields(s: int, num_spec: int, p: int, k: int) -> tuple[tuple[str, np.dtype, tuple], ...]:
    """The ``StepResult`` fields packed, in order, into a step's results buffer: ``s`` rows,
    ``num_spec`` drafts a verify row (0: none), ``p`` scored prompt positions, ``k`` top
    logprobs (float32 fields travel as their bits)."""
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    fields = [
        ("tokens", i32, (s, num_spec + 1) if num_spec else (s,)),
        ("logprobs", f32, (s,)),
        ("top_ids", i32, (s, k)),
        ("top_logprobs", f32, (s, k)),
    ]
    if p:
        fields += [
            ("prompt_logprobs", f32, (p,)),
            ("prompt_ranks", i32, (p,)),
            ("prompt_top_ids", i32, (p, k)),
            ("prompt_top_logprobs", f32, (p, k)),
        ]
    return tuple(fields)


def result_words(s: int, num_spec: int, p: int, k: int) -> int:
    return sum(math.prod(shape) for _, _, shape in result_fields(s, num_spec, p, k))


def unpack_results(words: np.ndarray, fields: tuple, names: tuple[str, ...]) -> dict:
    """The named fields of a fetched results buffer (``result_fields``' layout)."""
    out, offset = {}, 0
    for name, dtype, shape in fields:
        n = math.prod(shape)
        if name in names:
            out[name] = words[offset : offset + n].view(dtype).reshape(shape)
        offset += n
    return out


def _mtp_drafts(
    model: nnx.Module,
    batch: Batch,
    h: jax.Array,  # [T, D]  the target's last hidden states, before the final norm
    all_tokens: jax.Array,  # i32[S] or i32[S, K + 1] (verify rows: new tokens, then -1)
    arrays: dict[str, jax.Array],
    mtp_caches: tuple,
    ops: Ops,
    *,
    num_draft: int,
    decode_only: bool,
) -> tuple[tuple, jax.Array]:
    """The MTP drafter after the target's step: ``(mtp_caches, drafts i32[S, num_draft])``.

    Each row drafts from its last accepted position ``r`` and the token after it (the token
    this step sampled there, or the next prompt token of a prefill chunk short of the end)::

        verify row    [t  d1 d2 d3]     accepted a = 1: y1 follows d1
        token index    q  q+1 q+2 q+3   r = q + a = (q_end - 1) - num_drafts + a
        MTP pass 1     every row of the step (its KV at every position computed);
                       next ids: the row's own next tokens, y1 at r (junk after r:
                       rejected positions, rewritten when they are computed again)
        drafts         from r: d'1 = MTP(y1, hidden_r), d'2.. at positions p_r + 1 ..

    ``propose`` (hyjax.models.qwen3_next.mtp) writes the MTP KV through the step's slot
    mapping and block tables: the same block ids as the target's KV.
    """
    from hyjax.models.qwen3_next.mtp import next_token_ids, propose

    qsl = arrays["query_start_loc"]
    s = all_tokens.shape[0]
    last = qsl[1 : s + 1] - 1  # i32[S]  each row's last token index
    if all_tokens.ndim == 2:
        accepted = jnp.sum(all_tokens >= 0, axis=1) - 1  # i32[S]  drafts accepted (0 if none)
        rows = last - arrays["num_drafts"] + accepted
        sampled = jnp.take_along_axis(all_tokens, jnp.maximum(accepted, 0)[:, None], 1)[:, 0]
    else:
        rows, sampled = last, all_tokens
    known = arrays["next_ids"]  # i32[S]  -1: the row samples its next token
    last_ids = jnp.where(known >= 0, known, sampled)
    next_ids = next_token_ids(batch.input_ids, rows, batch.num_seqs, last_ids)
    hidden = model.norm(h)  # [T, D] post-norm, what the MTP layer reads
    mtp_caches, draft = propose(
        model, batch, hidden, next_ids, rows, mtp_caches, ops,
        num_draft=num_draft, decode_only=decode_only,
    )  # fmt: skip
    return mtp_caches, draft.tokens


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step sends back to the host, per row."""

    # i32[S], or i32[S, K + 1] in a step with verify rows (each row's tokens, then -1)
    tokens: np.ndarray
    # None when no row of the step asked for log-probabilities (nothing computed or fetched).
    logprobs: np.ndarray | None = None  # f32[S]   the sampled token's logprob
    top_ids: np.ndarray | None = None  # i32[S, K] the K most likely tokens (K = MAX_LOGPROBS)
    top_logprobs: np.ndarray | None = None  # f32[S, K]
    # None unless the plan scores prompt positions (``StepPlan.prompt_lp_*``), one entry each.
    prompt_logprobs: np.ndarray | None = None  # f32[P]   the prompt token's logprob
    prompt_ranks: np.ndarray | None = None  # i32[P]   its rank (1 = most likely)
    prompt_top_ids: np.ndarray | None = None  # i32[P, K]
    prompt_top_logprobs: np.ndarray | None = None  # f32[P, K]
    # The MTP drafter's next drafts of every row (None without it): i32[S, K] (K = its drafts)
    draft_tokens: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step's outputs, still on the device (``ModelRunner.submit``)."""

    # what ``fetch`` copies to the host: the results buffer, then the drafts (MTP)
    out: tuple[jax.Array, ...]
    # i32[R + 1]: the sampled tokens padded to max_num_seqs (and a word), for the next step
    tokens: jax.Array
    names: tuple[str, ...] = ("tokens",)  # the ``StepResult`` fields to unpack
    fields: tuple = ()  # the results buffer's layout (``result_fields``)


# ``_step``'s results in order (a step without prompt scoring stops after the fourth; the
# drafts are its own output).
_RESULT_NAMES = tuple(f.name for f in dataclasses.fields(StepResult))


class ModelRunner:
    """Holds the model's parameters and the caches; runs plans.

    Args:
      model: the loaded NNX model.
      cfg: its config.
      sched_cfg: the scheduler's config (buckets, block size).
      memory: the pool sizes (``serving.worker.pool_sizing.size_pools``), allocated here.
      kernel_backend: ``auto``, ``reference``, ``pallas`` or ``interpret``; a kernel that cannot
        take the model's shapes is replaced by its reference op (``hyjax.ops.ops_for_model``,
        one warning each).
      allow_tf32: a float32 model's matmuls may use TF32 on NVIDIA (the MXU's bf16 passes on
        TPU); by default they are IEEE float32. No effect on 16-bit models.
      sharding: tensor / expert parallel plan (``hyjax.sharding``): parameters are placed by
        its rules, the pools split by head, the kernels run under ``shard_map``. Pool sizes
        are then per device.
      state_dtype: the recurrent-state pool's dtype (``float32`` or ``bfloat16``); ``memory``
        must have been sized for it.
      num_mtp_drafts: K > 0: every step drafts K tokens a row with the model's MTP layers
        (``model.mtp``; their KV pools are allocated here, beside the target's, with as many
        blocks) and returns them (``StepResult.draft_tokens``). ``memory`` must have been
        sized with them (``size_pools(mtp_layers=)``).
      branch_free_step: the step's sampler and log-prob branches computed on every step and
        selected instead of ``lax.cond`` (:mod:`serving.worker.branches`): no conditional in
        the compiled step, so XLA:GPU may keep NCCL collectives inside its CUDA graphs.
    """

    def __init__(
        self,
        model: nnx.Module,
        cfg: ModelConfig,
        sched_cfg: SchedulerConfig,
        *,
        memory: MemoryPlan,
        kernel_backend: str = "auto",
        sharding: ShardingPlan | None = None,
        allow_tf32: bool = False,
        state_dtype: str = "float32",
        scan_layers: bool = False,
        num_mtp_drafts: int = 0,
        executable_dir: str | None = None,
        branch_free_step: bool = False,
    ):
        self.cfg = cfg
        self.num_mtp_drafts = num_mtp_drafts
        self.branch_free = branch_free_step
        if num_mtp_drafts:
            check_mtp_drafter(model, cfg, sharding)
        self.sched_cfg = sched_cfg
        self.sharding = sharding
        # Multi-host serve: the leader ships each plan to the followers before running it, so
        # every process enters the step's collectives (serving/engine/multihost.py).
        self.on_execute: Callable[[StepPlan], None] | None = None
        self._no_prev: jax.Array | None = None  # i32[max_num_seqs + 1] zeros: no previous tokens
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> i32[rows, ceil(V / 32)] of -1
        # Background warm-up: bucket -> its compile (None -> the closing log line).
        self._warming: dict[StepShape | None, Future] = {}
        self._warmup_pool: ThreadPoolExecutor | None = None
        self._warm_pending = False  # a background warm-up is still compiling
        self.ops = ops_for_model(
            kernel_backend,
            cfg,
            model.dtype,
            allow_tf32=allow_tf32,
            tp=sharding.tp if sharding is not None else 1,
            expert_parallel=sharding is not None and sharding.expert_parallel,
        )
        if sharding is not None:
            model = sharding.shard_model(model)
            self.ops = sharding.shard_ops(self.ops)
        # One lax.scan over the repeating layer group (compile time independent of depth).
        # Under TP the stacked parameters are built straight into their shards (a leading
        # unsplit group axis, ShardingPlan.spec), and the pools keep their specs: the groups
        # lie end to end along the block / slot axis, which no spec splits.
        # (A model built stacked, ``load_model(stacked=True)``, runs scanned whatever the flag.)
        prestacked = getattr(model, "groups", None) is not None
        self.scan_layers = (scan_layers or prestacked) and layer_groups(cfg) is not None
        if self.scan_layers:
            model.stack_layers(sharding.sharding if sharding is not None else None)
            lg = layer_groups(cfg)
            log.info("layers: %d groups of %d scanned, %d unrolled", lg.num_groups, lg.period,
                     cfg.num_hidden_layers - lg.num_groups * lg.period)  # fmt: skip
        elif scan_layers:
            log.info("--scan-layers: the model has no repeating layer group; per-layer loop")
        self.graphdef, self.state = nnx.split(model)
        self.dtype = model.dtype
        self.memory = memory
        if sharding is not None:
            log.info(sharding.describe_pools())
        for line in self.memory.describe().splitlines():
            log.info(line)
        self.state_dtype = jnp.dtype(state_dtype)
        if self.state_dtype != jnp.float32:
            log.info("recurrent states stored in %s (computed in float32)", self.state_dtype)
        pools = dict(
            num_blocks=self.memory.num_kv_blocks,
            block_size=sched_cfg.block_size,
            num_slots=self.memory.num_state_slots,
            dtype=self.dtype,
            state_dtype=self.state_dtype,
        )
        self._pool_args = (cfg, pools, sharding, num_mtp_drafts)
        self._fresh_pools()
        # The compiled steps by bucket (background warm-up, and with ``executable_dir`` every
        # bucket, kept on disk for the next start): a step of a kept bucket is not traced.
        fixed = (self._state_leaves, self.caches, self.tables, self.mtp_caches)
        fingerprint = repr((
            source_fingerprint(), environment_fingerprint(), repr(cfg), str(self.dtype),
            kernel_backend, _describe_ops(self.ops), allow_tf32, str(self.state_dtype),
            self.scan_layers, num_mtp_drafts, branch_free_step, describe_args(fixed),
        ))  # fmt: skip
        self.executables = StepExecutables(fingerprint, executable_dir)
        self._bucket_keys: dict[StepShape, str] = {}

    def _fresh_pools(self) -> None:
        """Empty pools (KV, states, MTP) and sampler tables, on the devices."""
        cfg, pools, sharding, num_mtp_drafts = self._pool_args
        if sharding is not None:
            self.caches = sharding.init_caches(stacked=self.scan_layers, **pools)
        else:
            # Committed to the device, as every step's donated outputs are: otherwise the first
            # bucket warmed up sees other argument types than the steps after it, and compiles
            # again in serving.
            make = functools.partial(init_caches, cfg, **pools)
            if self.scan_layers:  # allocated in the scan's layout, in one jitted fill
                make = jax.jit(lambda: stack_caches(cfg, init_caches(cfg, **pools)))
            self.caches = jax.device_put(make(), jax.devices()[0])
        self.mtp_caches: tuple = ()
        if num_mtp_drafts:
            from hyjax.models.qwen3_next.mtp import init_mtp_caches

            mtp = functools.partial(
                init_mtp_caches, cfg, num_blocks=self.memory.num_kv_blocks,
                block_size=pools["block_size"], dtype=self.dtype,
            )  # fmt: skip
            self.mtp_caches = jax.device_put(jax.jit(mtp)(), jax.devices()[0])
        tables = init_token_tables(self.sched_cfg.max_num_seqs, cfg.vocab_size)
        if sharding is not None:
            self.tables = replicate_tree(tables, sharding.mesh)
        else:
            self.tables = jax.device_put(tables, jax.devices()[0])

    def warmup(self, *, progress: bool = True) -> float:
        """Compiles every bucket the scheduler can produce. Returns the seconds it took."""
        start = time.perf_counter()
        shapes = self.sched_cfg.step_shapes()
        for shape in tqdm(shapes, desc="compiling buckets", disable=not progress, leave=False):
            try:
                self.execute(StepPlan.empty(shape))
            except jax.errors.JaxRuntimeError as e:
                key = self._bucket_keys.get(shape)
                if key is None or key not in self.executables.from_disk:
                    raise
                # Seen on CPU: an executable written by an earlier start loads, then fails
                # to run ("NOT_FOUND: Function ... not found"). Compile the bucket again.
                log.warning("the kept step of %s does not run (%s): compiling it again", shape, e)
                self.executables.discard(key)
                self._fresh_pools()  # the failed step's outputs (the pools) carry its error
                self.execute(StepPlan.empty(shape))
        seconds = time.perf_counter() - start
        log.info("compiled %d buckets in %.1f s", len(shapes), seconds)
        return seconds

    def start_background_warmup(self) -> None:
        """Compiles every bucket in a background thread (decode and verify buckets first, then
        prefill by size) while steps run. Compiling needs only the arguments' shapes, so the
        thread never touches the caches the steps donate; XLA keeps what it compiles, and a
        step's first call of a warmed bucket then only traces it again. A step that meets a
        bucket still queued compiles it itself; one that meets the bucket being compiled waits
        for it."""
        shapes = sorted(
            self.sched_cfg.step_shapes(),
            key=lambda s: (not (s.decode_only or s.verify_only), s.num_tokens),
        )
        sds = functools.partial(jax.tree.map, _shape_of)
        avals = (
            sds(self._state_leaves), sds(self.caches), sds(self.tables), sds(self.mtp_caches)
        )  # fmt: skip
        pool = ThreadPoolExecutor(1, thread_name_prefix="hyjax-warmup")
        start = time.perf_counter()
        self._warming = {s: pool.submit(self._compile_ahead, s, avals) for s in shapes}
        for shape, fut in self._warming.items():
            fut.add_done_callback(functools.partial(_log_failure, shape))

        def finished() -> None:
            self._warm_pending = False  # steps stop looking the bucket up
            log.info(
                "compiled %d buckets in the background in %.1f s",
                len(shapes),
                time.perf_counter() - start,
            )

        self._warm_pending = True
        self._warming[None] = pool.submit(finished)
        self._warmup_pool = pool

    def stop_background_warmup(self) -> None:
        """Drops the buckets not compiled yet (the one in compile finishes): at shutdown."""
        pool, self._warmup_pool = self._warmup_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def wait_warm(self) -> None:
        """Blocks until the background warm-up (if any) has compiled every bucket."""
        for fut in list(self._warming.values()):
            if not fut.cancelled():
                fut.result()

    def _compile_ahead(self, shape: StepShape, avals: tuple) -> None:
        static, ops, decode_only, max_row_tokens, *_, buf, prev, mask = self.step_args(
            StepPlan.empty(shape)
        )
        args = (static, ops, decode_only, max_row_tokens, *avals, buf, prev, mask)
        self._kept(shape, args, compile_missing=True)

    def _kept(self, shape: StepShape, args: tuple, *, compile_missing: bool):
        """The bucket's kept executable (from memory or disk); a missing one is compiled and
        kept if ``compile_missing``, else None."""
        key = self._bucket_keys.get(shape)
        if key is None:  # the arguments' shapes follow from the bucket's
            key = self._bucket_keys[shape] = self.executables.key(_bucket(shape, args))
        exe = self.executables.get(key, lambda: args[4:])
        if exe is None and compile_missing:
            with _CacheHits() as hits:
                exe = _step.lower(*args).compile()
            # One that JAX's persistent cache served is kept in memory only: on CPU it
            # serializes wrongly (jax 0.10.2: "`LessThan` is not serializable", or a file that
            # loads, then fails to run: "NOT_FOUND: Function ... not found"). JAX's cache
            # serves it again at the next start.
            self.executables.put(key, exe, write=not hits.count)
        return exe

    def _run(self, shape: StepShape, args: tuple) -> tuple:
        """``_step(*args)``, by the bucket's kept executable where there is one (loaded from
        disk, or compiled and kept when an executable directory is set), else by the jit."""
        exe = self._kept(shape, args, compile_missing=self.executables.directory is not None)
        return exe(*args[4:]) if exe is not None else _step(*args)

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step. Returns every row's sampled token and logprobs (padding included)."""
        return self.fetch(self.submit(plan))

    def submit(
        self,
        plan: StepPlan,
        *,
        prev: InFlightStep | None = None,
        from_prev: list[tuple[int, int]] = (),
    ) -> InFlightStep:
        """Dispatches one step without waiting for it (async scheduling). ``from_prev``:
        ``(token index, row)`` pairs: the plan's input id at the index is ``prev``'s sampled
        token of that row, which stays on the device."""
        if self.on_execute is not None:
            if from_prev:
                raise NotImplementedError("async scheduling with several processes")
            self.on_execute(plan)
        if self._warm_pending:
            fut = self._warming.pop(plan.shape, None)
            if fut is not None and not fut.cancel():  # under way (or done): its result
                fut.result()
        assert prev is not None or not from_prev
        for row, init in plan.sampling.table_inits.items():
            values = table_row_values(init, self.cfg.vocab_size)
            self.tables = set_table_row(self.tables, np.int32(row), values)
        self.caches, self.tables, self.mtp_caches, results, tokens, drafts = self._run(
            plan.shape, self.step_args(plan, from_prev, prev)
        )
        # Unpacked on the host: the tokens, and what some row of the plan asked for.
        names = _RESULT_NAMES[:1]
        if (plan.sampling.logprobs >= 0).any():
            names += _RESULT_NAMES[1:4]
        if plan.num_prompt_logprobs:
            names += _RESULT_NAMES[4:8]
        shape = plan.shape
        p = 0 if shape.decode_only else plan.prompt_lp_targets.shape[0]
        k = min(MAX_LOGPROBS, self.cfg.vocab_size)
        fields = result_fields(shape.num_seqs, plan.draft_ids.shape[1], p, k)
        out = (results,) if drafts is None else (results, drafts)
        return InFlightStep(out, tokens, names, fields)

    @staticmethod
    def fetch(step: InFlightStep) -> StepResult:
        """Waits for ``step`` and copies its results to the host."""
        got = _fetch(step.out)
        fields = unpack_results(got[0], step.fields, step.names)
        if len(got) > 1:
            fields["draft_tokens"] = got[1]
        return StepResult(**fields)

    def step_args(
        self,
        plan: StepPlan,
        from_prev: list[tuple[int, int]] = (),
        prev: InFlightStep | None = None,
    ) -> tuple:
        """``_step``'s arguments for ``plan``, its packed arrays and the splice on the device
        (the step's one host-to-device transfer)."""
        buf, layout = plan.packed()
        r = self.sched_cfg.max_num_seqs
        splice = np.zeros((2, r), np.int32)
        splice[0] = plan.input_ids.shape[0]  # past the tokens: nothing replaced
        for j, (at, row) in enumerate(from_prev):
            splice[:, j] = at, row
        buf = np.concatenate([buf, splice.reshape(-1)])
        if self.sharding is not None:
            buf = replicate_tree(buf, self.sharding.mesh)
        else:
            buf = jax.device_put(buf)
        static = self._static.get(layout)
        if static is None:  # one per bucket
            static = self._static[layout] = _Static(
                (self.graphdef, self._treedef, layout, self.num_mtp_drafts, self.branch_free)
            )
        if prev is not None:
            tokens = prev.tokens
        else:
            # Committed to the device, as a step's tokens are: else a bucket warmed up with
            # these compiles again at its first step fed by the step before.
            if self._no_prev is None:
                zeros = np.zeros(r + 1, np.int32)  # and the guard word
                self._no_prev = (
                    replicate_tree(zeros, self.sharding.mesh)
                    if self.sharding is not None
                    else jax.device_put(zeros, jax.devices()[0])
                )
            tokens = self._no_prev
        leaves = self._state_leaves
        return (
            static, self.ops, plan.shape.decode_only, plan.shape.max_row_tokens, leaves,
            self.caches, self.tables,
            self.mtp_caches, buf, tokens, self._token_mask(plan),
        )  # fmt: skip

    def _token_mask(self, plan: StepPlan) -> jax.Array:
        """The plan's token bitmask on the device (a transfer of its own, only in steps with a
        grammar row), else a resident all-ones mask of the bucket's rows (allowed everywhere,
        read by no row): the step's arguments keep their shapes, so nothing compiles again."""
        put = functools.partial(
            replicate_tree, mesh=self.sharding.mesh
        ) if self.sharding is not None else jax.device_put  # fmt: skip
        if plan.token_mask is not None:
            return put(plan.token_mask)
        s = plan.shape.num_seqs
        mask = self._all_allowed.get(s)
        if mask is None:
            words = mask_words(self.cfg.vocab_size)
            mask = self._all_allowed[s] = put(np.full((s, words), -1, np.int32))
        return mask

    @property
    def state(self) -> nnx.State:
        return self._state

    @state.setter
    def state(self, state: nnx.State) -> None:
        self._state = state
        self._state_leaves, self._treedef = jax.tree.flatten(state)
        self._static: dict = {}

    @staticmethod
    def compile_count() -> int:
        """Executables compiled so far for the step function (all runners of this process)."""
        return _step._cache_size() + StepExecutables.process_compiles


def check_mtp_drafter(model: nnx.Module, cfg: ModelConfig, sharding: ShardingPlan | None) -> None:
    """Raises ValueError unless ``model`` can draft with MTP layers in this runner."""
    if getattr(cfg, "num_mtp_layers", None) is None:
        raise ValueError(
            f"speculative method 'mtp': {cfg.model_type} models have no multi-token prediction "
            "layers in hyjax (Qwen3-Next only); use the 'ngram' method"
        )
    if not cfg.num_mtp_layers or getattr(model, "mtp", None) is None:
        raise ValueError(
            "speculative method 'mtp': the model was loaded without its MTP layers "
            "(load_model(..., mtp=True)), or its checkpoint has none"
        )
    if sharding is not None:
        raise ValueError("speculative method 'mtp' with tensor/expert parallelism")


def _bucket(shape: StepShape, args: tuple) -> str:
    """What tells a bucket's executable from the runner's others: the shape, the plan's
    layout, and the shapes of the per-step arguments (plan buffer, tokens, mask)."""
    layout = args[0].value[2]
    return repr((shape, layout, *(tuple(a.shape) for a in args[-3:])))


def _describe_ops(ops: Ops) -> str:
    """Which function runs each op (a stable text: names, not addresses)."""

    def name(fn) -> str:
        if isinstance(fn, functools.partial):
            return f"{name(fn.func)}{sorted(fn.keywords.items())!r}"
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"

    return repr({f.name: name(getattr(ops, f.name)) for f in dataclasses.fields(ops)})


def _log_failure(shape: StepShape, fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("background compile of %s failed: %r", shape, fut.exception())


class _CacheHits:
    """Counts JAX's persistent-cache hits of the compiles that run in this thread while
    inside (``jax.monitoring``'s events, which fire in the compiling thread)."""

    _local = threading.local()
    _listening = False
    _lock = threading.Lock()

    def __enter__(self) -> _CacheHits:
        with _CacheHits._lock:
            if not _CacheHits._listening:
                jax.monitoring.register_event_listener(_CacheHits._on_event)
                _CacheHits._listening = True
        self.count = 0
        _CacheHits._local.current = self
        return self

    def __exit__(self, *exc) -> None:
        _CacheHits._local.current = None

    @staticmethod
    def _on_event(name: str, **kwargs) -> None:
        current = getattr(_CacheHits._local, "current", None)
        if current is not None and name == "/jax/compilation_cache/cache_hits":
            current.count += 1


def _shape_of(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _fetch(out: tuple[jax.Array, ...]) -> tuple[np.ndarray, ...]:
    """The step's replicated results on the host: one ``device_get`` for all of them (its
    copies overlap), or, with several processes, each from a local device."""
    if all(x.is_fully_addressable for x in out):
        return tuple(np.asarray(x) for x in jax.device_get(out))
    return tuple(np.asarray(x.addressable_data(0)) for x in out)
