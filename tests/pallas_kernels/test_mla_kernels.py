"""The MLA kernels (Mosaic TPU and Triton GPU) vs the reference ops, interpreted on CPU.

Every case is a ragged batch over a paged latent cache whose pages are handed out in random
order; pages nobody owns (the null block included) and slots past a sequence's context hold
NaN, and so do the padding queries, whose outputs must come back 0. Cases cover decode-only,
prefill-only and mixed batches, block sizes 16/32/64/128, f32 and bf16 caches, several query
tiles per chunk, several KV blocks per row (the TPU's double-buffered page DMAs) and split-KV
merges (GPU), and on the GPU both prefill paths: decompressed keys and values for long rows
that fit the workspace, the absorbed kernel for the rest. The prefill cases are checked
against ``mla_prefill_reference`` (decompressed), the decode ones against
``mla_decode_reference`` (absorbed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention import mla_gpu, mla_tpu
from pallas_kernels.attention.mla_reference import (
    mla_decode_reference,
    mla_prefill_reference,
    write_latent_reference,
)

H, L, R, DN, DV = 4, 32, 16, 16, 8
SCALE = (DN + R) ** -0.5


@dataclasses.dataclass(frozen=True)
class MlaCase:
    q: jax.Array  # [T, H, Dn + R]
    cache: jax.Array  # [NB, bs, L + R]  this step's latents written
    w: jax.Array  # [L, H, Dn + Dv]
    qsl: jax.Array  # i32[S + 1]
    seq_lens: jax.Array  # i32[S]
    tables: jax.Array  # i32[S, max_blocks]
    num_seqs: jax.Array  # i32[]
    num_live: int

    @property
    def prefill_args(self) -> tuple:
        return (self.q, self.cache, self.w, self.qsl, self.seq_lens, self.tables, self.num_seqs)

    @property
    def decode_args(self) -> tuple:
        return (self.q, self.cache, self.w, self.seq_lens, self.tables, self.num_seqs)


def mla_case(cached, new, *, block_size, dtype, pad_tokens=3, pad_rows=1, seed=0) -> MlaCase:
    """``cached[i]`` latents already in the cache, ``new[i]`` written this step."""
    rng = np.random.default_rng(seed)
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    blocks_per = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks_per) + 1  # a trailing null entry in every table
    num_blocks = sum(blocks_per) + 3  # + the null block and two pages nobody owns
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lens) + pad_rows, max_blocks), np.int32)
    cache = np.full((num_blocks, block_size, L + R), np.nan, np.float32)
    new_lat, slots, used = [], [], 0
    for i, n in enumerate(lens):
        blocks = perm[used : used + blocks_per[i]]
        used += blocks_per[i]
        tables[i, : len(blocks)] = blocks
        lat = rng.normal(size=(n, L + R)).astype(np.float32)
        for p in range(n):
            b, o = blocks[p // block_size], p % block_size
            if p < cached[i]:
                cache[b, o] = lat[p]
            else:
                slots.append(b * block_size + o)
        new_lat.append(lat[cached[i] :])
    live = sum(new)
    new_lat.append(np.zeros((pad_tokens, L + R), np.float32))
    slots += [0] * pad_tokens  # padding tokens write the null block
    cache = write_latent_reference(
        jnp.asarray(np.concatenate(new_lat), dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(np.array(slots, np.int32)),
    )
    q = rng.normal(size=(live + pad_tokens, H, DN + R)).astype(np.float32)
    q[live:] = np.nan
    w = (rng.normal(size=(L, H, DN + DV)) / np.sqrt(L)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(new), [live] * pad_rows]).astype(np.int32)
    return MlaCase(
        q=jnp.asarray(q, dtype), cache=cache, w=jnp.asarray(w, dtype), qsl=jnp.asarray(qsl),
        seq_lens=jnp.asarray(np.array(lens + [0] * pad_rows, np.int32)),
        tables=jnp.asarray(tables), num_seqs=jnp.int32(len(lens)), num_live=live,
    )  # fmt: skip


def check(got, want, num_live: int, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), "NaN in the output: a poisoned page or padding was read"
    assert (got[num_live:] == 0).all(), "padding tokens must come back as zeros"
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    err = np.abs(got[:num_live] - want[:num_live]).max() / np.abs(want[:num_live]).max()
    assert err < tol, f"relative error {err:.2e} >= {tol}"


ATTN = dict(nope_dim=DN, scale=SCALE)
TPU_TUNING = dict(interpret=pltpu.InterpretParams())
# small blocks and few programs: several KV blocks, tiles and splits per row; rows of >= 4
# new tokens take the decompressed prefill (several query tiles, KV blocks and L chunks)
GPU_TUNING = dict(
    interpret=True, head_block=2, block_k_decode=16, block_k_prefill=16, rows_prefill=8,
    target_programs=16, decompress_min_q=4, decompress_tokens=4096, flash_block_q=8,
    flash_block_k=16, decompress_block_w=16, decompress_block_l=16,
)  # fmt: skip
KERNELS = {
    "tpu": (mla_tpu.mla_prefill, mla_tpu.mla_decode, TPU_TUNING),
    "gpu": (mla_gpu.mla_prefill, mla_gpu.mla_decode, GPU_TUNING),
}

PREFILL_CASES = [
    # (kernel, kind, cached, new, block_size, dtype)
    ("tpu", "prefill", [0, 40], [19, 6], 32, jnp.float32),
    ("tpu", "mixed", [65, 3, 0], [1, 12, 1], 16, jnp.bfloat16),
    ("gpu", "mixed", [130, 0, 20], [1, 9, 1], 128, jnp.float32),
    ("gpu", "prefill", [0, 40], [19, 6], 16, jnp.bfloat16),
]
DECODE_CASES = [
    # (kernel, cached, block_size, dtype)
    ("tpu", [37, 0, 70], 64, jnp.float32),
    ("gpu", [33, 70], 32, jnp.bfloat16),
]


def _id(*parts) -> str:
    return "_".join(p if isinstance(p, str) else f"bs{p}" for p in parts)


@pytest.mark.parametrize(
    "kernel,kind,cached,new,bs,dtype", PREFILL_CASES,
    ids=[_id(k, kind, bs, jnp.dtype(dt).name) for k, kind, _, _, bs, dt in PREFILL_CASES],
)  # fmt: skip
def test_prefill_matches_reference(kernel, kind, cached, new, bs, dtype):
    case = mla_case(cached, new, block_size=bs, dtype=dtype, seed=bs + len(cached))
    want = jax.jit(functools.partial(mla_prefill_reference, **ATTN))(*case.prefill_args)
    prefill, _, tuning = KERNELS[kernel]
    got = jax.jit(functools.partial(prefill, **ATTN, **tuning))(*case.prefill_args)
    check(got, want, case.num_live, dtype)


@pytest.mark.parametrize(
    "kernel,cached,bs,dtype", DECODE_CASES,
    ids=[_id(k, "decode", bs, jnp.dtype(dt).name) for k, _, bs, dt in DECODE_CASES],
)  # fmt: skip
def test_decode_matches_reference(kernel, cached, bs, dtype):
    # decode rows are the batch's rows: no padding tokens, one padding row
    case = mla_case(cached, [1] * len(cached), block_size=bs, dtype=dtype, pad_tokens=1,
                    seed=bs)  # fmt: skip
    want = jax.jit(functools.partial(mla_decode_reference, **ATTN))(*case.decode_args)
    _, decode, tuning = KERNELS[kernel]
    got = jax.jit(functools.partial(decode, **ATTN, **tuning))(*case.decode_args)
    check(got, want, case.num_live, dtype)


def test_gpu_prefill_rows_past_the_workspace_take_the_absorbed_kernel():
    # contexts 19, 46, 35 against a 60-token workspace: the first row is decompressed, the
    # other two (the running total passes 60) run on the absorbed long launch
    case = mla_case([0, 40, 5], [19, 6, 30], block_size=16, dtype=jnp.float32, seed=5)
    want = jax.jit(functools.partial(mla_prefill_reference, **ATTN))(*case.prefill_args)
    fn = functools.partial(mla_gpu.mla_prefill, **ATTN, **{**GPU_TUNING, "decompress_tokens": 60})
    check(jax.jit(fn)(*case.prefill_args), want, case.num_live, jnp.float32)


def test_bad_arguments_name_the_problem():
    case = mla_case([3], [1], block_size=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_q=3 must be a power of two"):
        mla_tpu.mla_prefill(*case.prefill_args, **ATTN, block_q=3)
    with pytest.raises(ValueError, match="head_block=6 must be a power of two"):
        mla_gpu.mla_prefill(*case.prefill_args, **ATTN, head_block=6)
    q, cache, w, *rest = case.prefill_args
    with pytest.raises(ValueError, match="kv_lora_rank=24 and rope dims=16 must be powers"):
        mla_gpu.mla_prefill(q, cache[..., :40], w[:24], *rest, **ATTN)  # L = 24
    with pytest.raises(ValueError, match="query_start_loc .* must be"):
        mla_tpu.mla_prefill(q, cache, w, rest[0][:-1], *rest[1:], **ATTN)
    with pytest.raises(ValueError, match="latent_cache width"):
        mla_tpu.mla_decode(q[:2], cache[..., :-1], w, *case.decode_args[3:], **ATTN)
    big = jax.ShapeDtypeStruct((1 << 20, 64, L + R), jnp.float32)  # > 2**31 elements
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in case.prefill_args]
    with pytest.raises(ValueError, match="2\\*\\*31 elements"):
        jax.eval_shape(functools.partial(mla_gpu.mla_prefill, **ATTN), args[0], big, *args[2:])


KIMI_H, KIMI_L, KIMI_R, KIMI_DN, KIMI_DV = 32, 512, 64, 128, 128  # Kimi-Linear-48B


def _kimi_args(t=64, s=8, max_blocks=32, bs=64):
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    return (sd((t, KIMI_H, KIMI_DN + KIMI_R), bf), sd((100, bs, KIMI_L + KIMI_R), bf),
            sd((KIMI_L, KIMI_H, KIMI_DN + KIMI_DV), bf), sd((s + 1,), i32), sd((s,), i32),
            sd((s, max_blocks), i32), sd((), i32))  # fmt: skip


def test_gpu_kernel_lowers_to_triton_at_48b_shapes():
    fn = functools.partial(mla_gpu.mla_prefill, nope_dim=KIMI_DN, scale=(KIMI_DN + KIMI_R) ** -0.5)
    # 512 tokens: room for a chunk of decompress_min_q = 256 new tokens
    text = jax.jit(fn).trace(*_kimi_args(t=512)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mla_latent_attention_") >= 2  # the short and the long launch
    # prefill chunks: decompression and flash attention over the decompressed context
    assert "mla_decompress_context" in text and "mla_decompressed_prefill" in text
    # each trip of an XLA while loop on GPU is a host round trip: none around the kernels
    assert "stablehlo.while" not in text
    # 64 tokens hold no row of 256 new tokens: the absorbed launches alone
    text = jax.jit(fn).trace(*_kimi_args(t=64)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_latent_attention_long" in text and "mla_decompress" not in text
    # decode: one launch (every row fits a short tile), no empty prefill launch
    q, cache, w, _, *rest = _kimi_args(t=8)
    fn = functools.partial(mla_gpu.mla_decode, nope_dim=KIMI_DN, scale=(KIMI_DN + KIMI_R) ** -0.5)
    text = jax.jit(fn).trace(q, cache, w, *rest).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_latent_attention_short" in text and "mla_latent_attention_long" not in text
    assert "mla_decompress" not in text


def test_tiny_kimi_linear_with_the_mla_kernel_matches_reference(tmp_path):
    """The tiny Kimi-Linear (KDA + MLA layer) with the interpret backend's MLA kernel gives the
    reference's logits on a mixed step (a decode row and a chunk over cached latents). Only
    MLA is swapped: the KDA kernels have their own tests."""
    from flax import nnx

    from hyjax.cache import init_caches
    from hyjax.loader import load_model
    from hyjax.ops import REFERENCE, get_ops
    from hyjax.testing import SeqChunk, make_batch, make_tiny_kimi_linear_model

    interp = get_ops("interpret")
    assert interp.mla_prefill.func is mla_tpu.mla_prefill  # the kernel, not the reference
    kernel_ops = dataclasses.replace(
        REFERENCE, mla_prefill=interp.mla_prefill, mla_decode=interp.mla_decode
    )
    model, cfg = load_model(make_tiny_kimi_linear_model(tmp_path))
    graphdef, state = nnx.split(model)
    bs = 16
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 256, size=(2, 48)).tolist()

    def forward(ops):
        @functools.partial(jax.jit, static_argnames="decode_only")
        def fn(state, batch, caches, decode_only=False):
            return nnx.merge(graphdef, state)(batch, caches, ops, decode_only=decode_only)

        return fn

    def run(forward, rows, caches, n, decode_only=False):
        batch, idx = make_batch(rows, block_size=bs, num_tokens=n, num_seqs=n, max_blocks=4)
        caches, logits = forward(state, batch, caches, decode_only=decode_only)
        return caches, [np.asarray(logits)[i] for i in idx]

    # Cached context without a prefill step (each compile of the model costs ~10 s): random
    # latents at the positions before this step's tokens, NaN elsewhere; both runs see the
    # same caches (the KDA layer starts from a zero state, src_slot 0).
    caches = init_caches(cfg, num_blocks=12, block_size=bs, num_slots=4, dtype=jnp.float32,
                         fill=np.nan)  # fmt: skip
    (latent,) = caches.kv[0]
    flat = np.array(latent).reshape(-1, latent.shape[-1])  # a writable copy
    for blocks, cached in (([3, 7, 1], 37), ([9, 2], 5)):
        for p in range(cached):
            flat[blocks[p // bs] * bs + p % bs] = rng.normal(size=latent.shape[-1])
    caches = dataclasses.replace(caches, kv=((jnp.asarray(flat.reshape(latent.shape)),),))
    mixed = [
        SeqChunk(a[37:38], 37, [3, 7, 1], dst_slot=1),  # a decode row
        SeqChunk(b[5:20], 5, [9, 2], dst_slot=2, all_logits=True),  # a chunk
    ]  # both kernel launches
    _, want = run(forward(REFERENCE), mixed, caches, 16)
    _, got = run(forward(kernel_ops), mixed, caches, 16)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not np.isnan(g).any(), f"output {i} has NaN"
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-4, f"output {i}: relative error {err:.2e}"
