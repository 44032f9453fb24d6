"""k-token decode (speculative verify) kernels on a GPU: correctness, then time vs bandwidth.

``pallas_kernels/common/multi_decode_gpu.py`` at Qwen3-Next-80B GDN shapes (Hk=16, Hv=32,
D=128) and Kimi-Linear-48B KDA shapes (H=32, D=128). A verify step of B rows with k tokens
each: every row reads its running slot, writes a checkpoint after each of its k tokens and
its running slot after the last (dst = src, in place). This script

1. checks both kernels, compiled, against the prefill references (ragged rows of 1..4
   tokens, src 0 and > 0, dst 0, NaN in the slots nobody reads): FLA's error ratio; for each
   of ``--kernels``: Triton's (``triton``) and Mosaic GPU's (``mgpu``,
   ``multi_decode_mgpu.py``);
2. times them (a kernel that failed its check is not timed) at B = 64 and 256 with
   k = 1, 2, 4 (``benchmarks.common.time_stateful``: the pool donated, every output
   consumed), next to the route they replace (the family's chunked prefill with the same
   slots; at k = 1 also the one-token decode kernel);
3. counts the bytes each launch must move and divides by the time, against the
   device-to-device copy bandwidth measured as ``benchmarks/gdn_kernels.py`` does.

Bytes per launch (what the kernel moves, at least once each; f32 state, bf16 activations)::

    state   B x (1 read + (k + 1) writes) x H x Dv x Dk x 4       (k checkpoints + dst)
    tokens  B k x (inputs read + output written)                   GDN: q, k [Hk, D], v [Hv, D],
                                                                   a, b [Hv]; o [Hv, D]
                                                                   KDA: q, k, g, v [H, D], b [H]

It prints one JSON summary (and writes it to ``--out``)::

    python -m benchmarks.multi_decode --out MULTI_DECODE.json
    python -m benchmarks.multi_decode --interpret --quick     # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    copy_bandwidth,
    device_name,
    err_ratio,
    fanout_bandwidth,
    guarded_entries,
    time_stateful,
)
from pallas_kernels.common import multi_decode_gpu as md
from pallas_kernels.common import multi_decode_mgpu as md_mgpu
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.gdn.reference import gdn_prefill_reference
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda.reference import kda_prefill_reference

GDN_HK, GDN_HV, KDA_H, D = 16, 32, 32, 128
INTERPRET = False  # --interpret: the kernels in Pallas interpret mode (CPU smoke runs)
# Calls in one timed program (--chain). Each call is lowered and compiled on its own (a Mosaic
# GPU one ~0.25 s to lower on a CPU host, more to compile): 50 cost ~30 s an entry on an H200.
# 10 are cheaper but read slow: on 2026-11-29 the same kernels at 64 rows, k = 1, read 159 / 205
# us (Triton / Mosaic GPU) in chains of 10 against 134 / 166 us in chains of 50, a fixed cost
# of each timed program spread over fewer calls. Compare kernels within one chain length only.
CHAIN = 50  # --chain


# ----------------------------------------------------------------------------- inputs


def _gdn_acts(key, n):
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (n, GDN_HK, D), bf)
    k = jax.random.normal(ks[1], (n, GDN_HK, D), bf)
    v = jax.random.normal(ks[2], (n, GDN_HV, D), bf)
    a = jax.random.normal(ks[3], (n, GDN_HV), bf)
    b = jax.random.normal(ks[4], (n, GDN_HV), bf)
    A_log = jnp.log(jnp.linspace(1.0, 16.0, GDN_HV, dtype=jnp.float32))
    return q, k, v, a, b, A_log, jnp.ones(GDN_HV, jnp.float32)


def _kda_acts(key, n):
    ks = jax.random.split(key, 7)
    bf = jnp.bfloat16
    q, k, v, g = (jax.random.normal(kk, (n, KDA_H, D), bf) for kk in ks[:4])
    b = jax.random.normal(ks[4], (n, KDA_H), bf)
    A_log = jnp.log(jax.random.uniform(ks[5], (KDA_H,), minval=1.0, maxval=16.0))
    dt_bias = jax.random.normal(ks[6], (KDA_H, D), jnp.float32)
    return q, k, v, g, b, A_log, dt_bias


def _token_bytes(family: str) -> int:
    """Activation bytes one token moves: its inputs read and its output written (bf16)."""
    if family == "gdn":
        return 2 * (2 * GDN_HK * D + GDN_HV * D + 2 * GDN_HV + GDN_HV * D)
    return 2 * (4 * KDA_H * D + KDA_H + KDA_H * D)


FAMILIES = {
    # family: (state heads, activations, multi-decode, prefill kernel, decode, reference)
    "gdn": (lambda: GDN_HV, _gdn_acts, md.gdn_multi_decode, gdn_gpu.gdn_prefill, gdn_gpu.gdn_decode,
            gdn_prefill_reference),
    "kda": (lambda: KDA_H, _kda_acts, md.kda_multi_decode, kda_gpu.kda_prefill, kda_gpu.kda_decode,
            kda_prefill_reference),
}  # fmt: skip


def _pool(key, num_slots, heads):
    """A state pool, ``[num_slots, H, Dv, Dk]`` (states stored transposed, ``hyjax.cache``)."""
    return 0.1 * jax.random.normal(key, (num_slots, heads, D, D), jnp.float32)


def verify_slots(rows: int, k: int):
    """B rows of k tokens; row r reads and writes slot 1 + r, checkpoint m of row r (the state
    after token m + 1) goes to slot 1 + B + r k + m. Returns (qsl, slots, num_slots)."""
    qsl = jnp.arange(rows + 1, dtype=jnp.int32) * k
    running = 1 + jnp.arange(rows, dtype=jnp.int32)
    ck_off = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (rows, k))
    ck_slot = (1 + rows + jnp.arange(rows * k, dtype=jnp.int32)).reshape(rows, k)
    return qsl, StateSlots(running, running, ck_off, ck_slot, jnp.int32(rows)), 1 + rows * (k + 1)


# ----------------------------------------------------------------------------- timing


def _time_stateful(step, state, operands, *, iters: int) -> float:
    if INTERPRET:  # CPU smoke run: exercise the code path only
        return time_stateful(step, state, operands, iters=1, repeats=1, runs=1)
    return time_stateful(step, state, operands, iters=iters)


def floors(ks=()) -> dict:
    """Read + write bytes / s of an elementwise pass over 1 GiB of float32
    (:func:`benchmarks.common.copy_bandwidth`, as ``benchmarks.gdn_kernels.floors``), and for
    each k of ``ks`` a pass over 256 MiB read once and written k + 1 times, the verify step's
    mix (:func:`benchmarks.common.fanout_bandwidth`)."""
    small = dict(iters=1, repeats=1) if INTERPRET else {}
    out = {"copy_bandwidth_GBps": copy_bandwidth(1 << 22 if INTERPRET else 1 << 30, **small) / 1e9}
    for k in ks:
        num_bytes = 1 << 20 if INTERPRET else 1 << 28
        out[f"fanout_{k + 1}_GBps"] = fanout_bandwidth(k + 1, num_bytes, **small) / 1e9
    return out


# ----------------------------------------------------------------------------- checks


def check(family: str, **pick) -> dict:
    """Compiled kernel vs the prefill reference on a ragged verify batch; ``pick``: the
    kernel's choice (``kernel=``, ``inputs_first=``)."""
    heads, acts_fn, kernel, *_, reference = FAMILIES[family]
    heads = heads()
    lens = [4, 1, 3, 2, 4, 4, 1, 2]
    rows = len(lens) + 1  # and a padding row
    qsl = jnp.array([0, *np.cumsum(lens), sum(lens)], jnp.int32)
    acts = acts_fn(jax.random.PRNGKey(0), sum(lens) + 3)
    src = np.array([0, 1, 2, 0, 3, 4, 0, 5, 0], np.int32)  # zeros: fresh rows, padding
    dst = np.array([6, 1, 0, 7, 3, 8, 9, 5, 0], np.int32)  # 0: no store; 1, 3, 5: in place
    ck_off = np.zeros((rows, 4), np.int32)
    ck_slot = np.zeros((rows, 4), np.int32)
    nxt = 10
    for r, n in enumerate(lens):
        for m in range(n if r % 2 == 0 else 1):  # every offset, or the first only
            ck_off[r, m], ck_slot[r, m] = m + 1, nxt
            nxt += 1
    pool = np.full((nxt + 1, heads, D, D), np.nan, np.float32)
    pool[1:6] = np.asarray(_pool(jax.random.PRNGKey(1), 5, heads))
    slots = StateSlots(*(jnp.asarray(x) for x in (src, dst, ck_off, ck_slot)), jnp.int32(len(lens)))
    args = (*acts, jnp.asarray(pool), qsl, slots)
    want_o, want_s = jax.jit(reference)(*args)
    run = functools.partial(kernel, max_tokens=4, interpret=INTERPRET, **pick)
    got_o, got_s = jax.jit(run)(*args)
    got_s, want_s = np.asarray(got_s), np.asarray(want_s)
    nan = np.isnan(want_s).reshape(len(want_s), -1).all(1)  # slots the reference left alone
    out = {
        "output_err_ratio": err_ratio(got_o, want_o),
        "state_err_ratio": err_ratio(got_s[~nan], want_s[~nan]),
        "untouched_slots_still_nan": bool(np.isnan(got_s[nan]).all()),
        "output_has_nan": bool(np.isnan(np.asarray(got_o, np.float32)).any()),
    }
    # bf16 activations: the output's bound as the decode benchmarks' (decode_variants)
    out["ok"] = bool(
        out["output_err_ratio"] < 4e-3 and out["state_err_ratio"] < 1e-5
        and out["untouched_slots_still_nan"] and not out["output_has_nan"]
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- timings


def _verify_setup(family: str, rows: int, k: int):
    heads, acts_fn, kernel, prefill, decode, _ = FAMILIES[family]
    heads = heads()
    qsl, slots, num_slots = verify_slots(rows, k)
    acts = acts_fn(jax.random.PRNGKey(2), rows * k)

    def timed(fn, iters=CHAIN):
        def one(st, acts, qsl, slots):
            o, st = fn(*acts, st, qsl, slots)
            return st, o

        pool = _pool(jax.random.PRNGKey(3), num_slots, heads)  # donated: one per timing
        return _time_stateful(one, pool, (acts, qsl, slots), iters=iters)

    return heads, kernel, prefill, decode, timed


def time_verify(family: str, rows: int, k: int, **tuning) -> dict:
    """The multi-decode kernel, bytes moved per launch and their rate."""
    heads, kernel, _, _, timed = _verify_setup(family, rows, k)
    t = timed(functools.partial(kernel, max_tokens=k, interpret=INTERPRET, **tuning))
    state_bytes = rows * (1 + k + 1) * heads * D * D * 4
    token_bytes = rows * k * _token_bytes(family)
    return {
        "us": 1e6 * t,
        "state_MB": state_bytes / 1e6,
        "token_MB": token_bytes / 1e6,
        "GBps": (state_bytes + token_bytes) / t / 1e9,
    }


def time_routes(family: str, rows: int, k: int) -> dict:
    """What a verify step runs without this kernel: the chunked prefill with the same slots
    (one-token chunks); at k = 1 also the one-token decode kernel."""
    _, _, prefill, decode, timed = _verify_setup(family, rows, k)
    out = {"prefill_kernel_us": 1e6 * timed(functools.partial(prefill, interpret=INTERPRET), 5)}
    if k == 1:  # same slots, no query_start_loc
        one = functools.partial(decode, interpret=INTERPRET)
        out["decode_kernel_us"] = 1e6 * timed(lambda *a: one(*a[:-2], a[-1]))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small batches (smoke run)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script")
    p.add_argument("--sweep", action="store_true", help="block_v x num_warps at B=64 k=4")
    p.add_argument("--no-baselines", action="store_true", help="skip the prefill/decode routes")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--ks", default="1,2,4")
    p.add_argument(
        "--kernels", default="triton,mgpu",
        help="triton, triton_first (every input read before the first store:"
        " multi_decode_gpu.INPUTS_FIRST) and / or mgpu",
    )  # fmt: skip
    p.add_argument("--chain", type=int, default=50, help="calls in one timed program")
    p.add_argument("--families", default="gdn,kda")
    p.add_argument(
        "--mgpu-buffers", default=None,
        help="comma-separated tile buffers a Mosaic GPU program holds (multi_decode_mgpu.BUFFERS),"
        " an entry each (suffix _buf<n>); default: the module's",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    global INTERPRET, GDN_HK, GDN_HV, KDA_H, D, CHAIN
    CHAIN = args.chain
    INTERPRET = args.interpret
    if args.interpret:  # the interpreter runs every program on the CPU: few heads only
        GDN_HK, GDN_HV, KDA_H, D = 2, 4, 2, 64  # (Mosaic GPU's kernel takes Dk 64 or 128)
    batches, ks = ([2], [1, 2]) if args.quick else (_ints(args.batches), _ints(args.ks))
    summary = {
        "device": device_name(),
        "jax": jax.__version__,
        "shapes": f"GDN Hk={GDN_HK} Hv={GDN_HV} D={D}; KDA H={KDA_H} D={D}",
        "chain": CHAIN,
    }

    guarded = guarded_entries(summary, args.out)

    guarded("floors", lambda: floors(ks))
    bw = summary["floors"].get("copy_bandwidth_GBps")
    kernels = args.kernels.split(",")
    families = args.families.split(",")
    tag = {"triton": "", "triton_first": "_first", "mgpu": "_mgpu"}
    # each kernel name's arguments (kernel=..., inputs_first=...)
    picks = {"triton": dict(kernel="triton", inputs_first=False), "mgpu": dict(kernel="mgpu"),
             "triton_first": dict(kernel="triton", inputs_first=True)}  # fmt: skip
    # (kernel, its name's suffix, Mosaic GPU's buffers or None)
    runs = [(kern, tag[kern], None) for kern in kernels if kern != "mgpu"]
    if "mgpu" in kernels:
        sweep = _ints(args.mgpu_buffers) if args.mgpu_buffers else [None]
        runs += [("mgpu", "_mgpu" + (f"_buf{n}" if n else ""), n) for n in sweep]
    for family in families:
        for kern in kernels:
            guarded(f"check_{family}{tag[kern]}", lambda f=family, kn=kern: check(f, **picks[kn]))
    default_buffers = md_mgpu.BUFFERS
    for family in families:
        for rows in batches:
            for k in ks:
                for kern, suffix, buffers in runs:
                    if not summary[f"check_{family}{tag[kern]}"].get("ok"):
                        continue
                    md_mgpu.BUFFERS = buffers or default_buffers
                    name = f"{family}{suffix}_B{rows}_k{k}"
                    guarded(
                        name,
                        lambda f=family, r=rows, k=k, kn=kern: time_verify(f, r, k, **picks[kn]),
                    )
                    md_mgpu.BUFFERS = default_buffers
                    fan = summary["floors"].get(f"fanout_{k + 1}_GBps")
                    if bw and "GBps" in summary[name]:
                        summary[name]["of_copy_bandwidth"] = summary[name]["GBps"] / bw
                    if fan and "GBps" in summary[name]:
                        summary[name]["of_fanout_bandwidth"] = summary[name]["GBps"] / fan
    if not args.no_baselines:
        for family in families:
            for rows in batches:
                for k in ks:
                    guarded(
                        f"routes_{family}_B{rows}_k{k}",
                        lambda f=family, r=rows, k=k: time_routes(f, r, k),
                    )
    if args.sweep:
        for family in families:
            for bv, nw in [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]:
                guarded(
                    f"sweep_{family}_B64_k4_bv{bv}_w{nw}",
                    lambda f=family, bv=bv, nw=nw: time_verify(f, 64, 4, block_v=bv, num_warps=nw),
                )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
