"""Trains a multi-token prediction (MTP) head on a frozen Qwen3-Next: ``python -m
hyjax.training.mtp --model DIR --out RUN``.

The main model's parameters stay as they are; only ``mtp/...`` (:mod:`hyjax.models.qwen3_next.
mtp`: two norms, ``fc``, one full-attention + MoE decoder layer, the final norm) learns, with
the shared embedding and LM head frozen too. Over a window ``tokens[0 .. T]``::

    hidden = dense_hidden(model, tokens[:T])          the target, post model.norm, no gradient
    row t (0 .. T-2): MTP(tokens[t+1], hidden[t])  -> logits of tokens[t+2]    (cross-entropy)

plus ``router_aux_loss_coef`` x the MTP layer's load-balancing loss. The MTP decoder layer
starts as a copy of the main model's last layer when that layer is full attention (the
embedded model's is), and ``fc`` as ``[small random | identity]``, so the head starts from
the target's own last layer reading its hidden state; random otherwise.

Evaluation on held-out windows: the head's greedy draft at row ``t`` against the target's
greedy token at ``t + 2`` given the true prefix (the acceptance rate of one greedy draft, on
text the target did not write), and against the text's own token. Orbax checkpoints (the
head's parameters and optimizer state) every ``--ckpt-every`` steps; a rerun resumes. The
export is the model directory with ``mtp.*`` added (``num_nextn_predict_layers`` in its
config), written through :mod:`hyjax.saver`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyjax.loader import load_model
from hyjax.models.qwen3_next.mtp import MultiTokenPredictor
from hyjax.training import data
from hyjax.training.dense import dense_forward, dense_hidden, layer_dense, load_balancing_loss
from hyjax.training.train import make_optimizer, resume

log = logging.getLogger("hyjax.train_mtp")

MTP = nnx.PathContains("mtp")


@dataclasses.dataclass(frozen=True)
class MtpTrainConfig:
    model: str  # a Qwen3-Next checkpoint directory (its tokenizer.json encodes the corpus)
    out: str
    seed: int = 0
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 300
    warmup_steps: int = 30
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.001
    ckpt_every: int = 100
    log_every: int = 20
    eval_tokens: int = 32_768
    heldout_percent: int = 3
    max_train_seconds: float | None = None
    stdlib: str | None = None


def mtp_dense(
    model,
    hidden: jax.Array,  # [B, T, D]  the target's post-norm hidden states
    next_ids: jax.Array,  # i32[B, T]  the token after each position
) -> tuple[jax.Array, jax.Array | None]:
    """The MTP pass over dense windows: ``(logits f32[B, T, vocab], router logits)``."""
    bsz, t, d = hidden.shape
    mtp = model.mtp
    e = mtp.pre_fc_norm_embedding(model.embed_tokens[...][next_ids])
    g = mtp.pre_fc_norm_hidden(hidden.astype(e.dtype))
    x = mtp.fc(jnp.concatenate([e, g], axis=-1))  # [B, T, 2D] -> [B, T, D]
    x, router = layer_dense(mtp.layers[0], x)
    h = mtp.norm(x).reshape(bsz * t, d)
    return model.logits(h).reshape(bsz, t, -1), router


def attach_mtp(model, cfg, *, seed: int):
    """Gives ``model`` one fresh MTP layer (initialised as the module docstring says)."""
    cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    mtp = MultiTokenPredictor(cfg, dtype=model.embed_tokens[...].dtype, rngs=nnx.Rngs(seed))
    last = model.layers[cfg.num_hidden_layers - 1]
    if last.is_attention and type(last.mlp) is type(mtp.layers[0].mlp):
        nnx.update(mtp.layers[0], jax.tree.map(jnp.copy, nnx.state(last)))
    d = cfg.hidden_size
    fc = mtp.fc.weight[...]  # [2D, D]: rows e, then rows g
    mtp.fc.weight.set_value(fc.at[d:].set(jnp.eye(d, dtype=fc.dtype)))
    model.mtp = mtp
    return model, cfg


def make_train_step(graphdef, tx, *, top_k: int, aux_coef: float):
    """``step(mtp_params, rest, opt_state, tokens) -> (mtp_params, opt_state, metrics)``."""

    def loss_fn(mtp_params, rest, hidden, tokens):
        model = nnx.merge(graphdef, mtp_params, rest)
        logits, router = mtp_dense(model, hidden[:, :-1], tokens[:, 1:-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 2:]).mean()
        aux = load_balancing_loss([router], top_k) if router is not None else jnp.float32(0)
        return ce + aux_coef * aux, (ce, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(mtp_params, rest, opt_state, tokens):  # tokens: i32[B, T+1]
        hidden, _ = dense_hidden(nnx.merge(graphdef, mtp_params, rest), tokens[:, :-1])
        (loss, (ce, aux)), grads = grad_fn(mtp_params, rest, hidden, tokens)
        updates, opt_state = tx.update(grads, opt_state, mtp_params)
        mtp_params = optax.apply_updates(mtp_params, updates)
        return mtp_params, opt_state, dict(loss=loss, ce=ce, aux=aux)

    return jax.jit(step, donate_argnums=(0, 2))


def make_eval_fn(graphdef):
    """``hits(mtp_params, rest, tokens i32[B, T+1])``: (draft == target greedy, draft == text),
    both ``bool[B, T-1]``."""

    @jax.jit
    def hits(mtp_params, rest, tokens):
        model = nnx.merge(graphdef, mtp_params, rest)
        ids = tokens[:, :-1]
        hidden, _ = dense_hidden(model, ids)
        target, _ = dense_forward(model, ids)  # [B, T, V]: row t predicts token t + 1
        greedy = jnp.argmax(target, axis=-1)  # [B, T]
        logits, _ = mtp_dense(model, hidden[:, :-1], tokens[:, 1:-1])  # row t -> token t + 2
        draft = jnp.argmax(logits, axis=-1)  # [B, T-1]
        return draft == greedy[:, 1:], draft == tokens[:, 2:]

    return hits


def evaluate(hits_fn, mtp_params, rest, windows: np.ndarray, batch: int = 8) -> dict:
    agree, right = [], []
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
        a, r = hits_fn(mtp_params, rest, jnp.asarray(chunk))
        agree.append(np.asarray(a)[: batch - pad])
        right.append(np.asarray(r)[: batch - pad])
    agree, right = np.concatenate(agree), np.concatenate(right)
    return dict(
        draft_vs_target_greedy=round(float(agree.mean()), 4),
        draft_vs_text=round(float(right.mean()), 4),
        predictions=int(agree.size),
    )


def corpus_streams(tc: MtpTrainConfig, tok) -> tuple[np.ndarray, np.ndarray]:
    """The training and held-out token streams of the standard library (the same file split
    as the main model's training), cached under ``out/work``."""
    work = os.path.join(tc.out, "work")
    os.makedirs(work, exist_ok=True)
    paths = {k: os.path.join(work, f"{k}.npy") for k in ("train", "heldout")}
    if not all(os.path.exists(p) for p in paths.values()):
        corpus = data.stdlib_corpus(tc.stdlib, heldout_percent=tc.heldout_percent)
        np.save(paths["train"], data.encode_stream(tok, [t for _, t in corpus.train]))
        np.save(paths["heldout"], data.encode_stream(tok, [t for _, t in corpus.heldout]))
    return np.load(paths["train"]), np.load(paths["heldout"])


def export(model, cfg, src_dir: str, out_dir: str) -> None:
    """``src_dir`` with the head added: its weights in bfloat16 through the saver (the main
    model's bfloat16 weights round-trip exactly), its tokenizer and other files copied."""
    from hyjax.saver import save_hf_checkpoint

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(src_dir, "config.json")) as f:
        hf = json.load(f)
    save_hf_checkpoint(model, dataclasses.replace(cfg, dtype="bfloat16"), out_dir)
    # The source's own config.json, plus the one new field (keeps its keys and their order).
    hf["num_nextn_predict_layers"] = cfg.num_mtp_layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def train(tc: MtpTrainConfig) -> dict:
    import orbax.checkpoint as ocp
    from tokenizers import Tokenizer

    t_start = time.perf_counter()
    tok = Tokenizer.from_file(os.path.join(tc.model, "tokenizer.json"))
    train_stream, heldout_stream = corpus_streams(tc, tok)
    log.info("data: %d training tokens, %d held-out", len(train_stream), len(heldout_stream))
    model, cfg = load_model(tc.model, dtype="float32")
    model, cfg = attach_mtp(model, cfg, seed=tc.seed)
    graphdef, mtp_params, rest = nnx.split(model, MTP, ...)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(mtp_params))
    log.info("MTP head: %d parameters", n_params)

    tx = make_optimizer(tc)  # the main model's: AdamW, warm-up + cosine
    opt_state = tx.init(mtp_params)
    step_fn = make_train_step(
        graphdef, tx, top_k=cfg.num_experts_per_tok, aux_coef=tc.router_aux_loss_coef
    )
    mngr, start, restored = resume(tc.out, {"mtp": mtp_params, "opt_state": opt_state})
    mtp_params, opt_state = restored["mtp"], restored["opt_state"]

    windows = data.eval_windows(heldout_stream, seq_len=tc.seq_len, max_tokens=tc.eval_tokens)
    hits_fn = make_eval_fn(graphdef)
    before = evaluate(hits_fn, mtp_params, rest, windows) if start == 0 else None
    if before:
        log.info("held-out before training: %s", before)

    history, t_loop, done = [], time.perf_counter(), start
    for step in range(start, tc.steps):
        batch = data.train_batch(
            train_stream, seed=tc.seed, step=step, batch=tc.batch_size, seq_len=tc.seq_len
        )
        mtp_params, opt_state, metrics = step_fn(mtp_params, rest, opt_state, jnp.asarray(batch))
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps or done == start + 1:
            m = {k: round(float(v), 4) for k, v in metrics.items()}
            m.update(step=done, seconds=round(time.perf_counter() - t_loop, 1))
            history.append(m)
            log.info("step %d  loss %.4f  ce %.4f  aux %.3f  %.1f s", done, m["loss"], m["ce"],
                     m["aux"], m["seconds"])  # fmt: skip
        stop = bool(tc.max_train_seconds) and time.perf_counter() - t_start > tc.max_train_seconds
        if done % tc.ckpt_every == 0 or done == tc.steps or stop:
            mngr.save(done, args=ocp.args.StandardSave({"mtp": mtp_params, "opt_state": opt_state}))
        if stop:
            log.warning("stopping at step %d: --max-train-seconds reached", done)
            break
    mngr.wait_until_finished()
    train_seconds = time.perf_counter() - t_loop

    after = evaluate(hits_fn, mtp_params, rest, windows)
    log.info("held-out after training: %s", after)
    model = nnx.merge(graphdef, mtp_params, rest)
    model_dir = os.path.join(tc.out, "model")
    export(model, cfg, tc.model, model_dir)
    # The export, loaded back in bfloat16 with its head, evaluated again.
    loaded, _ = load_model(model_dir, dtype="float32", mtp=True)
    g2, p2, r2 = nnx.split(loaded, MTP, ...)
    exported = evaluate(make_eval_fn(g2), p2, r2, windows)
    metrics = dict(
        steps=done,
        tokens_seen=done * tc.batch_size * tc.seq_len,
        train_seconds=round(train_seconds, 1),
        total_seconds=round(time.perf_counter() - t_start, 1),
        device=str(jax.devices()[0].device_kind),
        mtp_parameters=n_params,
        heldout_before=before,
        heldout_after=after,
        heldout_bf16_export=exported,
        eval_windows=int(windows.shape[0]),
        config=dataclasses.asdict(tc),
        history=history,
    )
    with open(os.path.join(tc.out, "mtp_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log.info("exported to %s: %s", model_dir, exported)
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyjax.training.mtp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", required=True, help="the frozen model's checkpoint directory")
    p.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    for f in dataclasses.fields(MtpTrainConfig):
        if f.name in ("model", "out"):
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
        if f.name == "max_train_seconds":
            kind = float
        p.add_argument("--" + f.name.replace("_", "-"), type=kind or str, default=f.default)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("absl", "orbax", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    train(MtpTrainConfig(**vars(ns)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
