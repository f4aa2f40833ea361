"""Scheduler -> worker lookups over a local socket (no vLLM import; unit-testable on its own).

vLLM's scheduler runs in another process than its workers, and a worker's DRAM tier (and the
stores it has queued but not yet written) is invisible to any other process. Each worker serves
lookups from its own engine on a Unix socket (abstract namespace on Linux, nothing to clean up);
the scheduler asks every tensor-parallel rank and takes the shortest answer, so a prompt re-sent
right after it was stored hits the worker's DRAM. When a worker does not answer within the
timeout, the scheduler falls back to the persistent tiers it can read itself, and leaves that
worker alone for a while, so a stuck worker never stalls scheduling.

Wire format (bytes, no pickle): request ``u16 n_layers, u16 layers[n], keys (16 bytes each)``;
reply ``u32 blocks, u32 fast`` (``fast``: how many of those blocks the worker holds in memory
tiers, DRAM or a queued store, so a load of them is a memcpy, not a disk or network read).
Connections authenticate with an HMAC handshake (``multiprocessing.connection``) keyed by the
vLLM instance id.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from kvstrata.core.keys import Key

log = logging.getLogger("kvstrata.vllm.lookup")

KEY_BYTES = 16
Answer = Callable[[list[Key], list[int]], tuple[int, int]]


def lookup_address(instance_id: str, dp_rank: int, tp_rank: int) -> str:
    """Socket address of one worker's lookup server (unique per vLLM instance and rank)."""
    name = f"kvstrata-lookup-{instance_id}-dp{dp_rank}-tp{tp_rank}"
    if sys.platform.startswith("linux"):
        return "\0" + name  # abstract namespace: no file, gone with the process
    return str(Path(tempfile.gettempdir()) / f"{name}.sock")


def encode_request(keys: Sequence[Key], layers: Sequence[int]) -> bytes:
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"lookup keys must be {KEY_BYTES} bytes, got {len(key)}")
    return struct.pack(f"<H{len(layers)}H", len(layers), *layers) + b"".join(keys)


def decode_request(data: bytes) -> tuple[list[Key], list[int]]:
    (n_layers,) = struct.unpack_from("<H", data)
    layers = list(struct.unpack_from(f"<{n_layers}H", data, 2))
    body = memoryview(data)[2 + 2 * n_layers :]
    if len(body) % KEY_BYTES:
        raise ValueError(f"lookup request body of {len(body)} bytes is not a whole number of keys")
    return [bytes(body[i : i + KEY_BYTES]) for i in range(0, len(body), KEY_BYTES)], layers


class LookupServer:
    """Answers lookups with ``answer(keys, layers) -> (restorable blocks, of them in memory)``
    on a daemon thread."""

    def __init__(self, address: str, authkey: bytes, answer: Answer) -> None:
        self.address = address
        self._answer = answer
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._closed = False
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="kvstrata-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # a client that failed the handshake, or close() waking us up
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstrata-lookup-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            while self._reply(conn):
                pass
        finally:
            with self._lock:  # under the lock: close() never touches a closed (reused) descriptor
                self._conns.discard(conn)
                conn.close()

    def _reply(self, conn: Connection) -> bool:
        try:
            data = conn.recv_bytes()
        except (OSError, EOFError):
            return False
        try:
            keys, layers = decode_request(data)
            n, fast = self._answer(keys, layers)
        except Exception as exc:  # a bad request or a tier fault: answer "nothing"
            log.warning("kvstrata lookup server: %s", exc)
            n = fast = 0
        try:
            conn.send_bytes(struct.pack("<II", int(n), int(min(fast, n))))
        except OSError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:  # unblock accept()
            wake.settimeout(1.0)
            wake.connect(self.address)
        self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:  # clients see the server gone at once; the reader thread closes conn
            with (
                contextlib.suppress(OSError, ValueError),
                socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock,
            ):
                sock.shutdown(socket.SHUT_RDWR)


class LookupClient:
    """The scheduler's side: ``lookup`` returns (blocks, of them in memory), or None when the
    worker cannot answer now."""

    def __init__(self, address: str, authkey: bytes, timeout_s: float = 1.0, retry_after_s: float = 5.0) -> None:
        self.address = address
        self.authkey = authkey
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._conn: Connection | None = None
        self._down_until = 0.0
        self.failures = 0

    def lookup(self, keys: Sequence[Key], layers: Sequence[int]) -> tuple[int, int] | None:
        if time.monotonic() < self._down_until:
            return None
        try:
            conn = self._connect()
            conn.send_bytes(encode_request(keys, layers))
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"no answer within {self.timeout_s}s")
            n, fast = struct.unpack("<II", conn.recv_bytes(16))
            n = min(int(n), len(keys))
            return n, min(int(fast), n)
        except (OSError, EOFError, TimeoutError, struct.error, AuthenticationError) as exc:
            self._fail(exc)
            return None

    def _connect(self) -> Connection:
        if self._conn is None:
            self._conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
        return self._conn

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("kvstrata: worker lookup at %r failed (%s); using the persistent tiers", self.address, exc)
        self.close()
        self._down_until = time.monotonic() + self.retry_after_s

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
