"""Registers, spills and shared memory of the delta-rule intra launches, on a CPU machine.

No GPU needed: the kernel is lowered for CUDA here (this project's jax), its Triton IR
written out, then compiled by a separate Python that has the ``triton`` package
(``python -m venv /tmp/tv && /tmp/tv/bin/pip install triton``). That Python runs its
Triton's compiler for sm_90 and ``ptxas -v`` on the result::

    python -m benchmarks.triton_registers --triton-python /tmp/tv/bin/python \\
        --kernels kda,gdn_blocked_bf16 --warps 2,4,8

Prints one line per (kernel, warps): registers a thread, stack frame, spill bytes, shared
memory, the kernel's SASS instructions (static: a loop's body counted once) and its longest
loop's (a branch back); ``--mix`` adds the instruction mix by group. The device's compiler
is the Triton in jax's CUDA plugin, another version; so the counts differ from the device's.
Use them to compare kernel variants, not as the device's own figures (2026-11-29: every
intra launch measured sits at the 255-register cap).
Kernels: ``kda`` (diagonal form by ``kda.gpu.DIAG_FORM``), ``kda_launch``
(the intra launch reading its diagonal blocks) and ``kda_diag`` (the launch making them;
``kda_diag_rows`` in the ``"launch_rows"`` form, its rows read from memory), and
``gdn_<form>`` for each of ``gdn.gpu.INTRA_FORMS`` (``gdn_fold``: ``blocked_bf16`` as
``gdn_prefill(fold=True)`` runs it). Each is taken at the 80B / 48B heads,
on the Mosaic GPU serial launch's scratch layout (the default path).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

# Run by --triton-python: compile one TTIR file, print the kernel's resources as one line.
_COMPILE = r"""
import os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": nw, "num_stages": ns})
ptx = path + f".w{nw}.ptx"
with open(ptx, "w") as f:  # (its bundled ptxas may read an older PTX version only)
    f.write(re.sub(r"^\.version \d+\.\d+", ".version 8.8", k.asm["ptx"], flags=re.M))
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
cubin = ptx + ".cubin"
r = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", cubin],
                   capture_output=True, text=True)
regs = re.search(r"Used (\d+) registers", r.stderr)
stack = re.search(r"(\d+) bytes stack frame", r.stderr)
spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
if regs is None:
    sys.exit("ptxas: " + r.stderr.strip()[-300:])
sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", cubin],
                      capture_output=True, text=True).stdout
addr = [int(a, 16) for a in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+\S", sass, flags=re.M)]
insts = len(addr)
# the longest loop: a branch back to an earlier address (16-byte instructions)
bra = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:0x)?([0-9a-f]+)"
loops = [(int(a, 16) - int(t, 16)) // 16 for a, t in re.findall(bra, sass)
         if int(t, 16) < int(a, 16)]
loop = max(loops, default=0)
# the instruction mix: each opcode (its modifiers dropped) counted into a group
ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, flags=re.M)
groups = {"mma": ("HMMA", "HGMMA"), "shared": ("LDS", "STS", "LDSM"), "barrier": ("BAR",),
          "shuffle": ("SHFL",), "global": ("LDG", "STG"), "spill": ("LDL", "STL"),
          "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP"), "mufu": ("MUFU",),
          "convert": ("F2FP", "PRMT", "F2F", "I2F", "F2I")}
mix = {g: sum(o in names for o in ops) for g, names in groups.items()}
mix["other"] = len(ops) - sum(mix.values())
mix = ", ".join(f"{g} {100 * n / max(len(ops), 1):.0f}%" for g, n in mix.items())
print(f"registers {regs[1]}, stack {stack[1] if stack else 0} B, spills "
      f"{spill[1] if spill else 0} / {spill[2] if spill else 0} B stored / loaded, "
      f"shared {k.metadata.shared} B, {insts} SASS instructions (static), the longest loop "
      f"{loop}" + (f"; mix: {mix}" if os.environ.get("MIX") else ""))
"""


def _with_diag_form(fn, gpu, form, *args):
    """``fn(*args)`` traced with KDA's diagonal blocks in ``form``."""
    saved, gpu.DIAG_FORM = gpu.DIAG_FORM, form
    try:
        return fn(*args)
    finally:
        gpu.DIAG_FORM = saved


def dump_intra_ttir(kernel: str, out_dir: str) -> list[str]:
    """Lower the prefill whose intra launch is ``kernel`` for CUDA and write that launch's
    Triton IR (no debug locations) to ``out_dir``, a file per launch (the split forms have
    two); returns their paths."""
    from jax._src.pallas.triton import lowering

    from tests.pallas_kernels.ragged_cases import abstract_slots

    sd = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    n, rows, max_ckpt = 256, 4, 2
    if kernel.startswith("kda"):
        from pallas_kernels.kda import gpu

        h, d = 32, 128
        acts = [sd((n, h, d), bf)] * 4 + [sd((n, h), bf)]
        gates = [sd((h,), f32), sd((h, d), f32)]
        forms = {"kda_launch": "launch", "kda_diag": "launch", "kda_diag_rows": "launch_rows"}
        fn = functools.partial(gpu.kda_prefill, precision=None)
        fn = functools.partial(_with_diag_form, fn, gpu, forms.get(kernel, gpu.DIAG_FORM))
        name = "kda_prefill_diag" if kernel.startswith("kda_diag") else "kda_prefill_intra"
    else:
        from pallas_kernels.gdn import gpu

        hk, h, d = 16, 32, 128
        acts = [sd((n, hk, d), bf)] * 2 + [sd((n, h, d), bf)] + [sd((n, h), bf)] * 2
        gates = [sd((h,), f32)] * 2
        form = kernel.removeprefix("gdn_")
        fold = form == "fold"  # the blocked bf16 launch of gdn_prefill(fold=True)
        form = "blocked_bf16" if fold else form
        fn = functools.partial(gpu.gdn_prefill, precision=None, intra_form=form, fold=fold)
        name = "gdn_prefill_intra"
    texts = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        pool = sd((8, h, d, d), f32)
        lowered = jax.jit(fn).trace(
            *acts, *gates, pool, sd((rows + 1,), i32), abstract_slots(rows, max_ckpt)
        )
        lowered.lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    paths = []
    for text in texts:  # the split forms' two launches: each
        module = text.split("\n", 1)[0].removeprefix("module @").split()[0]
        if module.startswith(name):
            paths.append(os.path.join(out_dir, f"{kernel}.{module}.ttir"))
            with open(paths[-1], "w") as f:
                f.write(text)
    if not paths:
        raise RuntimeError(f"{kernel}: no Triton launch named {name}* (the serial launch only?)")
    return paths


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--triton-python", required=True, help="a Python with the triton package")
    p.add_argument("--kernels", default="kda,kda_launch,kda_diag,gdn_blocked_bf16,gdn_whole")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--mix",
        action="store_true",
        help="also the SASS instruction mix, by group (MMA, shared memory, FP32, ...)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        for kernel in args.kernels.split(","):
            for path in dump_intra_ttir(kernel, out_dir):
                launch = path.split(".")[-2]
                for nw in args.warps.split(","):
                    r = subprocess.run(
                        [args.triton_python, "-c", _COMPILE, path, nw, str(args.stages)],
                        capture_output=True, text=True,
                        env={**os.environ, "MIX": "1" if args.mix else ""},
                    )  # fmt: skip
                    line = r.stdout.strip() or r.stderr.strip().splitlines()[-1]
                    print(f"{kernel} ({launch}) w{nw}: {line}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
