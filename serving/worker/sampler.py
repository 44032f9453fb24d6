"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seeds, and the
logit processors: presence / frequency / repetition penalties, logit bias, bad words and
min_tokens, and the structured-output token bitmask.

Each row draws from ``key(seed)`` folded with the position of the token it generates, so a
request's samples do not depend on which other requests share its steps.

The logit processors read ``TokenTables``: dense ``[R, V]`` tables on device, one row per
scheduler table row (R = max_num_seqs), donated through every step. Why dense tables and not
a bag of recent token ids per row: the step stays static-shaped whatever the context length
(a bag would need max_model_len ids per row in every plan), updating them is one scatter of
the step's T input tokens, and reading them is a gather of the S sampled rows, run only in
steps where some row uses them (``lax.cond``). The cost is memory: 13 bytes per row and
vocabulary entry (about 0.5 GB for 256 rows of a 150k vocabulary).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.plan import SamplingArrays, TableInit
from serving.core.request import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS
from serving.worker import branches

# A pytree, so that a jitted function takes the rows' parameters whole.
jax.tree_util.register_dataclass(SamplingArrays)


TokenTables = dict[str, jax.Array]  # the tables below, by name

# Multi-token bad words, per row: W words of up to L + 1 tokens, and the row's last L
# generated tokens. A word's last token is banned where the L tokens generated before the
# sampled position end with the rest of the word (vLLM's rule: generated tokens only)::
#
#     word       a b c          prefix [-1 ... -1 a b] (right-aligned, -1 = any), last c
#     generated  ... x a b      -> c banned at the next position
W, L = MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS - 1


def token_table_bytes(num_rows: int, vocab: int) -> int:
    """Device bytes of :func:`init_token_tables` (10 a row and vocabulary entry: 0.38 GB for
    256 rows of a 151k vocabulary), which the pools' default budget leaves free."""
    return num_rows * vocab * (4 + 1 + 1 + 4) + num_rows * 4 * (L + W * L + W)


def init_token_tables(num_rows: int, vocab: int) -> TokenTables:
    """Zeroed tables: ``counts`` i32[R, V] (generated tokens), ``prompt`` i8[R, V] (1: in the
    prompt), ``stop`` i8[R, V] (1: banned while ``min_tokens`` are not generated), ``bias``
    f32[R, V] (added to the logits; -inf bans)."""
    return {
        "counts": jnp.zeros((num_rows, vocab), jnp.int32),
        "prompt": jnp.zeros((num_rows, vocab), jnp.int8),
        "stop": jnp.zeros((num_rows, vocab), jnp.int8),
        "bias": jnp.zeros((num_rows, vocab), jnp.float32),
        "recent": jnp.full((num_rows, L), -1, jnp.int32),
        "bad_prefix": jnp.full((num_rows, W, L), -1, jnp.int32),
        "bad_last": jnp.full((num_rows, W), -1, jnp.int32),
    }


def table_row_values(init: TableInit, vocab: int) -> dict[str, np.ndarray]:
    """One row of each table (numpy) for a request just admitted (``TableInit``)."""
    ids = np.asarray(init.token_ids, np.int64)
    p = min(init.prompt_len, len(ids))
    prompt = np.zeros(vocab, np.int8)
    prompt[ids[:p]] = 1
    stop = np.zeros(vocab, np.int8)
    stop[list(init.stop_ids)] = 1
    bias = np.zeros(vocab, np.float32)
    for t, b in init.bias:
        bias[t] = b
    recent = np.full(L, -1, np.int32)
    for g, t in enumerate(ids[p:].tolist()):  # generated token g sits at g % L
        recent[g % L] = t
    bad_prefix = np.full((W, L), -1, np.int32)
    bad_last = np.full(W, -1, np.int32)
    for w, word in enumerate(init.bad_seqs):
        bad_prefix[w, L - len(word) + 1 :] = word[:-1]
        bad_last[w] = word[-1]
    return {
        "counts": np.bincount(ids[p:], minlength=vocab).astype(np.int32),
        "prompt": prompt,
        "stop": stop,
        "bias": bias,
        "recent": recent,
        "bad_prefix": bad_prefix,
        "bad_last": bad_last,
    }


