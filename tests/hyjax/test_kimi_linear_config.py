"""Kimi-Linear config parsing, cache sizes, and checkpoint names (both dense-layer spellings)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import PRESETS, kimi_linear_48b_a3b, kimi_linear_tiny
from hyjax.cache import cache_spec, init_caches, kv_block_bytes, state_slot_bytes
from hyjax.loader import CheckpointError, load_model
from hyjax.models import config_from_hf, load_config
from hyjax.models.kimi_linear import KimiLinearConfig
from hyjax.safetensors_io import SafetensorsFile, save_file
from hyjax.saver import save_hf_checkpoint
from hyjax.testing import hf_logits, save_tiny_kimi_linear


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_tiny")
    save_tiny_kimi_linear(path, seed=1)
    return path


def _flat_params(model):
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _rewrite(path, edit):
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_48b_preset_layout_and_cache_sizes():
    cfg = kimi_linear_48b_a3b()
    assert PRESETS["kimi-linear-48b-a3b"]() == cfg
    assert cfg.attention_layers == (3, 7, 11, 15, 19, 23, 26)  # 1-indexed in the checkpoint
    assert len(cfg.linear_layers) == 20
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192 and cfg.conv_dim == 3 * 4096
    assert cfg.kv_a_layernorm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    assert config_from_hf(cfg.to_hf()) == cfg
    # MLA caches 576 values per token and layer, not 2 x 32 heads x 192.
    assert kv_block_bytes(cfg, 16, jnp.bfloat16) == 7 * 576 * 2 * 16
    slot = 20 * ((4 - 1) * 3 * 4096 * 2 + 32 * 128 * 128 * 4)
    assert state_slot_bytes(cfg, jnp.bfloat16) == slot


def test_tiny_preset_matches_what_transformers_saved(tiny):
    cfg = load_config(tiny)
    assert isinstance(cfg, KimiLinearConfig)
    assert cfg == kimi_linear_tiny()
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.num_expert_group == 2 and cfg.topk_group == 1


def test_to_hf_reads_back_in_transformers():
    from transformers import KimiLinearConfig as HFConfig

    cfg = kimi_linear_tiny()
    hf = HFConfig(**cfg.to_hf())
    assert tuple(hf.layer_types) == cfg.layer_types
    assert tuple(hf.mlp_layer_types) == cfg.mlp_layer_types
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (8, 2)
    assert (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim) == (2, 16, 4)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (dict(num_experts_per_token=9), "num_experts_per_tok=9 must be at most"),
        (dict(mla_use_nope=False), "only NoPE MLA"),
        (dict(num_expert_group=3), "must be divisible by self.num_expert_group=3"),
        (
            dict(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3]}),
            r"names no kind for layers \[4\]",
        ),
    ],
    ids=["top_k", "rope", "groups", "layer_lists"],
)
def test_bad_configs_are_named(edit, message):
    d = kimi_linear_tiny().to_hf()
    d.pop("layer_types")
    d.update(edit)
    with pytest.raises(ValueError, match=message):
        config_from_hf(d)


def test_caches_hold_latents_and_three_conv_windows():
    cfg = kimi_linear_tiny()
    spec = cache_spec(cfg)
    assert spec.kv_token_shapes == ((16 + 8,),)
    caches = init_caches(cfg, num_blocks=5, block_size=16, num_slots=3, dtype=jnp.float32)
    assert [tuple(a.shape for a in layer) for layer in caches.kv] == [((5, 16, 24),)] * 2
    assert caches.conv[0].shape == (3, 3, 3 * 32) and caches.ssm[0].shape == (3, 2, 16, 16)


def test_dense_layer_loads_under_either_name(tiny, tmp_path):
    """transformers saves layer 0's dense MLP as block_sparse_moe.*; the checkpoint has mlp.*."""
    f = SafetensorsFile(tiny / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in f.keys()
    path = tmp_path / "renamed"
    shutil.copytree(tiny, path)

    def rename(t):
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[f"model.layers.0.mlp.{n}.weight"] = t.pop(
                f"model.layers.0.block_sparse_moe.{n}.weight"
            )

    _rewrite(path, rename)
    a, b = _flat_params(load_model(tiny)[0]), _flat_params(load_model(path)[0])
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    w = f.get("model.layers.0.block_sparse_moe.down_proj.weight")
    np.testing.assert_array_equal(a[("layers", 0, "mlp", "down_proj", "weight")], w.T)
    w1 = f.get("model.layers.1.block_sparse_moe.experts.5.w1.weight")  # gate of expert 5
    np.testing.assert_array_equal(a[("layers", 1, "mlp", "experts_gate")][5], w1.T)
    np.testing.assert_array_equal(
        a[("layers", 0, "self_attn", "A_log")], f.get("model.layers.0.self_attn.A_log").reshape(-1)
    )


def test_missing_expert_and_conv_are_named(tiny, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(tiny, path)
    _rewrite(path, lambda t: t.pop("model.layers.2.self_attn.k_conv1d.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.self_attn.k_conv1d"):
        load_model(path)
    shutil.rmtree(path)
    shutil.copytree(tiny, path)
    _rewrite(path, lambda t: t.pop("model.layers.3.block_sparse_moe.experts.7.w3.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.7\.w3"):
        load_model(path)


def test_saved_checkpoint_loads_in_transformers(tiny, tmp_path):
    """hyjax's saver writes the original names: transformers reads them to the same logits."""
    model, cfg = load_model(tiny)
    out = tmp_path / "resaved"
    save_hf_checkpoint(model, cfg, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_linear"
    assert (
        "model.layers.0.mlp.gate_proj.weight" in SafetensorsFile(out / "model.safetensors").keys()
    )
    tokens = [5, 9, 17, 3, 88, 41]
    np.testing.assert_allclose(hf_logits(out, tokens), hf_logits(tiny, tokens), rtol=0, atol=1e-6)
    again = _flat_params(load_model(out)[0])
    for k, v in _flat_params(model).items():
        np.testing.assert_array_equal(again[k], v, err_msg=str(k))


def test_q_lora_variant_matches_transformers(tmp_path):
    """``q_lora_rank`` set (q_a_proj -> q_a_layernorm -> q_b_proj), one prefill step."""
    from hyjax.cache import init_caches
    from hyjax.ops import get_ops
    from hyjax.testing import SeqChunk, make_batch

    save_tiny_kimi_linear(tmp_path, seed=3, q_lora_rank=8, num_hidden_layers=2,
                          linear_attn_config={"full_attn_layers": [2], "kda_layers": [1],
                                              "num_heads": 2, "head_dim": 16,
                                              "short_conv_kernel_size": 4})  # fmt: skip
    tokens = [7, 3, 99, 14, 56, 2, 81, 33, 9, 120]
    model, cfg = load_model(tmp_path)
    assert cfg.q_lora_rank == 8
    caches = init_caches(cfg, num_blocks=4, block_size=16, num_slots=2, dtype=jnp.float32)
    batch, (idx,) = make_batch(
        [SeqChunk(tokens, 0, [1], dst_slot=1, all_logits=True)],
        block_size=16, num_tokens=16, num_seqs=16, max_blocks=2,
    )  # fmt: skip
    graphdef, state = nnx.split(model)
    ops = get_ops("reference")
    _, logits = jax.jit(lambda st, b, c: nnx.merge(graphdef, st)(b, c, ops))(state, batch, caches)
    got, want = np.asarray(logits)[idx], hf_logits(tmp_path, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
