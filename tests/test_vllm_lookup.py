"""The scheduler -> worker lookup channel (no vLLM needed): answers, timeouts, dead workers, and
who may connect (a private directory, a random secret, handshakes under deadlines)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.integrations.vllm import lookup as lk
from kvstrata.integrations.vllm.lookup import (
    MAGIC,
    LookupClient,
    LookupServer,
    LookupSocketError,
    decode_request,
    encode_request,
    ensure_private_dir,
    key_path,
    lookup_address,
    read_key,
)

KEYS = [bytes([i]) * 16 for i in range(10)]
SLACK_S = 1.0  # scheduling noise on a loaded 2-core machine (a missed deadline shows as 5 s or more)
NOBODY = 65534


def _address(tag: str) -> str:
    return lookup_address(f"test-{os.getpid()}-{tag}-{time.monotonic_ns()}", 0, 0)


def _count(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
    return len(keys), 0


@contextlib.contextmanager
def serving(address: str, answer: lk.Answer = _count, **kw: float) -> Iterator[LookupServer]:
    server = LookupServer(address, answer, **kw)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.close()


def _raw(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(address)
    return s


def _closed_by_peer_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed ``sock`` (reading away whatever it sent first)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def _wait(cond: object, timeout_s: float = 3.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


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
    with serving(addr, answer):
        client = LookupClient(addr)  # the key comes from the server's key file
        try:
            assert client.lookup(KEYS, [1, 2]) == (6, 3)
            assert client.lookup(KEYS[:3], [0]) == (3, 1)
            assert seen == [[1, 2], [0]]
        finally:
            client.close()


def test_a_slow_worker_is_skipped_not_waited_for() -> None:
    release = threading.Event()

    def answer(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
        release.wait(5)
        return len(keys), 0

    addr = _address("slow")
    with serving(addr, answer):
        client = LookupClient(addr, timeout_s=0.2, retry_after_s=30)
        try:
            t0 = time.monotonic()
            assert client.lookup(KEYS, [0]) is None
            assert client.lookup(KEYS, [0]) is None  # backing off: no second wait
            assert time.monotonic() - t0 < 1.0
            assert client.failures == 1
        finally:
            release.set()
            client.close()


def test_no_server_wrong_key_or_closed_server_is_none() -> None:
    addr = _address("none")
    assert LookupClient(addr).lookup(KEYS, [0]) is None
    with serving(addr, lambda keys, layers: (len(keys), len(keys) + 5)):
        assert LookupClient(addr, secret=b"w" * 32).lookup(KEYS, [0]) is None
        good = LookupClient(addr, retry_after_s=0)
        assert good.lookup(KEYS, [0]) == (len(KEYS), len(KEYS))  # "fast" never exceeds the blocks
    assert good.lookup(KEYS, [0]) is None
    good.close()
    assert not os.path.lexists(addr) and not os.path.lexists(key_path(addr))  # close cleans up


def test_a_failing_answer_is_zero_not_a_dead_server() -> None:
    def answer(keys: list[bytes], layers: list[int]) -> tuple[int, int]:
        raise OSError("tier down")

    addr = _address("fail")
    with serving(addr, answer):
        client = LookupClient(addr)
        try:
            assert client.lookup(KEYS, [0]) == (0, 0)
            assert client.failures == 0
        finally:
            client.close()


# -- deadlines ------------------------------------------------------------------------------------
@pytest.mark.parametrize("idle", [20, 40])  # under and over max_pending (16): the oldest idle go
def test_idle_connections_never_stall_a_lookup(idle: int) -> None:
    addr = _address(f"idle{idle}")
    with serving(addr, handshake_timeout_s=3.0) as server:
        socks = [_raw(addr) for _ in range(idle)]  # connected, never say a word
        try:
            assert _wait(lambda: server.pending + sum(server.rejections.values()) >= idle)
            client = LookupClient(addr, timeout_s=1.0)
            t0 = time.monotonic()
            assert client.lookup(KEYS, [0]) == (len(KEYS), 0)  # an answer, not a timeout
            assert time.monotonic() - t0 < 1.0 + SLACK_S
            assert server.pending <= server.max_pending
            evicted = sum(n for why, n in server.rejections.items() if "waiting to authenticate" in why)
            assert (evicted > 0) == (idle + 1 > server.max_pending)
            client.close()
        finally:
            for s in socks:
                s.close()


def test_hostile_clients_are_dropped_after_the_deadline_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    addr = _address("hostile")
    deadline = 0.4
    with (
        caplog.at_level(logging.WARNING, "kvstrata.vllm.lookup"),
        serving(addr, handshake_timeout_s=deadline) as server,
    ):
        t0 = time.monotonic()
        silent, half, garbage = _raw(addr), _raw(addr), _raw(addr)
        half.sendall(MAGIC + b"\0" * 10)  # half a handshake, then nothing
        garbage.sendall(secrets.token_bytes(8 + 32 + 32))  # a full handshake's worth of junk
        assert _closed_by_peer_within(garbage, 5) < deadline  # judged at once
        for s in (silent, half):
            _closed_by_peer_within(s, 5)
            assert deadline * 0.9 < time.monotonic() - t0 < deadline + SLACK_S
        reasons = dict(server.rejections)
        assert sum(n for why, n in reasons.items() if "no complete handshake" in why) == 2, reasons
        assert sum(n for why, n in reasons.items() if "bad handshake bytes" in why) == 1, reasons
        assert _wait(lambda: server.pending == 0)
        for s in (silent, half, garbage):
            s.close()
        client = LookupClient(addr)
        assert client.lookup(KEYS, [0]) == (len(KEYS), 0)
        client.close()
    timeouts = [r for r in caplog.records if "no complete handshake" in r.getMessage()]
    assert len(timeouts) == 1  # logged once, counted twice


def _handshake(sock: socket.socket, secret: bytes) -> bytes:
    """Run the client's half of the handshake with ``secret``; the server's proof (or b"")."""
    hello = sock.recv(len(MAGIC) + 32)
    assert hello.startswith(MAGIC)
    nonce_s, nonce_c = hello[len(MAGIC) :], secrets.token_bytes(32)
    sock.sendall(MAGIC + nonce_c + hmac.new(secret, b"client" + nonce_s + nonce_c, hashlib.sha256).digest())
    try:
        return sock.recv(32)
    except ConnectionResetError:
        return b""


def test_a_wrong_key_gets_nothing_is_logged_once_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    instance = f"test-{os.getpid()}-wrongkey-{time.monotonic_ns()}"
    addr = lookup_address(instance, 0, 0)
    with caplog.at_level(logging.WARNING, "kvstrata.vllm.lookup"), serving(addr) as server:
        derived = f"kvstrata:{instance}".encode()  # what the old derivation gave anyone
        for wrong in (derived, secrets.token_bytes(32), server.secret[:-1] + b"\0"):
            with _raw(addr) as s:
                assert _handshake(s, wrong) == b""  # no proof back: the connection is closed
                with contextlib.suppress(OSError):
                    s.sendall(b"\x12\0\0\0" + encode_request(KEYS[:1], [0]))
                assert _closed_by_peer_within(s, 5) < 5  # and no answer ever comes
            assert LookupClient(addr, secret=wrong).lookup(KEYS, [0]) is None
        assert server.rejections["wrong key"] == 6
        with _raw(addr) as s:  # the right key: the server proves it holds it too
            proof = _handshake(s, server.secret)
            assert len(proof) == 32
        client = LookupClient(addr)
        assert client.lookup(KEYS, [0]) == (len(KEYS), 0)
        client.close()
    assert sum("connection (wrong key)" in r.getMessage() for r in caplog.records) == 1  # the server logs once


def test_the_client_respects_its_deadline_and_never_asks_an_impostor(tmp_path: Path) -> None:
    """Servers that are not ours: one that never accepts, one that accepts and says nothing, one
    that does not prove the key. The client gives up within its timeout and sends no keys."""
    d = ensure_private_dir(tmp_path / "sockets")
    secret = secrets.token_bytes(32)
    received: list[bytes] = []
    done = threading.Event()

    def impostor(listener: socket.socket, mode: str) -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                if mode == "mute":
                    done.wait(5)
                    return
                conn.sendall(MAGIC + secrets.token_bytes(32))
                conn.settimeout(3)
                conn.recv(8 + 64)
                conn.sendall(secrets.token_bytes(32))  # not a proof of the key
                with contextlib.suppress(OSError):
                    received.append(conn.recv(4096))

    for mode in ("backlog", "mute", "impostor"):
        addr = str(d / f"{mode}.sock")
        (d / f"{mode}.key").write_bytes(secret)
        os.chmod(d / f"{mode}.key", 0o600)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(addr)
        listener.listen(8)
        t = None
        if mode != "backlog":  # "backlog": connect() succeeds, nobody ever accepts
            t = threading.Thread(target=impostor, args=(listener, mode), daemon=True)
            t.start()
        client = LookupClient(addr, timeout_s=0.3)
        t0 = time.monotonic()
        assert client.lookup(KEYS, [0]) is None
        assert time.monotonic() - t0 < 0.3 + SLACK_S, mode
        done.set()
        client.close()
        listener.close()
        if t is not None:
            t.join(5)
    assert received in ([b""], [])  # the impostor got no request, only the hang-up


# -- who may connect ------------------------------------------------------------------------------
def test_the_socket_directory_and_files_are_private() -> None:
    addr = _address("modes")
    with serving(addr) as server:
        d = os.lstat(Path(addr).parent)
        assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.geteuid()
        s = os.lstat(addr)
        assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o600
        k = os.lstat(key_path(addr))
        assert stat.S_ISREG(k.st_mode) and stat.S_IMODE(k.st_mode) == 0o600 and k.st_uid == os.geteuid()
        assert read_key(addr) == server.secret and len(server.secret) == 32


def test_unsafe_directories_and_key_files_are_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(LookupSocketError, match=r"open has mode 0755; it must be 0700"):
        LookupServer(str(open_dir / "x.sock"), _count)
    assert not os.path.lexists(open_dir / "x.sock") and not os.path.lexists(open_dir / "x.key")
    target = ensure_private_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(LookupSocketError, match="is a symlink"):
        ensure_private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(LookupSocketError, match="is not a directory"):
        ensure_private_dir(tmp_path / "file")
    if os.geteuid() == 0:  # only root can make a directory someone else owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(0o700)
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(LookupSocketError, match=f"owned by uid {NOBODY}"):
            ensure_private_dir(theirs)
    addr = str(target / "k.sock")
    Path(key_path(addr)).write_bytes(b"k" * 32)
    os.chmod(key_path(addr), 0o644)
    with pytest.raises(LookupSocketError, match="not a private file"):
        read_key(addr)
    assert LookupClient(addr).lookup(KEYS, [0]) is None  # and a client will not use it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid in a child")
def test_another_uid_cannot_connect_or_read_the_key() -> None:
    """Run as root: a forked child that drops to uid 65534 (nobody) can neither connect nor read
    the key. (Root itself can do both: it bypasses file permissions, as it can read any process's
    memory; the secret protects nothing against root.)"""
    addr = _address("otheruid")
    with serving(addr):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it could do, then exit at once
            code = 0
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.settimeout(2)
                        s.connect(addr)
                    code |= 1  # connected: the test fails
                except PermissionError:
                    pass
                try:
                    with open(key_path(addr), "rb"):
                        code |= 2
                except PermissionError:
                    pass
                try:
                    os.listdir(Path(addr).parent)
                    code |= 4
                except PermissionError:
                    pass
            except BaseException:
                code = 8
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        report = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert report == b"\0", f"child as uid {NOBODY} could: {report!r} (1 connect, 2 read key, 4 list, 8 error)"
        client = LookupClient(addr)  # and we (root, here) still can
        assert client.lookup(KEYS, [0]) == (len(KEYS), 0)
        client.close()


def test_the_secret_is_random_and_nothing_visible_reveals_it() -> None:
    instance = f"test-{os.getpid()}-visible-{time.monotonic_ns()}"
    addr = lookup_address(instance, 0, 0)
    secrets_seen = []
    for _ in range(2):  # the same instance and path: a fresh secret each time
        with serving(addr) as server:
            secrets_seen.append(server.secret)
            visible = Path("/proc/net/unix").read_text() if os.path.exists("/proc/net/unix") else ""
            listed = [line.split()[-1] for line in visible.splitlines()[1:] if len(line.split()) >= 8]
            if visible:
                assert addr in listed  # a filesystem socket, in the private directory
                assert not any(name.startswith("@kvstrata") for name in listed)  # no abstract name
            for shown in (visible, addr, instance, os.path.basename(addr)):
                assert server.secret.hex() not in shown and server.secret not in shown.encode()
            for guess in (f"kvstrata:{instance}", instance, addr, os.path.basename(addr)):
                assert not hmac.compare_digest(server.secret, guess.encode()[:32].ljust(32, b"\0"))
                assert LookupClient(addr, secret=guess.encode()).lookup(KEYS, [0]) is None
    assert secrets_seen[0] != secrets_seen[1] and all(len(s) == 32 for s in secrets_seen)


def test_a_killed_servers_leftovers_are_swept_and_a_live_socket_is_never_taken() -> None:
    addr = _address("stale")
    old = str(Path(addr).with_name(f"killed-{os.getpid()}-{time.monotonic_ns()}.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # bound, then gone: no unlink
        dead.bind(old)
    Path(key_path(old)).write_bytes(b"x" * 32)
    recent = str(Path(addr).with_name(f"recent-{os.getpid()}-{time.monotonic_ns()}.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(recent)
    long_ago = time.time() - lk.STALE_AFTER_S - 10
    for p in (old, key_path(old)):
        os.utime(p, (long_ago, long_ago), follow_symlinks=False)
    try:
        with serving(addr):
            assert not os.path.lexists(old) and not os.path.lexists(key_path(old))
            assert os.path.lexists(recent)  # maybe a server between bind() and listen(): kept
            with pytest.raises(LookupSocketError) as err:
                LookupServer(addr, _count)  # the same address while one serves there
            assert err.value.errno == errno.EADDRINUSE
            client = LookupClient(addr)
            assert client.lookup(KEYS, [0]) == (len(KEYS), 0)  # the live one kept its key file
            client.close()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(recent)