@functools.partial(jax.jit, donate_argnums=(0,))
def set_table_row(tables: TokenTables, row: jax.Array, values: dict) -> TokenTables:
    """Writes one row of every table (``row`` traced: one executable)."""
    return {k: jax.lax.dynamic_update_index_in_dim(t, values[k], row, 0) for k, t in tables.items()}


def count_inputs(
    tables: TokenTables,
    sampling: SamplingArrays,  # [S] each
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    query_start_loc: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[]
) -> TokenTables:
    """Adds the step's input tokens to their rows' tables (rows that use them; T-entry scatter).

    A token at a prompt position marks ``prompt``; a later one (an output, fed back or
    re-prefilled after a preemption) counts once in ``counts``.
    """
    t = input_ids.shape[0]
    # compare_all, not the default scan: that is a ``while`` loop, which XLA:GPU cannot put
    # in a command buffer, so the ``lax.cond`` around this became a host sync in every step
    # (the host waited for the model's kernels to read the predicate, then launched the
    # sampler: 8-layer bench model at 8 rows, ~1.8 ms of a 3.8 ms step idle on an H200).
    idx = jnp.arange(t, dtype=jnp.int32)
    s = jnp.searchsorted(query_start_loc[1:], idx, side="right", method="compare_all")
    s = jnp.minimum(s, sampling.table_row.shape[0] - 1)  # i32[T]  plan row of each token
    live = (jnp.arange(t) < query_start_loc[num_seqs]) & (sampling.uses_tables[s] > 0)
    num_rows = tables["counts"].shape[0]
    row = jnp.where(live, sampling.table_row[s], num_rows)  # out of range: dropped
    in_prompt = positions < sampling.prompt_len[s]
    counts = tables["counts"].at[row, input_ids].add((~in_prompt).astype(jnp.int32), mode="drop")
    prompt = tables["prompt"].at[jnp.where(in_prompt, row, num_rows), input_ids].set(1, mode="drop")
    # The last L generated tokens, a ring indexed by generated-token number: only each row's
    # last L tokens of the step write, so no two writes of a step hit one entry.
    g = positions - sampling.prompt_len[s]
    tail = jnp.arange(t) >= query_start_loc[s + 1] - L
    ring = jnp.where(~in_prompt & tail, row, num_rows)
    recent = tables["recent"].at[ring, jnp.maximum(g, 0) % L].set(input_ids, mode="drop")
    return {**tables, "counts": counts, "prompt": prompt, "recent": recent}


def process_logits(
    logits: jax.Array,  # f32[S, V]
    sampling: SamplingArrays,  # [S] each
    positions: jax.Array,  # i32[S]  position of the token being generated
    tables: TokenTables,
) -> jax.Array:
    """The logits after penalties, bias, bad words and min_tokens: f32[S, V].

    Runs only when some row uses the tables; other rows come back unchanged.
    """

    def apply():
        row = sampling.table_row
        on = (sampling.uses_tables > 0)[:, None]
        counts = tables["counts"][row]  # [S, V]
        seen = (counts > 0) | (tables["prompt"][row] > 0)
        rep = sampling.repetition_penalty[:, None]
        x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        x = x - sampling.frequency_penalty[:, None] * counts
        x = x - sampling.presence_penalty[:, None] * (counts > 0)
        x = x + tables["bias"][row]
        ban = (positions < sampling.min_tokens_until)[:, None] & (tables["stop"][row] > 0)
        x = jnp.where(ban, -jnp.inf, x)
        x = _ban_bad_word_ends(x, tables, row, positions - sampling.prompt_len)
        return jnp.where(on, x, logits)

    # apply() leaves the rows without tables as they are
    return branches.cond(jnp.any(sampling.uses_tables > 0), apply, lambda: logits, masked=True)


