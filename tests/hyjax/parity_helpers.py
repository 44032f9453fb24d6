"""What the Qwen3-Next and Kimi-Linear parity tests share: a tiny checkpoint that transformers
saved with its reference logits, a jitted forward on the serving interface, and the scenarios
both families run through it.

Each scenario takes the step shapes (``(num_tokens, num_seqs)``) from its caller: the Qwen3-Next
tests vary them to cover padding, the Kimi-Linear tests keep two so each compiles once. Caches
start poisoned with NaN, so a read of anything not written first shows up as NaN logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyjax.cache import Caches, init_caches
from hyjax.loader import load_model
from hyjax.ops import get_ops
from hyjax.testing import SeqChunk, hf_logits, make_batch

BS = 16  # KV block size
RTOL = 1e-4  # max abs error / max abs value: f32 noise is ~3e-6, a real bug > 1e-2
LONG = 150  # tokens of the reference prompt

Shape = tuple[int, int]  # (num_tokens, num_seqs) of one step


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    tokens: list[int]  # the LONG-token prompt
    ref: np.ndarray  # f32[LONG, vocab]: transformers' logits of every prompt token


def tiny_checkpoint(directory: Path, save: Callable[..., object]) -> Checkpoint:
    """Saves a tiny random checkpoint with ``save`` (transformers writes it) and its logits."""
    save(directory, seed=0)
    tokens = np.random.default_rng(0).integers(3, 128, size=LONG).tolist()
    return Checkpoint(directory, tokens, hf_logits(directory, tokens))


class Runner:
    """The hyjax model of a checkpoint, jitted once per step shape and ``decode_only``."""

    def __init__(self, path: Path):
        model, self.cfg = load_model(path)
        graphdef, self.state = nnx.split(model)
        ops = get_ops("reference")

        @functools.partial(jax.jit, static_argnames="decode_only")
        def forward(state, batch, caches, decode_only=False):
            return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

        self.forward = forward

    def run(
        self, rows: Sequence[SeqChunk], caches: Caches, shape: Shape, *, decode_only: bool = False
    ) -> tuple[Caches, list[np.ndarray]]:
        """One step; returns the caches and each row's logits (``f32[n, vocab]``, n its picks)."""
        num_tokens, num_seqs = shape
        batch, idx = make_batch(
            rows, block_size=BS, num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=16
        )
        caches, logits = self.forward(self.state, batch, caches, decode_only=decode_only)
        logits = np.asarray(logits)
        return caches, [logits[i] for i in idx]

    def fresh(self) -> Caches:
        return init_caches(
            self.cfg, num_blocks=40, block_size=BS, num_slots=8, dtype=jnp.float32, fill=np.nan
        )


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < RTOL, f"relative error {err:.2e}"


def whole_prompt_one_step(ckpt: Checkpoint, runner: Runner, shape: Shape) -> Caches:
    """70 tokens in one step, logits of each; returns the caches for the caller's own checks."""
    n = 70
    row = SeqChunk(ckpt.tokens[:n], 0, range(1, 6), dst_slot=1, all_logits=True)
    caches, (out,) = runner.run([row], runner.fresh(), shape)
    assert not np.isnan(out).any(), "NaN logits: a read of an unwritten cache entry"
    assert_close(out, ckpt.ref[:n])
    return caches


def chunked_prefill_then_decode(
    ckpt: Checkpoint, runner: Runner, *, prefill: Shape, decode: Shape
) -> None:
    """Four chunks of different sizes (131 tokens), then 8 decode steps on ``decode_only``."""
    tokens, ref = ckpt.tokens, ckpt.ref
    caches = runner.fresh()
    blocks = list(range(3, 13))
    pos = 0
    for i, size in enumerate([5, 59, 64, 3]):
        row = SeqChunk(
            tokens[pos : pos + size],
            pos,
            blocks,
            src_slot=0 if i == 0 else 2,
            dst_slot=2,
            all_logits=True,
        )
        caches, (out,) = runner.run([row], caches, prefill)
        assert_close(out, ref[pos : pos + size])
        pos += size
    for _ in range(8):  # decode token by token through the update kernels
        row = SeqChunk(tokens[pos : pos + 1], pos, blocks, src_slot=2, dst_slot=2)
        caches, (out,) = runner.run([row], caches, decode, decode_only=True)
        assert_close(out[0], ref[pos])
        pos += 1


