"""Trains the embedded default model: ``python -m hyjax.training.train --out DIR``.

Pipeline (every stage is cached under ``DIR/work`` so a rerun resumes where it stopped):

1. corpus: the running interpreter's standard library, split by file (``data.stdlib_corpus``),
   plus ChatML examples made from its documented functions (training split only);
2. tokenizer: byte-level BPE trained with ``tokenizers`` on the training files;
3. training: AdamW (optax) on the dense forward (``dense.dense_forward``), cross-entropy plus
   ``router_aux_loss_coef`` x the MoE load-balancing loss; orbax checkpoints every
   ``--ckpt-every`` steps; batches depend only on ``(seed, step)``, so resuming from a
   checkpoint continues the same run;
4. evaluation: held-out loss / perplexity / bits per byte against a unigram baseline on the
   same tokenization;
5. export: Hugging Face layout in bfloat16 through :mod:`hyjax.saver`, reloaded through
   :mod:`hyjax.loader` and evaluated again, with ``metrics.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyjax.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from hyjax.tiny import CHATML, SPECIAL_TOKENS
from hyjax.training import data
from hyjax.training.dense import dense_forward, load_balancing_loss

log = logging.getLogger("hyjax.train")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    out: str
    preset: str = "default"  # "default" (the shipped model) | "tiny" (tests, smoke runs)
    seed: int = 0
    vocab_size: int = 4096
    seq_len: int = 1024
    batch_size: int = 64
    steps: int = 3000
    warmup_steps: int = 200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.001  # Qwen3-Next's value
    ckpt_every: int = 500
    log_every: int = 50
    eval_tokens: int = 262_144
    val_tokens: int = 65_536  # held-out tokens after the report windows: picks the export
    eval_every: int = 500
    heldout_percent: int = 3
    max_train_seconds: float | None = None  # safety stop (checkpoints, then evaluates)
    stdlib: str | None = None  # default: this interpreter's


def model_config(preset: str, vocab_size: int) -> Qwen3NextConfig:
    """The shipped architecture: 8 layers, full attention at layers 3 and 7 (interval 4),
    Gated DeltaNet elsewhere, 16 experts (top 2) plus a shared expert in every layer, tied
    embeddings; about 8.6 M parameters, 17 MB in bfloat16."""
    common = dict(
        model_type="qwen3_next",
        vocab_size=vocab_size,
        full_attention_interval=4,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        linear_conv_kernel_dim=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")],
        torch_dtype="float32",
    )
    if preset == "default":
        sizes = dict(
            hidden_size=256,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            intermediate_size=256,
            max_position_embeddings=2048,
        )
    elif preset == "tiny":
        sizes = dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            intermediate_size=32,
            max_position_embeddings=512,
        )
    else:
        raise ValueError(f"unknown preset {preset!r}; use default or tiny")
    return Qwen3NextConfig.from_hf(common | sizes)


def num_params(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- training step


def make_optimizer(tc) -> optax.GradientTransformation:
    """AdamW on a warm-up + cosine schedule (``tc``: a TrainConfig or anything with its
    ``lr``, ``warmup_steps``, ``steps``, ``min_lr_ratio``, ``grad_clip``, ``weight_decay``)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.lr,
        warmup_steps=tc.warmup_steps,
        decay_steps=max(tc.steps, tc.warmup_steps + 1),
        end_value=tc.lr * tc.min_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.95,
            weight_decay=tc.weight_decay,
            # Decay matrices only: norms, gates and biases keep their values.
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )


def resume(out: str, target: dict):
    """The run directory's orbax checkpoint manager, the step to start from, and ``target``
    (a dict of pytrees) restored from the latest checkpoint under ``out/ckpt`` if there is one
    (else as given)."""
    import orbax.checkpoint as ocp  # as the training entry points: imported when run

    mngr = ocp.CheckpointManager(
        os.path.abspath(os.path.join(out, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=2),
    )
    start = mngr.latest_step()
    if start is None:
        return mngr, 0, target
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
    log.info("resumed from the step-%d checkpoint", start)
    return mngr, start, restored


def make_loss_fn(graphdef, top_k: int, aux_coef: float):
    def loss_fn(params, tokens):  # tokens: i32[B, T+1]
        model = nnx.merge(graphdef, params)
        logits, router = dense_forward(model, tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        aux = load_balancing_loss(router, top_k) if router else jnp.float32(0.0)
        return ce + aux_coef * aux, (ce, aux)

    return loss_fn


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(graphdef, tx: optax.GradientTransformation, *, top_k: int, aux_coef: float):
    """``step(params, opt_state, tokens) -> (params, opt_state, metrics)``, jitted, donating."""
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, top_k, aux_coef), has_aux=True)

    def step(params, opt_state, tokens):
        (loss, (ce, aux)), grads = grad_fn(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(loss=loss, ce=ce, aux=aux, gnorm=_global_norm(grads))

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_fn(graphdef):
    """``nll(params, tokens i32[B, T+1]) -> f32[B, T]`` per-token negative log-likelihoods."""

    @jax.jit
    def nll(params, tokens):
        logits, _ = dense_forward(nnx.merge(graphdef, params), tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]
        )

    return nll


