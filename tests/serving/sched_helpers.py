"""Test helpers: small scheduler factories and a fake runner that checks every plan.

``FakeRunner`` plays the device: its KV cache maps slot -> (position, token) and its state
cache maps slot -> the exact token prefix the state summarises. Executing a plan writes the
step's K/V first (as attention does), then, per row, rebuilds the sequence from the block
table, checks it against the request's tokens, checks that ``src`` holds exactly the tokens
before the row's first new token, writes the checkpoints and ``dst``, and samples a token that
depends only on the sequence (so outputs are the same with caching on or off).
"""

from __future__ import annotations

import numpy as np

from serving.core.config import CacheConfig, SchedulerConfig
from serving.core.request import Request, SamplingParams
from serving.core.scheduler import Scheduler
from serving.core.scheduler_output import RequestUpdate, SchedulerOutput


def make_scheduler(
    *,
    block_size: int = 16,
    granularity: int | None = None,
    retention: int = 0,
    max_num_seqs: int = 4,
    budget: int = 256,
    max_model_len: int = 1024,
    num_kv_blocks: int = 64,
    num_state_slots: int = 16,
    caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_prefix_caching=caching,
        checkpoint_interval=granularity,
        retention_interval=retention,
    )
    return Scheduler(cfg, CacheConfig(num_kv_blocks, num_state_slots), rng_seed=0)


def make_request(
    rid: str, tokens: list[int], max_tokens: int = 4, eos: int | None = None, **params
) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), eos)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def fake_token(seq: list[int], vocab: int = 50_000) -> int:
    """The fake model's greedy token: a function of the whole sequence only."""
    return (sum((i + 1) * t for i, t in enumerate(seq)) * 2654435761) % vocab


class FakeRunner:
    def __init__(self, block_size: int, vocab: int = 50_000) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.kv: dict[int, tuple[int, int]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.reads: list[tuple[str, int, int]] = []  # (request id, src slot, start)

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        plan = out.plan
        bs = self.block_size
        n, qsl = int(plan.num_seqs), plan.query_start_loc
        t_live = int(qsl[n])
        assert n == out.num_rows and t_live == out.num_tokens
        assert (qsl[n:] == t_live).all() and not plan.seq_lens[n:].any()
        assert not plan.src_slot[n:].any() and not plan.dst_slot[n:].any()
        assert not plan.ckpt_slots[n:].any() and not plan.slot_mapping[t_live:].any()
        live_slots = plan.slot_mapping[:t_live]
        assert len(set(live_slots.tolist())) == t_live, "two tokens write one KV slot"
        assert (live_slots >= bs).all(), "a live token writes the null block"
        for t in range(t_live):
            self.kv[int(live_slots[t])] = (int(plan.positions[t]), int(plan.input_ids[t]))
        written = [int(x) for x in plan.ckpt_slots[:n].ravel() if x]
        assert len(set(written)) == len(written), "two checkpoint writes to one slot"
        dsts = plan.dst_slot[:n].tolist()
        assert len(set(dsts)) == n and 0 not in dsts
        assert not set(written) & set(dsts) and not set(written) & set(plan.src_slot[:n].tolist())
        sampled = np.zeros(plan.shape.num_seqs, np.int32)
        # The kernels read every row's src state before any row's writes land.
        srcs = [self.state[int(x)] if x else () for x in plan.src_slot[:n]]
        for s, req in enumerate(out.requests):
            q = int(qsl[s + 1] - qsl[s])
            seq_len = int(plan.seq_lens[s])
            start = seq_len - q
            assert q == out.num_new_tokens[s]
            seq = []
            for pos in range(seq_len):
                blk = int(plan.block_tables[s, pos // bs])
                assert blk != 0, f"{req.request_id}: null block at {pos=}"
                p, tok = self.kv[blk * bs + pos % bs]
                assert p == pos, f"{req.request_id}: block {blk} holds {p=}, expected {pos}"
                seq.append(tok)
            assert seq == req.all_token_ids[:seq_len], f"{req.request_id}: KV mismatch"
            src = int(plan.src_slot[s])
            assert srcs[s] == tuple(seq[:start]), (
                f"{req.request_id}: src slot {src} holds {len(srcs[s])} tokens, start={start}"
            )
            self.reads.append((req.request_id, src, start))
            for off, slot in zip(plan.ckpt_offsets[s], plan.ckpt_slots[s], strict=True):
                if slot:
                    assert 1 <= off <= q
                    self.state[int(slot)] = tuple(seq[: start + int(off)])
            self.state[int(plan.dst_slot[s])] = tuple(seq)
            assert plan.logits_indices[s] == qsl[s + 1] - 1
            sampled[s] = fake_token(seq, self.vocab)
        return sampled


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    out = sched.schedule()
    assert out is not None, "nothing scheduled"
    if out.plan is None:
        return out, sched.update(out, np.empty(0, np.int32))
    return out, sched.update(out, runner.execute(out))


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched, runner)[0])
    raise AssertionError("requests did not finish")


def expected_output(prompt_ids: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt_ids)
    for _ in range(max_tokens):
        seq.append(fake_token(seq))
    return seq[len(prompt_ids) :]
