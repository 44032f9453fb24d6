"""Scheduler and cache configuration: frozen dataclasses, validated on construction.

``SchedulerConfig`` holds what the user chooses (concurrency, token budget, context length,
caching knobs); the bucket sets and the plan's static sizes are derived properties.
``CacheConfig`` holds what the memory planner learned at start-up (pool sizes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from serving.core.plan import StepShape

KERNEL_CHUNK = 64  # token chunk of the chunked GDN/KDA kernels: checkpoints must land on it


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _powers_of_two(first: int, cap: int) -> tuple[int, ...]:
    """``first, 2*first, 4*first, ...`` below ``cap``, then ``cap`` itself."""
    out = []
    b = first
    while b < cap:
        out.append(b)
        b *= 2
    out.append(cap)
    return tuple(out)


def _smallest_at_least(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n=} exceeds the largest bucket {buckets[-1]}")


SCHEDULING_POLICIES = ("fcfs", "lpm")
# Past this many waiting requests "lpm" admits in arrival order (the sort's host time, and a
# queue that long is not waiting on a shared prefix; SGLang's bound too).
LPM_WINDOW = 128


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put in one step, and how prefixes are cached.

    Attributes:
      max_num_seqs: most sequences (rows) in one step; also the most running requests.
      max_num_batched_tokens: token budget of one step (prefill chunks plus decodes).
      max_model_len: most tokens (prompt plus output) of one request.
      block_size: tokens per KV block.
      enable_prefix_caching: look up, register and checkpoint prefixes.
      checkpoint_interval: the checkpoint granularity G; ``None`` means ``lcm(64, block_size)``.
        Every prefill chunk but a request's last starts and ends on a multiple of G, and
        checkpoints sit only at multiples of G.
      retention_interval: R; a checkpoint is kept every R tokens of a prompt (0 = none in the
        middle, only at the prompt end and the latest decode boundary). A multiple of G.
      mixed_row_buckets: a step with prefill tokens pads its rows to a power of two (one
        bucket per token count and row count); False pads them to ``min(T, max_num_seqs)``,
        one bucket per token count: a quarter of the compiles and their memory, for the padded
        rows' logits (free on CPU, where the embedded model's mixed steps take as long at 2 rows
        as at 32).
      max_prompt_logprobs: prompt positions one step may score for requests that ask for
        ``prompt_logprobs`` (0: such requests are refused). Rounded up to a multiple of G (a
        prompt-logprob request's prefill chunk is capped by it). The step holds P rows of
        f32 logits (P x vocab x 4 bytes: 155 MB at 256 x 151k) only while some row asks.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    checkpoint_interval: int | None = None
    retention_interval: int = 0
    min_token_bucket: int = 8  # the smallest token bucket of mixed steps (fewer compiles)
    # The smallest row bucket of decode and verify steps: a step of fewer rows pads to it (one
    # compile instead of log2(min_seq_bucket) + 1). Padded rows still cost compute (on CPU one
    # request padded to 32 rows decodes 3.4x slower), hence 1 by default.
    min_seq_bucket: int = 1
    mixed_row_buckets: bool = True
    max_prompt_logprobs: int = 256
    # K: draft tokens a decoding row may verify in one step (speculative decoding; 0 = off).
    # Mixed steps then carry K + 1 logits rows per sequence (``StepShape.num_spec``).
    num_speculative_tokens: int = 0
    # With K > 0: a step whose rows all have at most K + 1 tokens (decode rows and their
    # drafts, no prefill chunk) runs in a verify-shaped bucket (``verify_shapes``); False
    # runs it in a mixed bucket through the chunked prefill kernels, as before they existed.
    verify_buckets: bool = True
    # No row speculates in a step that starts with at least this many running requests
    # (``SpeculativeConfig.disable_by_batch_size``); 0: no limit.
    spec_disable_batch_size: int = 0
    # Admission order of the waiting requests: "fcfs" (arrival order), or "lpm" (longest
    # prefix match, SGLang's name: the longest cache hit first, ties in arrival order; a
    # request whose hit is a checkpoint a step is still writing is passed over for the
    # step instead of holding the queue). Over LPM_WINDOW waiting requests, fcfs.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r} must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        for name in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
            "min_seq_bucket",
        ):  # fmt: skip
            _check_positive(name, getattr(self, name))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens={k!r} must be a non-negative integer")
        base = math.lcm(KERNEL_CHUNK, self.block_size)
        g = self.checkpoint_interval
        if g is not None and (not isinstance(g, int) or g < 1 or g % base):
            raise ValueError(
                f"checkpoint_interval={g!r} must be a positive multiple of "
                f"lcm({KERNEL_CHUNK}, block_size={self.block_size}) = {base}"
            )
        r = self.retention_interval
        if not isinstance(r, int) or r < 0 or r % self.granularity:
            raise ValueError(
                f"retention_interval={r!r} must be 0 or a positive multiple of the checkpoint "
                f"granularity {self.granularity}"
            )
        if self.max_num_batched_tokens < self.granularity:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least the "
                f"checkpoint granularity {self.granularity} (prefill chunks are multiples of it)"
            )
        if not isinstance(self.max_prompt_logprobs, int) or self.max_prompt_logprobs < 0:
            raise ValueError(f"max_prompt_logprobs={self.max_prompt_logprobs!r} must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs} (every running sequence may decode at once)"
            )

    @property
    def granularity(self) -> int:
        """G: checkpoint positions and non-final prefill chunk edges are multiples of it."""
        if self.checkpoint_interval is not None:
            return self.checkpoint_interval
        return math.lcm(KERNEL_CHUNK, self.block_size)

    @property
    def prompt_logprob_capacity(self) -> int:
        """P: ``max_prompt_logprobs`` rounded up to a multiple of G (0 stays 0)."""
        g = self.granularity
        return -(-self.max_prompt_logprobs // g) * g

    @functools.cached_property
    def token_buckets(self) -> tuple[int, ...]:
        """Token capacities T of mixed steps: 8, 16, 32, ... up to the budget, budget included."""
        first = min(self.min_token_bucket, self.max_num_batched_tokens)
        return _powers_of_two(first, self.max_num_batched_tokens)

    @functools.cached_property
    def seq_buckets(self) -> tuple[int, ...]:
        """Sequence capacities S: ``min_seq_bucket`` (1 by default), twice it, ... up to
        ``max_num_seqs``, cap included."""
        return _powers_of_two(min(self.min_seq_bucket, self.max_num_seqs), self.max_num_seqs)

    @property
    def max_blocks(self) -> int:
        """Block table columns per sequence: ``cdiv(max_model_len, block_size)``."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_ckpt(self) -> int:
        """Most checkpoint writes of one sequence in one step.

        A chunk of at most ``max_num_batched_tokens`` tokens crosses at most
        ``cdiv(budget, R)`` multiples of R, plus the prompt-end boundary, two shared-prefix
        junctions and the latest boundary of a resumed request's replay. A verify row
        (speculative decoding) adds one write per draft token: its per-token slots.
        """
        r = self.retention_interval
        extra = -(-self.max_num_batched_tokens // r) if r else 0
        return extra + 4 + self.num_speculative_tokens

    @property
    def verify_shapes(self) -> bool:
        """Whether steps of short rows only get verify-shaped buckets (speculative decoding)."""
        return self.num_speculative_tokens > 0 and self.verify_buckets

    def is_verify_step(self, max_q_len: int, decode_only: bool, scores_prompt: bool) -> bool:
        """Whether a step runs in a verify bucket: speculation on, not decode-only, every row
        at most K + 1 tokens, and no prompt position to score (verify buckets score none)."""
        return (
            self.verify_shapes
            and not decode_only
            and not scores_prompt
            and max_q_len <= self.num_speculative_tokens + 1
        )

    def step_shape(
        self, num_tokens: int, num_seqs: int, decode_only: bool, *, verify: bool = False
    ) -> StepShape:
        """The bucket of a step with ``num_tokens`` tokens over ``num_seqs`` rows; ``verify``:
        every row has at most K + 1 tokens (:meth:`is_verify_step`)."""
        s = _smallest_at_least(self.seq_buckets, num_seqs)
        if verify:
            shape = self._shape(self._verify_tokens(s), s, False, verify=True)
            assert num_tokens <= shape.num_tokens, (num_tokens, shape)
            return shape
        t = s if decode_only else _smallest_at_least(self.token_buckets, num_tokens)
        if not decode_only:  # a mixed step never has more rows than tokens
            s = min(s, t) if self.mixed_row_buckets else self._mixed_rows(t)
        return self._shape(t, s, decode_only)

    def _verify_tokens(self, s: int) -> int:
        """T of the verify bucket of ``s`` rows: K + 1 tokens a row, capped by the budget
        (a step never has more tokens; the budget is at least ``max_num_seqs``)."""
        return min(s * (self.num_speculative_tokens + 1), self.max_num_batched_tokens)

    def _shape(self, t: int, s: int, decode_only: bool, *, verify: bool = False) -> StepShape:
        # decode and verify rows score no prompt
        p = 0 if decode_only or verify else self.prompt_logprob_capacity
        k = self._spec(decode_only)
        m = self.num_speculative_tokens + 1 if verify else 0
        return StepShape(t, s, self.max_blocks, self.max_ckpt, decode_only, p, k, m)

    def _spec(self, decode_only: bool) -> int:
        """``StepShape.num_spec``: mixed steps carry the verify rows of speculative decoding."""
        return 0 if decode_only else self.num_speculative_tokens

    def _mixed_rows(self, t: int) -> int:
        """The rows of a mixed step of ``t`` tokens without row buckets: as many as fit."""
        return min(t, self.max_num_seqs)

    def step_shapes(self) -> list[StepShape]:
        """Every shape ``schedule()`` can produce: what the runner compiles at start-up.

        Decode buckets, one per row count (speculation on: steps whose rows found no draft,
        e.g. the n-gram drafter's misses); verify buckets likewise when ``verify_shapes``;
        then the mixed buckets (prefill chunks, and verify rows beside them).
        """
        shapes = [self._shape(s, s, True) for s in self.seq_buckets]
        if self.verify_shapes:
            shapes += [
                self._shape(self._verify_tokens(s), s, False, verify=True) for s in self.seq_buckets
            ]
        if not self.mixed_row_buckets:
            shapes += [self._shape(t, self._mixed_rows(t), False) for t in self.token_buckets]
            return shapes
        for t in self.token_buckets:
            prev = 0
            for s in self.seq_buckets:
                if prev + 1 > t:  # needs more rows than tokens: unreachable
                    break
                shapes.append(self._shape(t, min(s, t), False))
                prev = s
        return shapes


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Pool sizes learned at start-up (see ``serving.core.memory_planner``).

    Attributes:
      num_kv_blocks: KV blocks including the null block 0.
      num_state_slots: state slots including the NULL slot 0; at least ``max_num_seqs + 1``
        (one running slot per request), the rest hold checkpoints.
    """

    num_kv_blocks: int
    num_state_slots: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks!r} must be at least 2 (null block + one)"
            )
        if not isinstance(self.num_state_slots, int) or self.num_state_slots < 2:
            raise ValueError(
                f"num_state_slots={self.num_state_slots!r} must be at least 2 (NULL slot + one)"
            )
