"""The decoder stack that Qwen3-Next and Kimi-Linear share, on the serving interface.

Both families are the same pre-norm residual stack over one flat ragged batch; they differ
only in what fills it (which mixers, which MLP, zero-centred or plain RMSNorm), so that is all
a model file says. Layer ``i``::

    h = h + mixer(input_layernorm(h))         linear attention or full attention, by layer type
    h = h + mlp(post_attention_layernorm(h))  a mixture of experts or a dense MLP

and around the layers: embedding, the final norm of the rows the batch wants logits for, and
the LM head (or the tied embedding). Each linear-attention layer owns one entry of the state
pools (``caches.conv``, ``caches.ssm``), each full-attention layer one entry of the paged pools
(``caches.kv``), both in layer order.

Parameter paths (``embed_tokens``, ``layers/{i}/...``, ``norm``, ``lm_head``) are what the
loader, the saver and the sharding rules match on: the attribute names here are that contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.cache import Caches
from hyjax.config import FULL_ATTENTION, ModelConfig
from hyjax.layers.linear import Linear
from hyjax.layers.norms import RMSNorm

if TYPE_CHECKING:
    from hyjax.ops import Ops

# flax >= 0.12 wants lists of modules wrapped; older versions take plain lists.
_ModuleList = getattr(nnx, "List", list)

# One layer's cache entry: its paged arrays (attention) or its (conv, ssm) slots (linear).
LayerCache = tuple[jax.Array, ...]


class HybridDecoderLayer(nnx.Module):
    """One pre-norm residual block; a subclass adds the mixer and ``mlp`` in its ``__init__``.

    The base builds what every family has the same way (the layer kind and the two norms), so
    a subclass says which norm (``zero_centred_norm``), which mixer and MLP it runs, and where
    the mixer lives (:meth:`mixer`): checkpoints name that attribute, and the families differ.
    """

    zero_centred_norm: ClassVar[bool]  # RMSNorm ``(1 + w)`` (True) or ``w`` (False), everywhere
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: nnx.Module

    def __init__(self, cfg: ModelConfig, i: int, *, dtype: jnp.dtype):
        # The norms draw no random numbers, and the subclass then builds its mixer before its
        # MLP: the order of draws from ``rngs``, so every random init, is what it always was.
        self.is_attention = cfg.layer_types[i] == FULL_ATTENTION
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=self.zero_centred_norm, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)

    def mixer(self) -> nnx.Module:
        """The token mixer, called as ``(x, cache, batch, ops, decode_only=) -> (cache, y)``."""
        raise NotImplementedError

    def __call__(
        self,
        h: jax.Array,  # [T, D]
        cache: LayerCache,
        batch: Batch,
        ops: Ops,
        *,
        decode_only: bool,
    ) -> tuple[LayerCache, jax.Array]:
        """Returns the layer's updated cache entry and ``h [T, D]`` after both residuals."""
        cache, y = self.mixer()(self.input_layernorm(h), cache, batch, ops, decode_only=decode_only)
        h = h + y
        h = h + self.mlp(self.post_attention_layernorm(h), ops)  # ops: the MoE experts' backend
        return cache, h


class HybridForCausalLM(nnx.Module):
    """Embedding, the layers, the final norm and the LM head; a family sets ``layer_class``.

    The final norm is the same kind as the layers' norms (``layer_class.zero_centred_norm``).
    """

    layer_class: ClassVar[type[HybridDecoderLayer]]

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = _ModuleList(
            [self.layer_class(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)]
        )
        zero_centred = self.layer_class.zero_centred_norm
        self.norm = RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps, zero_centred=zero_centred, dtype=dtype
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def __call__(
        self, batch: Batch, caches: Caches, ops: Ops, *, decode_only: bool = False
    ) -> tuple[Caches, jax.Array]:
        """Runs every layer over the batch. Returns ``(caches, logits f32[S, vocab])``.

        ``decode_only`` (jit-static) tells every mixer that each row is one token, so it may
        take its decode path.
        """
        h = self.embed_tokens[...][batch.input_ids]  # [T, D]
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        attn_i = lin_i = 0  # the next entry of the paged pools and of the state pools
        for layer in self.layers:
            if layer.is_attention:
                kv[attn_i], h = layer(h, kv[attn_i], batch, ops, decode_only=decode_only)
                attn_i += 1
            else:
                (conv[lin_i], ssm[lin_i]), h = layer(
                    h, (conv[lin_i], ssm[lin_i]), batch, ops, decode_only=decode_only
                )
                lin_i += 1
        h = self.norm(h[batch.logits_indices])  # [S, D]
        return Caches(kv=tuple(kv), conv=tuple(conv), ssm=tuple(ssm)), self.logits(h)

    def logits(
        self,
        h: jax.Array,  # [S, D], already normed
    ) -> jax.Array:  # f32[S, vocab]
        if self.config.tie_word_embeddings:
            w = self.embed_tokens[...].T
        else:
            w = self.lm_head.weight[...]
        return jnp.einsum("SD,DV->SV", h, w, preferred_element_type=jnp.float32)
