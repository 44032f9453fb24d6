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
    num_spec: int = 0,
    drafter=None,
    async_scheduling: bool = False,
    spec_disable_batch_size: int = 0,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_prefix_caching=caching,
        checkpoint_interval=granularity,
        retention_interval=retention,
        num_speculative_tokens=num_spec,
        spec_disable_batch_size=spec_disable_batch_size,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(
        cfg,
        CacheConfig(num_kv_blocks, num_state_slots),
        rng_seed=0,
        drafter=drafter,
        async_scheduling=async_scheduling,
    )


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


class FakeDrafter:
    """Proposes the fake model's true continuation with a wrong token from a position that
    depends on the sequence (so 0..k drafts are accepted, all of them sometimes)."""

    def __init__(self, wrong_every: int = 3) -> None:
        self.wrong_every = wrong_every

    def propose(self, req: Request, k: int) -> list[int]:
        seq = list(req.all_token_ids)
        out = []
        wrong_at = fake_token(seq, 7) % (k + self.wrong_every)
        for j in range(k):
            t = fake_token(seq)
            if j >= wrong_at:
                t = (t + 1) % 50_000
            out.append(t)
            seq.append(t)
        return out


class FakeRunner:
    def __init__(self, block_size: int, vocab: int = 50_000) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.kv: dict[int, tuple[int, int]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.reads: list[tuple[str, int, int]] = []  # (request id, src slot, start)

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Sampled tokens: i32[S], or i32[S, K + 1] (-1 after each row's run) in a step
        with verify rows (greedy acceptance of the drafts against the fake model)."""
        plan = out.plan
        k_max = plan.shape.num_spec
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
        sampled = np.full((plan.shape.num_seqs, k_max + 1), -1, np.int32)
        sampled[:, 0] = 0
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
            nd = int(plan.num_drafts[s])
            drafts = plan.draft_ids[s, :nd].tolist()
            assert (
                seq[seq_len - nd :] == drafts
                and seq_len - nd == len(req.all_token_ids)
                or (nd == 0)
            ), f"{req.request_id}: a verify row's tokens are not the known ones and the drafts"
            assert seq[: seq_len - nd] == req.all_token_ids[: seq_len - nd], (
                f"{req.request_id}: KV mismatch"
            )
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
            idx = plan.logits_indices.reshape(plan.shape.num_seqs, k_max + 1)[s]
            last = int(qsl[s + 1]) - 1
            assert idx.tolist() == [last - nd + min(j, nd) for j in range(k_max + 1)]
            a = 0
            while a < nd and drafts[a] == fake_token(seq[: seq_len - nd + a], self.vocab):
                a += 1
            sampled[s, : a + 1] = [*drafts[:a], fake_token(seq[: seq_len - nd + a], self.vocab)]
        return sampled if k_max else sampled[:, 0]


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