def apply_token_mask(
    logits: jax.Array,  # f32[S, V]
    uses_grammar: jax.Array,  # i32[S]  1: the row's mask applies
    token_mask: jax.Array,  # i32[S, ceil(V / 32)]  bit t % 32 of word t // 32: t allowed
) -> jax.Array:
    """Structured outputs: ``-inf`` for the tokens a row's grammar forbids: f32[S, V].

    Runs only when some row has a grammar (``lax.cond``); other rows come back unchanged.
    """

    def apply():
        s, v = logits.shape
        bits = jnp.arange(32, dtype=jnp.int32)
        # [S, W, 32] -> [S, W * 32]: bit j of word w is token 32 w + j.
        allowed = ((token_mask[:, :, None] >> bits) & 1).reshape(s, -1)[:, :v] > 0
        on = (uses_grammar > 0)[:, None]
        return jnp.where(on & ~allowed, -jnp.inf, logits)

    return branches.cond(jnp.any(uses_grammar > 0), apply, lambda: logits, masked=True)


def _ban_bad_word_ends(
    x: jax.Array,  # f32[S, V]
    tables: TokenTables,
    row: jax.Array,  # i32[S]  table row
    generated: jax.Array,  # i32[S]  tokens generated before the sampled position
) -> jax.Array:
    """Bans each multi-token bad word's last token where the generated tokens just before
    end with the rest of it (``hist[j]``: generated token ``n - L + j``; -2 before the first)."""
    g = generated[:, None] - L + jnp.arange(L)  # [S, L]
    hist = jnp.where(g >= 0, tables["recent"][row[:, None], jnp.maximum(g, 0) % L], -2)
    prefix, last = tables["bad_prefix"][row], tables["bad_last"][row]  # [S, W, L], [S, W]
    match = jnp.all((prefix == -1) | (prefix == hist[:, None, :]), axis=-1) & (last >= 0)
    s = jnp.arange(x.shape[0])[:, None]
    return x.at[s, jnp.where(match, last, x.shape[1])].set(-jnp.inf, mode="drop")


