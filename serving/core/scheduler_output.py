"""What ``Scheduler.schedule`` returns and ``Scheduler.update`` reports, and the plan builder.

``build_plan`` turns the step's rows into a ``StepPlan`` with numpy gathers only: its Python
work is O(rows + checkpoint writes); token-level arrays are filled by vectorised numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.core.config import SchedulerConfig
from serving.core.plan import SamplingArrays, StepPlan
from serving.core.request import FinishReason, Request


@dataclasses.dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one request did in a step (returned by ``Scheduler.update``).

    ``new_token_ids`` holds the token sampled this step (the stop token included when it
    finished the request); it is empty for a request finished before it ran (``error``).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class SpecRow:
    """A verify row's bookkeeping until its step's ``update``: what the request held when it
    was scheduled (``CacheManager``'s allocation), the per-token slots the step writes (slot
    ``j`` after ``j + 1`` of the row's tokens), and the row's first position."""

    alloc: object
    slots: list[int]
    start: int


@dataclasses.dataclass
class SchedulerOutput:
    """One scheduled step: the plan for the runner plus per-row bookkeeping.

    Row ``s`` of the plan is ``requests[s]``; it computes ``num_new_tokens[s]`` tokens and
    yields a sampled token only if ``samples[s]`` (a prefill chunk that stops short of the end
    of the known tokens does not). ``plan`` is None only when the step runs nothing and just
    reports ``finished`` (requests rejected at admission); call ``update(out, np.empty(0))``.
    """

    plan: StepPlan | None
    step_id: int
    requests: list[Request]
    num_new_tokens: list[int]
    samples: list[bool]
    finished: list[RequestUpdate] = dataclasses.field(default_factory=list)
    # Scheduler-internal: checkpoints this step writes, and the state slot references it holds
    # (those plus the hit checkpoints it reads) until ``update``.
    ckpt_written: list[int] = dataclasses.field(default_factory=list, repr=False)
    slots_held: list[int] = dataclasses.field(default_factory=list, repr=False)
    # Async scheduling: ``(token index in the plan's input_ids, row of the previous plan)``
    # for each token whose id that previous step samples (the runner splices it on device).
    from_prev: list[tuple[int, int]] = dataclasses.field(default_factory=list, repr=False)
    # Prompt logprobs: ``(request id, first position, offset, count)``: the step scores that
    # request's prompt positions ``first .. first + count - 1`` in entries ``offset ..`` of its
    # ``prompt_lp_*`` arrays (``StepResult.prompt_*``).
    prompt_logprobs: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    # Speculative decoding: plan row -> its verify row's bookkeeping (it holds the slots).
    spec: dict[int, SpecRow] = dataclasses.field(default_factory=dict, repr=False)
    updated: bool = dataclasses.field(default=False, repr=False)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def build_plan(
    cfg: SchedulerConfig,
    block_table: np.ndarray,  # i32[max_num_seqs, max_blocks] persistent, by table row
    sampling: SamplingArrays,  # [max_num_seqs] each, persistent, by table row
    table_rows: list[int],  # table row of each plan row
    starts: list[int],  # first new token position of each plan row
    q_lens: list[int],  # new tokens of each plan row
    input_ids: list[int],  # all new tokens, rows concatenated
    src: list[int],
    dst: list[int],
    ckpts: list[tuple[int, int, int]],  # (plan row, token offset, slot)
    prompt_lp: list[tuple[int, int]] = (),  # (token index, prompt token its logits score)
    drafts: list[list[int]] | None = None,  # each row's draft tokens (its last q_len tokens)
    next_ids: list[int] | None = None,  # the known token after each row's, -1: it samples it
) -> StepPlan:
    """A fresh ``StepPlan`` in the smallest bucket that holds these rows.

    Token ``t`` of row ``s`` sits at position ``pos = starts[s] + t``, its K/V goes to
    ``block_table[row, pos // B] * B + pos % B``::

        plan tokens  | a0 a1 a2 a3 | b0 | c0 c1 | pad ...
        tok_row        0  0  0  0    1    2  2
        positions     s_a ... s_a+3  s_b  s_c s_c+1   0 ...
        slot_mapping  block_table[row_a, pos // B] * B + pos % B, ...  0 (null block) ...

    A step whose rows all have at most K + 1 tokens (decode rows, verify rows, no prefill
    chunk longer than that) and score no prompt goes to a verify bucket
    (``StepShape.max_row_tokens``): its recurrent layers run the k-token decode kernels.

    Speculative decoding (``cfg.num_speculative_tokens`` = K > 0): mixed steps take logits
    at K + 1 positions of every row, ``logits_indices[s * (K + 1) + j]``: a verify row's token
    ``j`` (its last one past its drafts), another row's last token at every ``j``::

        row b = [t d1 d2] (K = 3)   b's entries  qsl[b] + 0, 1, 2, 2
        row c = prefill chunk        c's entries  qsl[c + 1] - 1 (4 times)
    """
    n_seqs, n_tok = len(q_lens), len(input_ids)
    assert n_seqs > 0 and n_tok == sum(q_lens)
    decode_only = n_tok == n_seqs
    verify = cfg.is_verify_step(max(q_lens), decode_only, bool(prompt_lp))
    plan = StepPlan.empty(cfg.step_shape(n_tok, n_seqs, decode_only, verify=verify))
    rows = np.asarray(table_rows, np.intp)
    start = np.asarray(starts, np.int32)
    qlen = np.asarray(q_lens, np.int32)
    qsl = plan.query_start_loc
    np.cumsum(qlen, out=qsl[1 : n_seqs + 1])
    qsl[n_seqs + 1 :] = n_tok
    plan.seq_lens[:n_seqs] = start + qlen
    plan.num_seqs[...] = n_seqs
    plan.input_ids[:n_tok] = input_ids

    if decode_only:
        tok_row = np.arange(n_seqs)
        pos = start
    else:
        tok_row = np.repeat(np.arange(n_seqs), qlen)
        pos = np.arange(n_tok, dtype=np.int32) + (start - qsl[:n_seqs])[tok_row]
    bs = cfg.block_size
    plan.positions[:n_tok] = pos
    plan.slot_mapping[:n_tok] = block_table[rows[tok_row], pos // bs] * bs + pos % bs
    plan.block_tables[:n_seqs] = block_table[rows]

    plan.src_slot[:n_seqs] = src
    plan.dst_slot[:n_seqs] = dst
    col = [0] * n_seqs
    for s, offset, slot in ckpts:
        # A decode row writes at most one checkpoint, at offset 1: its final state.
        assert not decode_only or (offset == 1 and col[s] == 0), (s, offset)
        plan.ckpt_offsets[s, col[s]] = offset
        plan.ckpt_slots[s, col[s]] = slot
        col[s] += 1
    last = qsl[1 : n_seqs + 1] - 1
    k_max = plan.shape.num_spec
    if k_max == 0:
        assert not any(drafts or ()), "drafts in a step without verify rows"
        plan.logits_indices[:n_seqs] = last
    else:
        nd = np.asarray([len(d) for d in drafts] if drafts else [0] * n_seqs, np.int32)
        assert (nd <= k_max).all(), (nd, k_max)
        j = np.arange(k_max + 1, dtype=np.int32)
        idx = (last - nd)[:, None] + np.minimum(j[None, :], nd[:, None])
        plan.logits_indices[: n_seqs * (k_max + 1)] = idx.reshape(-1)
        plan.num_drafts[:n_seqs] = nd
        for s, d in enumerate(drafts or ()):
            plan.draft_ids[s, : len(d)] = d
    if next_ids is not None:
        plan.next_ids[:n_seqs] = next_ids
    sampling.take(rows, plan.sampling)
    if prompt_lp:
        assert not decode_only and len(prompt_lp) <= plan.shape.max_prompt_logprobs
        plan.prompt_lp_indices[: len(prompt_lp)], plan.prompt_lp_targets[: len(prompt_lp)] = zip(
            *prompt_lp, strict=True
        )
    return plan
