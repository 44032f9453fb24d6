"""Kimi-Linear in hyjax vs transformers (>= 5.17) on a tiny random checkpoint it saved.

Every forward runs on the serving interface: the paged MLA latent cache (block tables, slot
mapping) and the KDA state pool with src/dst slots and checkpoint writes. Caches start
poisoned with NaN, so a read of anything not written first shows up as NaN logits. The
checkpoint is what ``save_pretrained`` writes (its dense layer 0 under ``block_sparse_moe``),
and the model has KDA and MLA layers, a dense and MoE layers with two expert groups. The
scenarios are :mod:`tests.hyjax.parity_helpers`'.

Two step shapes only (prefill: 160 tokens, decode: 2 rows), so each compiles once.
"""

import numpy as np
import pytest

from hyjax.testing import save_tiny_kimi_linear
from tests.hyjax import parity_helpers as parity

PREFILL = (160, 160)  # tokens and rows (so that every token's logits fit) of a prefill step
DECODE = (2, 2)  # a decode step: 2 rows of one token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return parity.tiny_checkpoint(
        tmp_path_factory.mktemp("kimi_linear_tiny"), save_tiny_kimi_linear
    )


@pytest.fixture(scope="module")
def runner(ckpt):
    return parity.Runner(ckpt.path)


def test_whole_prompt_one_step(ckpt, runner):
    caches = parity.whole_prompt_one_step(ckpt, runner, PREFILL)
    # The MLA cache holds one latent per token (kv_lora_rank + rope dims), nothing per head.
    (latent,) = caches.kv[0]
    assert latent.shape == (40, parity.BS, 16 + 8)
    assert not np.isnan(np.asarray(latent[1:5])).any()  # blocks 1..4 full, block 5 partly


def test_chunked_prefill_then_decode(ckpt, runner):
    parity.chunked_prefill_then_decode(ckpt, runner, prefill=PREFILL, decode=DECODE)


def test_mixed_ragged_step(ckpt, runner):
    parity.mixed_ragged_step(ckpt, runner, first=PREFILL, mixed=PREFILL, decode=DECODE)


@pytest.mark.parametrize("resume_at", [64, 128])
def test_resume_from_checkpoint(ckpt, runner, resume_at):
    parity.resume_from_checkpoint(ckpt, runner, resume_at, straight=PREFILL, resumed=PREFILL)
