"""Qwen3-Next's multi-token prediction (MTP) layer, and the drafter the engine calls.

The checkpoint's ``mtp.*`` tensors (Qwen3-Next-80B ships one layer) predict the token after
next. For target position ``t`` (zero-centred RMSNorm ``(1 + w) * normalize(x)`` everywhere)::

    e    = pre_fc_norm_embedding(embed_tokens[token_{t+1}])   the SHARED embedding
    g    = pre_fc_norm_hidden(hidden_t)    hidden_t: the target's last layer AFTER model.norm
    u    = fc(concat[e, g])                [2D] -> [D]; the embedding half comes first
    u    = layers[j](u)                    a full-attention decoder layer of the main model's
                                           kind (gated attention, partial RoPE at position t,
                                           its own paged KV; MoE whenever the model has experts)
    h'_t = norm(u)
    logits of token_{t+2} = lm_head(h'_t)  the SHARED head (the tied embedding when tied)

(vLLM's ``Qwen3NextMultiTokenPredictor`` reads the hidden states the target model returns,
which are post-``model.norm``; SGLang's NEXTN path the same.)

KV layout: the MTP row of target position ``t`` runs at position ``t`` and writes its K/V to
the target's slot of ``t``, so an MTP layer's KV pool is one more attention pool of the
target's geometry (``[NB, bs, Hkv, D]``, :func:`init_mtp_caches`) read through the target's
block tables and slot mapping: no tables of its own.

Drafting ``k`` tokens (:func:`propose`; vLLM's MTP proposer for ``num_speculative_tokens > 1``
feeds the MTP's own output hidden state back)::

    target step rows:  t0   t1  ...  tr          (tr = rows[s]: the row drafts start from)
    pass 1, all rows:  MTP(tok_{t+1}, hidden_t) at position t   -> h'_t ; d1 = argmax logits(h'_tr)
    pass 2, 1 row/seq: MTP(d1, h'_tr)        at position p + 1  -> h'   ; d2 = argmax logits(h')
    pass j:            MTP(d_{j-1}, h' of pass j-1) at position p + j - 1          (p = pos[tr])

Pass ``j`` uses MTP layer ``(j - 1) % num_mtp_layers``, each with its own KV pool. Pass 1
fills the MTP KV of every position the target computed (prefill chunks included, so later
passes attend over the whole context); passes 2..k write positions ``p+1 .. p+k-1``, which the
next step's pass 1 overwrites with the verified tokens. The block tables must therefore cover
positions up to ``p + k - 1`` (the verify step needs those blocks anyway); a position past
the table writes to the null block.

The public API (all jit-traceable; ``num_draft``, ``decode_only``, ``return_logits`` static)::

    Qwen3NextForCausalLM(batch, caches, ops, *, decode_only=False, return_hidden=True)
        -> (caches, logits f32[S, V], hidden [T, D])      hidden: post-model.norm, every row
    init_mtp_caches(cfg, *, num_blocks, block_size, dtype, fill=0.0) -> MtpCaches
    next_token_ids(input_ids i32[T], rows i32[S], num_seqs i32[], last_ids i32[S]) -> i32[T]
    propose(model, batch, hidden [T, D], next_ids i32[T], rows i32[S], caches: MtpCaches, ops,
            *, num_draft: int, decode_only=False, return_logits=False)
        -> (MtpCaches, Draft(tokens i32[S, num_draft], logits f32[S, num_draft, V] | None))
    MultiTokenPredictor.__call__(embed [V, D], hidden [T, D], next_ids i32[T], cache, batch,
            ops, *, layer=0, decode_only=False) -> (cache, h' [T, D])   one pass, post-norm
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.config import FULL_ATTENTION
from hyjax.layers.linear import Linear
from hyjax.layers.norms import RMSNorm
from hyjax.models.hybrid import _ModuleList
from hyjax.models.qwen3_next.config import Qwen3NextConfig
from hyjax.models.qwen3_next.model import DecoderLayer, KVCache

if TYPE_CHECKING:
    from hyjax.models.qwen3_next.model import Qwen3NextForCausalLM
    from hyjax.ops import Ops

MtpCaches = tuple[KVCache, ...]  # one (k, v) pool [NB, bs, Hkv, D] per MTP layer


def mtp_layer_config(cfg: Qwen3NextConfig) -> Qwen3NextConfig:
    """The config an MTP decoder layer is built from, as layer 0 of a one-layer model: full
    attention, and MoE whenever the model has experts (``mlp_only_layers`` and
    ``decoder_sparse_step`` count the main stack's layers, not these)."""
    return dataclasses.replace(
        cfg,
        num_hidden_layers=1,
        layer_types=(FULL_ATTENTION,),
        mlp_only_layers=(),
        decoder_sparse_step=1,
        num_mtp_layers=0,
    )


class MultiTokenPredictor(nnx.Module):
    """The ``mtp.*`` parameters: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``,
    ``layers/{j}`` (a :class:`DecoderLayer`) and ``norm``. The embedding and the LM head are
    the main model's, passed in."""

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(d, **norm)
        self.pre_fc_norm_hidden = RMSNorm(d, **norm)
        self.fc = Linear(2 * d, d, dtype=dtype, rngs=rngs)  # [2D, D]: rows e (D) then g (D)
        layer_cfg = mtp_layer_config(cfg)
        self.layers = _ModuleList(
            [DecoderLayer(layer_cfg, 0, dtype=dtype, rngs=rngs) for _ in range(cfg.num_mtp_layers)]
        )
        self.norm = RMSNorm(d, **norm)

    def __call__(
        self,
        embed: jax.Array,  # [V, D]  the main model's embedding table
        hidden: jax.Array,  # [T, D]  the target's (or the previous pass's) post-norm hidden
        next_ids: jax.Array,  # i32[T]  the token after each row's
        cache: KVCache,  # this layer's pool, [NB, bs, Hkv, D] each
        batch: Batch,
        ops: Ops,
        *,
        layer: int = 0,
        decode_only: bool = False,
    ) -> tuple[KVCache, jax.Array]:
        """One MTP pass over the batch's rows. Returns the pool and ``h' [T, D]`` (post-norm:
        the LM head's input, and the next pass's ``hidden``). Writes K/V at the batch's slots."""
        e = self.pre_fc_norm_embedding(embed[next_ids])  # [T, D]
        g = self.pre_fc_norm_hidden(hidden.astype(e.dtype))  # [T, D]
        x = self.fc(jnp.concatenate([e, g], axis=-1))  # [T, 2D] -> [T, D]
        cache, x = self.layers[layer](x, cache, batch, ops, decode_only=decode_only)
        return cache, self.norm(x)


def init_mtp_caches(
    cfg: Qwen3NextConfig, *, num_blocks: int, block_size: int, dtype: jnp.dtype, fill: float = 0.0
) -> MtpCaches:
    """One KV pool per MTP layer, shaped as the target's attention pools (same block ids).

    Each adds ``hyjax.cache.kv_block_bytes(cfg, ...) / num_attention_layers`` bytes a block.
    """
    token_shapes = cfg.cache_spec.kv_token_shapes
    return tuple(
        tuple(jnp.full((num_blocks, block_size) + s, fill, dtype) for s in token_shapes)
        for _ in range(cfg.num_mtp_layers)
    )


def next_token_ids(
    input_ids: jax.Array,  # i32[T]  the target step's tokens
    rows: jax.Array,  # i32[S]   the row each sequence drafts from
    num_seqs: jax.Array,  # i32[]
    last_ids: jax.Array,  # i32[S]   the token after row ``rows[s]``: sampled (or bonus) token,
    #                                or the next prompt token after a non-final prefill chunk
) -> jax.Array:  # i32[T]
    """The MTP's ``next_ids``: each row's following token in its sequence.

    ::

        input_ids:  | a0 a1 a2 | b0 b1 |        rows = [2, 4], last_ids = [A, B]
        next_ids:   | a1 a2 A  | b1 B  |

    Rows after ``rows[s]`` in a sequence (rejected drafts) keep their shifted neighbour: junk
    the causal mask keeps from ``rows[s]``, overwritten when those positions are verified.
    """
    t, s = input_ids.shape[0], rows.shape[0]
    shifted = jnp.concatenate([input_ids[1:], input_ids[:1]])  # [T]: row i holds token i + 1
    # Padding sequences point nowhere (index T is dropped), so they never overwrite a live row.
    where = jnp.where(jnp.arange(s) < num_seqs, rows, t)
    return shifted.at[where].set(last_ids.astype(input_ids.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    tokens: jax.Array  # i32[S, k]  greedy draft tokens, position p+1 .. p+k of each sequence
    logits: jax.Array | None  # f32[S, k, V] when asked for (probabilistic verification)


def _draft_batch(batch: Batch, rows: jax.Array, tokens: jax.Array, step: int, bs: int) -> Batch:
    """The one-token-per-sequence batch of draft pass ``step + 1``: sequence ``s`` at position
    ``positions[rows[s]] + step`` (row ``s`` of the batch), through the target's block table.
    Padding sequences are padding rows: null block, ``seq_lens`` 0."""
    s, max_blocks = batch.block_tables.shape
    live = jnp.arange(s) < batch.num_seqs
    pos = batch.positions[rows] + step  # i32[S]
    col = pos // bs
    block = jnp.take_along_axis(batch.block_tables, jnp.minimum(col, max_blocks - 1)[:, None], 1)
    block = jnp.where(col < max_blocks, block[:, 0], 0)  # past the table: the null block
    zeros = jnp.zeros_like(batch.src_slot)
    return Batch(
        input_ids=tokens,
        positions=jnp.where(live, pos, 0),
        slot_mapping=jnp.where(live, block * bs + pos % bs, 0),
        query_start_loc=jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), batch.num_seqs),
        seq_lens=jnp.where(live, pos + 1, 0),
        num_seqs=batch.num_seqs,
        block_tables=batch.block_tables,
        src_slot=zeros,
        dst_slot=zeros,
        ckpt_offsets=jnp.zeros_like(batch.ckpt_offsets),
        ckpt_slots=jnp.zeros_like(batch.ckpt_slots),
        logits_indices=jnp.arange(s, dtype=jnp.int32),
    )


def propose(
    model: Qwen3NextForCausalLM,
    batch: Batch,  # the target step's batch (its positions, slots, tables, seq_lens)
    hidden: jax.Array,  # [T, D]  the target's post-norm hidden states (return_hidden=True)
    next_ids: jax.Array,  # i32[T]  :func:`next_token_ids`
    rows: jax.Array,  # i32[S]  the row of each sequence its drafts start from
    caches: MtpCaches,
    ops: Ops,
    *,
    num_draft: int,
    decode_only: bool = False,
    return_logits: bool = False,
) -> tuple[MtpCaches, Draft]:
    """Drafts ``num_draft`` greedy tokens per sequence (the diagram in the module docstring).

    Pass 1 runs every row of ``batch`` (``decode_only`` as the target's step), filling the MTP
    KV of all of them; passes 2.. run one decode row per sequence. Returns the updated pools
    (donate them) and the drafts; padding sequences' drafts are junk.
    """
    if num_draft < 1:
        raise ValueError(f"{num_draft=} must be >= 1")
    mtp = model.mtp
    n_layers = len(mtp.layers)
    embed = model.embed_tokens[...]
    caches = list(caches)
    bs = caches[0][0].shape[1]

    caches[0], h = mtp(embed, hidden, next_ids, caches[0], batch, ops, decode_only=decode_only)
    h = h[rows]  # [S, D]
    tokens, logits = [], []
    for j in range(num_draft):
        if j:  # pass j + 1: one row per sequence at position p + j
            layer = j % n_layers
            step_batch = _draft_batch(batch, rows, tokens[-1], j, bs)
            caches[layer], h = mtp(
                embed, h, tokens[-1], caches[layer], step_batch, ops, layer=layer,
                decode_only=True,
            )  # fmt: skip
        lg = model.logits(h)  # f32[S, V]
        tokens.append(jnp.argmax(lg, axis=-1).astype(jnp.int32))
        if return_logits:
            logits.append(lg)
    draft = Draft(
        tokens=jnp.stack(tokens, axis=1),
        logits=jnp.stack(logits, axis=1) if return_logits else None,
    )
    return tuple(caches), draft
