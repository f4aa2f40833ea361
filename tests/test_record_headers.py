"""Record headers packed a chunk at a time (``pack_headers_into``): the array path for records
sealed by checksums writes the very bytes that ``pack_header`` writes one record at a time, which
``parse_header`` reads back; records it cannot take go the one-at-a-time way."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvstrata.core import native
from kvstrata.tiers import records
from kvstrata.tiers.records import RECORD_HEADER, pack_header, pack_headers_into, parse_header


def one_at_a_time(at: int, recs: list[tuple[bytes, int, int]], seals: list[tuple[int, bytes]]) -> bytes:
    return b"".join(
        pack_header(k, n, at + i * RECORD_HEADER - pos, c, t)
        for i, ((k, pos, n), (c, t)) in enumerate(zip(recs, seals, strict=True))
    )


def chunk(rng: random.Random, count: int, zero_keys: bool) -> tuple[list[tuple[bytes, int, int]], int]:
    recs, pos = [], 0
    for i in range(count):
        n = rng.choice([65536, 8192, 1024, 400, rng.randint(0, 200_000)])
        key = b"\0" * 15 + bytes([i % 256]) if zero_keys else rng.randbytes(16)  # trailing and leading NULs
        recs.append((key + rng.randint(0, 0xFFFF).to_bytes(2, "big"), pos, n))
        pos += (n + 63) // 64 * 64
    return recs, pos


@pytest.mark.skipif(native.NATIVE is None, reason="the array path hashes the headers in the extension")
@pytest.mark.parametrize("seed", range(6))
def test_the_array_path_writes_the_same_bytes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    calls: list[bool] = []
    fast = records._pack_checksum_headers

    def spy(*args: Any) -> bool:
        calls.append(fast(*args))
        return calls[-1]

    monkeypatch.setattr(records, "_pack_checksum_headers", spy)
    for trial in range(40):
        recs, at = chunk(rng, rng.randint(1, 300), zero_keys=trial % 3 == 0)
        seals = [(rng.getrandbits(64), b"") for _ in recs]
        want = one_at_a_time(at, recs, seals)
        whole = np.full(at + len(want) + 128, 0xA5, np.uint8)  # the chunk from its start
        assert pack_headers_into(whole, at, recs, seals) == at + len(want)
        assert whole[at : at + len(want)].tobytes() == want
        assert not (whole[:at] != 0xA5).any() and not (whole[at + len(want) :] != 0xA5).any()
        tail = np.full(len(want), 0x5A, np.uint8)  # the headers alone (``base``: the zero-copy write's)
        pack_headers_into(tail, at, recs, seals, base=at)
        assert tail.tobytes() == want
        raw = whole.tobytes()
        for i, ((key, pos, n), (csum, _)) in enumerate(zip(recs, seals, strict=True)):
            head = parse_header(raw, at + i * RECORD_HEADER)
            assert head == (key, n, at + i * RECORD_HEADER - pos, csum, b"")
    assert calls == [True] * 80


def test_records_the_array_path_cannot_take_go_one_at_a_time() -> None:
    rng = random.Random(9)
    recs, at = chunk(rng, 20, zero_keys=False)
    tagged = [(0, rng.randbytes(24)) for _ in recs]  # a tier with a secret: keyed tags
    assert not records._pack_checksum_headers(np.zeros(at + 20 * RECORD_HEADER, np.uint8), at, recs, tagged, 0)
    buf = np.zeros(at + 20 * RECORD_HEADER, np.uint8)
    pack_headers_into(buf, at, recs, tagged)
    assert buf[at:].tobytes() == one_at_a_time(at, recs, tagged)
    short = [(recs[0][0][:16], recs[0][1], recs[0][2])]  # not a block key (no layer)
    assert not records._pack_checksum_headers(np.zeros(at + RECORD_HEADER, np.uint8), at, short, [(1, b"")], 0)
    huge = [(recs[0][0], 0, 1 << 32)]  # a length a header cannot hold: the struct names it
    assert not records._pack_checksum_headers(np.zeros(RECORD_HEADER, np.uint8), 0, huge, [(1, b"")], 0)
    with pytest.raises(Exception, match=r"format requires|out of range"):
        pack_headers_into(np.zeros(RECORD_HEADER, np.uint8), 0, huge, [(1, b"")])
