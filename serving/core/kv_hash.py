"""Chained KV block hashes over token ids.

Block ``j`` covers tokens ``[j*B, (j+1)*B)``; its hash chains over the whole prefix::

    h_0 = H(ROOT,    tokens[0:B],   salt)      salt (cache_salt) only in block 0
    h_j = H(h_{j-1}, tokens[jB:(j+1)B])

so equal hashes mean equal prefixes ``[0, (j+1)*B)``. Only full blocks are hashed. ``H`` is
sha256 over a compact little-endian encoding (no pickle), so hashes are deterministic across
processes and runs. A checkpoint of the state after ``p`` tokens is keyed by ``h_{p/B - 1}``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"hyjax/kv-block-hash/v1").digest()


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], cache_salt: str | None = None
) -> BlockHash:
    """The hash of one full block given its parent's hash (``ROOT_HASH`` for block 0)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if cache_salt is not None:
        salt = cache_salt.encode()
        h.update(b"salt" + struct.pack("<I", len(salt)) + salt)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> None:
    """Appends to ``hashes`` the hashes of the blocks of ``token_ids`` that became full.

    Mutates ``hashes`` only. Incremental: call it after every append to ``token_ids``; the cost
    is one sha256 per newly full block.
    """
    for j in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[j - 1] if j else ROOT_HASH
        block = token_ids[j * block_size : (j + 1) * block_size]
        hashes.append(hash_block(parent, block, cache_salt if j == 0 else None))