def evaluate(nll_fn, params, windows: np.ndarray, batch: int = 16) -> np.ndarray:
    """Per-token NLLs of every window: f32[n, T]."""
    out = []
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        pad = batch - len(chunk)
        if pad:  # one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
        out.append(np.asarray(nll_fn(params, jnp.asarray(chunk)))[: batch - pad])
    return np.concatenate(out)


# ----------------------------------------------------------------------------- stages


def prepare_data(tc: TrainConfig):
    """Tokenizer and token streams, cached under ``out/work``."""
    from tokenizers import Tokenizer

    work = os.path.join(tc.out, "work")
    os.makedirs(work, exist_ok=True)
    tok_path = os.path.join(work, "tokenizer.json")
    paths = {k: os.path.join(work, f"{k}.npy") for k in ("train", "heldout")}
    corpus = None
    if os.path.exists(tok_path):
        tok = Tokenizer.from_file(tok_path)
    else:
        corpus = data.stdlib_corpus(tc.stdlib, heldout_percent=tc.heldout_percent)
        t0 = time.perf_counter()
        tok = data.train_tokenizer([t for _, t in corpus.train], tc.vocab_size)
        tok.save(tok_path)
        log.info("tokenizer: %d tokens in %.1f s", tok.get_vocab_size(), time.perf_counter() - t0)
    if not all(os.path.exists(p) for p in paths.values()):
        corpus = corpus or data.stdlib_corpus(tc.stdlib, heldout_percent=tc.heldout_percent)
        chats = data.chat_examples(corpus.train)
        train_texts = [t for _, t in corpus.train] + chats
        # Interleave chats among files deterministically (the batches sample windows anyway).
        order = np.random.default_rng(tc.seed).permutation(len(train_texts))
        train = data.encode_stream(tok, [train_texts[i] for i in order])
        heldout = data.encode_stream(tok, [t for _, t in corpus.heldout])
        np.save(paths["train"], train)
        np.save(paths["heldout"], heldout)
        info = dict(
            stdlib=corpus.root,
            train_files=len(corpus.train),
            heldout_files=len(corpus.heldout),
            train_bytes=corpus.num_bytes("train"),
            heldout_bytes=corpus.num_bytes("heldout"),
            chat_examples=len(chats),
            train_tokens=int(len(train)),
            heldout_tokens=int(len(heldout)),
        )
        with open(os.path.join(work, "data.json"), "w") as f:
            json.dump(info, f, indent=2)
    with open(os.path.join(work, "data.json")) as f:
        info = json.load(f)
    return tok, np.load(paths["train"]), np.load(paths["heldout"]), info


def export(model, cfg: Qwen3NextConfig, tok, out_dir: str) -> None:
    """Hugging Face layout in bfloat16: config, weights, tokenizer, chat template."""
    from hyjax.saver import save_hf_checkpoint

    save_hf_checkpoint(model, dataclasses.replace(cfg, dtype="bfloat16"), out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": cfg.max_position_embeddings,
            },
            f,
            indent=2,
        )


