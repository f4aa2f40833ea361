"""Ports for the servers the tests and ``kvstrata experiment`` start (:func:`kvstrata.servers.free_ports`)."""

from __future__ import annotations

import socket

import pytest

from kvstrata.servers import GRPC_OFFSET, LOWEST_PORT, ephemeral_ports, free_port, free_ports


def test_ports_lie_below_the_ephemeral_range_free_and_never_handed_out_twice() -> None:
    """An outgoing connection takes its local port from the ephemeral range: a port picked there
    may be gone by the time its server binds it. Below that range nothing takes it unasked."""
    lo, hi = ephemeral_ports()
    assert LOWEST_PORT < lo <= hi
    if lo - GRPC_OFFSET - LOWEST_PORT < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {lo}: no room below it")
    given = free_ports(50) + free_ports(50) + [free_port() for _ in range(20)]
    assert len(set(given)) == len(given)  # not handed out again, even unbound
    for port in given:
        assert port >= LOWEST_PORT and port + GRPC_OFFSET < lo, port
    for port in given[:10]:  # free to bind, and so is its gRPC companion
        for p in (port, port + GRPC_OFFSET):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", p))


def test_ports_in_use_are_not_handed_out() -> None:
    """200 ports held (picked here, not by free_ports): none of 3,000 ports handed out is one
    of them, nor has one of them as its gRPC companion (by chance ~50 would be)."""
    lo, _ = ephemeral_ports()
    held: list[socket.socket] = []
    try:
        for port in range(LOWEST_PORT + 5, lo, 61):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
            if len(held) == 200:
                break
        taken = {s.getsockname()[1] for s in held}
        given = free_ports(3000)
        assert not taken & set(given)
        assert not taken & {p + GRPC_OFFSET for p in given}
    finally:
        for s in held:
            s.close()
