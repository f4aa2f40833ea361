"""Scheduler -> worker lookups over a local socket (no vLLM import; unit-testable on its own).

vLLM's scheduler runs in another process than its workers, and a worker's DRAM tier (and the
stores it has queued but not yet written) is invisible to any other process. Each worker serves
lookups from its own engine on a Unix socket; the scheduler asks every tensor-parallel rank and
takes the shortest answer, so a prompt re-sent right after it was stored hits the worker's DRAM.
When a worker does not answer within the timeout, the scheduler falls back to the persistent
tiers it can read itself, and leaves that worker alone for a while, so a stuck worker never
stalls scheduling.

**Who may connect.** The answers say which prefixes this instance holds, so the socket admits
only this user's kvstrata processes, in two layers:

* The socket is a file in a per-user directory (:func:`socket_dir`: ``$XDG_RUNTIME_DIR/kvstrata``
  when that runtime directory is ours and private, else ``<tmp>/kvstrata-<uid>``), created
  ``0700`` and checked before every use (a directory, not a symlink, owned by us, no group or
  other bits; anything else is refused with an error naming the path). Other users cannot even
  ``connect()``; the path (it names the vLLM instance and rank, and shows in ``/proc/net/unix``)
  gives them nothing.
* Each connection must pass a mutual HMAC-SHA256 challenge with the server's secret: 32 random
  bytes (``secrets.token_bytes``) the worker's server makes when it starts, written to a ``0600``
  key file beside the socket (``<name>.key``, the same checked directory) and read by the
  scheduler's client when it connects. Nothing about the secret is derivable from the instance
  id, the path or anything else visible; a client with another key gets no data (the connection
  is closed, counted in :attr:`LookupServer.rejections`, logged once), and a client never sends
  a lookup to a server that did not prove it holds the key.

**Why the secret travels through the key file**, not vLLM's config, an environment variable or
vLLM's handshake channel (read from vLLM 0.32's source). ``EngineCore.__init__`` builds the
executor, then ``_initialize_kv_caches`` runs every worker's ``initialize_from_config``, which
builds the worker connectors (and their servers), and only then ``Scheduler(...)`` builds the
scheduler connector: the scheduler half exists after the workers already serve, in every
executor (``UniProcExecutor``: the worker in the engine-core process; ``MultiprocExecutor``:
worker processes that unpickle ``vllm_config``), so it cannot hand them anything. The process
that creates ``vllm_config`` (the front end) runs none of our code with it before it is pickled,
and ``kv_transfer_config`` is logged by vLLM (non-default engine args), so a secret in
``kv_connector_extra_config`` would leak. An environment variable reaches only the processes
spawned after it is set (not Ray actors) and every one of them, with no instance scope. vLLM's
worker -> scheduler handshake metadata (``get_handshake_metadata``) arrives in time, but a
``MultiConnector`` keeps the first sub-connector's metadata only and hands it to every
sub-connector: next to ``NixlConnector`` it would break NIXL's start-up. The key file is written
by the process that owns the socket (the worker; under ``UniProcExecutor`` that is the
engine-core process itself), is readable only by this user (as the socket itself is), crosses
any process boundary on the node (the in-process executor, spawned worker processes, any
executor whose workers run on the node as the same user with the same ``TMPDIR`` /
``XDG_RUNTIME_DIR``), and is removed with the socket; a killed server's leftovers are swept by
the next server in the directory. Each server (each rank) has its own secret.

**Deadlines.** The server's accept loop never talks to a client: each connection authenticates
on its own thread within ``handshake_timeout_s`` (a client that sends nothing, garbage or half a
handshake is dropped then), and at most ``max_pending`` connections wait to authenticate (a new
one pushes out the oldest), so idle connections never stall a real lookup. The client's connect,
handshake, request and reply all run under one deadline of ``timeout_s`` per lookup.

Wire format (bytes, no pickle). Handshake: server ``MAGIC, nonce_s (32)``; client ``MAGIC,
nonce_c (32), HMAC(key, "client" nonce_s nonce_c)``; server ``HMAC(key, "server" nonce_c
nonce_s)``. Then frames ``u32 length, payload``: request ``u16 n_layers, u16 layers[n], keys (16
bytes each)``; reply (8 bytes, unframed) ``u32 blocks, u32 fast`` (``fast``: how many of those
blocks the worker holds in memory tiers, DRAM or a queued store, so a load of them is a memcpy,
not a disk or network read).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata.core.keys import Key

log = logging.getLogger("kvstrata.vllm.lookup")

KEY_BYTES = 16
SECRET_BYTES = 32
NONCE_BYTES = 32
MAGIC = b"KVSLOOK1"
MAX_REQUEST_BYTES = 4 << 20  # 262,144 keys: far beyond any prompt
STALE_AFTER_S = 60.0  # a socket this old that refuses connections is a killed server's leftover
_MAX_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
Answer = Callable[[list[Key], list[int]], tuple[int, int]]


class LookupSocketError(OSError):
    """The lookup socket's directory or key file is unsafe (or the socket is taken)."""


