"""Qwen3-Next's multi-token prediction layer: loading ``mtp.*`` and the drafter.

transformers ignores ``mtp.*``, so there is no Hugging Face oracle for the MTP forward: the
oracle here is a float64 numpy transcription of the published structure (vLLM's
``qwen3_next_mtp.py``), written apart from hyjax's layers, fed with transformers' own
post-norm hidden states. The checkpoint is a tiny one transformers saved, with random ``mtp.*``
tensors added to its safetensors file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyjax.cache import init_caches
from hyjax.loader import CheckpointError, load_model
from hyjax.models.qwen3_next.mtp import init_mtp_caches, next_token_ids, propose
from hyjax.ops import get_ops
from hyjax.safetensors_io import SafetensorsFile, save_file
from hyjax.testing import SeqChunk, make_batch, save_tiny_qwen3_next

BS = 16
RTOL = 1e-4  # max abs error / max abs value (f32 against f64)


# ----------------------------------------------------------------------------- checkpoint


def mtp_tensors(hf: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random ``mtp.*`` tensors of the config, in the checkpoint's names and [out, in] layout;
    norm weights away from 0 (a zero ``w`` hides a ``w`` vs ``1 + w`` mistake)."""
    d, hq, hkv, hd = (
        hf["hidden_size"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["head_dim"],
    )
    e, f, fs = hf["num_experts"], hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]

    def w(*shape, s=0.2):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    t = {"mtp.fc.weight": w(d, 2 * d)}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{n}.weight"] = w(d, s=0.5)
    p = "mtp.layers.0."
    t[p + "input_layernorm.weight"] = w(d, s=0.5)
    t[p + "post_attention_layernorm.weight"] = w(d, s=0.5)
    t[p + "self_attn.q_proj.weight"] = w(2 * hq * hd, d)
    t[p + "self_attn.k_proj.weight"] = w(hkv * hd, d)
    t[p + "self_attn.v_proj.weight"] = w(hkv * hd, d)
    t[p + "self_attn.o_proj.weight"] = w(d, hq * hd)
    t[p + "self_attn.q_norm.weight"] = w(hd, s=0.5)
    t[p + "self_attn.k_norm.weight"] = w(hd, s=0.5)
    t[p + "mlp.gate.weight"] = w(e, d, s=1.0)
    t[p + "mlp.shared_expert_gate.weight"] = w(1, d)
    t[p + "mlp.shared_expert.gate_proj.weight"] = w(fs, d)
    t[p + "mlp.shared_expert.up_proj.weight"] = w(fs, d)
    t[p + "mlp.shared_expert.down_proj.weight"] = w(d, fs)
    for x in range(e):
        t[p + f"mlp.experts.{x}.gate_proj.weight"] = w(f, d)
        t[p + f"mlp.experts.{x}.up_proj.weight"] = w(f, d)
        t[p + f"mlp.experts.{x}.down_proj.weight"] = w(d, f)
    return t


def read_all(path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path / "model.safetensors")
    out = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    return out


