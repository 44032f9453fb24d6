"""Qwen3-Next in hyjax vs transformers on a tiny random checkpoint that transformers saved.

Every forward runs on the serving interface: paged KV (block tables, slot mapping), the state
pool with src/dst slots and checkpoint writes. Caches start poisoned with NaN, so a read of
anything not written first shows up as NaN logits. The scenarios are
:mod:`tests.hyjax.parity_helpers`'; here they run at step shapes that vary, padding included.
"""

import pytest

from hyjax.testing import save_tiny_qwen3_next
from tests.hyjax import parity_helpers as parity


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return parity.tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next_tiny"), save_tiny_qwen3_next)


@pytest.fixture(scope="module")
def runner(ckpt):
    return parity.Runner(ckpt.path)


def test_whole_prompt_one_step(ckpt, runner):
    parity.whole_prompt_one_step(ckpt, runner, (72, 72))


def test_chunked_prefill_then_decode(ckpt, runner):
    parity.chunked_prefill_then_decode(ckpt, runner, prefill=(64, 64), decode=(1, 1))


def test_mixed_ragged_step(ckpt, runner):
    parity.mixed_ragged_step(ckpt, runner, first=(48, 4), mixed=(80, 80), decode=(2, 2))


@pytest.mark.parametrize("resume_at", [64, 128])
def test_resume_from_checkpoint(ckpt, runner, resume_at):
    parity.resume_from_checkpoint(ckpt, runner, resume_at, straight=(160, 160), resumed=(96, 96))