# -- the private directory and the key file ---------------------------------------------------
def _private_dir_problem(path: Path) -> str | None:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (chmod 700 {path})"
    return None


def ensure_private_dir(path: str | Path) -> Path:
    """``path`` as a directory only this user can enter: created ``0700`` when missing, else
    checked (a directory, not a symlink, owned by us, no group/other bits). Raises
    :class:`LookupSocketError` naming the path and what is wrong; never repairs another's dir."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise LookupSocketError(
            exc.errno, f"kvstrata lookup socket directory {path}: cannot create it ({exc})"
        ) from None
    problem = _private_dir_problem(path)
    if problem is not None:
        raise LookupSocketError(errno.EPERM, f"kvstrata lookup socket directory {path} {problem}; refusing to use it")
    return path


def socket_dir() -> Path:
    """The per-user directory the lookup sockets live in (see the module; the server creates and
    checks it, the client checks it)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _private_dir_problem(Path(runtime)) is None:
        return Path(runtime) / "kvstrata"
    return Path(tempfile.gettempdir()) / f"kvstrata-{os.geteuid()}"


def lookup_address(instance_id: str, dp_rank: int, tp_rank: int) -> str:
    """Socket path of one worker's lookup server (unique per vLLM instance and rank), in
    :func:`socket_dir`. The instance id is not a secret: it only names the socket."""
    directory = socket_dir()
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id) or "_"
    path = directory / f"{safe}-dp{dp_rank}-tp{tp_rank}.sock"
    if len(os.fsencode(path)) > _MAX_PATH:  # a long instance id: its digest names the socket
        digest = hashlib.sha256(instance_id.encode()).hexdigest()[:16]
        path = directory / f"{digest}-dp{dp_rank}-tp{tp_rank}.sock"
    return str(path)


def key_path(address: str) -> str:
    """The key file beside a lookup socket."""
    return str(Path(address).with_suffix(".key"))


def _write_key(path: str, secret: bytes) -> int:
    """Write ``secret`` to ``path`` (``0600``, atomically replacing a leftover); its inode."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret)
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return ino


def read_key(address: str) -> bytes:
    """The secret of the server at ``address``, from its key file, which must be a regular file
    of ours that no one else can read, in a private directory (:class:`LookupSocketError` if not)."""
    path = key_path(address)
    problem = _private_dir_problem(Path(path).parent)
    if problem is not None:
        raise LookupSocketError(errno.EPERM, f"kvstrata lookup socket directory {Path(path).parent} {problem}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise LookupSocketError(
                errno.EPERM,
                f"kvstrata lookup key file {path} is not a private file of this user "
                f"(mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}); refusing it",
            )
        secret = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(secret) != SECRET_BYTES:
        raise LookupSocketError(
            errno.EINVAL, f"kvstrata lookup key file {path} holds {len(secret)} bytes, not {SECRET_BYTES}"
        )
    return secret


def _listening(path: str) -> bool:
    """Whether a server accepts connections on ``path`` (a refused or missing socket: no)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # a full backlog, a timeout: someone is there
        return True


