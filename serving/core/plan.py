"""The step plan: what the scheduler hands the runner, as fixed-capacity numpy arrays.

This module is the contract between the plain-Python scheduler and the jitted step
(DESIGN.md §5). It imports numpy and the request type only. Every array has a static
capacity chosen from a small bucket set; rows past ``num_seqs`` and tokens past
``query_start_loc[num_seqs]`` are padding and must be harmless:

- padding tokens write their K/V into the null block 0 (``slot_mapping`` 0..block_size-1
  are the null block's slots, never read unmasked);
- padding sequences have ``src_slot = dst_slot = 0`` and no checkpoint writes, so the
  recurrent kernels neither read nor write any state for them; they sample greedily and
  report no log-probabilities (``SamplingArrays``' padding values).

Token layout of one step (S = 3 live sequences, T = 8 token capacity)::

    tokens:          | a0 a1 a2 a3 | b0 | c0 c1 | pad |
    query_start_loc:  0             4    5       7     7 ... (repeated for padding rows)
    seq_lens:        [ctx_a + 4,    ctx_b + 1, ctx_c + 2, 0 ...]

``seq_lens[s]`` counts all tokens of sequence ``s`` once this step has run (cached context
plus the new ones), so the new tokens of ``s`` sit at positions
``seq_lens[s] - q_len(s) .. seq_lens[s] - 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from serving.core.request import Request


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static part of a step: its bucket. One compiled executable per StepShape."""

    num_tokens: int  # T: token capacity
    num_seqs: int  # S: sequence capacity
    max_blocks: int  # block table columns per sequence
    max_ckpt: int  # checkpoint writes per sequence in one step
    decode_only: bool  # every live sequence has exactly one new token (T == S)
    # P: prompt positions whose next-token log-probabilities one step may report (requests
    # with ``prompt_logprobs``); the same in every bucket, so it adds no compile.
    max_prompt_logprobs: int = 0
    # K: draft tokens a row may verify (speculative decoding); the step then returns logits
    # and tokens for K + 1 positions of every row. 0 in decode-only steps and without drafts.
    num_spec: int = 0
    # A verify-shaped step (speculative decoding, ``SchedulerConfig.verify_shapes``): every
    # live row has at most this many tokens (K + 1: a decode row and its drafts), so the
    # recurrent layers run the k-token decode kernels instead of the chunked prefill. 0: no
    # bound (mixed steps; decode-only steps have their own, stronger marker).
    max_row_tokens: int = 0

    @property
    def verify_only(self) -> bool:
        """Every row is a decode row with at most K drafts (or as short): no prefill chunk."""
        return self.max_row_tokens > 0


def _per_row(dtype: type, pad: float) -> Any:
    """A field of ``SamplingArrays``: its dtype, and its value in a padding row (sampling off)."""
    return dataclasses.field(metadata={"dtype": np.dtype(dtype), "pad": pad})


