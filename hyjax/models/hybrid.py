"""The decoder stack that Qwen3-Next and Kimi-Linear share, on the serving interface.

Both families are the same pre-norm residual stack over one flat ragged batch; they differ
only in what fills it (which mixers, which MLP, zero-centred or plain RMSNorm), so that is all
a model file says. Layer ``i``::

    h = h + mixer(input_layernorm(h))         linear attention or full attention, by layer type
    h = h + mlp(post_attention_layernorm(h))  a mixture of experts or a dense MLP

and around the layers: embedding, the final norm of the rows the batch wants logits for, and
the LM head (or the tied embedding). Each linear-attention layer owns one entry of the state
pools (``caches.conv``, ``caches.ssm``: ``[slots, H, Dv, Dk]``, the states transposed as
:mod:`hyjax.cache` says), each full-attention layer one entry of the paged pools
(``caches.kv``), both in layer order.

Parameter paths (``embed_tokens``, ``layers/{i}/...``, ``norm``, ``lm_head``) are what the
loader, the saver and the sharding rules match on: the attribute names here are that contract.

The scanned form (:meth:`HybridForCausalLM.stack_layers`, which the runner calls after loading,
on one device or into a sharding plan's shards): the stack is cut into a prefix, ``G``
identical groups and a tail (:func:`layer_groups`; Qwen3-Next-80B: 12 groups of [GDN, GDN,
GDN, attention])::

    layers/{i}        the prefix and tail layers, unrolled as before
    group_layers/{j}  position j of every group, each parameter stacked to [G, ...]

and the groups run as one ``lax.scan``, so XLA compiles one group whatever the depth. A group
position's pools are one array, the groups' pools end to end along the slot (block) axis
(:func:`stack_caches`); group ``g`` addresses its part by offsetting its slot (block) ids by
``g`` pools' worth, slot 0 excepted (its "nothing read / nothing written"). The kernels take
the longer pool as they are and the scan carries it in place: no step copies a pool.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
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
    from jax.sharding import Sharding

    from hyjax.ops import Ops

# flax >= 0.12 wants lists of modules wrapped; older versions take plain lists.
_ModuleList = getattr(nnx, "List", list)

# The scanned form's attribute (and parameter path prefix): ``group_layers/{j}/...``.
GROUP_LAYERS = "group_layers"

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

        self.groups: LayerGroups | None = None  # set by stack_layers: the scanned form

    def stack_layers(self, place: Callable[[tuple], Sharding] | None = None) -> None:
        """Turns the layers into the scanned form, in place (once, after loading).

        The layers of each position of the repeating group (:func:`layer_groups`) become one
        module whose parameters have a leading ``[G]`` axis, ``group_layers[j]``; the layers
        before and after the groups stay as they are (``layers`` keeps the prefix, then the
        tail). The forward then runs one ``lax.scan`` over the groups, so XLA compiles a
        group once whatever the depth. The caches must then be in the stacked layout
        (:func:`stack_caches`). Does nothing when no group repeats.

        ``place``: each stacked parameter's sharding by its new path (tensor parallel:
        ``ShardingPlan.sharding``); the stack is built straight into it, so a sharded layer
        is never gathered on one device. Default: where ``jnp.stack`` puts it.
        """
        groups = layer_groups(self.config)
        if groups is None or self.groups is not None:
            return
        layers = list(self.layers)
        stacked = []
        for j in range(groups.period):
            members = [layers[i] for i in groups.members(j)]
            graphdef, state = nnx.split(members[0])
            states = [state] + [nnx.split(m)[1] for m in members[1:]]
            if place is None:
                merged = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
            else:
                flat = [dict(nnx.to_flat_state(st)) for st in states]
                out = {}
                for rel, var in flat[0].items():
                    xs = [f[rel].get_value() for f in flat]
                    to = place((GROUP_LAYERS, j, *rel))
                    var = var.replace(value=_stack_into(to)(*xs))
                    out[rel] = var
                merged = nnx.from_flat_state(out)
                del flat, out
            stacked.append(nnx.merge(graphdef, merged))
            del state, states, merged
            # Free each layer's own arrays now: the model is held twice only one position at
            # a time, not whole.
            for m in members:
                for _, node in nnx.iter_graph(m):
                    if isinstance(node, nnx.Variable):
                        node.set_value(jnp.zeros((0,), node.get_value().dtype))
        self.layers = _ModuleList(layers[: groups.prefix] + layers[groups.end :])
        setattr(self, GROUP_LAYERS, _ModuleList(stacked))
        self.groups = groups

    def __call__(
        self,
        batch: Batch,
        caches: Caches,
        ops: Ops,
        *,
        decode_only: bool = False,
        return_hidden: bool = False,
    ) -> tuple[Caches, jax.Array] | tuple[Caches, jax.Array, jax.Array]:
        """Runs every layer over the batch. Returns ``(caches, logits f32[S, vocab])``.

        ``decode_only`` (jit-static) tells every mixer that each row is one token, so it may
        take its decode path. ``return_hidden`` (jit-static) adds a third output: the final
        hidden states of every row, after the final norm (``[T, D]``, model dtype), which a
        multi-token-prediction drafter reads (:mod:`hyjax.models.qwen3_next.mtp`).
        """
        caches, h = self.hidden_states(batch, caches, ops, decode_only=decode_only)
        if not return_hidden:
            return caches, self.head(h[batch.logits_indices])
        hidden = self.norm(h)  # [T, D]: the norm is per row, so its rows are those below
        return caches, self.logits(hidden[batch.logits_indices]), hidden

    def hidden_states(
        self, batch: Batch, caches: Caches, ops: Ops, *, decode_only: bool = False
    ) -> tuple[Caches, jax.Array]:
        """Runs every layer over the batch. Returns ``(caches, h [T, D])``: every token's last
        hidden state before the final norm (``head`` turns rows of it into logits)."""
        if self.groups is not None:
            return self._scanned(batch, caches, ops, decode_only=decode_only)
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
        return Caches(kv=tuple(kv), conv=tuple(conv), ssm=tuple(ssm)), h

    def _scanned(
        self, batch: Batch, caches: Caches, ops: Ops, *, decode_only: bool
    ) -> tuple[Caches, jax.Array]:
        """The forward of the stacked form: prefix layers, one scan over the groups, tail.

        Caches are in :func:`stack_caches`' layout: the prefix layers' entries, one stacked
        entry per group position, the tail layers' entries (per pool kind, in that order).
        """
        groups = self.groups
        h = self.embed_tokens[...][batch.input_ids]  # [T, D]
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        attn_i = lin_i = 0

        def run(layer, h, attn_i, lin_i, batch):
            if layer.is_attention:
                kv[attn_i], h = layer(h, kv[attn_i], batch, ops, decode_only=decode_only)
                return h, attn_i + 1, lin_i
            (conv[lin_i], ssm[lin_i]), h = layer(
                h, (conv[lin_i], ssm[lin_i]), batch, ops, decode_only=decode_only
            )
            return h, attn_i, lin_i + 1

        for layer in list(self.layers)[: groups.prefix]:
            h, attn_i, lin_i = run(layer, h, attn_i, lin_i, batch)

        # One entry per group position, in pool order: the scan carries them with h.
        graphdefs, params = zip(*(nnx.split(m) for m in self.group_layers), strict=True)
        kinds = [m.is_attention for m in self.group_layers]
        a0, l0 = attn_i, lin_i
        na, nl = sum(kinds), len(kinds) - sum(kinds)
        g_count = groups.num_groups

        def body(carry, xs):
            h, kv_g, conv_g, ssm_g = carry
            g, params_g = xs
            kv_g, conv_g, ssm_g = list(kv_g), list(conv_g), list(ssm_g)
            a = ln = 0
            for graphdef, p, is_attn in zip(graphdefs, params_g, kinds, strict=True):
                layer = nnx.merge(graphdef, p)
                if is_attn:
                    nb, bs = kv_g[a][0].shape[0] // g_count, kv_g[a][0].shape[1]
                    kv_g[a], h = layer(h, kv_g[a], _kv_batch(batch, g, nb, bs), ops,
                                       decode_only=decode_only)  # fmt: skip
                    a += 1
                else:
                    ns = conv_g[ln].shape[0] // g_count
                    (conv_g[ln], ssm_g[ln]), h = layer(
                        h, (conv_g[ln], ssm_g[ln]), _state_batch(batch, g, ns), ops,
                        decode_only=decode_only,
                    )  # fmt: skip
                    ln += 1
            return (h, tuple(kv_g), tuple(conv_g), tuple(ssm_g)), None

        carry = (h, tuple(kv[a0 : a0 + na]), tuple(conv[l0 : l0 + nl]), tuple(ssm[l0 : l0 + nl]))
        xs = (jnp.arange(g_count, dtype=jnp.int32), params)
        (h, kv_g, conv_g, ssm_g), _ = jax.lax.scan(body, carry, xs)
        kv[a0 : a0 + na], conv[l0 : l0 + nl], ssm[l0 : l0 + nl] = kv_g, conv_g, ssm_g
        attn_i, lin_i = a0 + na, l0 + nl

        for layer in list(self.layers)[groups.prefix :]:
            h, attn_i, lin_i = run(layer, h, attn_i, lin_i, batch)
        return Caches(kv=tuple(kv), conv=tuple(conv), ssm=tuple(ssm)), h

    def head(self, h: jax.Array) -> jax.Array:  # [N, D] hidden rows -> f32[N, vocab]
        """The final norm and the LM head over some rows of ``hidden_states``."""
        return self.logits(self.norm(h))

    def logits(
        self,
        h: jax.Array,  # [S, D], already normed
    ) -> jax.Array:  # f32[S, vocab]
        if self.config.tie_word_embeddings:
            w = self.embed_tokens[...].T
        else:
            w = self.lm_head.weight[...]
        return jnp.einsum("SD,DV->SV", h, w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """The repeating part of a layer stack::

        | prefix (unrolled) | group 0 | group 1 | ... | group G-1 | tail (unrolled) |
                            |<- period ->|

    Layer ``prefix + g * period + j`` is position ``j`` of group ``g``; every group has the
    same layer kinds (mixer, MLP) at each position.
    """

    prefix: int
    period: int
    num_groups: int

    @property
    def end(self) -> int:
        return self.prefix + self.period * self.num_groups

    def members(self, j: int) -> range:
        """The layer indices of position ``j``, group by group."""
        return range(self.prefix + j, self.end, self.period)


def _layer_kind(cfg: ModelConfig, i: int) -> tuple[str, bool]:
    return cfg.layer_types[i], cfg.is_moe_layer(i)


def layer_groups(cfg: ModelConfig, *, min_groups: int = 2) -> LayerGroups | None:
    """The longest run of at least ``min_groups`` identical groups (ties: the shortest
    period, then the earliest start); None when no group repeats."""
    n = cfg.num_hidden_layers
    kinds = [_layer_kind(cfg, i) for i in range(n)]
    best: LayerGroups | None = None
    for prefix in range(n):
        for period in range(1, (n - prefix) // min_groups + 1):
            g = 1
            while prefix + (g + 1) * period <= n and all(
                kinds[prefix + g * period + j] == kinds[prefix + j] for j in range(period)
            ):
                g += 1
            if g >= min_groups and (best is None or g * period > best.period * best.num_groups):
                best = LayerGroups(prefix, period, g)
    return best


@functools.cache
def _stack_into(sharding: Sharding) -> Callable:
    """``jnp.stack`` jitted to land in ``sharding`` (one per sharding, reused by shape)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