def _sweep(directory: Path, keep: str) -> None:
    """Remove what killed servers left in ``directory``: sockets older than
    :data:`STALE_AFTER_S` that refuse connections, and their key files (bounded, best effort)."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for n, entry in enumerate(it):
            if n >= 1024:
                break
            if entry.path == keep or not entry.name.endswith((".sock", ".key", ".tmp")):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if now - st.st_mtime < STALE_AFTER_S:
                    continue
                if entry.name.endswith(".sock"):
                    if stat.S_ISSOCK(st.st_mode) and not _listening(entry.path):
                        os.unlink(entry.path)
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(key_path(entry.path))
                elif entry.name.endswith(".tmp"):
                    os.unlink(entry.path)  # a key file a killed server was writing
                elif not os.path.lexists(str(Path(entry.path).with_suffix(".sock"))):
                    os.unlink(entry.path)  # a key whose socket is gone


# -- framing under a deadline -------------------------------------------------------------------
def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(None if deadline is None else _remaining(deadline))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(len(buf))  # the number of bytes that did arrive
        buf += chunk
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


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


class _Rejected(Exception):
    """A connection that failed the handshake; the message is the reason."""


class LookupServer:
    """Answers lookups with ``answer(keys, layers) -> (restorable blocks, of them in memory)``
    on daemon threads, to clients that prove they hold its secret (see the module docstring).

    ``secret``: the handshake key (default: 32 fresh random bytes, written to the key file
    beside the socket for the scheduler to read). ``rejections`` counts the connections dropped
    before authenticating, by reason (each reason is logged once)."""

    def __init__(
        self,
        address: str,
        answer: Answer,
        *,
        secret: bytes | None = None,
        handshake_timeout_s: float = 2.0,
        max_pending: int = 16,
    ) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError(f"a lookup secret needs at least 16 bytes, got {len(secret)}")
        self.address = address
        self.secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending = max(1, max_pending)
        self.rejections: Counter[str] = Counter()
        self._answer = answer
        self._closed = False
        self._pending: dict[socket.socket, float] = {}  # waiting to authenticate, oldest first
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        if len(os.fsencode(address)) > _MAX_PATH:
            raise LookupSocketError(
                errno.ENAMETOOLONG,
                f"kvstrata lookup socket path {address} is too long for a Unix socket (a shorter TMPDIR)",
            )
        directory = ensure_private_dir(Path(address).parent)
        _sweep(directory, keep=address)
        self._claim(address)
        self._key_ino = _write_key(key_path(address), self.secret)  # before anyone can connect
        try:
            self._sock, self._sock_ino = self._listen(address)
        except BaseException:
            self._unlink_ours(key_path(address), self._key_ino)
            raise
        self._thread = threading.Thread(target=self._accept, name="kvstrata-lookup", daemon=True)
        self._thread.start()

    @staticmethod
    def _claim(address: str) -> None:
        """Refuse an address another server listens on; remove a killed server's socket there."""
        if os.path.lexists(address):
            st = os.lstat(address)
            if not stat.S_ISSOCK(st.st_mode):
                raise LookupSocketError(errno.EEXIST, f"kvstrata lookup socket {address} exists and is not a socket")
            if _listening(address):
                raise LookupSocketError(
                    errno.EADDRINUSE, f"kvstrata lookup socket {address}: another server listens there"
                )
            os.unlink(address)  # a killed server's leftover

    @staticmethod
    def _listen(address: str) -> tuple[socket.socket, int]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(address)
            os.chmod(address, 0o600)  # the directory already keeps others out; no one needs more
            ino = os.stat(address).st_ino
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return sock, ino

    @property
    def pending(self) -> int:
        """Connections waiting to authenticate now."""
        with self._lock:
            return len(self._pending)

    def _reject(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1
            first = self.rejections[reason] == 1
        if first:
            log.warning(
                "kvstrata lookup server %s: dropped a connection (%s) before it could ask anything. Further ones "
                "are counted, not logged",
                self.address,
                reason,
            )

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. out of descriptors: do not spin
                continue
            if self._closed:
                conn.close()
                return
            evicted = None
            with self._lock:
                if len(self._pending) >= self.max_pending:
                    evicted = next(iter(self._pending))
                    del self._pending[evicted]
                    with contextlib.suppress(OSError):  # wakes its thread, which closes it
                        evicted.shutdown(socket.SHUT_RDWR)
                self._pending[conn] = time.monotonic()
            if evicted is not None:
                self._reject(f"more than {self.max_pending} connections waiting to authenticate; the oldest went")
            threading.Thread(target=self._serve, args=(conn,), name="kvstrata-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                self._handshake(conn)
            except _Rejected as why:
                with self._lock:
                    ours = conn in self._pending  # not pushed out (counted then) or closing
                if ours:
                    self._reject(str(why))
                return
            except (OSError, EOFError):  # pushed out (already counted), a probe that hung up at once
                return
            with self._lock:
                if self._closed or self._pending.pop(conn, None) is None:
                    return  # closing, or pushed out meanwhile
                self._conns.add(conn)
            while self._reply(conn):
                pass
        finally:
            with self._lock:  # under the lock: close() never touches a closed (reused) descriptor
                self._pending.pop(conn, None)
                self._conns.discard(conn)
                conn.close()

    def _handshake(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.handshake_timeout_s
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        _send_all(conn, MAGIC + nonce_s, deadline)
        want = len(MAGIC) + NONCE_BYTES + hashlib.sha256().digest_size
        try:
            reply = _recv_exact(conn, want, deadline)
        except TimeoutError:
            raise _Rejected(f"no complete handshake within {self.handshake_timeout_s:g}s") from None
        except EOFError as exc:
            if exc.args and exc.args[0]:
                raise _Rejected("closed in the middle of the handshake") from None
            raise
        if not reply.startswith(MAGIC):
            raise _Rejected("not a kvstrata lookup client (bad handshake bytes)")
        nonce_c, proof = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES], reply[len(MAGIC) + NONCE_BYTES :]
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", nonce_s, nonce_c)):
            raise _Rejected("wrong key")
        _send_all(conn, _mac(self.secret, b"server", nonce_c, nonce_s), deadline)

    def _reply(self, conn: socket.socket) -> bool:
        try:
            (size,) = struct.unpack("<I", _recv_exact(conn, 4, None))  # an idle client may wait
            if size > MAX_REQUEST_BYTES:
                log.warning("kvstrata lookup server: a %d-byte request is over the limit; closing", size)
                return False
            data = _recv_exact(conn, size, time.monotonic() + self.handshake_timeout_s)
        except (OSError, EOFError):
            return False
        try:
            keys, layers = decode_request(data)
            n, fast = self._answer(keys, layers)
        except Exception as exc:  # a bad request or a tier fault: answer "nothing"
            log.warning("kvstrata lookup server: %s", exc)
            n = fast = 0
        try:
            conn.settimeout(self.handshake_timeout_s)
            conn.sendall(struct.pack("<II", int(n), int(min(fast, n))))
        except OSError:
            return False
        return True

    @staticmethod
    def _unlink_ours(path: str, ino: int) -> None:
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == ino:  # not a newer server's file at the same path
                os.unlink(path)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):  # wakes accept() on Linux
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:  # and elsewhere
            wake.settimeout(1.0)
            wake.connect(self.address)
        self._thread.join(timeout=2.0)
        self._unlink_ours(self.address, self._sock_ino)
        self._unlink_ours(key_path(self.address), self._key_ino)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:  # clients see the server gone at once; each connection's thread closes it
            for conn in [*self._pending, *self._conns]:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._pending.clear()
            self._conns.clear()


class LookupClient:
    """The scheduler's side: ``lookup`` returns (blocks, of them in memory), or None when the
    worker cannot answer within ``timeout_s`` (connect, handshake, request and reply together).

    The key is read from the server's key file at each connect, unless ``secret`` is given."""

    def __init__(
        self, address: str, timeout_s: float = 1.0, retry_after_s: float = 5.0, *, secret: bytes | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._secret = secret
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self.failures = 0

    def lookup(self, keys: Sequence[Key], layers: Sequence[int]) -> tuple[int, int] | None:
        if time.monotonic() < self._down_until:
            return None
        request = encode_request(keys, layers)
        deadline = time.monotonic() + self.timeout_s
        try:
            sock = self._connect(deadline)
            _send_all(sock, struct.pack("<I", len(request)) + request, deadline)
            n, fast = struct.unpack("<II", _recv_exact(sock, 8, deadline))
        except (OSError, EOFError) as exc:  # TimeoutError and LookupSocketError are OSErrors
            self._fail(exc)
            return None
        n = min(int(n), len(keys))
        return n, min(int(fast), n)

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(self.address)
            secret = (
                self._secret if self._secret is not None else read_key(self.address)
            )  # after connect: the live server's
            hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
            if not hello.startswith(MAGIC):
                raise LookupSocketError(errno.EPROTO, "not a kvstrata lookup server")
            nonce_s, nonce_c = hello[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES)
            _send_all(sock, MAGIC + nonce_c + _mac(secret, b"client", nonce_s, nonce_c), deadline)
            proof = _recv_exact(sock, hashlib.sha256().digest_size, deadline)
            if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
                raise LookupSocketError(errno.EACCES, "the server did not prove it holds the key")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            if isinstance(exc, EOFError):
                exc = EOFError("the server closed the connection (a wrong key, or it stopped)")
            log.warning("kvstrata: worker lookup at %r failed (%s); using the persistent tiers", self.address, exc)
        self.close()
        self._down_until = time.monotonic() + self.retry_after_s

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
