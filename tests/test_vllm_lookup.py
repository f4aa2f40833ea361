"""The scheduler -> worker lookup channel (no vLLM needed): answers, timeouts, dead workers."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvstrata.integrations.vllm.lookup import (
    LookupClient,
    LookupServer,
    decode_request,
    encode_request,
    lookup_address,
)

KEYS = [bytes([i]) * 16 for i in range(10)]


def _address(tag: str) -> str:
    return lookup_address(f"test-{os.getpid()}-{tag}-{time.monotonic_ns()}", 0, 0)


def test_request_round_trips_and_rejects_bad_keys() -> None:
    assert decode_request(encode_request(KEYS, [0, 3, 7])) == (KEYS, [0, 3, 7])
    with pytest.raises(ValueError, match="16 bytes"):
        encode_request([b"short"], [0])


def test_client_gets_the_servers_answer() -> None:
    held = set(KEYS[:6])
    seen: list[list[int]] = []

    def answer(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
        seen.append(layers)
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n, n // 2

    addr = _address("answer")
    server = LookupServer(addr, b"secret", answer)
    client = LookupClient(addr, b"secret")
    try:
        assert client.lookup(KEYS, [1, 2]) == (6, 3)
        assert client.lookup(KEYS[:3], [0]) == (3, 1)
        assert seen == [[1, 2], [0]]
    finally:
        client.close()
        server.close()


def test_a_slow_worker_is_skipped_not_waited_for() -> None:
    release = threading.Event()

    def answer(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
        release.wait(5)
        return len(keys), 0

    addr = _address("slow")
    server = LookupServer(addr, b"k", answer)
    client = LookupClient(addr, b"k", timeout_s=0.2, retry_after_s=30)
    try:
        t0 = time.monotonic()
        assert client.lookup(KEYS, [0]) is None
        assert client.lookup(KEYS, [0]) is None  # backing off: no second wait
        assert time.monotonic() - t0 < 1.0
        assert client.failures == 1
    finally:
        release.set()
        client.close()
        server.close()


def test_no_server_wrong_key_or_closed_server_is_none() -> None:
    addr = _address("none")
    assert LookupClient(addr, b"k").lookup(KEYS, [0]) is None
    server = LookupServer(addr, b"right", lambda keys, layers: (len(keys), len(keys) + 5))
    try:
        assert LookupClient(addr, b"wrong").lookup(KEYS, [0]) is None
        good = LookupClient(addr, b"right", retry_after_s=0)
        assert good.lookup(KEYS, [0]) == (len(KEYS), len(KEYS))  # "fast" never exceeds the blocks
    finally:
        server.close()
    assert good.lookup(KEYS, [0]) is None
    good.close()


def test_a_failing_answer_is_zero_not_a_dead_server() -> None:
    def answer(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
        raise OSError("tier down")

    addr = _address("fail")
    server = LookupServer(addr, b"k", answer)
    client = LookupClient(addr, b"k")
    try:
        assert client.lookup(KEYS, [0]) == (0, 0)
        assert client.failures == 0
    finally:
        client.close()
        server.close()
