"""The runner's kept executables (``serving.worker.executables``): their fingerprint tells one
engine's from another's, and old fingerprints' folders are pruned. Writing, loading and
compiling a torn entry again are checked across fresh processes in
``test_compilation_cache.py`` (in a process that compiled the same module before, XLA:CPU may
hand back an executable it cannot serialize: it is then kept in memory only, with a warning)."""

import os

import pytest

from hyjax.tiny import make_tiny_model
from serving.engine.llm_engine import EngineArgs, LLMEngine

SMALL = dict(
    max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=128,
    warmup=False, progress=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def _engine(model_dir, directory, **kw) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=model_dir, **dict(SMALL, **kw)))
    engine.runner.executables.directory = str(directory)  # as --compilation-cache-dir sets it
    return engine


def test_another_engine_shape_has_other_keys(model_dir, tmp_path):
    """Other pools (a longer max_model_len: more blocks per row) make other executables: the
    fingerprint covers every fixed argument, and the bucket its per-step ones."""
    a = _engine(model_dir, tmp_path).runner
    b = _engine(model_dir, tmp_path, max_model_len=256).runner
    assert a.executables.fingerprint != b.executables.fingerprint
    c = _engine(model_dir, tmp_path).runner
    assert a.executables.fingerprint == c.executables.fingerprint


def test_old_fingerprints_are_pruned(tmp_path):
    """Each source change makes a new fingerprint folder: only the most recent few stay."""
    from serving.worker.executables import StepExecutables

    keep = StepExecutables.keep_fingerprints
    made = []
    for i in range(keep + 3):
        made.append(StepExecutables(f"fingerprint {i}", str(tmp_path)).directory)
        os.utime(made[-1], (i, i))  # used in this order, oldest first
    mine = StepExecutables("fingerprint 0", str(tmp_path)).directory  # the oldest, used again
    left = sorted(os.path.join(tmp_path, d) for d in os.listdir(tmp_path))
    assert left == sorted([mine, *made[-(keep - 1) :]])