@dataclasses.dataclass(frozen=True)
class TableInit:
    """What a request's row of the runner's token tables holds when it is admitted.

    The runner keeps, per table row, dense vocabulary-wide tables on device (``TokenTables``
    in ``serving/worker/sampler.py``): output-token counts, prompt presence, the stop ids that
    ``min_tokens`` bans, and the logit bias. Every step adds its *input* tokens to its rows'
    counts (a prompt position marks presence, a later one counts an output), so at a sampling
    step the counts cover exactly the tokens before the sampled position. Tokens a step never
    feeds are those of a prefix-cache hit: admission (also after a preemption) starts the row
    from ``token_ids[:num_computed]``, the tokens the hit skips, so the counts are rebuilt
    exactly whatever the hit length.
    """

    token_ids: tuple[int, ...]  # tokens [0, num_computed) of the request (cache hit)
    prompt_len: int
    stop_ids: tuple[int, ...]  # banned while min_tokens are not generated
    bias: tuple[tuple[int, float], ...]  # (token id, bias); bad words at -inf
    bad_seqs: tuple[tuple[int, ...], ...] = ()  # multi-token bad words

    @classmethod
    def of(cls, req: Request) -> TableInit:
        sp = req.sampling_params
        stop = tuple(sp.stop_token_ids)
        if sp.min_tokens and req.eos_token_id is not None and not sp.ignore_eos:
            stop += (req.eos_token_id,)
        bias = dict(sp.logit_bias or {})
        for t in sp.bad_words_token_ids:
            bias[t] = float("-inf")
        return cls(
            tuple(req.all_token_ids[: req.num_computed_tokens]),
            req.num_prompt_tokens,
            stop if sp.min_tokens else (),
            tuple(bias.items()),
            sp.bad_word_sequences,
        )


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters as fixed-capacity arrays, one entry a row.

    One type wherever rows sample: the scheduler's table (a row per block-table row, set as a
    request is admitted), each plan's (a row per plan row, gathered from that table), and the
    sampler's on device, which reads the same fields. A new sampling parameter is a field of
    ``SamplingParams``, a field here with its line in ``set_row``, and its use in the sampler.
    """

    temperature: np.ndarray = _per_row(np.float32, 0.0)  # f32[R]   0 = greedy
    top_p: np.ndarray = _per_row(np.float32, 1.0)  # f32[R]   1 = off
    top_k: np.ndarray = _per_row(np.int32, 0)  # i32[R]   0 = off
    min_p: np.ndarray = _per_row(np.float32, 0.0)  # f32[R]   0 = off
    seeds: np.ndarray = _per_row(np.uint32, 0)  # u32[R]   mixed with the position by the sampler
    logprobs: np.ndarray = _per_row(np.int32, -1)  # i32[R]   top logprobs reported; -1 = none
    # The token tables (``TokenTables``): row ``table_row`` of the runner's per-request tables
    # is this row's when ``uses_tables`` is 1 (else the sampler skips them).
    table_row: np.ndarray = _per_row(np.int32, 0)  # i32[R]
    uses_tables: np.ndarray = _per_row(np.int32, 0)  # i32[R]   1: penalties / bias / min_tokens
    prompt_len: np.ndarray = _per_row(np.int32, 0)  # i32[R]   positions below are the prompt's
    presence_penalty: np.ndarray = _per_row(np.float32, 0.0)  # f32[R]   0 = off
    frequency_penalty: np.ndarray = _per_row(np.float32, 0.0)  # f32[R]   0 = off
    repetition_penalty: np.ndarray = _per_row(np.float32, 1.0)  # f32[R]   1 = off
    # EOS and stop ids are banned while the sampled position is below this (prompt + min_tokens).
    min_tokens_until: np.ndarray = _per_row(np.int32, 0)  # i32[R]   0 = off
    # Structured outputs: the row's logits are masked by its row of the step's token bitmask
    # (``StepPlan.token_mask``) when 1; rows at 0 never read it.
    uses_grammar: np.ndarray = _per_row(np.int32, 0)  # i32[R]

    def __post_init__(self) -> None:
        # Host only (not a dataclass field, so never on device): table row -> the contents
        # its token tables get before the step that first samples for a newly admitted request.
        self.table_inits: dict[int, TableInit] = {}

    @classmethod
    def empty(cls, n: int) -> SamplingArrays:
        """``n`` padding rows."""
        fields = dataclasses.fields(cls)
        return cls(**{f.name: np.full(n, f.metadata["pad"], f.metadata["dtype"]) for f in fields})

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> SamplingArrays:
        """Picks this type's fields out of a larger dict (a plan's arrays, on host or device)."""
        return cls(**{f.name: arrays[f.name] for f in dataclasses.fields(cls)})

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def set_row(self, row: int, req: Request) -> None:
        """Row ``row`` samples as ``req`` asks (with the seed the scheduler resolved)."""
        sp = req.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.seeds[row] = req.seed
        self.logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.table_row[row] = row
        self.uses_tables[row] = sp.uses_token_tables
        self.prompt_len[row] = req.num_prompt_tokens
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.min_tokens_until[row] = req.num_prompt_tokens + sp.min_tokens if sp.min_tokens else 0
        self.uses_grammar[row] = req.grammar is not None
        if sp.uses_token_tables:
            self.table_inits[row] = TableInit.of(req)
        else:
            self.table_inits.pop(row, None)

    def take(self, rows: np.ndarray, out: SamplingArrays) -> None:
        """Copies rows ``rows`` of this table into the first ``len(rows)`` rows of ``out``, and
        moves their pending ``table_inits`` to ``out`` (each is run once, before its step)."""
        for name, a in self.arrays().items():
            getattr(out, name)[: len(rows)] = a[rows]
        for r in rows.tolist():
            init = self.table_inits.pop(r, None)
            if init is not None:
                out.table_inits[r] = init


@dataclasses.dataclass
class StepPlan:
    """One engine step, ready for a single host-to-device transfer.

    Attributes mirror the arguments of the model's ragged forward. ``ckpt_offsets[s, j]`` is a
    count of this step's tokens of sequence ``s`` (1..q_len) after which the recurrent state
    and conv window are written to ``ckpt_slots[s, j]``; slot 0 means "no write".
    """

    shape: StepShape
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]   KV cache slot = block_id * block_size + offset
    query_start_loc: np.ndarray  # i32[S + 1]
    seq_lens: np.ndarray  # i32[S]
    num_seqs: np.ndarray  # i32[]     live sequences
    block_tables: np.ndarray  # i32[S, max_blocks]   0 = null block
    src_slot: np.ndarray  # i32[S]   state slot read at the start; 0 = zero state
    dst_slot: np.ndarray  # i32[S]   state slot written at the end; 0 = not written
    ckpt_offsets: np.ndarray  # i32[S, max_ckpt]
    ckpt_slots: np.ndarray  # i32[S, max_ckpt]   0 = no write
    # i32[S * (K + 1)]: row s's logits at [s * (K + 1) + j]; entry j of a verify row is its
    # token j, a row without drafts repeats its last token (K = shape.num_spec, usually 0)
    logits_indices: np.ndarray
    sampling: SamplingArrays  # [S] each
    draft_ids: np.ndarray  # i32[S, K]   the draft tokens a verify row checks
    num_drafts: np.ndarray  # i32[S]   0: an ordinary row
    # Structured outputs: i32[S, ceil(V / 32)] packed bitmask of the tokens each row may
    # sample (bit t % 32 of word t // 32), read for rows with ``sampling.uses_grammar``; None
    # when no row has a grammar (the runner passes a resident all-ones mask instead). Not
    # part of ``packed``: its own transfer, only in steps that have one.
    token_mask: np.ndarray | None = None
    # Prompt log-probabilities: the logits at token index ``prompt_lp_indices[j]`` score the
    # prompt token ``prompt_lp_targets[j]`` (the next one); target -1 = padding. A step whose
    # targets are all -1 computes none of them (``lax.cond`` in the runner).
    prompt_lp_indices: np.ndarray = None  # i32[P]
    prompt_lp_targets: np.ndarray = None  # i32[P]
    # A device-side drafter (MTP) reads, for each row, the token after its last one: -1 when
    # the row samples it, else the next known token (a prefill chunk short of the prompt's end).
    next_ids: np.ndarray = None  # i32[S]

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt positions this step scores (they come first in the P arrays)."""
        return int((self.prompt_lp_targets >= 0).sum())

    @classmethod
    def empty(cls, shape: StepShape) -> StepPlan:
        """A plan with every row padding: what the scheduler fills in place."""
        t, s = shape.num_tokens, shape.num_seqs
        return cls(
            shape=shape,
            input_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            slot_mapping=np.zeros(t, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            seq_lens=np.zeros(s, np.int32),
            num_seqs=np.zeros((), np.int32),
            block_tables=np.zeros((s, shape.max_blocks), np.int32),
            src_slot=np.zeros(s, np.int32),
            dst_slot=np.zeros(s, np.int32),
            ckpt_offsets=np.zeros((s, shape.max_ckpt), np.int32),
            ckpt_slots=np.zeros((s, shape.max_ckpt), np.int32),
            logits_indices=np.zeros(s * (shape.num_spec + 1), np.int32),
            sampling=SamplingArrays.empty(s),
            prompt_lp_indices=np.zeros(shape.max_prompt_logprobs, np.int32),
            prompt_lp_targets=np.full(shape.max_prompt_logprobs, -1, np.int32),
            draft_ids=np.zeros((s, shape.num_spec), np.int32),
            num_drafts=np.zeros(s, np.int32),
            next_ids=np.full(s, -1, np.int32),
        )

    @classmethod
    def from_arrays(cls, shape: StepShape, arrays: Mapping[str, np.ndarray]) -> StepPlan:
        """The plan of shape ``shape`` whose ``arrays()`` these are."""
        sampling = SamplingArrays.from_arrays(arrays)
        rest = {k: v for k, v in arrays.items() if k not in sampling.arrays()}
        return cls(shape=shape, sampling=sampling, **rest)

    def arrays(self) -> dict[str, np.ndarray]:
        """The device-bound arrays (everything but the static shape), the sampling ones under
        their own names: one flat namespace, which ``from_arrays`` splits again."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["shape"], out["sampling"], out["token_mask"]
        return out | self.sampling.arrays()

    def packed(self) -> tuple[np.ndarray, PlanLayout]:
        """Every device-bound array in one int32 buffer, and where each lies in it.

        One host-to-device transfer per step instead of one per array: on a GPU host each
        transfer costs tens of microseconds, ~20 of them per step. Every field is 4 bytes wide
        (int32, uint32, float32), so each is a bit-exact view of its stretch of the buffer.
        """
        arrays = self.arrays()
        layout = tuple((name, a.dtype.str, a.shape) for name, a in arrays.items())
        parts = []
        for name, a in arrays.items():
            if a.dtype.itemsize != 4:
                raise TypeError(f"StepPlan.{name} is {a.dtype}: packed fields must be 4 bytes")
            parts.append(np.ascontiguousarray(a).reshape(-1).view(np.int32))
        return np.concatenate(parts), layout


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (``StepPlan.token_mask``)."""
    return (vocab_size + 31) // 32


# (field name, numpy dtype string, shape) of each array in ``StepPlan.packed``'s buffer, in order.
PlanLayout = tuple[tuple[str, str, tuple[int, ...]], ...]
