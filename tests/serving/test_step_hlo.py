"""The compiled step updates the donated pools in place: no step copies a whole pool.

A copy of a pool per step costs its bytes twice over (read and written) and as much again in
temporaries; the step's bytes should be the rows it touches. XLA inserts such copies when it
cannot order every read of the old pool before the write of the new one (a one-row gather
turned into a dynamic slice fused into the ops that consume it, say), so the check is on the
optimized HLO of the shapes where that happened: one row, decode and prefill, both families.
"""

import math
import re

import jax
import pytest

from hyjax.testing import make_tiny_kimi_linear_model
from hyjax.tiny import make_tiny_model
from serving.core.plan import StepPlan, StepShape
from serving.engine.llm_engine import EngineArgs, LLMEngine
from serving.worker.runner import _step

SMALL = dict(
    max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=128,
    warmup=False, progress=False, kernel_backend="reference",
)  # fmt: skip

MAKERS = {"qwen3_next": make_tiny_model, "kimi_linear": make_tiny_kimi_linear_model}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def runner(request, tmp_path_factory):
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param), seed=3)
    return LLMEngine(EngineArgs(model=path, **SMALL)).runner


def _pool_copies(runner, shape) -> list[str]:
    """The copies in the step's optimized HLO as large as a pool (under any reshape)."""
    hlo = _step.lower(*runner.step_args(StepPlan.empty(shape))).compile().as_text()
    sizes = {math.prod(x.shape) for x in jax.tree.leaves(runner.caches)}
    copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
    return [c for c in copies if math.prod(int(d) for d in c.split(",") if d) in sizes]


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("rows", [1, 2])
def test_no_step_copies_a_pool(runner, rows, decode_only):
    cfg = runner.sched_cfg
    shape = StepShape(rows if decode_only else 64, rows, cfg.max_blocks, cfg.max_ckpt, decode_only)
    assert _pool_copies(runner, shape) == []


def _depth(line: str) -> int:
    """The line's ``{`` less its ``}``, outside string literals (a Triton kernel's IR travels
    as a string attribute of its custom call)."""
    code = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
    return code.count("{") - code.count("}")


def _functions(text: str) -> dict[str, list[str]]:
    """A StableHLO module's functions by name: their body lines."""
    funcs, name, depth = {}, None, 0
    for line in text.splitlines():
        m = re.search(r"func\.func (?:private |public )?@([\w.$-]+)", line)
        if name is None and m:
            name, depth = m.group(1), 0
            funcs[name] = []
        if name is not None:
            funcs[name].append(line)
            depth += _depth(line)
            if depth == 0 and "}" in line:
                name = None
    return funcs


def loops_in_branches(text: str) -> list[str]:
    """Each ``stablehlo.case`` (a ``lax.cond``) whose branches hold a ``while``, directly or in
    a function they call: ``"function: case line"``."""
    funcs = _functions(text)
    calls = {f: set(re.findall(r"call @([\w.$-]+)", "\n".join(b))) for f, b in funcs.items()}
    has_loop = {f: any("stablehlo.while" in line for line in b) for f, b in funcs.items()}
    changed = True
    while changed:  # a function that calls one with a loop has one
        changed = False
        for f in funcs:
            if not has_loop[f] and any(has_loop.get(c) for c in calls[f]):
                has_loop[f] = changed = True
    found = []
    for f, body in funcs.items():
        for i, line in enumerate(body):
            if "stablehlo.case" not in line:
                continue
            depth, j = 0, i
            while True:
                depth += _depth(body[j])
                if depth == 0 and j > i:
                    break
                j += 1
            region = "\n".join(body[i : j + 1])
            if "stablehlo.while" in region or any(
                has_loop.get(c) for c in re.findall(r"call @([\w.$-]+)", region)
            ):
                found.append(f"{f}: {line.strip()[:80]}")
    return found


