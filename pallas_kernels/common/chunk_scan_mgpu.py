"""The delta-rule prefill's serial launch in Mosaic GPU (TMA copies, ``wgmma`` products).

The Triton serial launch (:mod:`pallas_kernels.common.chunk_scan_gpu`) is latency-bound on an
H200 (ncu at 8x4096, BENCHMARKS.md: one 4-warp program an SM, a warp issuing about one cycle in
five, a third of the gaps on global loads). Hopper's own answer is asynchronous: TMA copies
bring the next chunk's operands into shared memory while this chunk's ``wgmma`` products run.
This launch takes the same ragged batches as the Triton one (:class:`RowPlan`: rows at any
token offset, checkpoints, explicit source and destination slots) on GDN's scalar decay or
KDA's per key channel (a ``[Dk]`` vector a chunk, brought by TMA with its tiles), with
an f32 pool (a bf16 pool rounds its state at every 64 tokens of a row, which a token-aligned
plan's chunks need not end at: ``pallas_kernels.common.slots``).

**Windows on 64-token blocks.** Mosaic GPU's TMA copies of a swizzled tile take the tile's
rows (8) and, for ``U^T``, its columns (64) as units of the global array: a window that starts
between them is read wrong (H200, jax 0.11.2, ``benchmarks/mgpu_probe.py``, on windows that
started at each chunk: rows of 128 + 64 tokens from token 0 matched the Triton launch to 3e-5,
a window moved back to the batch's end was wrong, rows of 1, 5 and 63 tokens and a checkpoint
at token 100 faulted with an illegal instruction). So this launch runs on a *token-aligned*
chunk plan (``chunking.plan_chunks(token_aligned=True)``): chunks restart at every multiple of
64 of the batch's token index as well as at each row's start and checkpoints, so each chunk
lies inside one 64-token block, and every window (the intra launch's and this one's) is that
block, its start a multiple of 64 (the tokens are padded to a multiple of 64). A chunk's
tokens sit at ``lead = start % 64`` in it. The interpreter does not model the copies' units,
so only a GPU shows that this holds: ``benchmarks/mgpu_probe.py`` (not yet run on this plan).

One program per (Dv block of 64, value head, row), one warpgroup. The state is the transposed
``S^T [BV, Dk]`` (the pool's layout) and is the ``wgmma`` accumulator::

    V'^T = U^T - S^T W^T          A = bf16(S^T) in registers, B = W^T (shared memory)
           columns outside the chunk set to 0 (the block's other tokens)
    S^T  = e^gam_last S^T + V'^T k_dec                  A = bf16(V'^T) in registers
    o    = q_dec S + Aqk V'       A = q_dec, Aqk; B = the chunk's bf16 S^T and V'^T, stored
                                  to shared memory and read transposed

so ``o`` leaves as ``[C, BV]`` token rows, the engine's ``[T, H, Dv]`` layout. A chunk of
64 tokens is one TMA store; a shorter one (a row's first or last, or cut by a checkpoint) is
at most six, of 32, 16, ..., 1 rows (its length's bits), so no program writes a token it does
not own.

**Pairs** (GDN's fold, ``Dv = 128``; :data:`PAIR`, opt-in): one program a (head, row), its two
Dv blocks a warpgroup each (``plgpu.Mesh(num_threads=2)``). Warpgroup 0 copies the tiles both
read into the shared stages; warpgroup 1 arrives at a ``consumed`` barrier once it has read a
stage, which warpgroup 0 waits for before refilling it (and drains at the end); each
warpgroup's own tiles (its f32 state tile, the chunk's S^T, V'^T and o tiles, a short chunk's
rows: never live at once) share one ``RefUnion``.

The intra launch leaves the scratch for it (``gdn.gpu.intra_launch(tma_layout=True)``): ``U``
transposed (``[H, Dv, Tp]``, a block of ``U^T`` is one TMA box) and ``k_dec`` zero on the rows
after the batch's last token (the last block multiplies them by the zero columns of ``V'^T``:
rows never written could hold NaN).

:func:`scan_mgpu` runs it; ``interpret=True`` runs it in Pallas' GPU interpreter on a CPU host
(the copies, barriers, loops and stores as written; the products, which the interpreter does
not model in registers, as plain dots; the pool written through an output, not in place).
It is the GPU prefill's default (:data:`SERIAL_DEFAULT`); ``serial="triton"`` (or
``HYJAX_PREFILL_SERIAL=triton`` for a process) asks for the Triton launch.

Measured on an H200 on the token-aligned plan (BENCHMARKS.md, session 30): GDN's serial launch
alone 1.30-1.59x the Triton one in device time (606 against 787 us at 8x4096, 104 against 165
at 1x4096); ragged batches (rows of 1-200 tokens, checkpoints inside a block) match the Triton
launch (``benchmarks/mgpu_probe.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.chunk_scan_gpu import ChunkRefs
from pallas_kernels.common.delta_rule_gpu import RowPlan, resident_programs
from pallas_kernels.common.slots import ROUND_EVERY

CHUNK = 64
BV = 64  # a wgmma's M: the Dv rows of S^T a program owns
STAGES = 2  # chunks in flight
# Per-chunk scalars are stored [.., NCP / 128, 128]: a TMA box dim is <= 256, so up to 32768
# chunks; the shared-memory bound (unsupported_reason) stops far below that.
META_COLS = 128
SMEM_BYTES = 227 * 1024  # an H100 / H200 block's shared memory
FOLD_ROWS = 8  # the rows of FoldRefs.vec a chunk's copy brings (gdn.gpu.FOLD_VECTORS, padded)
f32 = jnp.float32
log = logging.getLogger(__name__)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def smem_bytes(
    dk: int,
    num_chunks: int,
    pool_dtype,
    op_dtype=jnp.bfloat16,
    per_channel_decay=False,
    fold=False,
    fold_aqk=False,
    pair=False,
) -> int:
    """The launch's shared memory: two stages of a chunk's five tiles (and its ``[Dk]`` decay,
    per channel; :class:`FoldRefs`' six, one of them the f32 vectors), the chunk's S^T and
    V'^T, two output tiles, the state in and out, the chunk plan and (one per head) the
    decays. ``pair`` (:data:`PAIR`): a stage has both Dv blocks' v rows, and each warpgroup's
    own tiles share one union (the largest of them)."""
    op = jnp.dtype(op_dtype).itemsize
    stage = (3 * CHUNK * dk + BV * CHUNK + CHUNK * CHUNK) * op + (
        4 * dk if per_channel_decay else 0
    )
    if fold:  # Tm diag(beta) and v's rows for U^T; the vectors for Aqk (or Aqk itself)
        stage += CHUNK * BV * op + 8 * CHUNK * 4 - CHUNK * CHUNK * op
        stage += CHUNK * CHUNK * op if fold_aqk else 0
    ncp = _round_up(max(num_chunks, 1), META_COLS)
    state = BV * dk * jnp.dtype(pool_dtype).itemsize
    if pair:
        stage += CHUNK * BV * op
        own = 2 * max(state, (BV * dk + BV * CHUNK + CHUNK * BV) * op, CHUNK * BV * op)
    else:
        own = (BV * dk + BV * CHUNK + 2 * CHUNK * BV) * op + state
    # (+ 2.5 KB: the barriers' and alignments'; Mosaic GPU's count was 1,080 bytes above a
    # 1 KB allowance at 80B's heads, where fold_aqk at 1x16384 then failed to lower)
    return STAGES * stage + own + (3 if per_channel_decay else 4) * ncp * 4 + 2560


# The serial launch a GPU prefill runs when not told (``serial=None``): Mosaic GPU's, the shapes
# it cannot take falling back to Triton's with one log line (its token-aligned plan passed
# ``benchmarks/mgpu_probe.py`` and the checks on an H200, 2026-11-29). The environment's
# HYJAX_PREFILL_SERIAL=triton sets Triton's for a process.
SERIAL_DEFAULT = os.environ.get("HYJAX_PREFILL_SERIAL", "mgpu")
# Chunks ahead of the next one whose tiles a program prefetches into L2 (``scan_mgpu``'s
# ``prefetch``) when not told: 0 (none; 1 and 2 measured no gain on an H200, session 30, 168
# against 173 / 182 us at 1x4096); HYJAX_PREFILL_PREFETCH=N for a process.
PREFETCH = int(os.environ.get("HYJAX_PREFILL_PREFETCH", "0"))
# Diagnostics (benchmarks/mgpu_regions.py): with a folder, every Mosaic GPU launch of this
# module records its named regions (``jax.named_scope`` in :func:`_body`: the chunk's wait,
# products, stores) per warpgroup, up to PROFILE_SPACE of them, into a trace file there per
# call (Mosaic GPU's profiler, shared memory of PROFILE_SPACE * 16 bytes).
PROFILE_DIR = os.environ.get("HYJAX_MGPU_PROFILE_DIR", "")
PROFILE_SPACE = int(os.environ.get("HYJAX_MGPU_PROFILE_SPACE", "512"))
# GDN's fold launch takes its exps (Aqk's decays, 32 a thread a chunk) from ex2.approx: its
# products' wait went from 1,860 to 1,418 cycles a chunk and the launch from 5,293 to 4,768
# (H200, benchmarks/mgpu_regions.py, 2026-11-30); the exps feed bf16 operands, whose rounding
# (2^-9) is far above the approximation's (~2^-22).
FOLD_APPROX_MATH = True
# GDN's fold launch runs the two Dv blocks of a (head, row) (Dv = 128) in one program, a
# warpgroup each (``scan_mgpu(pair=...)``): the tiles both read (W, Tm, q's and k's rows, the
# vectors) copied once, two chains an SM, half the programs. Measured on an H200 (session 36,
# BENCHMARKS.md): 1.07x the unpaired launch's prefill at 8x4096 and 4x4096 (1.176 against
# 1.259 ms, 0.713 against 0.761), 0.81x at 2x4096 (0.560 against 0.453: 64 programs on 132
# SMs); timed back to back (session 37) 1.08x at 8x4096 (1.043 against 1.129), 1.02x at
# 4x4096, 0.79x at 2x4096. Two chains on an SM run ~1.7x slower each, so a pair only pays
# once the unpaired programs fill more than a wave, and that is not known from a step's
# static shape: an engine step pads its rows to a power of two, and one long prefill row among
# many decode rows would run at the 2x4096 figure. Hence off by default; "auto" pairs where
# the unpaired programs (heads x rows x 2) outnumber the SMs (a batch of equal long rows), "1"
# always, "dynamic" (not yet timed) runs both launches and lets the plan pick on the device
# (use_pair, pair_mode). HYJAX_PREFILL_SERIAL_PAIR.
PAIR = os.environ.get("HYJAX_PREFILL_SERIAL_PAIR", "0")


class FoldRefs(NamedTuple):
    """GDN's ``fold`` scratch (``gdn.gpu.intra_launch(fold=True)``): W as :class:`ChunkRefs`',
    U's factor ``Tm diag(beta)`` with v's own rows (``U = Tm diag(beta) v``, made here), q's
    and k's own rows, and per token the vectors that scale them (``gdn.gpu.FOLD_VECTORS``) in
    place of ``q_dec``, ``k_dec`` and ``Aqk``; or with ``aqk`` (``gdn.intra_mgpu``'s
    ``with_aqk``) the chunk's ``Aqk`` made already, which this launch then reads instead of
    making it from q's and k's rows."""

    w: jax.Array  # [H, Tp, Dk]  W = Tm (beta k e^gam)
    tm: jax.Array  # [H, Tp, C]  Tm diag(beta): a token's row, its 64-token block's columns
    v: jax.Array  # [Tp, H, Dv]  the prefill's v (padded)
    q: jax.Array  # [Tp, Hk, Dk]  the prefill's q (padded), not normalised
    k: jax.Array  # [Tp, Hk, Dk]
    vec: jax.Array  # f32[H, R, Tp]  gdn.gpu.FOLD_VECTORS, then other rows (R >= 8; the
    # first FOLD_ROWS are read here)
    decay: jax.Array  # f32[NC, H]  e^gam_last
    aqk: jax.Array | None = None  # [H, Tp, C]  Aqk as ChunkRefs' (incl. lower in its chunk)


@functools.cache
def _log_fallback(what: str, why: str) -> None:
    log.warning("%s: Triton's (Mosaic GPU's cannot take %s)", what, why)


def choose_mgpu(arg: str, value, default: str, env: str, interpret: bool, why, what: str) -> bool:
    """Whether a GPU op runs its Mosaic GPU kernel: its argument ``arg=value`` (``"mgpu"``,
    ``"triton"``, or None: ``default``, the environment's ``env`` or the module's, and Triton
    in interpret mode). ``why()``: why the kernel cannot take the call, or None. Asked for, a
    call it cannot take is a ``ValueError`` naming why; by default, Triton with one log line."""
    if value not in (None, "mgpu", "triton"):
        raise ValueError(f"{arg}={value!r}: 'mgpu', 'triton' or None")
    if default not in ("mgpu", "triton"):
        raise ValueError(f"{env}={default!r}: 'mgpu' or 'triton'")
    asked = value == "mgpu"
    if not asked and (value == "triton" or interpret or default != "mgpu"):
        return False
    reason = why()
    if reason is None:
        return True
    if asked:
        raise ValueError(f"{arg}='mgpu': the Mosaic GPU {what} cannot take {reason}")
    _log_fallback(what, reason)
    return False


def serial_is_mgpu(
    serial, dk, dv, num_chunks, op, pool_dtype, three_launches, interpret, per_channel_decay
) -> bool:
    """Whether a GDN / KDA GPU prefill runs this launch: its ``serial`` (``"mgpu"``,
    ``"triton"``, or None: :data:`SERIAL_DEFAULT`, Triton in interpret mode); see
    :func:`choose_mgpu`."""

    def why():
        if three_launches:
            return "three_launches (a Triton path)"
        return unsupported_reason(dk, dv, num_chunks, op, pool_dtype, per_channel_decay)

    return choose_mgpu(
        "serial", serial, SERIAL_DEFAULT, "HYJAX_PREFILL_SERIAL", interpret, why,
        "prefill serial launch",
    )  # fmt: skip


def unsupported_reason(
    dk: int, dv: int, num_chunks: int, op_dtype, pool_dtype, per_channel_decay: bool = False
) -> str | None:
    """Why this launch cannot take a prefill (the Triton one then does), or None."""
    if jnp.dtype(pool_dtype) != jnp.dtype(f32):
        return (
            f"a {jnp.dtype(pool_dtype).name} pool (its state rounds at every {ROUND_EVERY} "
            "tokens of a row, where a token-aligned plan's chunks need not end)"
        )
    if jnp.dtype(op_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"operand dtype {jnp.dtype(op_dtype).name} (wgmma takes 16-bit operands here)"
    if dk not in (64, 128):
        return f"Dk={dk} (64 or 128: the f32 accumulator S^T [64, Dk] in registers)"
    if dv % BV:
        return f"Dv={dv} (a multiple of {BV})"
    if smem_bytes(dk, num_chunks, pool_dtype, op_dtype, per_channel_decay) > SMEM_BYTES:
        return f"{num_chunks} chunks: shared memory over {SMEM_BYTES} bytes"
    return None


def use_pair(pair, fold, fold_aqk, dk, dv, heads, rows, num_chunks, pool_dtype, op_dtype):
    """Whether :func:`scan_mgpu` runs pairs (:data:`PAIR`): ``pair`` True / False / "auto", or
    None (:data:`PAIR`'s). Asked for by the argument (True, "1"), a launch it cannot take is a
    ``ValueError`` naming why; by the environment, one log line and the unpaired launch (so a
    process-wide setting never fails KDA's launch, or GDN's at shapes a pair cannot take);
    "auto" pairs where it can and the unpaired programs outnumber the SMs; "dynamic" (returned
    as is) runs both launches where "auto" would pair, each program exiting unless the plan's
    mode (:func:`pair_mode`, made on the device from the rows' chunk counts) is its launch's,
    the pair writing ``o`` in place of the unpaired launch's."""
    by_env = pair is None
    pair = PAIR if pair is None else pair
    if pair not in (True, False, "auto", "dynamic", "1", "0"):
        raise ValueError(f"pair={pair!r}: True, False, 'auto', 'dynamic', '1' or '0'")
    if pair in (False, "0"):
        return False
    why = None
    if not fold or fold_aqk:
        why = "a launch other than GDN's fold without Aqk"
    elif dv != 2 * BV:
        why = f"Dv={dv} (two Dv blocks of {BV})"
    elif smem_bytes(dk, num_chunks, pool_dtype, op_dtype, fold=True, pair=True) > SMEM_BYTES:
        why = f"{num_chunks} chunks: shared memory over {SMEM_BYTES} bytes"
    if pair in (True, "1"):
        if why and by_env:
            _log_unpaired(why)
            return False
        if why:
            raise ValueError(f"pair={pair!r}: the paired serial launch cannot take {why}")
        return True
    if pair == "dynamic":  # (both launches where the static shape allows a pair's win)
        dynamic = why is None and heads * rows * (dv // BV) > resident_programs()
        return "dynamic" if dynamic else False
    return why is None and heads * rows * (dv // BV) > resident_programs()


@functools.cache
def _log_unpaired(why: str) -> None:
    log.warning("prefill serial launch: unpaired (HYJAX_PREFILL_SERIAL_PAIR=1 cannot take %s)", why)


def _union(interpret, *trees):
    """Shared-memory tiles whose lifetimes never overlap, in one allocation (Mosaic GPU's
    ``RefUnion``; Pallas' GPU interpreter has none and allocates each apart)."""
    return trees if interpret else _plgpu().RefUnion(*trees)


class Transposed(NamedTuple):
    """A product's ``a`` operand: the transpose of a 16-bit shared-memory tile."""

    ref: object


class GpuOps:
    """The products, loads and index arrays of the kernel on a GPU (WGMMA layouts)."""

    @staticmethod
    def load(ref, optimized=True):
        plgpu = _plgpu()
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA, optimized=optimized)

    @staticmethod
    def load_row_vector(ref):  # a [N] vector that scales the columns of a [M, N] WGMMA array
        plgpu = _plgpu()
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

    @staticmethod
    def load_col_vector(ref):  # a [M] vector that scales the rows of a [M, N] WGMMA array
        plgpu = _plgpu()
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

    @staticmethod
    def iota(shape, dim):
        plgpu = _plgpu()
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    @staticmethod
    def zeros(shape):
        plgpu = _plgpu()
        return plgpu.layout_cast(jnp.zeros(shape, f32), plgpu.Layout.WGMMA)

    @staticmethod
    def prefetch(ref):  # a TMA prefetch of a global-memory slice into L2
        _plgpu().async_prefetch(ref)

    @staticmethod
    def mma(*groups):
        """``acc + sum(a @ b)`` for each group ``(acc, terms)`` of ``(a, b_ref, transpose_b)``
        terms (``a`` in registers or shared memory, ``b`` in shared memory), every product
        issued before one wait; the accumulators in order. An ``a`` that is a function is
        called when its product is issued: its work runs while the products before it do."""
        plgpu = _plgpu()

        def run(acc_refs):
            for acc_ref, (_, terms) in zip(acc_refs, groups, strict=True):
                for a, b, transpose_b in terms:
                    b = plgpu.transpose_ref(b, (1, 0)) if transpose_b else b
                    if isinstance(a, Transposed):
                        a = plgpu.transpose_ref(a.ref, (1, 0))
                    plgpu.wgmma(acc_ref, a() if callable(a) else a, b)

        return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, _ in groups))


class InterpretOps:
    """The same in Pallas' GPU interpreter: plain arrays and dots."""

    @staticmethod
    def load(ref, optimized=True):
        return ref[...]

    @staticmethod
    def load_row_vector(ref):
        return ref[...]

    @staticmethod
    def load_col_vector(ref):
        return ref[...]

    @staticmethod
    def iota(shape, dim):
        return jax.lax.broadcasted_iota(jnp.int32, shape, dim)

    @staticmethod
    def zeros(shape):
        return jnp.zeros(shape, f32)

    @staticmethod
    def prefetch(ref):  # (the interpreter has no caches, and no prefetch)
        pass

    @staticmethod
    def mma(*groups):
        out = []
        for acc, terms in groups:
            for a, b, transpose_b in terms:
                a = a.ref[...].T if isinstance(a, Transposed) else a() if callable(a) else a
                a = a if isinstance(a, jax.Array) else a[...]
                b = b[...].T if transpose_b else b[...]
                acc = acc + jnp.dot(a, b, preferred_element_type=f32)
            out.append(acc)
        return tuple(out)


DIAGNOSTICS = (None, "chain", "loads")


def _body(
    refs,
    scratch,
    *,
    ops,
    num_ckpt: int,
    per_channel: bool,
    diagnostic=None,
    prefetch: int = 0,
    fold_heads: int = 0,
    fold_aqk: bool = False,
    pair: bool = False,
    mode: int | None = None,
):
    """One program (module docstring). ``mode``: the program runs its row only where the
    plan's mode column is ``mode`` (a dynamic pair's two launches), else nothing.
    ``prefetch``: at chunk ``i``, chunk ``i + 1 + prefetch``'s tiles are prefetched into L2
    (0: none). ``diagnostic`` (benchmarks only,
    :func:`scan_mgpu`):
    ``"chain"`` copies a chunk's W, U^T, k_dec (and decays) only and runs the state's chain
    without ``o`` (nothing written to it); ``"loads"`` copies all five tiles and waits for
    them, with no products (the state passes through unchanged). ``fold_heads`` (GDN's
    :class:`FoldRefs`, the key heads' count; 0: :class:`ChunkRefs`): the tiles after W are
    ``Tm diag(beta)``, v's, q's and k's rows (``[Tp, heads * D]``) and the scaling vectors,
    and U, ``Aqk`` and the rows' scalings are made here (:func:`_fold_step`). ``pair`` (the
    fold): a program a (head, row), its two Dv blocks a warpgroup each (:data:`PAIR`):
    warpgroup 0 issues the copies of the tiles both read, warpgroup 1 arrives at ``consumed``
    once it has read a stage, and each warpgroup's own tiles share one union (the state's f32
    tile, the chunk's products' tiles, the short chunk's rows: never live at once)."""
    plgpu = _plgpu()
    fa_ref = fa_s = None  # (fa: the fold's Aqk made already, FoldRefs.aqk)
    if fold_heads:  # (the tiles FoldRefs' order, then the same refs)
        ri_ref, meta_ref, dec_ref, w_ref, tm_ref, v_ref, qd_ref, kd_ref, aqk_ref, *rest = refs
        w_s, tm_s, *more = scratch
        v_bufs, more = (more[:2], more[2:]) if pair else (more[:1], more[1:])  # v's, a Dv block's
        qd_s, kd_s, aqk_s, *more = more
        if fold_aqk:
            fa_ref, *rest = rest
            fa_s, *more = more
        ut_ref = ut_s = None
    else:
        ri_ref, meta_ref, dec_ref, w_ref, ut_ref, qd_ref, kd_ref, aqk_ref, *rest = refs
        w_s, ut_s, qd_s, kd_s, aqk_s, *more = scratch
        v_bufs = (None,)
    pool_in, pool_out, o_ref = rest
    if pair:  # each warpgroup's tiles: one union (_union) a warpgroup
        own, ri_s, meta_s, dec_s, bars, plan_bar, state_bar, consumed = more
    else:
        st_t, vt_t, o_t, o_s, st_s, ri_s, meta_s, dec_s, bars, plan_bar, state_bar = more
    head, r = jax.lax.axis_index("h"), jax.lax.axis_index("r")
    wg = jax.lax.axis_index("wg") if pair else None
    op = w_ref.dtype

    def load_plan():  # this row's plan, every chunk's start / length / end, this head's decays
        plgpu.copy_gmem_to_smem(ri_ref.at[r], ri_s, plan_bar.at[0])
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, plan_bar.at[0])
        if not per_channel:
            plgpu.copy_gmem_to_smem(dec_ref.at[head], dec_s, plan_bar.at[0])

    if pair:
        pl.when(wg == 0)(load_plan)  # (warpgroup 0 issues every copy of the program's)
    else:
        load_plan()
    plgpu.barrier_wait(plan_bar.at[0])

    def program(w, vb, st_t, vt_t, o_t, o_s, st_s, v_s, sbar):
        """The rest, for Dv block ``vb``: warpgroup ``w`` of a pair (None: the program's one
        warpgroup) with its own tiles, state barrier and (the fold) v tile."""
        vs = pl.ds(vb * BV, BV)
        issues = w in (None, 0)  # (the copies' issuer)
        first, n, src, dst = ri_s[0], ri_s[1], ri_s[2], ri_s[3]
        if mode is not None:  # (the other launch runs this row)
            n = jnp.where(ri_s[_mode_column(num_ckpt)] == mode, n, 0)

        def chunk(i):  # the row's i-th chunk: start, length, end (tokens of its row after it)
            ci = first + i
            hi, lo = ci // META_COLS, ci % META_COLS
            return ci, meta_s[0, hi, lo], meta_s[1, hi, lo], meta_s[2, hi, lo]

        def window(start):  # the 64-token block of the batch the chunk lies in
            return start - start % CHUNK

        def tiles(i):  # the row's i-th chunk's tiles (and decays): (global slice, stage buffers)
            ci, start, _, _ = chunk(i)
            tok = pl.ds(window(start), CHUNK)
            pairs = [(dec_ref.at[head, ci], dec_s)] if per_channel else []
            if fold_heads:  # (qd_ref, kd_ref, aqk_ref: q's rows, k's rows, the vectors)
                dk, dv = w_ref.shape[-1], pool_in.shape[2]
                keys = pl.ds(head // (pool_in.shape[1] // fold_heads) * dk, dk)
                blocks = enumerate(v_bufs) if pair else [(vb, v_s)]  # (a pair: both Dv blocks)
                v_rows = [(v_ref.at[tok, pl.ds(head * dv + b * BV, BV)], buf) for b, buf in blocks]
                return [*pairs, (w_ref.at[head, tok], w_s), (tm_ref.at[head, tok], tm_s),
                        *v_rows, (qd_ref.at[tok, keys], qd_s),
                        (aqk_ref.at[head, pl.ds(0, FOLD_ROWS), tok], aqk_s),
                        (kd_ref.at[tok, keys], kd_s),
                        *([(fa_ref.at[head, tok], fa_s)] if fold_aqk else [])]  # fmt: skip
            pairs += [(w_ref.at[head, tok], w_s), (ut_ref.at[head, vs, tok], ut_s)]
            if diagnostic != "chain":  # (o's operands)
                pairs += [(qd_ref.at[head, tok], qd_s), (aqk_ref.at[head, tok], aqk_s)]
            return [*pairs, (kd_ref.at[head, tok], kd_s)]

        @jax.named_scope("issue")
        def issue(i, slot):  # the row's i-th chunk's five tiles (and decays) into stage ``slot``
            for src_ref, buf in tiles(i):
                plgpu.copy_gmem_to_smem(src_ref, buf.at[slot], bars.at[slot])

        def store_state(s, slot):  # S^T to pool[slot, head, vs] (rounded to the pool's dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            st_s[...] = s.astype(pool_out.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, pool_out.at[slot, head, vs])

        def step(i, s):
            slot = i % STAGES
            ci, start, length, end = chunk(i)
            lead = start - window(start)  # the block's rows before the chunk

            if issues:

                @pl.when(i + 1 < n)
                def _():
                    if pair:  # (the stage's last chunk read by the other warpgroup too)

                        @pl.when(i >= 1)
                        def _():
                            plgpu.barrier_wait(consumed.at[(i + 1) % STAGES])

                    issue(i + 1, (i + 1) % STAGES)

            if prefetch and issues:

                @pl.when(i + 1 + prefetch < n)
                def _():  # a later chunk's tiles on their way into L2
                    for src_ref, _ in tiles(i + 1 + prefetch):
                        ops.prefetch(src_ref)

            with jax.named_scope("wait"):
                plgpu.barrier_wait(bars.at[slot])
            if diagnostic == "loads":
                return s
            if fold_heads:
                s, o = _fold_step(
                    ops, s, slot, lead, length, dec_s[ci // META_COLS, ci % META_COLS],
                    w_s, tm_s, v_s, qd_s, kd_s, aqk_s, st_t, vt_t, fa_s,
                )  # fmt: skip
                if w == 1:  # this stage read: warpgroup 0 may refill it
                    plgpu.barrier_arrive(consumed.at[slot])
            else:
                s, o = chain_and_output(slot, ci, lead, length, s)
            finish(s, o, start, length, lead, end)
            return s

        @jax.named_scope("mma1")
        def first_product(slot, s):  # S^T W^T (and S^T kept for o)
            sb = s.astype(op)
            if diagnostic is None:
                st_t[...] = sb
            (sw,) = ops.mma((ops.zeros((BV, CHUNK)), [(sb, w_s.at[slot], True)]))
            return sw

        def chain_and_output(slot, ci, lead, length, s):
            sw = first_product(slot, s)
            with jax.named_scope("vt"):
                ut = ops.load(ut_s.at[slot]).astype(f32)
                col = ops.iota((BV, CHUNK), 1)
                in_chunk = (col >= lead) & (col < lead + length)
                vt = jnp.where(in_chunk, ut - sw, 0.0).astype(op)  # V'^T, zero outside the chunk
                if diagnostic is None:
                    vt_t[...] = vt
                    plgpu.commit_smem()
            if per_channel:  # e^gam_last per key channel: S^T's columns
                vec = ops.load_row_vector(dec_s.at[slot])
                decay = jax.lax.broadcast_in_dim(vec, s.shape, (1,))
            else:
                decay = dec_s[ci // META_COLS, ci % META_COLS]
            update = (s * decay, [(vt, kd_s.at[slot], False)])  # the state's (the serial chain)
            with jax.named_scope("update_o"):
                if diagnostic == "chain":
                    (s,) = ops.mma(update)
                    return s, None
                return ops.mma(  # and the chunk's output
                    update,
                    (ops.zeros((CHUNK, BV)),
                     [(qd_s.at[slot], st_t, True), (aqk_s.at[slot], vt_t, True)]),
                )  # fmt: skip

        @jax.named_scope("finish")
        def finish(s, o, start, length, lead, end):  # checkpoints, then the chunk's output rows
            for m in range(num_ckpt):
                ck_off, ck_slot = ri_s[4 + m], ri_s[4 + num_ckpt + m]

                @pl.when((ck_slot > 0) & (ck_off == end))
                def _(ck_slot=ck_slot):
                    store_state(s, ck_slot)

            if o is None:
                return
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's o has left
            o = o.astype(o_ref.dtype)

            @pl.when(length == CHUNK)
            def _():  # one store from the swizzled tile
                o_t[...] = o
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_t, o_ref.at[pl.ds(start, CHUNK), head, vs])

            @pl.when(length < CHUNK)
            def _():  # the chunk's rows only, in runs of its length's bits, from plain rows
                o_s[...] = o
                plgpu.commit_smem()
                for bit in (32, 16, 8, 4, 2, 1):
                    off = length & (CHUNK - 2 * bit)

                    @pl.when(length & bit != 0)
                    def _(off=off, bit=bit):
                        plgpu.copy_smem_to_gmem(
                            o_s.at[pl.ds(lead + off, bit)],
                            o_ref.at[pl.ds(start + off, bit), head, vs],
                        )

                if pair:  # (o_s's memory is the next chunk's S^T and V'^T tiles')
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(n > 0)
        def _():
            @pl.when(src > 0)
            def _():
                plgpu.copy_gmem_to_smem(pool_in.at[src, head, vs], st_s, sbar)
                plgpu.barrier_wait(sbar)

            if issues:
                issue(0, 0)
            s = ops.load(st_s, optimized=False).astype(f32)
            s = jnp.where(src > 0, s, 0.0)  # st_s was not read into: zeros
            if pair:  # (every thread's read of st_s done before the first chunk's tiles)
                plgpu.commit_smem()
            s = jax.lax.fori_loop(0, n, step, s)

            @pl.when(dst > 0)
            def _():
                store_state(s, dst)

            plgpu.wait_smem_to_gmem(0)
            if w == 0:  # the last two chunks' stages read by warpgroup 1 (no wait left behind)
                for back in (2, 1):

                    @pl.when(n >= back)
                    def _(back=back):
                        plgpu.barrier_wait(consumed.at[(n - back) % STAGES])

    if not pair:
        vb = jax.lax.axis_index("v")
        program(None, vb, st_t, vt_t, o_t, o_s, st_s, v_bufs[0], state_bar.at[0])
        return
    for w in range(2):
        st_s, (st_t, vt_t, o_t), o_s = own[w]
        args = (w, w, st_t, vt_t, o_t, o_s, st_s, v_bufs[w], state_bar.at[w])
        pl.when(wg == w)(functools.partial(program, *args))


def _fold_step(
    ops, s, slot, lead, length, decay, w_s, tm_s, v_s, q_s, k_s, vec_s, st_t, vt_t, aqk_s=None
):  # fmt: skip
    """A chunk of GDN's ``fold`` (:class:`FoldRefs`): ``(S^T, o)`` after it. The state's chain
    as :func:`_body`'s with ``U^T = v^T (Tm diag(beta))^T`` issued in the same accumulator as
    ``-S^T W^T``, its update's operand ``k_dec`` as ``k``'s rows with ``V'^T``'s columns
    scaled (``k_dec^T V' = k^T (c V')``, ``c`` the ``k_state`` vector), and ``o`` from q's rows::

        V'^T = v^T Tm_b^T - S^T W^T                  (one accumulator)
        QK   = q k^T                                 (issued with them)
        Aqk = QK * q_norm_i * k_norm_j * e^min(gam_i - gam_j, 0),  j <= i in the chunk, else 0
        o   = q_out * (q S) + Aqk V'                 (Aqk made while the update and q S run)

    Every exponent kept is <= 0 (``gam`` never increases inside a chunk); columns outside the
    chunk are selected away, never multiplied (the block's other tokens' vectors are another
    chunk's, or unwritten). Making Aqk a chunk ahead, into a shared-memory tile while the first
    products run, was slower: 7,969 against 4,618 cycles a chunk at 1x4096 (H200, 2026-11-30).
    With ``aqk_s`` (:class:`FoldRefs`' ``aqk``: Aqk made by the scratch's launch) no ``QK``
    and no Aqk here: the tile is o's operand as it is.
    """
    op = q_s.dtype
    first = (ops.zeros((BV, CHUNK)),
             [(Transposed(v_s.at[slot]), tm_s.at[slot], True),
              ((-s).astype(op), w_s.at[slot], True)])  # fmt: skip
    with jax.named_scope("mma1"):
        st_t[...] = s.astype(op)
        if aqk_s is None:
            vt_f, qk = ops.mma(
                first, (ops.zeros((CHUNK, CHUNK)), [(q_s.at[slot], k_s.at[slot], True)])
            )
        else:
            (vt_f,) = ops.mma(first)

    def over_tokens(i, shape, dim):  # vector i (FOLD_VECTORS) along dim ``dim`` of ``shape``
        load = ops.load_row_vector if dim == 1 else ops.load_col_vector
        return jax.lax.broadcast_in_dim(load(vec_s.at[slot, i]), shape, (dim,))

    with jax.named_scope("vt"):
        col = ops.iota((BV, CHUNK), 1)
        in_chunk = (col >= lead) & (col < lead + length)
        vt_t[...] = jnp.where(in_chunk, vt_f, 0.0).astype(op)  # V'^T, zero outside the chunk
        _plgpu().commit_smem()
        vt_c = jnp.where(in_chunk, vt_f * over_tokens(1, (BV, CHUNK), 1), 0.0).astype(op)

    def a_qk():
        sq = (CHUNK, CHUNK)
        ri, cj = ops.iota(sq, 0), ops.iota(sq, 1)
        # (cj < lead + length matters to rows past the chunk's end only, never stored; without
        # it the launch took 5,059 cycles a chunk against 4,768, H200, 2026-11-30)
        keep = (ri >= cj) & (cj >= lead) & (cj < lead + length)
        e = jnp.exp(jnp.minimum(over_tokens(4, sq, 0) - over_tokens(4, sq, 1), 0.0))
        scores = qk * over_tokens(2, sq, 0) * over_tokens(3, sq, 1) * e
        return jnp.where(keep, scores, 0.0).astype(op)

    with jax.named_scope("update_o"):  # Aqk made while the update and q S run
        s, o_s, o_v = ops.mma(
            (s * decay, [(vt_c, k_s.at[slot], False)]),  # the state's (the serial chain)
            (ops.zeros((CHUNK, BV)), [(q_s.at[slot], st_t, True)]),
            (ops.zeros((CHUNK, BV)), [(a_qk if aqk_s is None else aqk_s.at[slot], vt_t, True)]),
        )
    with jax.named_scope("scale"):
        return s, o_v + o_s * over_tokens(0, (CHUNK, BV), 0)


def _mode_column(num_ckpt: int) -> int:
    """The column of :func:`_plan_arrays`' row scalars that holds the launch's mode."""
    return 4 + 2 * num_ckpt


def pair_mode(rp: RowPlan, heads: int, dv: int) -> jax.Array:
    """A dynamic pair's mode (:func:`use_pair`), i32 1 (paired) or 0, from the plan: paired
    where the rows with at least half the longest row's chunks (and two) would run more than
    one and a half waves of unpaired programs (``heads x rows x Dv / BV``). Measured on an
    H200 (session 37): pairs 0.79x the unpaired launch's prefill at 2x4096 (128 programs),
    1.02x at 4x4096 (256), 1.08x at 8x4096 (512); one long row among short ones runs as
    the one row it is."""
    chunks = rp.row_chunks
    long = chunks >= jnp.maximum(jnp.max(chunks) // 2, 2)
    programs = jnp.sum(long.astype(jnp.int32)) * heads * (dv // BV)
    return (2 * programs > 3 * resident_programs()).astype(jnp.int32)


def _plan_arrays(rp: RowPlan, decay: jax.Array, mode: jax.Array):
    """The kernel's scalars: each row's ``[first chunk, chunks, src, dst, ckpt offsets,
    ckpt slots, mode]`` (i32 ``[S, K]``, K padded to 128 bytes: a warpgroup's copy), every chunk's
    start / length / end (i32 ``[3, NCP / 128, 128]``) and each head's chunk decays (f32
    ``[H, NCP / 128, 128]``, or per key channel ``[H, NC, Dk]``)."""
    nc, h = decay.shape[:2]
    ncp = _round_up(nc, META_COLS)
    m = rp.ck_off.shape[1]
    cols = [rp.row_first, rp.row_chunks, rp.src, rp.dst]
    ri = jnp.concatenate([jnp.stack(cols, 1), rp.ck_off, rp.ck_slot], axis=1).astype(jnp.int32)
    # then the launch's mode (i32 ``mode``: a dynamic pair's, :func:`pair_mode`), zeros after
    ri = jnp.concatenate([ri, jnp.broadcast_to(mode, (ri.shape[0], 1)).astype(jnp.int32)], 1)
    ri = jnp.pad(ri, [(0, 0), (0, _round_up(5 + 2 * m, 32) - (5 + 2 * m))])
    meta = jnp.stack([rp.c_start, rp.c_len, rp.c_end]).astype(jnp.int32)
    meta = jnp.pad(meta, [(0, 0), (0, ncp - nc)]).reshape(3, ncp // META_COLS, META_COLS)
    if decay.ndim == 3:
        return ri, meta, jnp.swapaxes(decay.astype(f32), 0, 1)
    dec = jnp.pad(decay.T.astype(f32), [(0, 0), (0, ncp - nc)])
    return ri, meta, dec.reshape(h, ncp // META_COLS, META_COLS)


def _written_slots(rp: RowPlan) -> tuple[jax.Array, jax.Array]:
    """The slots a launch writes (``num_slots``-sized masks are built from these): each row's
    ``dst`` and the checkpoints inside its chunks, as ``(slots, written)``."""
    rows = rp.row_first.shape[0]
    last = rp.row_first + jnp.maximum(rp.row_chunks, 1) - 1
    before = rp.c_end[rp.row_first] - rp.c_len[rp.row_first]  # the row's tokens before the step
    after = rp.c_end[last]
    live = rp.row_chunks > 0
    ck = (rp.ck_slot > 0) & (rp.ck_off > before[:, None]) & (rp.ck_off <= after[:, None])
    slots = jnp.concatenate([rp.dst.reshape(rows, 1), rp.ck_slot], axis=1)
    written = jnp.concatenate([(rp.dst > 0).reshape(rows, 1), ck], axis=1) & live[:, None]
    return slots.reshape(-1), written.reshape(-1)


def scan_mgpu(
    rp: RowPlan,
    x: ChunkRefs | FoldRefs,  # the intra launch's scratch with ``u`` = U^T [H, Dv, Tp]
    state: jax.Array,  # f32[num_slots, H, Dv, Dk]  donated: updated in place
    *,
    out_dtype,
    name: str = "gdn_prefill",
    live: jax.Array | None = None,
    diagnostic: str | None = None,
    prefetch: int | None = None,
    pair: bool | str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The serial launch (module docstring) on the scratch of a token-aligned plan
    (``gdn.gpu.prefill_scratch(tma_layout=True)``; KDA's, with its decay per key channel,
    ``kda.gpu.intra_launch(tma_layout=True)``). Returns ``(o [Tp, H, Dv], state)``; rows
    outside every chunk of ``o`` are left unwritten, or with ``live`` (the plan's bool ``[T]``,
    ``T <= Tp``) ``o`` is its ``T`` rows, zero where not live (the prefill's contract).

    ``diagnostic`` (benchmarks only: what bounds the chain, ``benchmarks.gdn_kernels
    --mgpu-scan``): ``"chain"``, the state's chain without ``o`` or its operands' copies
    (``o`` unwritten); ``"loads"``, the copies and their waits alone (the state unchanged,
    ``o`` unwritten). See :func:`_body`.

    ``prefetch`` (None: :data:`PREFETCH`): while chunk ``i + 1``'s tiles are copied into
    their stage, chunk ``i + 1 + prefetch``'s are prefetched into L2 (TMA prefetches; 0:
    none). Two stages put one chunk's copies in flight; a prefetch gives later ones a head
    start without shared memory. No effect on the results (the interpreter skips it).

    With GDN's :class:`FoldRefs` (``gdn.gpu.intra_launch(fold=True)``) U, ``Aqk`` and the rows'
    scalings are made here from v's, q's and k's rows (:func:`_fold_step`); ``pair`` (None:
    :data:`PAIR`; :func:`use_pair`) runs its two Dv blocks of a (head, row) in one program, a
    warpgroup each."""
    if diagnostic not in DIAGNOSTICS:
        raise ValueError(f"diagnostic={diagnostic!r}: one of {DIAGNOSTICS}")
    fold = isinstance(x, FoldRefs)
    fold_aqk = fold and x.aqk is not None
    if fold and diagnostic is not None:
        raise ValueError(f"diagnostic={diagnostic!r}: not with FoldRefs")
    prefetch = PREFETCH if prefetch is None else prefetch
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: a chunk count >= 0")
    plgpu = _plgpu()
    h, num_tokens, dk = x.w.shape
    dv = x.v.shape[2] if fold else x.u.shape[1]
    nc = x.decay.shape[0]
    rows, num_ckpt = rp.ck_off.shape
    per_channel = x.decay.ndim == 3
    if why := unsupported_reason(dk, dv, nc, x.w.dtype, state.dtype, per_channel):
        raise ValueError(f"the Mosaic GPU serial launch cannot take this prefill: {why}")
    op = x.w.dtype
    pair = use_pair(pair, fold, fold_aqk, dk, dv, h, rows, nc, state.dtype, op)
    # (a dynamic pair's mode, made on the device; 0 for any other launch, which never reads it)
    mode = pair_mode(rp, h, dv) if pair == "dynamic" else jnp.zeros((), jnp.int32)
    ri, meta, dec = _plan_arrays(rp, x.decay, mode)
    if fold:
        tp, hk, _ = x.q.shape
        flat = [a.reshape(tp, -1) for a in (x.v, x.q, x.k)]  # a token's heads in one row
        tiles = (x.w, x.tm, *flat, x.vec, *(() if x.aqk is None else (x.aqk,)))
    else:
        tiles = (x.w, x.u, x.q_dec, x.k_dec, x.a_qk)

    def tile(shape, stages=STAGES):
        return swizzled(((stages,) if stages else ()) + shape, op)

    slots, mask = _written_slots(rp)

    def launch(state, pair: bool, runs_in: int | None = None, o_in=None):
        """The launch, paired or not; with ``runs_in`` its programs run their rows only where
        the plan's ``mode`` is ``runs_in``, writing into ``o_in``'s ``o`` (a dynamic pair:
        :func:`use_pair`)."""
        own = (
            tile((BV, dk), 0),  # the chunk's bf16 S^T (o's B)
            tile((BV, CHUNK), 0),  # the chunk's bf16 V'^T (o's B)
            swizzled((CHUNK, BV), out_dtype),  # o of a 64-token chunk
            plgpu.SMEM((CHUNK, BV), out_dtype),  # o of a shorter one: plain rows, by runs
            plgpu.SMEM((BV, dk), state.dtype),  # the state in and out
        )
        if pair:  # (the state's tile | the chunk's products' and full o's tiles | o's rows)
            st_t, vt_t, o_t, o_s, st_s = own
            own = (tuple(_union(interpret, st_s, (st_t, vt_t, o_t), o_s) for _ in range(2)),)
        scratch = (
            tile((CHUNK, dk)),  # w
            # (fold: Tm diag(beta) and v's rows, a tile each Dv block a program runs) U^T
            *(
                (tile((CHUNK, CHUNK)), *[tile((CHUNK, BV))] * (1 + pair))
                if fold
                else (tile((BV, CHUNK)),)
            ),  # fmt: skip
            tile((CHUNK, dk)),  # q_dec (fold: q's rows)
            tile((CHUNK, dk)),  # k_dec (fold: k's rows)
            # Aqk (fold: the vectors, f32 rows)
            plgpu.SMEM((STAGES, FOLD_ROWS, CHUNK), f32) if fold else tile((CHUNK, CHUNK)),
            *((tile((CHUNK, CHUNK)),) if fold_aqk else ()),  # (the fold's Aqk made already)
            *own,
            plgpu.SMEM(ri.shape[1:], jnp.int32),
            plgpu.SMEM(meta.shape, jnp.int32),
            # the decays: this head's for every chunk, or a stage's chunk's per key channel
            plgpu.SMEM((STAGES, dk) if per_channel else dec.shape[1:], f32),
            # a stage's copies: five tiles (three without o's), and per channel its decays
            plgpu.Barrier(
                num_arrivals=(3 if diagnostic == "chain" else 5)
                + per_channel
                + fold
                + fold_aqk
                + pair,
                num_barriers=STAGES,
            ),  # fmt: skip
            plgpu.Barrier(num_arrivals=2 if per_channel else 3, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1 + pair),  # the state's, a warpgroup's
            # (pair) a stage read by warpgroup 1
            *((plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),) if pair else ()),
        )
        body = functools.partial(
            _body, ops=InterpretOps if interpret else GpuOps, num_ckpt=num_ckpt,
            per_channel=per_channel, diagnostic=diagnostic, prefetch=prefetch,
            fold_heads=x.q.shape[1] if fold else 0, fold_aqk=fold_aqk, pair=pair, mode=runs_in,
        )  # fmt: skip
        if pair:
            mesh = plgpu.Mesh(
                grid=(h, rows), grid_names=("h", "r"), num_threads=2, thread_name="wg"
            )  # fmt: skip
        else:
            mesh = plgpu.Mesh(grid=(dv // BV, h, rows), grid_names=("v", "h", "r"))
        on = None if runs_in is None else mode == runs_in
        return pool_kernel(
            body, scratch, mesh, (ri, meta, dec, *tiles), state, o_type,
            jnp.where(mask if on is None else mask & on, slots, 0), name=f"{name}_serial_mgpu",
            interpret=interpret, approx_math=fold and FOLD_APPROX_MATH,
            collective_axes="wg" if pair else (), o_in=o_in, mode_on=on,
        )  # fmt: skip

    o_type = jax.ShapeDtypeStruct((num_tokens, h, dv), out_dtype)
    if pair == "dynamic":  # both launches, each running the rows of the mode the plan picks
        o, state = launch(state, False, runs_in=0)
        if interpret:  # (the pair's launch only where it runs rows: in Pallas' GPU interpreter
            # its warpgroups wait for each other's plan copies, which on a 2-CPU host can hold
            # the last thread; on a GPU its programs read the plan and exit)
            o, state = jax.lax.cond(
                mode == 1, lambda o, s: launch(s, True, runs_in=1, o_in=o), lambda o, s: (o, s),
                o, state,
            )  # fmt: skip
        else:
            o, state = launch(state, True, runs_in=1, o_in=o)
    else:
        o, state = launch(state, pair)
    if live is not None:
        o = jnp.where(live[:, None, None], o[: live.shape[0]], 0)
    return o, state


def swizzled(shape, dtype):
    """A shared-memory tile of 16-bit rows as TMA copies and ``wgmma`` read them: tiles of 8
    rows of 64 values, swizzled by 128 bytes."""
    plgpu = _plgpu()
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def mgpu_kernel(kernel, out_type, mesh, *, name: str, interpret: bool, approx_math=False):
    """``pl.kernel`` of ``kernel`` over ``mesh`` in Mosaic GPU's Lane semantics, or in Pallas'
    GPU interpreter (a CPU host). ``approx_math``: exp and the like by the hardware's
    approximations (``ex2.approx``)."""
    plgpu = _plgpu()
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return pl.kernel(
            kernel, out_type=out_type, mesh=mesh, interpret=InterpretGPUParams(), name=name
        )
    profile = dict(profile_space=PROFILE_SPACE, profile_dir=PROFILE_DIR) if PROFILE_DIR else {}
    params = plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        approx_math=approx_math,
        **profile,
    )
    return pl.kernel(kernel, out_type=out_type, mesh=mesh, compiler_params=params, name=name)


def pool_kernel(
    body, scratch, mesh, args, state, o_type, written_slots, *, name, interpret, approx_math=False,
    collective_axes=(), o_in=None, mode_on=None,
):  # fmt: skip
    """``body((*args refs, pool_in, pool_out, o), scratch refs)`` as one Mosaic GPU kernel over
    ``mesh`` that writes the pool in place: ``pool_in`` and ``pool_out`` are one ref, a
    ``jax.new_ref`` of ``state`` (donated). Returns ``(o, state)``. With ``o_in``, ``o`` is
    written in place of it too (a ref), where the kernel writes it.

    In Pallas' GPU interpreter (which takes no ref arguments) ``pool_out`` is an output of the
    pool's shape instead, and its ``written_slots`` (i32, 0: none) are copied into the pool;
    with ``o_in``, ``o`` is the kernel's where ``mode_on`` (a bool scalar), else ``o_in``."""
    if not interpret:
        pool = jax.new_ref(state)
        o_ref_in = None if o_in is None else jax.new_ref(o_in)

        def kernel(*refs):  # the pool (and o_in's o) read and written through one ref
            *ins, pool_ref, o_ref = refs  # (o: the output, or o_in's ref)
            pl.run_scoped(
                lambda *s: body((*ins, pool_ref, pool_ref, o_ref), s), *scratch,
                collective_axes=collective_axes,
            )  # fmt: skip

        out_type = o_type if o_in is None else ()
        run = mgpu_kernel(
            kernel, out_type, mesh, name=name, interpret=False, approx_math=approx_math
        )  # fmt: skip
        if o_in is None:
            return run(*args, pool), jax.freeze(pool)
        run(*args, pool, o_ref_in)
        return jax.freeze(o_ref_in), jax.freeze(pool)

    def kernel_i(*refs):
        *ins, pool_in, o_ref, pool_out = refs
        pl.run_scoped(
            lambda *s: body((*ins, pool_in, pool_out, o_ref), s), *scratch,
            collective_axes=collective_axes,
        )  # fmt: skip

    out_type = (o_type, jax.ShapeDtypeStruct(state.shape, state.dtype))
    o, written = mgpu_kernel(kernel_i, out_type, mesh, name=name, interpret=True)(*args, state)
    if o_in is not None:
        o = jnp.where(mode_on, o, o_in)
    n = state.shape[0]
    to = jnp.where(written_slots > 0, written_slots, n).reshape(-1)  # out of range: dropped
    return o, state.at[to].set(written[jnp.minimum(to, n - 1)], mode="drop")
