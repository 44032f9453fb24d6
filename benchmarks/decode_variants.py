"""GDN / KDA decode variants on a GPU (issue 19): which layout and tiling reaches the copy floor.

Decode moves each row's recurrent state once in and once out (f32 ``[H, 128, 128]``, 2 MiB a
row and layer at Qwen3-Next-80B's 32 value heads), so its floor is a copy of those bytes. This
script times, in one process and one chain discipline, at B = 64 and B = 256:

* ``copy``: an XLA elementwise pass over a ``[B, H, Dk, Dv]`` f32 array (read + write, the
  same bytes as the state), an optimization barrier between calls so XLA cannot fuse the
  chain into one pass; ``copy_B1`` (one row) estimates the fixed cost of a call in the chain;
* the engine's kernels: ``gdn_decode``, ``conv_gdn_decode`` (what the engine calls: its bytes
  include the conv windows), ``conv_then_gdn_decode`` (XLA's conv update, then
  ``gdn_decode``: the unfused alternative), ``conv_pallas_then_gdn_decode`` (the Pallas
  conv update handing q, k, v apart to ``gdn_decode``: two kernels), ``kda_decode`` and its
  three conv pairings, at their defaults. Since the
  run recorded in BENCHMARKS.md the engine's pool is stored ``[V, K]`` and ``gdn_decode`` /
  ``kda_decode`` are that run's winner (``vk``, 16 rows, one warp): a rerun times them in the
  new layout;
* the variants of :mod:`pallas_kernels.gdn.decode_variants` (``SWEEP``): GDN with the pool
  transposed (``gdn_vk``, variant A), GDN on the earlier ``[K, V]`` pool with several tiles a
  program,
  software pipelining and dot reductions (``gdn_kv``, variant B), KDA in both layouts
  (``kda_vk`` / ``kda_kv``, variant C). The full grid runs at B = 64; B = 256 times each
  group's first tiling (its control) and the ``--top`` fastest of B = 64.

Every variant is first checked against the pure-JAX reference on the GPU at the timing shape
(src 0, dst 0, a row written to another slot, a checkpoint at offset 1, a padding row, NaN in
slot 0; a ``kv`` pool transposed in and out); one that fails is reported and not timed.

Timing (:func:`time_chain`): as :func:`benchmarks.common.time_stateful`, one jitted program of
``--iters`` unrolled calls with the state donated and every output consumed (one element of
each summed into a returned scalar); here ``--chains`` such programs are dispatched back to
back before one sync, so the host's sync is spread over ``chains * iters`` calls. At B = 64
the state is 134 MB (H200 L2: 50 MB), so every call streams it from HBM. ``vs_copy`` is
``copy time / kernel time`` at the same B: the issue's bar is >= 0.90.

GPU run (about 2-3 minutes on an H200, JSON written after every entry)::

    python -m benchmarks.decode_variants --out benchmarks/results/decode_variants_h200.json

CPU dry run (tiny shapes in Pallas interpret mode, and every GPU tiling lowered to Triton at
the real shapes)::

    python -m benchmarks.decode_variants --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import device_name, time_stateful
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import causal_conv1d_update_reference
from pallas_kernels.gdn import fused_decode, gpu
from pallas_kernels.gdn.decode_variants import (
    DecodeTiling,
    gdn_decode_variant,
    kda_decode_variant,
    to_layout,
)
from pallas_kernels.gdn.reference import gdn_decode_reference
from pallas_kernels.kda import fused_decode as kda_fused_decode
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda.reference import kda_decode_reference


@dataclasses.dataclass(frozen=True)
class Shapes:
    hk: int = 16  # Qwen3-Next-80B GDN: 16 key heads, 32 value heads of 128
    hv: int = 32
    d: int = 128
    conv_k: int = 4

    @property
    def conv_c(self) -> int:
        return 2 * self.hk * self.d + self.hv * self.d


T = DecodeTiling
# The grid timed at B = 64. A group's first tiling is its control (timed at every B).
SWEEP: dict[str, list[DecodeTiling]] = {
    # Variant A: the pool stored [slots, H, Dv, Dk]; reductions along the contiguous axis.
    "gdn_vk": [
        T("vk", 32, 4),
        T("vk", 8, 1),
        T("vk", 16, 1),
        T("vk", 16, 2),
        T("vk", 32, 2),
        T("vk", 64, 4),
        T("vk", 64, 8),
        T("vk", 128, 8),
        T("vk", 32, 4, fused_output=False),
        T("vk", 16, 2, tiles=4, prefetch=True),
        T("vk", 32, 4, tiles=4, prefetch=True),
        T("vk", 32, 4, num_stages=3, tiles=4),
        T("vk", 32, 4, reduce="dot"),
        T("vk", 64, 4, reduce="dot"),
    ],
    # Variant B: the earlier [slots, H, Dk, Dv] pool, several tiles a program, pipelined.
    "gdn_kv": [
        T("kv", 64, 4, fused_output=False),  # the earlier gdn_decode but for the load order
        T("kv", 64, 4),
        T("kv", 64, 4, tiles=4, prefetch=True),
        T("kv", 64, 4, num_stages=3, tiles=4),
        T("kv", 64, 4, num_stages=2, tiles=2),
        T("kv", 32, 4, tiles=4, prefetch=True),
        T("kv", 32, 2, tiles=8, prefetch=True),
        T("kv", 64, 8, tiles=4, prefetch=True),
        T("kv", 64, 4, reduce="dot"),
        T("kv", 64, 4, tiles=4, prefetch=True, reduce="dot"),
        T("kv", 32, 4, reduce="dot3"),
    ],
    # Variant C: KDA (a decay per key channel) in both layouts.
    "kda_vk": [
        T("vk", 32, 4),
        T("vk", 16, 1),
        T("vk", 16, 2),
        T("vk", 32, 2),
        T("vk", 64, 4),
        T("vk", 32, 4, tiles=4, prefetch=True),
        T("vk", 32, 4, reduce="dot"),
    ],
    # The winning [V, K] tilings with the state's load and stores marked evict-first (the
    # state is streamed once a step; the token's inputs stay in L2).
    "gdn_ef": [
        T("vk", 16, 1),
        T("vk", 16, 1, evict_first=True),
        T("vk", 8, 1, evict_first=True),
        T("vk", 32, 4, evict_first=True),
    ],
    "kda_ef": [
        T("vk", 16, 1),
        T("vk", 16, 1, evict_first=True),
    ],
    "kda_kv": [
        T("kv", 64, 4),
        T("kv", 32, 4),
        T("kv", 64, 4, tiles=4, prefetch=True),
    ],
}
VARIANT_FNS = {"gdn": gdn_decode_variant, "kda": kda_decode_variant}
REFERENCES = {"gdn": gdn_decode_reference, "kda": kda_decode_reference}


def family_of(group: str) -> str:
    return group.split("_")[0]


# ----------------------------------------------------------------------------- inputs


def gdn_inputs(sh: Shapes, rows: int, key) -> tuple[jax.Array, ...]:
    """q, k [rows, Hk, D], v [rows, Hv, D], a, b [rows, Hv] (bf16), A_log, dt_bias (f32)."""
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (rows, sh.hk, sh.d), bf)
    k = jax.random.normal(ks[1], (rows, sh.hk, sh.d), bf)
    v = jax.random.normal(ks[2], (rows, sh.hv, sh.d), bf)
    a = jax.random.normal(ks[3], (rows, sh.hv), bf)
    b = jax.random.normal(ks[4], (rows, sh.hv), bf)
    A_log = jnp.log(jnp.linspace(1.0, 16.0, sh.hv, dtype=jnp.float32))
    return q, k, v, a, b, A_log, jnp.ones(sh.hv, jnp.float32)


def kda_inputs(sh: Shapes, rows: int, key) -> tuple[jax.Array, ...]:
    """q, k, v, raw gate [rows, H, D], b [rows, H] (bf16), A_log [H], dt_bias [H, D] (f32);
    H = ``sh.hv`` (Kimi-Linear-48B: 32 KDA heads of 128, the same state bytes as GDN's)."""
    ks = jax.random.split(key, 7)
    h, bf = sh.hv, jnp.bfloat16
    q, k, v, g = (jax.random.normal(ks[i], (rows, h, sh.d), bf) for i in range(4))
    b = jax.random.normal(ks[4], (rows, h), bf)
    A_log = jnp.log(jax.random.uniform(ks[5], (h,), minval=1.0, maxval=16.0))
    return q, k, v, g, b, A_log, jax.random.normal(ks[6], (h, sh.d), jnp.float32)


INPUTS = {"gdn": gdn_inputs, "kda": kda_inputs}


def pool(sh: Shapes, num_slots: int, key) -> jax.Array:
    return 0.1 * jax.random.normal(key, (num_slots, sh.hv, sh.d, sh.d), jnp.float32)


def running_slots(rows: int) -> StateSlots:
    """Steady decode: row r reads and writes its own slot r + 1, no checkpoints."""
    running = 1 + jnp.arange(rows, dtype=jnp.int32)
    none = jnp.zeros((rows, 2), jnp.int32)
    return StateSlots(running, running, none, none, jnp.int32(rows))


def check_slots(rows: int) -> StateSlots:
    """``running_slots`` plus the contract's corners (``rows >= 8``; slots up to rows + 2)::

    row 3 starts from zero (src 0), row 5 writes nothing (dst 0), row 7 writes slot rows + 1,
    row 0 also writes a checkpoint at offset 1 to slot rows + 2, the last row is padding.
    """
    src = (1 + jnp.arange(rows, dtype=jnp.int32)).at[3].set(0)
    dst = (1 + jnp.arange(rows, dtype=jnp.int32)).at[5].set(0).at[7].set(rows + 1)
    ck_off = jnp.zeros((rows, 2), jnp.int32).at[0, 1].set(1)
    ck_slot = jnp.zeros((rows, 2), jnp.int32).at[0, 1].set(rows + 2)
    return StateSlots(src, dst, ck_off, ck_slot, jnp.int32(rows - 1))


# ----------------------------------------------------------------------------- timing


def time_chain(step, state, operands, *, iters: int, chains: int, repeats: int = 3) -> float:
    """Median seconds of one ``state, out = step(state, *operands)``: ``chains`` dispatches of
    one jitted program of ``iters`` unrolled calls, then one sync
    (:func:`benchmarks.common.time_stateful`'s program, ``chains`` its ``runs``)."""
    return time_stateful(step, state, operands, iters=iters, repeats=repeats, runs=chains)


def _swap(fn):
    """``fn(*acts, state, slots) -> (o, state)`` as a ``step(state, acts, slots)``. ``fn`` is
    jitted so the chain's calls share one lowering (a Pallas call lowers in Python)."""
    fn = jax.jit(fn)

    def step(state, acts, slots):
        o, state = fn(*acts, state, slots)
        return state, o

    return step


def copy_step(x):
    """One read and one write of ``x``; the barrier keeps XLA from fusing consecutive calls."""
    x = jax.lax.optimization_barrier(x * 1.0001)
    return x, x


# ----------------------------------------------------------------------------- the runner


class Runner:
    """Runs and records the entries, writing the JSON after each one."""

    def __init__(self, args, sh: Shapes):
        self.args, self.sh = args, sh
        self.interpret = args.dry_run
        self.start = time.perf_counter()
        self.budget_s = args.budget_s or (float("inf") if args.dry_run else 480.0)
        self.summary = {
            "device": device_name(),
            "jax": jax.__version__,
            "shapes": dataclasses.asdict(sh),
            "dry_run": args.dry_run,
            "iters": args.iters,
            "chains": args.chains,
        }

    def record(self, name: str, fn):
        t0 = time.perf_counter()
        if t0 - self.start > self.budget_s:
            self.summary[name] = {"skipped": f"past the time budget, {self.budget_s} s"}
            print(name, "skipped: out of time", flush=True)
            return self.summary[name]
        try:
            self.summary[name] = fn()
        except Exception as e:  # noqa: BLE001 - report the failure and go on
            self.summary[name] = {"failed": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        print(f"{name} ({time.perf_counter() - t0:.1f} s)", json.dumps(self.summary[name]),
              flush=True)  # fmt: skip
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.summary, f, indent=2)
        return self.summary[name]

    def time(self, step, state, operands) -> float:
        if self.interpret:  # CPU: exercise the code path only
            return time_chain(step, state, operands, iters=1, chains=1, repeats=1)
        return time_chain(step, state, operands, iters=self.args.iters, chains=self.args.chains)

    def state_bytes(self, rows: int) -> int:
        return 2 * rows * self.sh.hv * self.sh.d * self.sh.d * 4  # read + write, f32

    def timed(self, rows: int, seconds: float, copy_s: float | None) -> dict:
        out = {"us": 1e6 * seconds, "state_GBps": self.state_bytes(rows) / seconds / 1e9}
        if copy_s:
            out["vs_copy"] = copy_s / seconds
        return out

    # -- entries

    def copy(self, rows: int) -> dict:
        x = pool(self.sh, rows, jax.random.PRNGKey(0))
        t = self.time(copy_step, x, ())
        return {"us": 1e6 * t, "GBps": self.state_bytes(rows) / t / 1e9}

    def baseline(self, name: str, rows: int, copy_s) -> dict:
        sh, fam = self.sh, "kda" if "kda" in name else "gdn"
        acts = INPUTS[fam](sh, rows, jax.random.PRNGKey(1))
        slots = running_slots(rows)
        st = pool(sh, rows + 1, jax.random.PRNGKey(2))
        if name.startswith("conv_"):
            # KDA: H = Hv heads of q, k and v channels each (Kimi's three filters)
            c = sh.conv_c if fam == "gdn" else 3 * sh.hv * sh.d
            ks = jax.random.split(jax.random.PRNGKey(3), 3)
            mixed = jax.random.normal(ks[0], (rows, c), jnp.bfloat16)
            weight = 0.5 * jax.random.normal(ks[1], (c, sh.conv_k), jnp.bfloat16)
            conv = jax.random.normal(ks[2], (rows + 1, sh.conv_k - 1, c), jnp.bfloat16)
            # The fused kernel; (``conv_then_*``) XLA's conv update then the GPU decode
            # kernel: two passes, the decode on its own many-program grid; or
            # (``conv_pallas_then_*``) the Pallas conv update handing q, k, v apart to it.
            interp = {"interpret": self.interpret}
            fused_op, composed, decode, two_kernels = {
                "gdn": (fused_decode.conv_gdn_decode, fused_decode.composed_conv_gdn_decode,
                        gpu.gdn_decode, fused_decode.two_kernel_conv_gdn_decode),
                "kda": (kda_fused_decode.conv_kda_decode, kda_fused_decode.composed_conv_kda_decode,
                        kda_gpu.kda_decode, kda_fused_decode.two_kernel_conv_kda_decode),
            }[fam]  # fmt: skip
            gates = acts[3:]  # GDN: a, b, A_log, dt_bias; KDA: g, b, A_log, dt_bias
            if name.startswith("conv_then_"):
                op = composed(causal_conv1d_update_reference, functools.partial(decode, **interp))
            elif name.startswith("conv_pallas_then_"):
                op = functools.partial(two_kernels, **interp)
            else:
                op = functools.partial(fused_op, **interp)
            ref = {"gdn": fused_decode.conv_gdn_decode_reference,
                   "kda": kda_fused_decode.conv_kda_decode_reference}[fam]  # fmt: skip
            if fam == "gdn":
                op = functools.partial(op, num_k_heads=sh.hk)
                ref = functools.partial(ref, num_k_heads=sh.hk)
            fused = jax.jit(op)
            checked = self.check_conv(fused, ref, (mixed, weight, conv, *gates, st, slots))

            def step(state, mixed, weight, gates):
                conv, ssm = state
                o, conv, ssm = fused(mixed, weight, conv, *gates, ssm, slots)
                return (conv, ssm), o

            conv_mb = 2 * conv[1:].nbytes / 1e6  # read + written too, not in state_GBps
            t = self.time(step, (conv, st), (mixed, weight, gates))  # donates conv, st
            return {**self.timed(rows, t, copy_s), "conv_bytes_MB": conv_mb, "check": checked}
        fn = {"gdn_decode": gpu.gdn_decode, "kda_decode": kda_gpu.kda_decode}[name]
        fn = functools.partial(fn, interpret=self.interpret)
        return self.timed(rows, self.time(_swap(fn), st, (acts, slots)), copy_s)

    @staticmethod
    def check_conv(op, ref, args) -> dict:
        """A conv + decode op against the composed references on the timing inputs (before
        the timed chain donates them): the same error ratios as :meth:`check`, and the conv
        pool, whose windows are copies of inputs, bit for bit."""

        @jax.jit
        def errors(args):
            with jax.default_matmul_precision("highest"):
                want = ref(*args)
            got = op(*args)
            return {
                "output_err_ratio": _err_ratio(got[0], want[0]),
                "conv_pool_equal": (got[1] == want[1]).all(),
                "state_err_ratio": _err_ratio(got[2], want[2]),
            }

        out = {k: v.item() for k, v in errors(args).items()}
        # The fused kernels feed the conv's f32 outputs to the delta rule; the reference (and
        # the two-kernel pairs) round them to bf16 first: one bf16 step (~2e-3) in the state
        # and the outputs (CPU interpreter: 1.8e-3 / 3.0e-3 fused, 1e-8 / 0 two kernels).
        out["ok"] = bool(
            out["conv_pool_equal"] and out["output_err_ratio"] < 5e-3
            and out["state_err_ratio"] < 5e-3
        )  # fmt: skip
        return out

    def check(self, group: str, tiling: DecodeTiling, rows: int) -> dict:
        """The variant vs the reference on the device, at ``rows`` rows (``check_slots``)."""
        fam = family_of(group)
        kernel = functools.partial(VARIANT_FNS[fam], tiling=tiling, interpret=self.interpret)

        def in_layout(*acts, st, slots):
            o, s = kernel(*acts, to_layout(st, tiling.layout), slots)
            return o, to_layout(s, tiling.layout)

        # ``dot3``, 3xTF32, a little looser
        return check_decode(
            self.sh, fam, rows, in_layout, 1e-5 if tiling.reduce != "dot3" else 1e-4
        )

    def variant(self, group: str, tiling: DecodeTiling, rows: int, copy_s) -> dict:
        fam = family_of(group)
        acts = INPUTS[fam](self.sh, rows, jax.random.PRNGKey(1))
        st = to_layout(pool(self.sh, rows + 1, jax.random.PRNGKey(2)), tiling.layout)
        fn = functools.partial(VARIANT_FNS[fam], tiling=tiling, interpret=self.interpret)
        return self.timed(rows, self.time(_swap(fn), st, (acts, running_slots(rows))), copy_s)


def check_decode(sh: Shapes, fam: str, rows: int, kernel, state_tol: float = 1e-5) -> dict:
    """``kernel(*acts, st=pool, slots=slots) -> (o, pool)`` against the family's reference on the
    device, at ``rows`` rows of ``check_slots`` (slot 0 NaN), with ``ok``: the state within
    ``state_tol``, the bf16 output within 4e-3 (every variant measured 1.6e-3 on an H200
    against the reference, the exact ones too: one bf16 rounding step where the two sides round
    differently), slot 0 untouched, the output finite."""
    acts = INPUTS[fam](sh, rows, jax.random.PRNGKey(4))
    slots = check_slots(rows)
    st = pool(sh, rows + 3, jax.random.PRNGKey(5)).at[0].set(jnp.nan)

    @jax.jit
    def errors(acts, st):
        # IEEE f32 products in the reference (a GPU's default for f32 dots is TF32, whose
        # 1e-3 output error would fail every variant against it).
        with jax.default_matmul_precision("highest"):
            want_o, want_s = REFERENCES[fam](*acts, st, slots)
        got_o, got_s = kernel(*acts, st=st, slots=slots)
        return {
            "output_err_ratio": _err_ratio(got_o, want_o),
            "state_err_ratio": _err_ratio(got_s[1:], want_s[1:]),
            "slot0_untouched": jnp.isnan(got_s[0]).all(),
            "output_finite": jnp.isfinite(got_o.astype(jnp.float32)).all(),
        }

    out = {k: v.item() for k, v in errors(acts, st).items()}
    out["ok"] = bool(
        out["output_err_ratio"] < 4e-3
        and out["state_err_ratio"] < state_tol
        and out["slot0_untouched"]
        and out["output_finite"]
    )
    return out


def _err_ratio(got: jax.Array, want: jax.Array) -> jax.Array:
    """FLA's ``rms(got - want) / rms(want)``."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    rms = lambda x: jnp.sqrt(jnp.mean(x * x))  # noqa: E731
    return rms(got - want) / jnp.maximum(rms(want), 1e-30)


def lower_all(sweep: dict[str, list[DecodeTiling]], rows: int = 64) -> dict:
    """Every tiling traced and lowered to Triton for CUDA at Qwen3-Next / Kimi shapes (no GPU
    needed): a tiling the Pallas Triton lowering rejects fails here, not on the GPU."""
    sh, sd = Shapes(), jax.ShapeDtypeStruct
    slots = jax.tree.map(lambda x: sd(x.shape, x.dtype), running_slots(rows))
    out = {}
    for group, tilings in sweep.items():
        fam = family_of(group)
        acts = [sd(x.shape, x.dtype) for x in INPUTS[fam](sh, rows, jax.random.PRNGKey(0))]
        for t in tilings:
            st = sd(t.pool_shape(rows + 1, sh.hv, sh.d, sh.d), jnp.float32)
            try:
                fn = jax.jit(functools.partial(VARIANT_FNS[fam], tiling=t))
                text = fn.trace(*acts, st, slots).lower(lowering_platforms=("cuda",)).as_text()
                out[f"{group}/{t.name}"] = "ok" if "triton" in text else "no triton call"
            except Exception as e:  # noqa: BLE001
                out[f"{group}/{t.name}"] = f"failed: {type(e).__name__}: {e}"[:500]
    return out


def dry_run_sweep(d: int) -> dict[str, list[DecodeTiling]]:
    """The sweep with ``block_v`` clipped to the tiny head dim (duplicates dropped), less
    ``dot3`` (3xTF32 exists on NVIDIA only: :func:`lower_all` covers it)."""
    out = {}
    for group, tilings in SWEEP.items():
        clipped = [
            dataclasses.replace(t, block_v=min(t.block_v, d)) for t in tilings if t.reduce != "dot3"
        ]
        out[group] = list({t.name: t for t in clipped}.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path, rewritten after every entry")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--iters", type=int, default=10, help="unrolled calls per jitted chain")
    p.add_argument("--chains", type=int, default=10, help="chains dispatched per measurement")
    p.add_argument("--top", type=int, default=3, help="B=64's fastest per group timed at 256")
    p.add_argument("--full", action="store_true", help="the whole grid at every batch")
    p.add_argument("--groups", default=",".join(SWEEP), help="comma-separated SWEEP groups")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no entry after this many seconds (GPU default 480)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpret mode")
    args = p.parse_args()
    sweep = {g: SWEEP[g] for g in args.groups.split(",")}
    sh = Shapes()
    batches = [int(b) for b in args.batches.split(",")]
    if args.dry_run:
        lowered = lower_all(sweep)
        print("lowered to triton:", json.dumps(lowered, indent=1), flush=True)
        sh, batches = Shapes(hk=2, hv=4, d=32), [8, 16]
        sweep = {g: ts for g, ts in dry_run_sweep(sh.d).items() if g in sweep}
    run = Runner(args, sh)
    if args.dry_run:
        run.summary["lowered_to_triton"] = lowered
    run.record("copy_B1", lambda: run.copy(1))
    checked: dict[str, bool] = {}
    for i, rows in enumerate(batches):
        run_batch(run, sweep, rows, None if i == 0 or args.full else batches[0], checked)
    run.record("best", lambda: best_per_group(run.summary, sweep, batches))


def run_batch(run: Runner, sweep, rows: int, ranked_at: int | None, checked: dict) -> None:
    """The copy, the engine's kernels and the variants at ``rows`` rows. With ``ranked_at``,
    each group's control and its ``--top`` fastest at that batch only; a tiling is checked
    once (``checked``: its verdict) and timed only if it passed."""
    copy_s = run.record(f"copy_B{rows}", lambda: run.copy(rows)).get("us", 0) * 1e-6
    for name in ("gdn_decode", "conv_gdn_decode", "conv_then_gdn_decode",
                 "conv_pallas_then_gdn_decode", "kda_decode", "conv_kda_decode",
                 "conv_then_kda_decode", "conv_pallas_then_kda_decode"):  # fmt: skip
        run.record(f"{name}_B{rows}", lambda name=name: run.baseline(name, rows, copy_s))
    for group, tilings in sweep.items():
        if ranked_at is not None:
            us = {t.name: run.summary.get(f"{group}/{t.name}_B{ranked_at}", {}).get("us")
                  for t in tilings}  # fmt: skip
            fastest = sorted((t for t in tilings if us[t.name]), key=lambda t: us[t.name])
            tilings = list({t.name: t for t in tilings[:1] + fastest[: run.args.top]}.values())
        for t in tilings:
            key = f"{group}/{t.name}"
            if key not in checked:
                res = run.record(f"{key}_check", lambda g=group, t=t: run.check(g, t, rows))
                checked[key] = bool(res.get("ok"))
            if checked[key]:
                run.record(f"{key}_B{rows}", lambda g=group, t=t: run.variant(g, t, rows, copy_s))
    run.record(f"copy_again_B{rows}", lambda: run.copy(rows))  # drift over the batch


def best_per_group(summary: dict, sweep, batches) -> dict:
    """The fastest timed tiling of each group at each batch."""
    best = {}
    for rows in batches:
        for group in sweep:
            mine = (k for k in summary if k.startswith(f"{group}/") and k.endswith(f"_B{rows}"))
            timed = {k: summary[k] for k in mine if "us" in summary[k]}
            if timed:
                k = min(timed, key=lambda k: timed[k]["us"])
                best[f"{group}_B{rows}"] = {"tiling": k.split("/")[1], **timed[k]}
    return best


if __name__ == "__main__":
    main()