def _state_batch(batch: Batch, g: jax.Array, num_slots: int) -> Batch:
    """The batch as group ``g``'s linear layers see their pool: the group-stacked pool is
    ``[G * num_slots, ...]`` and group ``g``'s slot ``s`` is row ``g * num_slots + s``; slot
    0 stays 0 (the contract's "nothing read / nothing written")."""

    def shift(s: jax.Array) -> jax.Array:
        return jnp.where(s == 0, 0, s + g * num_slots)

    return dataclasses.replace(
        batch,
        src_slot=shift(batch.src_slot),
        dst_slot=shift(batch.dst_slot),
        ckpt_slots=shift(batch.ckpt_slots),
    )


def _kv_batch(batch: Batch, g: jax.Array, num_blocks: int, block_size: int) -> Batch:
    """The batch as group ``g``'s attention layers see their pool: ``[G * NB, bs, ...]``, group
    ``g``'s block ``b`` is block ``g * NB + b`` (its null block included: padding writes there)."""
    off = g * num_blocks
    return dataclasses.replace(
        batch,
        block_tables=batch.block_tables + off,
        slot_mapping=batch.slot_mapping + off * block_size,
    )


def _pool_order(cfg: ModelConfig, groups: LayerGroups) -> tuple[list[list[int]], list[list[int]]]:
    """Each entry of the stacked layout as the layers it holds, attention and linear apart:
    prefix layers one each, then one entry per group position (its layers, group by group),
    then the tail layers one each."""
    attn: list[list[int]] = []
    lin: list[list[int]] = []
    units = [[i] for i in range(groups.prefix)]
    units += [list(groups.members(j)) for j in range(groups.period)]
    units += [[i] for i in range(groups.end, cfg.num_hidden_layers)]
    for unit in units:
        (attn if cfg.layer_types[unit[0]] == FULL_ATTENTION else lin).append(unit)
    return attn, lin


