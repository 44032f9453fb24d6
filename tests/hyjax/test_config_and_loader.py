"""Config parsing and checkpoint loading, including every loader error path."""

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from configs import qwen3_next_80b_a3b, qwen3_next_tiny
from hyjax.loader import CheckpointError, load_model
from hyjax.models import config_from_hf, load_config
from hyjax.safetensors_io import SafetensorsFile, save_file
from hyjax.testing import save_tiny_qwen3_next


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_qwen3_next(path, seed=1)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _flat_params(model):
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_80b_preset_layout():
    cfg = qwen3_next_80b_a3b()
    assert cfg.attention_layers == tuple(range(3, 48, 4))
    assert len(cfg.linear_layers) == 36
    assert cfg.conv_dim == 8192 and cfg.rotary_dim == 64
    assert config_from_hf(cfg.to_hf()) == cfg


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'.*qwen3_next"):
        config_from_hf({"model_type": "llama"})


def test_config_reads_transformers_rope_parameters(tiny):
    cfg = load_config(tiny)
    assert cfg.rope_theta == 10000.0 and cfg.partial_rotary_factor == 0.25
    assert cfg == qwen3_next_tiny()


def test_sharded_equals_single(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, _ = load_model(tiny)
    b, _ = load_model(sharded)
    pa, pb = _flat_params(a), _flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


def test_bf16_checkpoint_dtypes(tmp_path):
    save_tiny_qwen3_next(tmp_path, seed=2, dtype="bfloat16")
    assert load_config(tmp_path).dtype == "bfloat16"
    model, _ = load_model(tmp_path)  # auto: the checkpoint's own dtype
    params = _flat_params(model)
    assert params[("embed_tokens",)].dtype == ml_dtypes.bfloat16
    assert params[("layers", 0, "linear_attn", "A_log")].dtype == np.float32
    f32, _ = load_model(tmp_path, dtype="float32")
    emb = _flat_params(f32)[("embed_tokens",)]
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, params[("embed_tokens",)].astype(np.float32))


def test_expert_and_deinterleave_layout(tiny):
    """Per-expert tensors stack to [E, in, out]; linear weights are transposed."""
    model, cfg = load_model(tiny)
    f = SafetensorsFile(tiny / "model.safetensors")
    p = _flat_params(model)
    w = f.get("model.layers.0.mlp.experts.5.down_proj.weight")  # [D, F]
    np.testing.assert_array_equal(p[("layers", 0, "mlp", "experts_down")][5], w.T)
    conv = f.get("model.layers.0.linear_attn.conv1d.weight")  # [C, 1, K]
    np.testing.assert_array_equal(p[("layers", 0, "linear_attn", "conv1d")], conv[:, 0])


def test_missing_tensor(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_norm"):
        load_model(path)


def test_missing_expert(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.3.mlp.experts.7.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.7\.up_proj"):
        load_model(path)


def test_unexpected_tensor(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.bogus.weight": np.zeros(3, np.float32)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model.layers.0.bogus.weight'.*model.safetensors"
    ):
        load_model(path)


def test_mtp_tensors_are_ignored(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, lambda t: t.update({"mtp.fc.weight": np.zeros((2, 2), np.float32)}))
    load_model(path)


def test_shape_mismatch(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    name = "model.layers.0.linear_attn.in_proj_ba.weight"
    _rewrite(path, lambda t: t.update({name: np.zeros((5, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"in_proj_ba.weight.*\(5, 32\).*expected \(12, 32\)"):
        load_model(path)


def test_index_points_to_missing_tensor(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    f = SafetensorsFile(path / "model.safetensors")
    weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map["model.layers.9.extra"] = "model.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9.extra'"):
        load_model(path)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen3_next_tiny().to_hf()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(tmp_path)


def test_bad_dtype_flag(tiny):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(tiny, dtype="int8")


def test_remote_code_is_not_run(tiny, tmp_path):
    """An auto_map in config.json is ignored: the checkpoint's Python files never run."""
    path = _copy(tiny, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    model, _ = load_model(path)
    assert model is not None and jnp.dtype(model.dtype) == jnp.float32
