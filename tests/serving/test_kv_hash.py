"""Chained block hashes."""

from serving.core.kv_hash import ROOT_HASH, extend_block_hashes, hash_block


def hashes(tokens, block_size=4, salt=None):
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, salt)
    return out


def test_only_full_blocks_are_hashed_and_the_chain_is_explicit():
    hs = hashes(list(range(10)))
    assert len(hs) == 2
    assert hs[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7])


def test_hashes_are_deterministic_and_prefix_closed():
    a = hashes(list(range(12)))
    b = hashes([*list(range(8)), 99, 9, 10, 11])
    assert a == hashes(list(range(12)))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert hashes([1, 2, 3, 4]) != hashes([2, 1, 3, 4])


def test_salt_enters_block_zero_only_but_changes_the_whole_chain():
    plain, salted = hashes(list(range(8))), hashes(list(range(8)), salt="s")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted[0] == hash_block(ROOT_HASH, [0, 1, 2, 3], "s")
    assert salted[1] == hash_block(salted[0], [4, 5, 6, 7])
    assert hashes(list(range(8)), salt="t") != salted


def test_incremental_extension_equals_one_shot():
    tokens = list(range(40))
    inc: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(inc, tokens[:n], 4)
    assert inc == hashes(tokens)
