"""The runner's kept executables (``serving.worker.executables``): a bucket's executable is
written once and loaded by the next runner of the same engine, never by a different one, and
an entry that cannot be loaded is compiled again (the restart across processes is in
``test_compilation_cache.py``)."""

import os

import pytest

from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
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


def _generate(engine) -> list[int]:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(EngineRequest(list(range(2, 30)), params))
    return engine.run_to_completion()[rid].output_token_ids


def test_kept_executables_load_and_a_torn_one_compiles_again(model_dir, tmp_path, caplog):
    first = _engine(model_dir, tmp_path)
    want = _generate(first)
    files = sorted(os.listdir(tmp_path))
    assert first.runner.executables.compiled == len(files) >= 2  # prefill and decode buckets

    second = _engine(model_dir, tmp_path)
    assert _generate(second) == want
    assert (second.runner.executables.loaded, second.runner.executables.compiled) == (2, 0)

    for name in files:  # torn writes, or another jaxlib's entries
        with open(tmp_path / name, "wb") as f:
            f.write(b"not an executable")
    third = _engine(model_dir, tmp_path)
    assert _generate(third) == want
    assert (third.runner.executables.loaded, third.runner.executables.compiled) == (0, 2)
    assert "compiling it again" in caplog.text
    assert sorted(os.listdir(tmp_path)) == files  # rewritten in place, no temporary left


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