def mixed_ragged_step(
    ckpt: Checkpoint, runner: Runner, *, first: Shape, mixed: Shape, decode: Shape
) -> None:
    """One step: a decode of a cached sequence, a fresh 1-token prompt, and longer chunks."""
    tokens, ref = ckpt.tokens, ckpt.ref
    # Step 1 (shape ``first``): prefill 40 tokens of sequence A (blocks 1..4, slot 1).
    caches, _ = runner.run(
        [SeqChunk(tokens[:40], 0, [1, 2, 3, 4], dst_slot=1)], runner.fresh(), first
    )
    ref1 = hf_logits(ckpt.path, tokens[:1])
    rows = [
        SeqChunk(tokens[40:41], 40, [1, 2, 3, 4], src_slot=1, dst_slot=1),  # decode, length 1
        SeqChunk(tokens[:1], 0, [5], dst_slot=2),  # a 1-token prompt
        SeqChunk(tokens[:65], 0, [6, 7, 8, 9, 10], dst_slot=3, all_logits=True),  # 65 tokens
        SeqChunk(tokens[:7], 0, [11], dst_slot=4, all_logits=True),  # 7 tokens
    ]
    caches, outs = runner.run(rows, caches, mixed)
    assert_close(outs[0][0], ref[40])
    assert_close(outs[1][0], ref1[0])
    assert_close(np.stack(outs[2]), ref[:65])
    assert_close(np.stack(outs[3]), ref[:7])
    # The written running slots continue correctly in a decode-only step.
    rows = [
        SeqChunk(tokens[41:42], 41, [1, 2, 3, 4], src_slot=1, dst_slot=1),
        SeqChunk(tokens[65:66], 65, [6, 7, 8, 9, 10], src_slot=3, dst_slot=3),
    ]
    caches, outs = runner.run(rows, caches, decode, decode_only=True)
    assert_close(outs[0][0], ref[41])
    assert_close(outs[1][0], ref[65])


def resume_from_checkpoint(
    ckpt: Checkpoint, runner: Runner, resume_at: int, *, straight: Shape, resumed: Shape
) -> None:
    """Checkpoints written inside one 150-token step resume to the same logits."""
    tokens, ref = ckpt.tokens, ckpt.ref
    blocks = list(range(1, 11))
    row = SeqChunk(tokens, 0, blocks, dst_slot=1, ckpts=[(64, 2), (128, 3)], all_logits=True)
    caches, (whole,) = runner.run([row], runner.fresh(), straight)
    assert_close(whole, ref)
    # A second request shares the prefix blocks and reads the checkpoint as its source.
    shared = blocks[: resume_at // BS]
    own = list(range(20, 20 + (LONG - resume_at) // BS + 1))
    slot = {64: 2, 128: 3}[resume_at]
    row = SeqChunk(
        tokens[resume_at:], resume_at, shared + own, src_slot=slot, dst_slot=5, all_logits=True
    )
    caches, (out,) = runner.run([row], caches, resumed)
    # Resumed vs straight: two float32 runs that sum the same terms in another chunk order.
    # Relative to the logits' magnitude (~10 here) they differ by ~3e-6 (the absolute 1e-4 this
    # test once used was at the noise floor: 1.2e-4 on an AVX-512 host); resuming from a wrong
    # slot or the zero state differs by > 1 relative. RTOL sits 30x above the noise.
    assert_close(out, whole[resume_at:])
    assert_close(out, ref[resume_at:])