def hf_hidden(path, token_ids) -> np.ndarray:
    """transformers' final hidden states (after ``model.norm``) of one sequence, float64."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model.model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.last_hidden_state[0].numpy()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    hf = save_tiny_qwen3_next(path, seed=0)
    rng = np.random.default_rng(0)
    seqs = {"a": rng.integers(3, 128, 43).tolist(), "b": rng.integers(3, 128, 33).tolist()}
    hidden = {k: hf_hidden(path, s) for k, s in seqs.items()}  # before mtp.* is in the file
    tensors = read_all(path)
    mtp = mtp_tensors(hf, rng)
    save_file(tensors | mtp, path / "model.safetensors", metadata={"format": "pt"})
    weights = {k: v.astype(np.float64) for k, v in (tensors | mtp).items()}
    return dict(path=path, hf=hf, seqs=seqs, hidden=hidden, w=weights)


# ----------------------------------------------------------------------------- the oracle


def _rms(x, w, eps=1e-6):  # zero-centred: (1 + w)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope(x, pos, rot, theta=10000.0):  # x [T, H, hd]: rotate_half on the first ``rot`` dims
    inv = theta ** (-np.arange(0, rot, 2) / rot)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    xr = x[..., :rot]
    half = np.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return np.concatenate([xr * cos + half * sin, x[..., rot:]], -1)


def ref_mtp(w, hf, next_ids, hidden, *, concat_order="eh", skip_norm=None):
    """The MTP layer over one sequence from position 0: ``(h' [n, D], logits [n, V])``.

    ``concat_order`` / ``skip_norm`` make deliberately wrong oracles (the test checks that
    they disagree with hyjax, so the comparison can tell those mistakes apart)."""
    n = len(next_ids)
    hq, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    p = "mtp.layers.0."

    def norm(name, x):
        return x if skip_norm == name else _rms(x, w[name])

    e = norm("mtp.pre_fc_norm_embedding.weight", w["model.embed_tokens.weight"][next_ids])
    g = norm("mtp.pre_fc_norm_hidden.weight", hidden)
    x = np.concatenate([e, g] if concat_order == "eh" else [g, e], -1) @ w["mtp.fc.weight"].T

    a = _rms(x, w[p + "input_layernorm.weight"])
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(n, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, hq * hd)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, hd)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, hd)
    pos = np.arange(n, dtype=np.float64)
    prf = hf.get("partial_rotary_factor") or hf["rope_parameters"]["partial_rotary_factor"]
    rot = int(hd * prf)
    q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"]), pos, rot)
    k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"]), pos, rot)
    rep = hq // hkv
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("thd,uhd->htu", q, k) * hd**-0.5
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("htu,uhd->thd", s / s.sum(-1, keepdims=True), v).reshape(n, hq * hd)
    x = x + (o * (1.0 / (1.0 + np.exp(-gate)))) @ w[p + "self_attn.o_proj.weight"].T

    b = _rms(x, w[p + "post_attention_layernorm.weight"])
    logits = b @ w[p + "mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, : hf["num_experts_per_tok"]]
    moe = np.zeros_like(x)
    for t in range(n):
        wt = probs[t, top[t]] / probs[t, top[t]].sum()
        for j, ex in enumerate(top[t]):
            ep = p + f"mlp.experts.{ex}."
            y = _silu(b[t] @ w[ep + "gate_proj.weight"].T) * (b[t] @ w[ep + "up_proj.weight"].T)
            moe[t] += wt[j] * (y @ w[ep + "down_proj.weight"].T)
    sp = p + "mlp.shared_expert."
    y = _silu(b @ w[sp + "gate_proj.weight"].T) * (b @ w[sp + "up_proj.weight"].T)
    gate_s = 1.0 / (1.0 + np.exp(-(b @ w[p + "mlp.shared_expert_gate.weight"].T)))
    x = x + moe + gate_s * (y @ w[sp + "down_proj.weight"].T)

    h = norm("mtp.norm.weight", x)
    return h, h @ w["lm_head.weight"].T


def ref_drafts(w, hf, tokens, last, hidden, k, **wrong):
    """Greedy drafts after ``tokens + [last]``: ``(tokens [k], logits [k, V])``."""
    next_ids = list(tokens[1:]) + [last]
    hid = hidden
    out_tokens, out_logits = [], []
    for _ in range(k):
        h, logits = ref_mtp(w, hf, np.asarray(next_ids), hid, **wrong)
        out_logits.append(logits[-1])
        out_tokens.append(int(np.argmax(logits[-1])))
        next_ids.append(out_tokens[-1])  # the next pass: (draft, h' of the last row)
        hid = np.concatenate([hid, h[-1:]])
    return np.asarray(out_tokens), np.stack(out_logits)


def close(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# ----------------------------------------------------------------------------- hyjax side


class Drafter:
    def __init__(self, path):
        model, self.cfg = load_model(path, mtp=True)
        graphdef, self.state = nnx.split(model)
        ops = get_ops("reference")

        @functools.partial(jax.jit, static_argnames="num_draft")
        def step(state, batch, caches, mtp_caches, rows, last_ids, num_draft):
            model = nnx.merge(graphdef, state)
            caches, _, hidden = model(batch, caches, ops, return_hidden=True)
            next_ids = next_token_ids(batch.input_ids, rows, batch.num_seqs, last_ids)
            mtp_caches, draft = propose(
                model, batch, hidden, next_ids, rows, mtp_caches, ops,
                num_draft=num_draft, return_logits=True,
            )  # fmt: skip
            return caches, mtp_caches, hidden, draft

        @jax.jit
        def all_rows(state, batch, caches, mtp_caches, next_ids):
            model = nnx.merge(graphdef, state)
            caches, _, hidden = model(batch, caches, ops, return_hidden=True)
            emb = model.embed_tokens[...]
            _, h = model.mtp(emb, hidden, next_ids, mtp_caches[0], batch, ops)
            return hidden, model.logits(h)

        self.step, self.all_rows = step, all_rows

    def fresh(self):
        kw = dict(num_blocks=24, block_size=BS, dtype=jnp.float32, fill=np.nan)
        return (
            init_caches(self.cfg, num_slots=6, **kw),
            init_mtp_caches(self.cfg, **kw),
        )


@pytest.fixture(scope="module")
def drafter(ckpt):
    return Drafter(ckpt["path"])


# ----------------------------------------------------------------------------- tests


def test_loader_skips_mtp_unless_asked(ckpt):
    model, cfg = load_model(ckpt["path"])
    assert cfg.num_mtp_layers == 0 and not hasattr(model, "mtp")
    model, cfg = load_model(ckpt["path"], mtp=True)
    assert cfg.num_mtp_layers == 1  # config.json names none: counted in the checkpoint
    params = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model.mtp))}
    w = ckpt["w"]
    np.testing.assert_array_equal(params[("fc", "weight")], w["mtp.fc.weight"].T)
    np.testing.assert_array_equal(params[("norm", "weight")], w["mtp.norm.weight"])
    got = params[("layers", 0, "mlp", "experts_down")][3]
    np.testing.assert_array_equal(got, w["mtp.layers.0.mlp.experts.3.down_proj.weight"].T)


def test_loader_mtp_errors_and_fused_experts(ckpt, tmp_path):
    import shutil

    path = tmp_path / "fused"
    shutil.copytree(ckpt["path"], path)
    t = read_all(path)
    e, p = ckpt["hf"]["num_experts"], "mtp.layers.0.mlp.experts."
    gate = np.stack([t.pop(f"{p}{x}.gate_proj.weight") for x in range(e)])
    up = np.stack([t.pop(f"{p}{x}.up_proj.weight") for x in range(e)])
    t[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2F, D]
    t[p + "down_proj"] = np.stack([t.pop(f"{p}{x}.down_proj.weight") for x in range(e)])
    save_file(t, path / "model.safetensors")
    model, _ = load_model(path, mtp=True)
    np.testing.assert_array_equal(np.asarray(model.mtp.layers[0].mlp.experts_up[...][5]), up[5].T)

    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no mtp.layers"):
        load_model(path, mtp=True)


def test_hidden_and_mtp_logits_match_reference(ckpt, drafter):
    """Every row of one prefill: the target's post-norm hidden states against transformers',
    the MTP logits against the oracle; and the oracle's deliberate mistakes are told apart."""
    tokens, hf, w = ckpt["seqs"]["a"], ckpt["hf"], ckpt["w"]
    n = 40
    batch, _ = make_batch([SeqChunk(tokens[:n], 0, [1, 2, 3])], block_size=BS, num_tokens=48,
                          num_seqs=2, max_blocks=4)  # fmt: skip
    next_ids = np.zeros(48, np.int32)
    next_ids[:n] = tokens[1 : n + 1]
    caches, mtp_caches = drafter.fresh()
    hidden, logits = drafter.all_rows(drafter.state, batch, caches, mtp_caches, next_ids)
    want_hidden = ckpt["hidden"]["a"][:n]
    assert close(np.asarray(hidden)[:n], want_hidden) < RTOL

    _, want = ref_mtp(w, hf, np.asarray(tokens[1 : n + 1]), want_hidden)
    got = np.asarray(logits)[:n]
    assert not np.isnan(got).any()
    assert close(got, want) < RTOL
    for wrong in (
        dict(concat_order="he"),
        dict(skip_norm="mtp.pre_fc_norm_hidden.weight"),
        dict(skip_norm="mtp.pre_fc_norm_embedding.weight"),
        dict(skip_norm="mtp.norm.weight"),
    ):
        _, bad = ref_mtp(w, hf, np.asarray(tokens[1 : n + 1]), want_hidden, **wrong)
        assert close(got, bad) > 1e-2, wrong


def test_next_token_ids():
    ids = jnp.asarray([10, 11, 12, 20, 21, 0, 0], jnp.int32)
    rows = jnp.asarray([2, 4, 0], jnp.int32)  # the padding sequence points at row 0
    got = next_token_ids(ids, rows, jnp.int32(2), jnp.asarray([13, 22, 99], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), [11, 12, 13, 21, 22, 0, 10])


@pytest.mark.parametrize("num_draft", [1, 3])
def test_propose_after_chunked_prefill_ragged(ckpt, drafter, num_draft):
    """Sequence a prefills in two chunks (the second beside all of b, plus a padding sequence);
    the drafts of both after the second step against the oracle's greedy drafts."""
    a, b = ckpt["seqs"]["a"], ckpt["seqs"]["b"]
    na, nb = 40, 30
    blocks_a, blocks_b = [1, 2, 3], [4, 5, 6]
    caches, mtp_caches = drafter.fresh()
    kw = dict(block_size=BS, num_tokens=48, num_seqs=3, max_blocks=4)
    # Step 1: a[:24]; its last row's next token is the next prompt token.
    batch, _ = make_batch([SeqChunk(a[:24], 0, blocks_a, dst_slot=1)], **kw)
    rows = jnp.asarray([23, 0, 0], jnp.int32)
    last = jnp.asarray([a[24], 0, 0], jnp.int32)
    caches, mtp_caches, _, _ = drafter.step(drafter.state, batch, caches, mtp_caches, rows, last,
                                            num_draft=1)  # fmt: skip
    # Step 2: a[24:40] and b[:30]; "sampled" tokens a[40], b[30].
    step_rows = [
        SeqChunk(a[24:na], 24, blocks_a, src_slot=1, dst_slot=1),
        SeqChunk(b[:nb], 0, blocks_b, dst_slot=2),
    ]
    batch, _ = make_batch(step_rows, **kw)
    rows = jnp.asarray([na - 24 - 1, na - 24 + nb - 1, 0], jnp.int32)
    last = jnp.asarray([a[na], b[nb], 0], jnp.int32)
    _, _, _, draft = drafter.step(drafter.state, batch, caches, mtp_caches, rows, last,
                                  num_draft=num_draft)  # fmt: skip
    tokens, logits = np.asarray(draft.tokens), np.asarray(draft.logits)
    assert tokens.shape == (3, num_draft) and logits.shape[:2] == (3, num_draft)
    for s, (seq, n) in enumerate(((a, na), (b, nb))):
        key = "a" if s == 0 else "b"
        want_t, want_l = ref_drafts(ckpt["w"], ckpt["hf"], seq[:n], seq[n],
                                    ckpt["hidden"][key][:n], num_draft)  # fmt: skip
        assert not np.isnan(logits[s]).any()
        assert close(logits[s], want_l) < RTOL
        np.testing.assert_array_equal(tokens[s], want_t)
