"""The Mosaic GPU serial launch's ragged cases on a GPU, each in its own process.

A kernel fault (illegal instruction or address) poisons the CUDA context of its process, so
each case runs in a child: ``python -m benchmarks.mgpu_probe --out probe.json``. A case is a
batch of rows (``lens``) in ``tokens`` token slots, GDN at the 80B's heads; the Mosaic GPU
serial launch (``pallas_kernels.common.chunk_scan_mgpu``) runs it on its token-aligned plan,
and its outputs and pool are compared with the Triton launch's (``gdn.gpu.gdn_prefill``).
What each case isolates:

- ``full_pad_rows``: 64-token chunks only, two rows with no tokens;
- ``partial``: a row's last chunk of 36 tokens;
- ``tail``: the same with the batch ending 4 tokens later;
- ``short_rows``: rows of 1, 5 and 63 tokens (chunks inside one block);
- ``ckpt_cut``: a checkpoint inside a block, so the block holds two chunks;
- ``mid_block_rows``: rows starting inside blocks, a checkpoint.

Its first run (H200, jax 0.11.2, ``benchmarks/results/mgpu_probe_h200_687b498.json``) was on
the plan before, whose windows started at each chunk: ``full_pad_rows`` and ``partial``
matched to 3e-5; a window moved back to the batch's end (``tail``) was wrong, and
``short_rows`` and ``ckpt_cut`` (windows off a multiple of 8 tokens) faulted with an illegal
instruction. The token-aligned plan puts every window on a multiple of 64.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {  # name: (row lengths, token slots, checkpoint offsets of row 0)
    "full_pad_rows": ([128, 64], 256, []),
    "partial": ([100], 256, []),
    "tail": ([100], 104, []),
    "short_rows": ([1, 5, 63], 128, []),
    "ckpt_cut": ([150], 256, [100]),
    "mid_block_rows": ([37, 200, 90], 384, [64]),
}


def run_case(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import err_ratio
    from benchmarks.gdn_kernels import _activations, _pool
    from pallas_kernels.common import chunk_scan_mgpu
    from pallas_kernels.common.slots import StateSlots
    from pallas_kernels.gdn import gpu

    lens, tokens, ckpts = CASES[name]
    rows = len(lens) + 2  # two padding rows
    qsl = np.concatenate([[0], np.cumsum(lens), [sum(lens)] * 2]).astype(np.int32)
    src = np.array([1 + i if i % 2 == 0 else 0 for i in range(len(lens))] + [0, 0], np.int32)
    dst = np.array([1 + i for i in range(len(lens))] + [0, 0], np.int32)
    ck_off = np.zeros((rows, 2), np.int32)
    ck_slot = np.zeros((rows, 2), np.int32)
    for j, off in enumerate(ckpts):
        ck_off[0, j], ck_slot[0, j] = off, len(lens) + 1 + j
    num_slots = len(lens) + 4
    slots = StateSlots(*map(jnp.asarray, (src, dst, ck_off, ck_slot)), jnp.int32(len(lens)))
    args = _activations(jax.random.PRNGKey(0), tokens, slow_gates=True)
    pool = _pool(jax.random.PRNGKey(1), num_slots)
    bf = jnp.bfloat16

    want_o, want_s = jax.jit(
        lambda p: gpu.gdn_prefill(*args, p, jnp.asarray(qsl), slots, precision=None)
    )(jnp.copy(pool))

    @jax.jit
    def mgpu(p):
        plan, rp, x = gpu.prefill_scratch(
            *args, jnp.asarray(qsl), slots, operand_dtype=bf, precision=None, tma_layout=True
        )
        o, p = chunk_scan_mgpu.scan_mgpu(rp, x, p, out_dtype=bf)
        return o, p

    got_o, got_s = mgpu(jnp.copy(pool))
    got_o.block_until_ready()
    n = sum(lens)
    return {
        "output_err_vs_triton": err_ratio(got_o[:n], want_o[:n]),
        "state_err_vs_triton": err_ratio(got_s, want_s),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--case", default=None, help="run one case here (the child's entry)")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)), flush=True)
        return
    summary = {}
    for name in CASES:
        cmd = [sys.executable, "-m", "benchmarks.mgpu_probe", "--case", name]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = r.stdout.strip().splitlines()
            if r.returncode == 0 and lines:
                result = json.loads(lines[-1])
            else:
                err = [ln for ln in r.stderr.splitlines() if "Error" in ln]
                result = {"failed": (err[-1] if err else f"rc={r.returncode}")[:400]}
        except subprocess.TimeoutExpired:
            result = {"failed": f"timeout {args.timeout} s (a hang?)"}
        summary[name] = result
        print(name, json.dumps(result), flush=True)
    text = json.dumps(summary, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
