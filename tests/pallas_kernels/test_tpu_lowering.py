"""The Mosaic TPU kernels lower for a TPU at Qwen3-Next-80B and Kimi-Linear-48B shapes, on CPU.

No TPU is reachable from CI, so the interpret-mode tests check the kernels' arithmetic and
this test checks that Pallas' Mosaic lowering accepts them (block shapes, layouts, the ops
used) for a real chip: the lowering asks ``tpu_info`` which chip it targets, and JAX's
registry of device kinds lets the CPU device stand for one. (What only libtpu checks, at
compile time on a TPU, stays unchecked here.)
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic import tpu_info

from pallas_kernels.attention import mla_tpu
from pallas_kernels.conv1d import tpu as conv1d_tpu
from pallas_kernels.gdn import tpu as gdn_tpu
from pallas_kernels.kda import tpu as kda_tpu
from tests.pallas_kernels.ragged_cases import abstract_slots

HK, HV, D, CONV_C = 16, 32, 128, 2 * 16 * 128 + 32 * 128
ROWS, M, TOKENS, SLOTS = 4, 2, 256, 8
sd = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
SLOTS_ARG = abstract_slots(ROWS, M)


@pytest.fixture(params=["v5e", "v6e"])
def as_tpu(request):
    """The CPU device kind stands for the given chip while lowering."""
    chip = tpu_info.ChipVersion(request.param)
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(chip, 1)
    clear = getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)  # (cached in jax 0.10)
    clear()
    yield
    del tpu_info.registry["cpu"]
    clear()


def _gdn_args(t, prefill, state=F32):
    """``state``: the recurrent-state pool's dtype (``--state-dtype``)."""
    acts = [sd((t, HK, D), BF)] * 2 + [sd((t, HV, D), BF)] + [sd((t, HV), BF)] * 2
    qsl = [sd((ROWS + 1,), I32)] if prefill else []
    return [*acts, sd((HV,), F32), sd((HV,), F32), sd((SLOTS, HV, D, D), state), *qsl, SLOTS_ARG]


# Kimi-Linear-48B's KDA: 32 heads of 128 channels, a gate per key channel.
KDA_H = 32


def _kda_args(t, prefill, state=F32):
    acts = [sd((t, KDA_H, D), BF)] * 4 + [sd((t, KDA_H), BF)]  # q, k, v, g; b
    qsl = [sd((ROWS + 1,), I32)] if prefill else []
    params = [sd((KDA_H,), F32), sd((KDA_H, D), F32), sd((SLOTS, KDA_H, D, D), state)]
    return [*acts, *params, *qsl, SLOTS_ARG]


def _conv_args(t, prefill):
    qsl = [sd((ROWS + 1,), I32)] if prefill else []
    return [sd((t, CONV_C), BF), sd((CONV_C, 4), BF), sd((SLOTS, 3, CONV_C), BF), *qsl, SLOTS_ARG]


@pytest.mark.parametrize(
    "kernel,args",
    [
        (gdn_tpu.gdn_prefill, _gdn_args(TOKENS, True)),
        (gdn_tpu.gdn_decode, _gdn_args(ROWS, False)),
        (kda_tpu.kda_prefill, _kda_args(TOKENS, True)),
        (kda_tpu.kda_decode, _kda_args(ROWS, False)),
        # A bf16 state pool: the slot DMAs go through a bf16 VMEM stage.
        (gdn_tpu.gdn_prefill, _gdn_args(TOKENS, True, state=BF)),
        (gdn_tpu.gdn_decode, _gdn_args(ROWS, False, state=BF)),
        (kda_tpu.kda_prefill, _kda_args(TOKENS, True, state=BF)),
        (kda_tpu.kda_decode, _kda_args(ROWS, False, state=BF)),
        (conv1d_tpu.causal_conv1d_prefill, _conv_args(TOKENS, True)),
        (conv1d_tpu.causal_conv1d_update, _conv_args(ROWS, False)),
    ],
    ids=[
        "gdn_prefill",
        "gdn_decode",
        "kda_prefill",
        "kda_decode",
        "gdn_prefill_bf16_state",
        "gdn_decode_bf16_state",
        "kda_prefill_bf16_state",
        "kda_decode_bf16_state",
        "conv1d_prefill",
        "conv1d_update",
    ],
)
def test_kernel_lowers_to_mosaic(as_tpu, kernel, args):
    lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


# Kimi-Linear-48B's MLA: 32 heads, latent 512 + 64 rope dims, Dn = Dv = 128, 64-token pages.
MLA_H, MLA_L, MLA_R, MLA_DN, MLA_DV, MLA_BS, MLA_MAX_BLOCKS = 32, 512, 64, 128, 128, 64, 32


def _mla_args(t, prefill):
    q = sd((t, MLA_H, MLA_DN + MLA_R), BF)
    cache = sd((100, MLA_BS, MLA_L + MLA_R), BF)
    w = sd((MLA_L, MLA_H, MLA_DN + MLA_DV), BF)
    qsl = [sd((ROWS + 1,), I32)] if prefill else []
    return [q, cache, w, *qsl, sd((ROWS,), I32), sd((ROWS, MLA_MAX_BLOCKS), I32), sd((), I32)]


@pytest.mark.parametrize(
    "kernel,args",
    [(mla_tpu.mla_prefill, _mla_args(TOKENS, True)), (mla_tpu.mla_decode, _mla_args(ROWS, False))],
    ids=["mla_prefill", "mla_decode"],
)
def test_mla_kernel_lowers_to_mosaic(as_tpu, kernel, args):
    fn = functools.partial(kernel, nope_dim=MLA_DN, scale=(MLA_DN + MLA_R) ** -0.5)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") >= 1