def filtered_logits(
    logits: jax.Array,  # f32[N, V]
    sampling: SamplingArrays,  # [N] each
    gather: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> jax.Array:
    """f32[N, V]: the temperature-scaled logits with what top-k, top-p and min-p drop at
    -inf (the distribution the sampler draws from; greedy rows at temperature 1). min-p drops
    tokens below min_p times the top probability."""
    temperature = sampling.temperature
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    vocab = logits.shape[-1]
    top_k = sampling.top_k
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    mth = top + jnp.log(jnp.maximum(sampling.min_p[:, None], 1e-30))
    mth = jnp.where(sampling.min_p[:, None] > 0, mth, -jnp.inf)
    needs_sort = jnp.any((temperature > 0) & ((k < vocab) | (sampling.top_p < 1)))
    threshold = branches.cond(
        needs_sort,
        lambda: jnp.maximum(_searched_threshold(gather(scaled), k, sampling.top_p), mth),
        lambda: mth,
    )
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(
    logits: jax.Array,  # f32[S, V]
    sampling: SamplingArrays,  # [S] each, as jax arrays
    positions: jax.Array,  # i32[S]  position of the token being generated
    *,
    gather: Callable[[jax.Array], jax.Array] = lambda x: x,
    tables: TokenTables | None = None,
    token_mask: jax.Array | None = None,  # i32[S, ceil(V / 32)]
) -> jax.Array:
    """Returns i32[S] token ids.

    Only what some row asks for runs (``lax.cond`` on the batch; both sides under
    ``branches.selecting``): an all-greedy step is one argmax; the full-vocabulary sort that
    top-k / top-p read their thresholds from runs only when a sampled row sets one of them.

    ``gather`` makes the logits whole on every device before the sort (tensor parallel leaves
    them split by vocab: a partitioned sort and cumsum are all-to-alls and a while loop). The
    rest (argmax, max, the Gumbel draw) runs on the split logits, as XLA partitions them with
    a few scalars per row crossing devices instead of the [S, V] logits (on two H100s that
    gather was 1.2 ms of a 64-row decode step).
    """
    if tables is not None:
        logits = process_logits(logits, sampling, positions, tables)
    if token_mask is not None:
        logits = apply_token_mask(logits, sampling.uses_grammar, token_mask)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_rows = sampling.temperature > 0

    def draw_all():
        masked = filtered_logits(logits, sampling, gather)

        def draw(seed, pos, row):
            key = jax.random.fold_in(jax.random.key(seed), pos)
            return jax.random.categorical(key, row).astype(jnp.int32)

        return jnp.where(sampled_rows, jax.vmap(draw)(sampling.seeds, positions, masked), greedy)

    # draw_all() keeps the greedy token of every row that does not sample
    return branches.cond(jnp.any(sampled_rows), draw_all, lambda: greedy, masked=True)


def _sorted_threshold(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[S, 1]: the lowest logit top-k (``k``) and top-p keep, read off one sorted row.

    The reference for :func:`_searched_threshold` (tests, ``benchmarks.sampler_ops``). A sort
    on a GPU is a multi-pass segmented radix sort: ~0.43 / 1.3 / 3.0 ms for 8 / 64 / 256 rows
    of a 152k vocabulary on an H200."""
    sorted_logits = -jnp.sort(-scaled, axis=-1)  # [S, V]
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    # top_p = 1 is off: no threshold from a cumsum that may round to 1 before the tail.
    return jnp.maximum(kth, jnp.where(top_p[:, None] < 1, pth, -jnp.inf))


def _order_keys(x: jax.Array) -> jax.Array:
    """u32 keys in the order of the f32 values: a positive float's sign bit flipped, every
    bit of a negative one flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return bits ^ jnp.where(bits >> 31 == 1, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _from_order_keys(keys: jax.Array) -> jax.Array:
    bits = keys ^ jnp.where(keys >> 31 == 1, jnp.uint32(0x80000000), jnp.uint32(0xFFFFFFFF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


THRESHOLD_SEARCH_WAYS = 4


def _searched_threshold(
    scaled: jax.Array,
    k: jax.Array,
    top_p: jax.Array,
    ways: int = THRESHOLD_SEARCH_WAYS,
    unroll: bool | None = None,
) -> jax.Array:
    """f32[S, 1]: :func:`_sorted_threshold`'s value without a sort: a search over the 2^32
    f32 order keys, row reductions only.

    Both keep ``key >= t* - 1`` for the first order key ``t*`` at which

        Q(t) = count(key >= t) < k  and  (top_p = 1  or  mass(key >= t) < top_p)

    holds (Q is false ... false, true ...: the keys at or above t shrink as t grows). The
    lowest kept key is then the k-th largest (ties kept) or the first whose strictly-greater
    mass is below p, whichever is higher: the sort's threshold. A pass splits the interval
    (lo, hi] that holds t* at ``ways - 1`` points, each one row reduction of the count and
    the mass above it (XLA fuses them as siblings); 32 / log2(ways) passes, unrolled. On an
    H200 (``benchmarks.sampler_ops``), 4 ways: 0.26 / 0.97 / 2.79 ms at 8 / 64 / 256 rows
    against the sort's 0.43 / 1.33 / 3.01 (2 ways: 0.25 / 1.10 / 3.49; 16: 0.54 / 1.81 / 5.40).
    The mass is summed unnormalized against p times the row's sum, where the sort compares a
    cumsum of probabilities: at a boundary within rounding the two may keep one token apart.
    ``unroll`` (default: when lowered for a GPU) writes the passes out; elsewhere they are one
    ``fori_loop`` (CPU: 0.9 s more to compile every step bucket unrolled, against 0.4 s for the
    sort, where the search runs in 86 ms against the sort's 439 ms at 8 rows of 152k)."""
    bits = ways.bit_length() - 1
    if ways != 1 << bits or bits < 1:
        raise ValueError(f"ways={ways} must be a power of two >= 2")
    keys = _order_keys(scaled)  # u32[S, V]
    e = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    target = top_p[:, None] * jnp.sum(e, axis=-1, keepdims=True)
    use_p = (top_p < 1)[:, None]
    s = scaled.shape[0]
    lo = jnp.zeros((s, 1), jnp.uint32)  # Q(0) is false: every key counts and V >= k
    hi = jnp.full((s, 1), 0xFFFFFFFF, jnp.uint32)  # Q is true there (only a NaN's key)

    def one_pass(_, bounds):
        lo, hi = bounds
        width = hi - lo
        step = (width - 1) // ways + 1
        splits = [lo + jnp.minimum(jnp.uint32(j) * step, width) for j in range(1, ways)]
        first = jnp.zeros((s, 1), jnp.int32)  # how many splits Q is still false at
        for split in splits:
            above = keys >= split
            count = jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
            mass = jnp.sum(jnp.where(above, e, 0.0), axis=-1, keepdims=True)
            q = (count < k[:, None]) & (~use_p | (mass < target))
            first = first + (~q).astype(jnp.int32)
        lo_new, hi_new = lo, hi
        for j, split in enumerate(splits):
            lo_new = jnp.where(first == j + 1, split, lo_new)
            hi_new = jnp.where(first == j, split, hi_new)
        return lo_new, hi_new

    passes = -(-32 // bits)

    def unrolled(lo, hi):  # a GPU: no while loop (none may sit in a command buffer)
        for i in range(passes):
            lo, hi = one_pass(i, (lo, hi))
        return lo, hi

    def looped(lo, hi):  # elsewhere one loop body: a sixteenth of the program to compile
        return jax.lax.fori_loop(0, passes, one_pass, (lo, hi))

    if unroll is None:  # by the platform the step is lowered for
        lo, hi = jax.lax.platform_dependent(lo, hi, cuda=unrolled, rocm=unrolled, default=looped)
    else:
        lo, hi = (unrolled if unroll else looped)(lo, hi)
    return _from_order_keys(hi - 1)


MAX_LOGPROBS = 20  # top logprobs a request may ask for (OpenAI's chat limit)


def token_logprobs(
    logits: jax.Array,  # f32[S, V]  raw model logits (before temperature and filters)
    tokens: jax.Array,  # i32[S]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's distribution, as vLLM reports them by default.

    Returns the sampled token's logprob f32[S] and the ``MAX_LOGPROBS`` most likely tokens
    (i32[S, K], f32[S, K]), best first.
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    k = min(MAX_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = blocked_top_k(lp, k)
    return chosen, top_ids, top_lp


_TOP_K_BLOCK = 128


def blocked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` of f32[N, V] rows (values, i32 indices; ties: the lower index
    first), read off the k blocks of 128 with the largest maxima: a top-k of the V / 128 block
    maxima, then one of those blocks' k * 128 entries. Exact: the k largest entries lie in
    those blocks (an entry outside is at most its block's maximum, at most the k-th largest
    block maximum, and the chosen blocks hold k entries at least that large). XLA:GPU runs a
    top-k of a whole 152k-vocabulary row as a multi-pass segmented sort: on an H200, 0.44 /
    1.29 / 2.76 ms for 8 / 64 / 256 rows, and these two 0.11 / 0.08 / 0.17 ms
    (``benchmarks.sampler_ops``)."""
    n, v = x.shape
    nb = -(-v // _TOP_K_BLOCK)
    if nb <= 2 * k:  # a small vocabulary: the plain top-k
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    pad = nb * _TOP_K_BLOCK - v
    blocks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    blocks = blocks.reshape(n, nb, _TOP_K_BLOCK)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [N, k]
    # in index order, so that ties between blocks go to the lower index as in lax.top_k
    best = jnp.sort(best, axis=-1)
    cand = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(n, -1)  # [N, k * B]
    values, at = jax.lax.top_k(cand, k)
    ids = best[jnp.arange(n)[:, None], at // _TOP_K_BLOCK] * _TOP_K_BLOCK + at % _TOP_K_BLOCK
    return values, ids.astype(jnp.int32)


def prompt_token_logprobs(
    logits: jax.Array,  # f32[P, V]  raw model logits at prompt positions
    targets: jax.Array,  # i32[P]     the prompt token after each position
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt log-probabilities: each target's logprob f32[P] and rank i32[P] (1 = the most
    likely token; ties with it do not push it down), and the ``MAX_LOGPROBS`` most likely
    tokens (i32[P, K], f32[P, K])."""
    chosen, top_ids, top_lp = token_logprobs(logits, targets)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1, dtype=jnp.int32)
    return chosen, rank, top_ids, top_lp
