"""``--load-format dummy``: random weights from a config.json alone, no checkpoint.

A preset's directory (``benchmarks.full_size --write-config``) holds a config.json only; the
engine builds the model with random weights (stacked at once with ``--scan-layers``) and takes
the embedded model's tokenizer, whose vocabulary is smaller than the model's here: the ids past
it get a text of their own (``hyjax.tokenizer.cover_vocab``), so every generated token streams.
Under tensor parallel the build's placement is checked by
``test_full_size_build.py`` (simulated devices).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.full_size import write_config
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.engine_args import EngineArgs
from serving.engine.llm_engine import LLMEngine

SMALL = dict(
    max_num_seqs=2, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=128,
    warmup=False, progress=False, kernel_backend="reference", dtype="float32",
)  # fmt: skip


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    """The tiny Qwen3-Next preset (8 layers: two groups of [GDN x 3, attention]) with a
    vocabulary twice the embedded tokenizer's 4096 ids."""
    out = tmp_path_factory.mktemp("dummy")
    path = write_config(str(out), "tiny-qwen3-next")
    with open(path) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 8192
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(out)


def test_write_config_is_a_model_dir(tmp_path):
    from hyjax.models import load_config

    write_config(str(tmp_path), "qwen3-next-80b", 12)
    cfg = load_config(str(tmp_path))
    assert cfg.num_hidden_layers == 12 and cfg.num_experts == 512


def test_dummy_engine_generates_with_the_embedded_tokenizer(dummy_dir):
    engine = LLMEngine(EngineArgs(model=dummy_dir, load_format="dummy", scan_layers=True, **SMALL))
    assert engine.runner.scan_layers  # built stacked: two groups of four layers
    assert engine.tokenizer is not None and engine.tokenizer.vocab_size == 8192
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True)
    engine.add_request(EngineRequest("def f(x):", params))
    (out,) = engine.run_to_completion().values()
    ids = out.output_token_ids
    assert len(ids) == 12 and max(ids) < 8192
    assert out.text == engine.tokenizer.decode(ids)
    past = [i for i in ids if i >= 4096]
    assert past and all(f" t{i}" in out.text for i in past)  # a text for every id past 4096
    # the embedded vocabulary encodes as before: text in, its ids out
    from hyjax.assets import model_dir
    from hyjax.tokenizer import Tokenizer

    text = "def f(x):\n    return x + 1"
    assert engine.tokenizer.encode(text) == Tokenizer.from_dir(model_dir()).encode(text)


def test_bad_load_format_is_named(tmp_path, capsys):
    from hyjax.loader import load_model
    from serving.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--load-format", "pt"])
    assert "invalid choice: 'pt'" in capsys.readouterr().err
    write_config(str(tmp_path), "tiny-qwen3-next")
    with pytest.raises(ValueError, match="unknown load_format 'pt'; one of auto, dummy"):
        load_model(tmp_path, load_format="pt")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(tmp_path)  # auto: the checkpoint is needed


def test_the_server_front_end_encodes_text_for_dummy_weights(dummy_dir, monkeypatch):
    """hyjax serve --load-format dummy: the HTTP front end takes the engine's tokenizer (the
    embedded one) and accepts text prompts; a real model directory without one accepts ids."""
    from hyjax.tokenizer import load_tokenizer
    from serving.entrypoints import server

    class Started(Exception):
        pass

    class FakeClient:
        def __init__(self, kwargs):
            pass

        def start(self):
            return {}

        def close(self):
            pass

    seen = {}

    def state(*args, tokenizer=None, **kw):
        seen["tokenizer"] = tokenizer
        raise Started

    monkeypatch.setattr(server, "EngineClient", FakeClient)
    monkeypatch.setattr(server, "ServerState", state)
    with pytest.raises(Started):
        server.serve({"model": dummy_dir, "load_format": "dummy"}, port=0)
    assert seen["tokenizer"] is not None and seen["tokenizer"].vocab_size == 8192
    assert load_tokenizer(dummy_dir) is None  # real weights there: token ids only