def train(tc: TrainConfig) -> dict:
    import orbax.checkpoint as ocp

    t_start = time.perf_counter()
    tok, train_stream, heldout_stream, info = prepare_data(tc)
    log.info("data: %s", info)
    cfg = model_config(tc.preset, tok.get_vocab_size())
    model = Qwen3NextForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(tc.seed))
    graphdef, params = nnx.split(model)
    log.info("model: %d parameters", num_params(params))
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    step_fn = make_train_step(
        graphdef, tx, top_k=cfg.num_experts_per_tok, aux_coef=tc.router_aux_loss_coef
    )

    mngr, start, restored = resume(tc.out, {"params": params, "opt_state": opt_state})
    params, opt_state = restored["params"], restored["opt_state"]

    # Held-out windows: the first ``eval_tokens`` report the final numbers; the ones after them
    # (disjoint) pick which step's parameters are exported, in case repeated epochs overfit.
    windows = data.eval_windows(heldout_stream, seq_len=tc.seq_len, max_tokens=tc.eval_tokens)
    rest = heldout_stream[windows.shape[0] * tc.seq_len + 1 :]
    val = None
    if len(rest) > tc.seq_len + 1 and tc.val_tokens:
        val = data.eval_windows(rest, seq_len=tc.seq_len, max_tokens=tc.val_tokens)
    nll_fn = make_eval_fn(graphdef)
    best = dict(step=start, val_loss=math.inf, params=params)

    def select(step_done: int) -> None:
        if val is None:  # nothing to select on: the last step's parameters are exported
            return
        v = float(evaluate(nll_fn, params, val).mean())
        log.info("step %d  val loss %.4f (best %.4f at step %d)", step_done, v,
                 best["val_loss"], best["step"])  # fmt: skip
        history.append(dict(step=step_done, val_loss=round(v, 4)))
        if v < best["val_loss"]:  # params are donated to the next step: keep a copy
            best.update(step=step_done, val_loss=v, params=jax.tree.map(jnp.copy, params))

    tokens_per_step = tc.batch_size * tc.seq_len
    t_loop = time.perf_counter()
    history = []
    step = start
    for step in range(start, tc.steps):
        batch = data.train_batch(
            train_stream, seed=tc.seed, step=step, batch=tc.batch_size, seq_len=tc.seq_len
        )
        params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(batch))
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps or done == start + 1:
            m = {k: float(v) for k, v in metrics.items()}
            el = time.perf_counter() - t_loop
            m.update(step=done, seconds=round(el, 1))
            history.append(m)
            log.info(
                "step %d  loss %.4f  ce %.4f  aux %.3f  gnorm %.2f  %.0f tok/s",
                done, m["loss"], m["ce"], m["aux"], m["gnorm"],
                (done - start) * tokens_per_step / el,
            )  # fmt: skip
        if done % tc.eval_every == 0 or done == tc.steps:
            select(done)
        if done % tc.ckpt_every == 0 or done == tc.steps:
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        if tc.max_train_seconds and time.perf_counter() - t_start > tc.max_train_seconds:
            log.warning("stopping at step %d: --max-train-seconds reached", done)
            select(done)
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            break
    else:
        done = max(start, tc.steps)
    mngr.wait_until_finished()
    train_seconds = time.perf_counter() - t_loop

    if val is None or best["val_loss"] == math.inf:
        best.update(step=done, params=params)
    params = best["params"]
    log.info("exporting the parameters of step %d", best["step"])

    # Evaluation: same windows for the model, the exported model and the unigram baseline.
    targets = windows[:, 1:]
    byte_len = data.token_byte_lengths(tok)
    n_bytes = int(byte_len[targets].sum())
    nll = evaluate(nll_fn, params, windows)
    uni = data.unigram_nll(train_stream, targets, tok.get_vocab_size())

    def summary(mean_nll: float) -> dict:
        return dict(
            loss=round(mean_nll, 4),
            perplexity=round(math.exp(mean_nll), 2),
            bits_per_byte=round(mean_nll * targets.size / n_bytes / math.log(2), 4),
        )

    model = nnx.merge(graphdef, params)
    model_dir = os.path.join(tc.out, "model")
    export(model, cfg, tok, model_dir)
    from hyjax.loader import load_model

    loaded, _ = load_model(model_dir)
    g2, p2 = nnx.split(loaded)
    nll_bf16 = evaluate(make_eval_fn(g2), p2, windows)

    metrics = dict(
        steps=done,
        exported_step=best["step"],
        val_loss=None if val is None else round(best["val_loss"], 4),
        tokens_seen=done * tokens_per_step,
        train_seconds=round(train_seconds, 1),
        total_seconds=round(time.perf_counter() - t_start, 1),
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        parameters=num_params(params),
        safetensors_bytes=os.path.getsize(os.path.join(model_dir, "model.safetensors")),
        eval_windows=int(windows.shape[0]),
        eval_tokens=int(targets.size),
        eval_bytes=n_bytes,
        heldout_f32=summary(float(nll.mean())),
        heldout_bf16_export=summary(float(nll_bf16.mean())),
        heldout_unigram=summary(uni),
        data=info,
        config=dataclasses.asdict(tc),
        history=history,
    )
    with open(os.path.join(tc.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    for k in ("heldout_f32", "heldout_bf16_export", "heldout_unigram"):
        log.info("%s: %s", k, metrics[k])
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyjax.training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "out":
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
        if f.name in ("max_train_seconds",):
            kind = float
        p.add_argument("--" + f.name.replace("_", "-"), type=kind or str, default=f.default)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("absl", "orbax", "jax"):  # orbax logs every save at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    train(TrainConfig(**vars(ns)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