@pytest.mark.parametrize("rows", [1, 2])
def test_no_branch_of_the_decode_step_loops(runner, rows):
    """No ``lax.cond`` branch of a decode step holds a ``while`` loop. XLA:GPU cannot put a
    while loop in its command buffers (CUDA graphs), nor a conditional whose branch holds one:
    such a conditional copies its predicate to the host, which waits there for every kernel
    before it, and the device then idles while the host launches the rest. A
    ``jnp.searchsorted`` (a while loop by default) in the token tables' branch did that in every
    decode step. Lowered for CUDA, where JAX unrolls the random bits' rounds (a loop on CPU)."""
    cfg = runner.sched_cfg
    shape = StepShape(rows, rows, cfg.max_blocks, cfg.max_ckpt, True)
    traced = _step.trace(*runner.step_args(StepPlan.empty(shape)))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.case") >= 4  # the sampler's branches are there
    assert loops_in_branches(text) == []


@pytest.fixture(scope="module", params=sorted(MAKERS))
def gpu_runner(request, tmp_path_factory):
    """A runner with the GPU column's Pallas kernels (as ``pallas`` picks them on an NVIDIA
    GPU), built on this CPU host: its steps are only lowered for CUDA, never run."""
    import hyjax.ops

    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param), seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hyjax.ops, "accelerator_platform", lambda: "cuda")
        args = EngineArgs(model=path, **dict(SMALL, kernel_backend="pallas"))
        return LLMEngine(args).runner


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_gpu_step_has_no_loop(gpu_runner, decode_only):
    """The step as an NVIDIA GPU runs it (Triton kernels, lowered for CUDA) holds no ``while``
    at all: on a GPU each trip of one costs a host round trip, and inside a ``cond`` one keeps
    the conditional out of the CUDA graph, a host sync in every step (see above)."""
    shape = next(s for s in gpu_runner.sched_cfg.step_shapes() if s.decode_only == decode_only)
    traced = _step.trace(*gpu_runner.step_args(StepPlan.empty(shape)))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text  # the kernels are there
    assert text.count("stablehlo.while") == 0


def _main_arg_uses(text: str) -> tuple[list[tuple[str, str]], dict[str, list[str]]]:
    """The StableHLO module's ``main``: its arguments in order (name, tensor type), and the
    lines that use each."""
    start = text.index("func.func public @main(")
    end = text.find("\n  func.func", start + 1)
    main = text[start : end if end > 0 else len(text)]
    header, body = main.split("\n", 1)
    args = re.findall(r"(%arg\d+): tensor<([^>]*)>", header)
    lines = body.splitlines()
    uses = {a: [ln.strip() for ln in lines if re.search(rf"{a}\b", ln)] for a, _ in args}
    return args, uses


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_gpu_step_results_go_into_buffers_made_first(gpu_runner, decode_only):
    """On NVIDIA the step's results (the packed results, the next step's tokens) are written
    in place into buffers the step's first kernel makes (the one that reads the plan), so
    they are live for the whole step: a buffer made last is where XLA also put dozens of the
    step's small temporaries, and under async scheduling it moves every step, which makes
    XLA re-record every CUDA-graph node that touches it."""
    shape = next(s for s in gpu_runner.sched_cfg.step_shapes() if s.decode_only == decode_only)
    args = gpu_runner.step_args(StepPlan.empty(shape))
    text = _step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    main_args, uses = _main_arg_uses(text)
    (buf, buf_type), _, _ = main_args[-3:]  # _step's plan, previous tokens, token mask
    assert buf_type == f"{args[-3].shape[0]}xi32"
    (first,) = uses[buf]  # the plan is read once: by the kernel that makes the buffers
    made = re.match(r"(%\d+):3 = stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(" + buf, first)
    assert made, first
    start = text.index("func.func public @main(")
    end = text.find("\n  func.func", start + 1)
    main = text[start : end if end > 0 else len(text)]
    returned = re.findall(r"^\s*return (%[^:]*) :", main, re.M)[-1].split(", ")
    results, next_tokens = returned[-2:]  # no MTP drafts: the last two outputs
    for value, index in ((results, 1), (next_tokens, 2)):
        line = re.search(rf"{value} = (.*)", main).group(1)
        assert line.startswith(f"stablehlo.dynamic_update_slice {made.group(1)}#{index},"), line
