"""Which parts of the engine's step run outside XLA's command buffers (CUDA graphs) on a GPU.

XLA:GPU records runs of capturable thunks (fusions, cuBLAS, Triton custom calls, conditionals
whose branches are all capturable) into command buffers, launched as one CUDA graph each. What
is left between them runs as thunks of its own, one host launch each; a ``conditional`` left
outside copies its predicate to the host and waits for it: the host blocks until the device has
run everything before it, and the device idles while the host launches what comes after.

This compiles the engine's steps for a small bench-shaped model with ``--xla_dump_to``, then
reads the optimized HLO of each step executable: the command buffers, and every top-level
instruction outside them, with what keeps a conditional out (the custom calls, sorts and
loops in its branches).

    python -m benchmarks.command_buffers --out CB.json    # on a GPU
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

_NO_THUNK = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
    "partition-id", "replica-id",
}  # fmt: skip
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO text's computations by name: their instruction lines (ENTRY under "ENTRY")."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()
            name = "ENTRY" if head[0] == "ENTRY" else head[0].lstrip("%")
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            comps[name].append(line.strip())
    return comps


def _called(line: str) -> list[str]:
    attrs = r"(?:to_apply|calls|body|condition|branch_computations)"
    names = re.findall(attrs + r"=\{?([^,}]+(?:,\s*%[\w.\-]+)*)\}?", line)
    out: list[str] = []
    for group in names:
        out += [n.strip().lstrip("%") for n in group.split(",")]
    return out


def blockers(comps: dict[str, list[str]], name: str, seen: set | None = None) -> list[str]:
    """What inside computation ``name`` (and what it calls) is not a plain fusion: custom
    calls by target, sorts, while loops, host transfers."""
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
        return []
    seen.add(name)
    found: list[str] = []
    for line in comps[name]:
        m = _LINE.match(line)
        if not m:
            continue
        op = m.group(3)
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            found.append(f"custom-call {t.group(1) if t else '?'}")
        elif op in ("sort", "while", "infeed", "outfeed", "send", "recv"):
            found.append(op)
        if op != "fusion":  # a fusion's body is one kernel
            for c in _called(line):
                found += blockers(comps, c, seen)
    return found


def outside_command_buffers(hlo: str) -> dict:
    """The top level of an optimized module: command buffers, and what runs outside them."""
    comps = computations(hlo)
    entry = comps.get("ENTRY", [])
    buffers, outside = 0, []
    for line in entry:
        m = _LINE.match(line)
        if not m or m.group(3) in _NO_THUNK:
            continue
        name, op = m.group(1), m.group(3)
        called = _called(line)
        if op == "call" and any("command_buffer" in c for c in called):
            buffers += 1
            continue
        item = {"name": name, "op": op}
        if op in ("conditional", "while", "call"):
            item["blocked_by"] = sorted(set(sum((blockers(comps, c) for c in called), [])))
        elif op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            item["target"] = t.group(1) if t else "?"
        outside.append(item)
    ops: dict[str, int] = {}
    for item in outside:
        ops[item["op"]] = ops.get(item["op"], 0) + 1
    return {
        "command_buffers": buffers,
        "outside_by_op": ops,
        "outside_not_fusion": [i for i in outside if i["op"] != "fusion"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--dump-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dump = args.dump_dir or tempfile.mkdtemp(prefix="xla_dump_")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
        " --xla_dump_hlo_module_re=.*_step.*"
    )
    if "jax" in sys.modules:
        raise RuntimeError("run as a script: XLA_FLAGS must be set before jax is imported")
    import jax

    from benchmarks.common import bench_config, device_name, random_model
    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    cfg = bench_config(args.layers, args.experts)
    engine = LLMEngine(
        EngineArgs(
            model=".",
            max_num_seqs=args.rows,
            max_num_batched_tokens=512,
            max_model_len=256,
            min_seq_bucket=args.rows,
            enable_prefix_caching=False,
            warmup=False,
            progress=False,
            cache_bytes=2 << 30,
        ),  # fmt: skip
        preloaded=(random_model(cfg), cfg),
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(args.rows):
        engine.add_request(EngineRequest(list(range(10 + i, 40 + i)), greedy))
    while engine.has_unfinished_requests():
        engine.step()
    results = {"device": device_name(), "jax": jax.__version__, "modules": []}
    for path in sorted(glob.glob(os.path.join(dump, "*_step*after_optimizations.txt"))):
        with open(path) as f:
            res = outside_command_buffers(f.read())
        res["module"] = os.path.basename(path)
        results["modules"].append(res)
        print(json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