def stack_caches(cfg: ModelConfig, caches: Caches) -> Caches:
    """Per-layer pools (:func:`hyjax.cache.init_caches`) -> the layout of the scanned
    forward: a group position's pools concatenated along the block / slot axis, group by
    group (``[G * NB, bs, ...]``, ``[G * slots, ...]``). Copies: for start-up and tests."""
    groups = layer_groups(cfg)
    if groups is None:
        return caches
    attn, lin = _pool_order(cfg, groups)
    a_index = {i: n for n, i in enumerate(cfg.attention_layers)}
    l_index = {i: n for n, i in enumerate(cfg.linear_layers)}

    def cat(pools, unit, index):
        return jnp.concatenate([pools[index[i]] for i in unit])

    kv = tuple(
        tuple(jnp.concatenate(xs) for xs in zip(*(caches.kv[a_index[i]] for i in unit)))
        for unit in attn
    )
    conv = tuple(cat(caches.conv, unit, l_index) for unit in lin)
    ssm = tuple(cat(caches.ssm, unit, l_index) for unit in lin)
    return Caches(kv=kv, conv=conv, ssm=ssm)


def unstack_caches(cfg: ModelConfig, caches: Caches) -> Caches:
    """The inverse of :func:`stack_caches`: one pool per layer, in layer order."""
    groups = layer_groups(cfg)
    if groups is None:
        return caches
    attn, lin = _pool_order(cfg, groups)
    kv: dict[int, tuple[jax.Array, ...]] = {}
    conv: dict[int, jax.Array] = {}
    ssm: dict[int, jax.Array] = {}
    for unit, entry in zip(attn, caches.kv, strict=True):
        for g, i in enumerate(unit):
            kv[i] = tuple(jnp.split(x, len(unit))[g] for x in entry)
    for unit, c, s in zip(lin, caches.conv, caches.ssm, strict=True):
        for g, i in enumerate(unit):
            conv[i], ssm[i] = jnp.split(c, len(unit))[g], jnp.split(s, len(unit))[g]
    return Caches(
        kv=tuple(kv[i] for i in cfg.attention_layers),
        conv=tuple(conv[i] for i in cfg.linear_layers),
        ssm=tuple(ssm[i] for i in cfg.linear_layers),
    )
