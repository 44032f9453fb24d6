"""Speculative decoding's per-token state slots through the slot contract.

k draft tokens per sequence need the state after each of them in its own slot, so that the
verifier can keep the state after the last accepted token without a copy. The prefill ops
give that with checkpoint writes at offsets 1..k (conv windows and recurrent states alike);
this test checks the states against k single-token decode steps of the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d.reference import (
    causal_conv1d_prefill_reference,
    causal_conv1d_update_reference,
)
from pallas_kernels.gdn import gpu
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_prefill_reference
from tests.pallas_kernels.ragged_cases import assert_close, state_slots

ROWS, K_DRAFT, HK, HV, D, C, TAPS = 3, 4, 2, 4, 16, 24, 4


def _draft_slots():
    # slot 1..ROWS: the running states; then K_DRAFT slots per row, one per draft token
    ck_off = np.tile(np.arange(1, K_DRAFT + 1, dtype=np.int32), (ROWS, 1))
    ck_slot = (1 + ROWS + np.arange(ROWS * K_DRAFT, dtype=np.int32)).reshape(ROWS, K_DRAFT)
    return ck_off, ck_slot, 1 + ROWS + ROWS * K_DRAFT


@pytest.mark.parametrize(
    "prefill",
    [gdn_prefill_reference, functools.partial(gpu.gdn_prefill, interpret=True)],
    ids=["reference", "gpu_interpret"],
)
def test_per_token_state_slots_equal_sequential_decode(prefill):
    rng = np.random.default_rng(7)
    n = ROWS * K_DRAFT
    q, k = (jnp.asarray(x, jnp.float32) for x in rng.normal(size=(2, n, HK, D)))
    v = jnp.asarray(rng.normal(size=(n, HV, D)), jnp.float32)
    a, b = (jnp.asarray(x, jnp.float32) for x in rng.normal(size=(2, n, HV)))
    A_log, dt_bias = (jnp.asarray(x, jnp.float32) for x in rng.normal(size=(2, HV)))
    ck_off, ck_slot, num_slots = _draft_slots()
    pool = np.full((num_slots, HV, D, D), np.nan, np.float32)
    pool[1 : ROWS + 1] = rng.normal(size=(ROWS, HV, D, D))
    running = np.arange(1, ROWS + 1, dtype=np.int32)
    qsl = jnp.arange(ROWS + 1, dtype=jnp.int32) * K_DRAFT
    # dst 0: the running slot is left as it was (the verifier picks a draft slot)
    drafts = state_slots(running, np.zeros(ROWS), ck_off, ck_slot, ROWS)
    _, got = jax.jit(prefill)(q, k, v, a, b, A_log, dt_bias, jnp.asarray(pool), qsl, drafts)
    got = np.asarray(got)
    np.testing.assert_array_equal(got[1 : ROWS + 1], pool[1 : ROWS + 1])  # running untouched

    state = jnp.asarray(pool)
    none = np.zeros((ROWS, 1), np.int32)
    in_place = state_slots(running, running, none, none, ROWS)
    for t in range(K_DRAFT):
        tok = np.arange(ROWS) * K_DRAFT + t  # draft token t of every row
        _, state = gdn_decode_reference(
            q[tok], k[tok], v[tok], a[tok], b[tok], A_log, dt_bias, state, in_place
        )
        want = np.asarray(state)[1 : ROWS + 1]
        assert_close(got[ck_slot[:, t]], want, rtol=2e-4, atol=2e-4)


def test_per_token_conv_windows_equal_sequential_updates():
    rng = np.random.default_rng(8)
    n = ROWS * K_DRAFT
    x = jnp.asarray(rng.normal(size=(n, C)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(C, TAPS)), jnp.float32)
    ck_off, ck_slot, num_slots = _draft_slots()
    conv = np.full((num_slots, TAPS - 1, C), np.nan, np.float32)
    conv[1 : ROWS + 1] = rng.normal(size=(ROWS, TAPS - 1, C))
    running = np.arange(1, ROWS + 1, dtype=np.int32)
    qsl = jnp.arange(ROWS + 1, dtype=jnp.int32) * K_DRAFT
    drafts = state_slots(running, np.zeros(ROWS), ck_off, ck_slot, ROWS)
    _, got = causal_conv1d_prefill_reference(x, weight, jnp.asarray(conv), qsl, drafts)
    state = jnp.asarray(conv)
    none = np.zeros((ROWS, 1), np.int32)
    in_place = state_slots(running, running, none, none, ROWS)
    for t in range(K_DRAFT):
        tok = np.arange(ROWS) * K_DRAFT + t
        _, state = causal_conv1d_update_reference(x[tok], weight, state, in_place)
        np.testing.assert_array_equal(
            np.asarray(got)[ck_slot[:, t]], np.asarray(state)[1 : ROWS + 1]
        )
