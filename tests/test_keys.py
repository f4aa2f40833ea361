"""Block keys: chained, namespaced, deterministic, full blocks only."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("code_path")  # both paths: the C extension and pure Python

BS = 4
NS = Namespace(model="m", kv_dtype="bfloat16", layout_fingerprint="0123456789abcdef", block_size=BS)
TOKENS = list(range(1000, 1000 + 6 * BS))


def keys(tokens: object, ns: Namespace = NS, **kw: object) -> list[bytes]:
    return BlockHasher(ns).keys_for_tokens(tokens, **kw)  # type: ignore[arg-type]


def test_one_key_per_full_block_and_sixteen_bytes() -> None:
    k = keys(TOKENS)
    assert len(k) == 6 and all(isinstance(x, bytes) and len(x) == 16 for x in k)
    assert len(set(k)) == 6


def test_partial_block_has_no_key() -> None:
    assert len(keys(TOKENS[: 2 * BS + 3])) == 2
    assert keys(TOKENS[: BS - 1]) == []
    assert keys([]) == []
    assert keys(TOKENS[: 2 * BS + 3]) == keys(TOKENS)[:2]  # the partial tail does not change earlier keys


def test_key_identifies_the_whole_prefix() -> None:
    other = TOKENS.copy()
    other[1] += 1  # one token of the first block differs
    a, b = keys(TOKENS), keys(other)
    assert all(x != y for x, y in zip(a, b, strict=True))  # every later key changes too
    tail = TOKENS.copy()
    tail[-1] += 1
    assert keys(tail)[:-1] == keys(TOKENS)[:-1] and keys(tail)[-1] != keys(TOKENS)[-1]


def test_block_order_matters() -> None:
    swapped = TOKENS[BS : 2 * BS] + TOKENS[:BS] + TOKENS[2 * BS :]
    assert keys(swapped)[1] != keys(TOKENS)[1]


def test_chain_continues_from_a_parent() -> None:
    full = keys(TOKENS)
    head = keys(TOKENS[: 2 * BS])
    rest = keys(TOKENS[2 * BS :], parent=head[-1])
    assert head + rest == full
    assert keys(TOKENS, parent=full[1], start_block=2) == full[2:]
    assert keys(TOKENS, parent=full[-1], start_block=6) == []


def test_start_block_without_parent_is_refused() -> None:
    with pytest.raises(ValueError):
        keys(TOKENS, start_block=2)


def test_token_containers_give_the_same_keys() -> None:
    expected = keys(TOKENS)
    for tokens in (tuple(TOKENS), np.array(TOKENS, dtype=np.int64), np.array(TOKENS, dtype=np.uint32)):
        assert keys(tokens) == expected
    assert keys(np.array(TOKENS, dtype=">u4")) == expected  # big-endian input is normalized


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0]])
def test_token_ids_must_fit_uint32(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        keys(bad)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "m2"},
        {"kv_dtype": "float8_e4m3fn"},
        {"layout_fingerprint": "fedcba9876543210"},
        {"block_size": BS},  # same block size must be the same namespace (control, see below)
        {"tp_rank": 1},
        {"tp_size": 2},
        {"tenant_salt": "tenant-a"},
    ],
)
def test_namespaces_never_share_keys(change: dict[str, Any]) -> None:
    other = dataclasses.replace(NS, **change)
    if other == NS:
        assert keys(TOKENS, other) == keys(TOKENS)
        return
    assert other.seed != NS.seed and other.fingerprint != NS.fingerprint
    assert not set(keys(TOKENS, other)) & set(keys(TOKENS))


def test_block_size_is_part_of_the_namespace() -> None:
    """Same tokens, same first 8 token ids, different block size: never the same key."""
    ns8 = dataclasses.replace(NS, block_size=2 * BS)
    assert not set(keys(TOKENS, ns8)) & set(keys(TOKENS))


def test_with_salt() -> None:
    salted = NS.with_salt("t1")
    assert salted == dataclasses.replace(NS, tenant_salt="t1")
    assert keys(TOKENS, salted) != keys(TOKENS) and keys(TOKENS, NS.with_salt("")) == keys(TOKENS)


def test_fingerprint_is_sixteen_hex_digits() -> None:
    assert len(NS.fingerprint) == 16 and int(NS.fingerprint, 16) >= 0
    assert NS.fingerprint == NS.seed.hex()[:16]


def test_keys_are_the_same_in_another_process() -> None:
    """No per-process randomness (e.g. PYTHONHASHSEED) may leak into keys."""
    code = (
        "from kvstrata.core.keys import BlockHasher, Namespace;"
        f"ns = Namespace(model='m', kv_dtype='bfloat16', layout_fingerprint='0123456789abcdef', block_size={BS});"
        f"print(','.join(k.hex() for k in BlockHasher(ns).keys_for_tokens({TOKENS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip().split(",") == [k.hex() for k in keys(TOKENS)]


def test_key_format_is_stable() -> None:
    """Keys name data on disk across versions: changing the hash, token encoding or namespace
    digest must be a conscious decision (with a format bump), not an accident."""
    assert NS.fingerprint == "f661fe6e6f2aed95"
    assert keys(TOKENS[:BS])[0].hex() == "2c6a7b5ca05f63eb82e7dee3020a3a5e"


def test_hash_id_keys() -> None:
    hasher = BlockHasher(NS)
    ids = [7, 8, 9, 10]
    k = hasher.keys_for_hash_ids(ids)
    assert len(k) == 4 and len(set(k)) == 4 and all(len(x) == 16 for x in k)
    assert hasher.keys_for_hash_ids(ids[:2]) + hasher.keys_for_hash_ids(ids[2:], parent=k[1]) == k
    assert hasher.keys_for_hash_ids([7, 9]) != [k[0], k[2]]  # chained: a block's key depends on its prefix
    assert not set(k) & set(hasher.keys_for_tokens(ids))  # id keys and token keys never collide
    assert not set(k) & set(BlockHasher(NS.with_salt("x")).keys_for_hash_ids(ids))
    assert hasher.keys_for_hash_ids([]) == []


def test_engine_keys_use_its_namespace(layout: KVLayout) -> None:
    config = {"tiers": [{"name": "dram", "capacity": 4096}]}
    with Engine(config, layout=layout) as a, Engine(config, layout=layout, tenant_salt="b") as b:
        assert a.namespace.model == layout.model and a.namespace.block_size == layout.block_size
        assert a.namespace.layout_fingerprint == layout.fingerprint()
        tokens = list(range(3 * layout.block_size))
        assert a.keys_for_tokens(tokens) == BlockHasher(a.namespace).keys_for_tokens(tokens)
        assert not set(a.keys_for_tokens(tokens)) & set(b.keys_for_tokens(tokens))


def test_keys_of_a_long_prompt_follow_the_documented_chain() -> None:
    """key[i] = xxh3_128(key[i-1] || tokens of block i as little-endian uint32), from the namespace
    seed; across the chunks the hasher makes its token rows in (stored keys must never change)."""
    import xxhash

    from kvstrata.core import keys as keys_module

    n = 3 * keys_module.ROWS_AT_ONCE + 5
    toks = np.random.default_rng(4).integers(0, 2**32, size=n * BS, dtype=np.uint64).astype(np.uint32)
    expect, parent = [], NS.seed
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + toks[i * BS : (i + 1) * BS].astype("<u4").tobytes())
        expect.append(parent)
    assert keys(toks) == expect
    assert keys(toks[BS * 700 :], parent=expect[699]) == expect[700:]  # continuing a chain mid-way
