"""Do the engine caching tests catch a wrong resumed state? Mutation check, both families.

For each mutation below, a scratch copy of the project gets one small source edit in the
caching path (scheduler, cache manager, step plan, reference kernels), and the engine tests of
both model families run there. A mutation is *caught* in a file when a test of that file
fails; the tests pass on the unmutated copy first (the baseline), or the check stops::

    python -m tests.mutations                  # every mutation, table at the end
    python -m tests.mutations -m zero_state    # some of them (repeat -m)
    python -m tests.mutations --list

The copy holds the working tree's files that git tracks or would track (``git ls-files -co
--exclude-standard``), so uncommitted edits are checked as they stand; ``--head`` copies the
last commit instead. The runs share a persistent JAX compilation cache in the scratch
directory: a mutation outside the kernels compiles nothing new after the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ("tests/serving/test_engine.py", "tests/serving/test_engine_kimi.py")
# Not about caching, and a subprocess that compiles its own buckets: left out of the check.
DESELECT = ("tests/serving/test_engine_kimi.py::test_kimi_generate_cli",)


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (path, text found exactly once, replacement)


MUTATIONS = (
    Mutation(
        "zero_state",
        "every prefix hit resumes from the zero state (src slot 0) instead of its checkpoint",
        (
            (
                "serving/core/scheduler.py",
                "self._add_row(b, req, hit.num_tokens, n, src=hit.ckpt_slot)",
                "self._add_row(b, req, hit.num_tokens, n, src=NULL_ID)",
            ),
        ),
    ),
    Mutation(
        "stale_conv_window",
        "a prefill checkpoint's conv window is one token stale (the window before the last token)",
        (
            (
                "pallas_kernels/conv1d/reference.py",
                "ckpt = _window_after(x, init, query_start_loc, ckpt_seq, "
                "ckpt_offsets.reshape(-1))",
                "ckpt = _window_after(x, init, query_start_loc, ckpt_seq, "
                "ckpt_offsets.reshape(-1) - 1)",
            ),
        ),
    ),
    Mutation(
        "hit_past_ckpt",
        "a hit one 64-token step past its checkpoint: the lookup serves position p with the "
        "state of p - G (64 tokens behind), the KV blocks up to p",
        (
            (
                "serving/core/cache_manager.py",
                "slot = self.state.lookup(hashes[p // bs - 1])",
                "slot = self.state.lookup(hashes[p // bs - 1 - g // bs]) if p > g else None",
            ),
        ),
    ),
    Mutation(
        "ckpt_offset_early",
        "the scheduler places a prefill row's checkpoint one token early (offset p - start - "
        "1: the state after p - 1 tokens is kept as the state after p)",
        (
            (
                "serving/core/scheduler.py",
                "b.ckpts.append((row, p - start, slot))",
                "b.ckpts.append((row, p - start - (n > 1), slot))",
            ),
        ),
    ),
    Mutation(
        "kernel_ckpt_early",
        "the GDN and KDA prefill kernels write the recurrent state of a checkpoint one token "
        "early (the conv window stays right)",
        tuple(
            (
                f"pallas_kernels/{op}/reference.py",
                "write_index(ckpt_slots[s], ok & (ckpt_offsets[s] == n), num_slots)",
                "write_index(ckpt_slots[s], ok & (ckpt_offsets[s] == n + 1), num_slots)",
            )
            for op in ("gdn", "kda")
        ),
    ),
    Mutation(
        "src_dst_swapped",
        "the step plan swaps every row's source and destination state slots",
        (
            (
                "serving/core/scheduler_output.py",
                "plan.src_slot[:n_seqs] = src\n    plan.dst_slot[:n_seqs] = dst",
                "plan.src_slot[:n_seqs] = dst\n    plan.dst_slot[:n_seqs] = src",
            ),
        ),
    ),
    Mutation(
        "same_step_hit",
        "the same-step rule is off: a request may hit a checkpoint that a step not yet run "
        "will write (it reads the slot before the kernel writes it)",
        (
            (
                "serving/core/cache_manager.py",
                "            if pending:\n                return None\n",
                "",
            ),
        ),
    ),
)


def _files(head: bool) -> list[str]:
    args = ["ls-files", "-z"] if head else ["ls-files", "-z", "-co", "--exclude-standard"]
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def make_copy(dest: Path, head: bool) -> None:
    """The project's files in ``dest``: the working tree's, or the last commit's."""
    if head:
        archive = subprocess.run(
            ["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    for rel in _files(head=False):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def apply(copy: Path, mutation: Mutation) -> dict[Path, str]:
    """Applies the edits; returns the original texts to restore. Each found text must occur
    exactly once, so a refactor that moves it fails loudly instead of testing nothing."""
    originals: dict[Path, str] = {}
    for rel, old, new in mutation.edits:
        path = copy / rel
        current = path.read_text()
        originals.setdefault(path, current)
        if current.count(old) != 1:
            raise SystemExit(
                f"{mutation.name}: expected the text once in {rel}, found it "
                f"{current.count(old)} times:\n{old}"
            )
        path.write_text(current.replace(old, new))
    return originals


def run_tests(copy: Path, test_file: str, env: dict, timeout: int) -> tuple[str, str, float]:
    """Runs one test file in ``copy``: ``(verdict, failed tests, seconds)``.

    The verdict is ``pass``, ``FAIL`` (a test failed: the mutation is caught) or ``error``
    (pytest could not run the file, or it timed out).
    """
    cmd = [sys.executable, "-m", "pytest", test_file, "-x", "-q", "-rf"]
    cmd += ["-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    cmd += [arg for d in DESELECT if d.startswith(test_file) for arg in ("--deselect", d)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "error", f"timed out after {timeout} s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    # "FAILED path::test - AssertionError: hit_plus_1" (-rf): the test and the first words of
    # its message (the engine tests' token assertions name the request that differs).
    failed = "; ".join(
        f"{test}: {msg[:60]}" if msg else test
        for test, msg in re.findall(r"^FAILED \S+::(\S+)(?: - (.*))?$", proc.stdout, re.M)
    )
    if proc.returncode == 0:
        return "pass", "", seconds
    if proc.returncode == 1 and failed:
        return "FAIL", failed, seconds
    return "error", (proc.stdout + proc.stderr)[-2000:], seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--mutation", action="append", help="run only these (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--head", action="store_true", help="copy the last commit, not the tree")
    p.add_argument("--keep", action="store_true", help="keep the scratch copy")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per test file run")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:20s} {m.what}")
        return 0
    chosen = [m for m in MUTATIONS if not args.mutation or m.name in args.mutation]
    unknown = set(args.mutation or ()) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutations {sorted(unknown)}; --list shows them")

    scratch = Path(tempfile.mkdtemp(prefix="hyjax-mutations-"))
    copy = scratch / "project"
    copy.mkdir()
    make_copy(copy, args.head)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(copy),
        JAX_COMPILATION_CACHE_DIR=str(scratch / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    print(f"scratch copy: {copy}", flush=True)
    where = subprocess.run(
        [sys.executable, "-c", "import serving; print(serving.__file__)"],
        cwd=copy, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy imports serving from {where}, not from {copy}")
    rows = []
    try:
        for test_file in TEST_FILES:
            verdict, detail, seconds = run_tests(copy, test_file, env, args.timeout)
            cached = len(list((scratch / "jax-cache").glob("*")))
            print(f"baseline {test_file}: {verdict} ({seconds:.0f} s, {cached} cached)", flush=True)
            if verdict != "pass":
                print(detail)
                print("the unmutated copy does not pass: nothing to compare against")
                return 2
        for m in chosen:
            originals = apply(copy, m)
            try:
                row = [m]
                for test_file in TEST_FILES:
                    verdict, detail, seconds = run_tests(copy, test_file, env, args.timeout)
                    print(f"{m.name} {test_file}: {verdict} ({seconds:.0f} s) {detail}", flush=True)
                    row.append((verdict, detail))
                rows.append(row)
            finally:
                for path, text in originals.items():
                    path.write_text(text)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    print()
    print("| mutation | " + " | ".join(Path(f).name for f in TEST_FILES) + " |")
    print("|---|" + "---|" * len(TEST_FILES))
    for m, *results in rows:
        cells = []
        for verdict, detail in results:
            word = {"FAIL": "caught", "pass": "MISSED", "error": "error"}[verdict]
            cells.append(f"{word} ({detail.splitlines()[0][:90]})" if detail else word)
        print(f"| {m.name}: {m.what} | " + " | ".join(cells) + " |")
    missed = [m.name for m, *results in rows if any(v != "FAIL" for v, _ in results)]
    print(f"\nnot caught by every file: {missed or 'none'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
