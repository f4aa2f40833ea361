"""The ``mooncake`` tier: layer-blocks in a cluster-wide DRAM pool (Mooncake Store).

Every process that opens this tier becomes a Mooncake client: it contributes
``global_segment_size`` bytes of its DRAM to a pool that one ``mooncake_master`` manages,
and may put objects into, and read them from, any node's share. The pool is a cache
(``persistent=False``): the master may evict objects, and the objects in a node's share
vanish when that process exits. It is shared (``shared=True``): ``contains`` asks the
master, so a process finds blocks that another one stored.

Objects
-------
One object holds one key's layer-blocks of one *chunk*: consecutive layers of one layer
group (same kind, shape and dtype), as many as fit in ``object_size`` (at least one).
A 32-layer model with 64 KiB layer-blocks thus keeps a block as one 2 MiB object, large
enough for full transfer speed (per-call overhead dominates small objects), and a
mixed model (full attention, sliding window, Mamba state) keeps each group apart. The
chunking is a pure function of the layout and ``object_size``, so a reader knows where
layer ``L`` of key ``K`` lies without asking anyone. An object is its layers' *records*
back to back, each at a 64-byte aligned offset; a record is a 64-byte header and then
the layer's bytes (little-endian)::

    0    magic "KVMR", format u16, layer u16, flags u16 (1: present), reserved u16, length u32
    16   namespace seed (16 B), key (16 B)
    48   xxh3_64 of the layer's bytes
    56   xxh3_64 of header bytes 0-55
    64   the layer's bytes, zero-padded to a multiple of 64

So a record checks itself (identity and both checksums) and one contiguous byte range
serves one layer: a layer-by-layer load reads one range per layer of each object.
Object names are ``<prefix>/<namespace seed, hex>/<key, hex>/<first>-<last>-<hash of the
chunk's layers>``: the namespace digest (model, layout, dtype, TP rank, tenant salt, ...)
keeps models and tenants apart in a shared master, and a process configured with another
``object_size`` misses instead of misreading. No pickle anywhere.

Moving bytes
------------
All transfers go through staging slabs carved out of one buffer registered with the
client (``register_buffer``), so the transfer engine moves bytes straight between that
buffer and the pool (RDMA or TCP) with one call per slab-full, never one per block:

* ``write`` packs a batch's objects into a slab and sends them with one
  ``batch_put_from``; objects it replaces (ones this tier put before) are removed first
  in the same client-thread call. Not ``upsert``: two clients upserting one key at once
  leak pool space in Mooncake 0.3.13. A put of a name that exists keeps the object there
  (the first writer wins): keys are prefix hashes, so both writers hold the same bytes,
  and a bad copy reads as ``CORRUPT``, which the engine drops and stores again. An
  object that the batch covers only in part (some of its layers) is first read back
  (``batch_get_into``), merged and replaced, under a lock of this process; two processes
  merging into one object at once may lose one's layers (a miss later, never wrong
  bytes).
* ``read`` fetches only the records of the requested layers (``get_into_ranges``, one
  call per slab-full), so the engine's layer-by-layer loads do not move whole objects
  once per layer; consecutive records travel as one range. Every record is verified
  (identity and xxh3_64 of header and bytes) before a byte reaches the caller's buffer;
  a mismatch is re-read once (a concurrent rewrite or eviction tears reads): the same
  bad bytes again are ``CORRUPT``, other bytes (the object is changing) ``MISSING``.
  Objects that are gone, or between the remove and the put of a rewrite, are
  ``MISSING``.
* ``delete`` removes whole objects (``batch_remove(force=True)``: a reader's lease must
  not keep evicted blocks alive) and rewrites objects that lose only some layers.

Faults
------
The tiers of one process that name the same master and client settings share one
Mooncake client (a client is heavy: a DRAM segment, a transfer engine, ports,
heartbeats; closing one stalls the interpreter for 1-2 s); it closes with the last of
them. Every client call runs on the client's own threads with a deadline
(``timeout_s``). A call that times out or fails with an RPC error trips a breaker: for a
backoff period (doubling up to 8 s) every operation answers at once with misses,
``False`` or ``ERROR``, and so does every operation while the client's own health check
says the master is unreachable. Nothing is raised into the engine except ``TierError``
after ``close``. Reconnecting: the Mooncake client re-mounts its segment by itself when
a restarted master comes back on the same address; if the master stays unreachable for
``reconnect_after_s`` a fresh client is set up (with backoff) and replaces it once
that succeeded, unless the old one recovered meanwhile. A master that is down when the
tier opens is retried the same way; the tier serves misses meanwhile (``connected``
says whether it has a client now). ``faults`` counts the operations answered that way,
``checksum_failures`` the layer-blocks reported ``CORRUPT``.

Space
-----
The pool's capacity is cluster-wide and the master's business. This tier's
``capacity`` bounds what *this process* has put: ``used_bytes`` is the size of the
objects it put and has not deleted (headers and padding included), whichever node's
share holds them. ``write`` never lets it exceed ``capacity``; ``has_room`` answers
from it and from the engine's live bytes, assuming each layer-block costs its bytes plus
its record header and padding (an object written in part costs its full size, absent
records included; ``write`` then refuses what does not fit). A delete releases the bytes
from the account even if the master cannot be reached (a restarted master has lost
them anyway), so the account cannot leak space forever.

Deployment notes (mooncake-transfer-engine 0.3.13)
--------------------------------------------------
``local_hostname`` must be this node's address as other nodes reach it. ``P2PHANDSHAKE``
needs no metadata server; the master's HTTP metadata server binds 0.0.0.0 whatever
``-http_metadata_server_host`` says, and the client's transfer engine listens on all
interfaces. Client knobs are environment variables read by Mooncake itself, e.g.
``MC_DISABLE_METACACHE=1`` (no cached replica locations: fewer torn reads while objects
are rewritten) or ``MC_TCP_BIND_ADDRESS``; this module sets none of them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import numpy as np
import xxhash
from mooncake.store import MooncakeDistributedStore
from pydantic import Field, field_validator

from kvstrata.core.buffers import Buffer, copy_bytes, host_bytes, is_device, nbytes
from kvstrata.core.layout import KVLayout
from kvstrata.errors import TierError
from kvstrata.tiers.base import BlockId, ReadStatus, Tier, TierCapabilities, TierContext, TierOptions
from kvstrata.tiers.records import ALIGN, KEY_BYTES, RECORD_ALIGN, align_up, digest
from kvstrata.units import Size

log = logging.getLogger("kvstrata.tiers.mooncake")

T = TypeVar("T")
MiB = 1024**2
GiB = 1024**3
MAGIC = b"KVMR"
FORMAT_VERSION = 1
RECORD_HEADER = 64
PRESENT = 1
SLABS = 4  # transfers in flight per tier (one staging slab each)
WORKERS = 4  # threads that run client calls
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 8.0
PROBE_TIMEOUT_S = 2.0

_REC = struct.Struct("<4sHHHHI16s16sQ")  # a record header's first 56 bytes; then their xxh3_64
_SUM = struct.Struct("<Q")

# Mooncake error codes (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600  # get_into_ranges answers this for ranges outside the object: not one of ours
_GONE = {-703, OBJECT_NOT_FOUND, -707, -710, -712}  # not ready, not found, lease expired, replica gone


def _master_fault(code: int) -> bool:
    return -999 <= code <= -900  # RPC_FAIL, RPC_TIMEOUT, heartbeat errors


class MooncakeOptions(TierOptions):
    """Options of the ``mooncake`` tier."""

    master_address: str = "127.0.0.1:50051"  # host:port of mooncake_master's RPC service
    metadata_server: str = "P2PHANDSHAKE"  # or the transfer-engine metadata URL, e.g. http://host:port/metadata
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_names: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1" ("" lets Mooncake choose)
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this node's segment at
    global_segment_size: Size = Field(GiB, ge=0)  # DRAM this node contributes to the pool
    local_buffer_size: Size = Field(16 * MiB, ge=0)  # the client's own transfer buffer
    staging_size: Size = Field(64 * MiB, ge=MiB)  # registered staging buffers of this tier (split in 4 slabs)
    object_size: Size = Field(4 * MiB, ge=4096)  # largest object: layers of a group are packed up to this
    timeout_s: float = Field(5.0, gt=0, le=600)  # deadline of one client call
    setup_timeout_s: float = Field(30.0, gt=0, le=3600)  # how long opening the tier waits for the master
    reconnect_after_s: float = Field(60.0, gt=0)  # replace the client after the master was unreachable this long
    prefix: str = Field("kvstrata", pattern=r"^[A-Za-z0-9._-]{1,64}$")  # first part of every object name

    @field_validator("master_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_address must be host:port, e.g. '10.0.0.1:50051', got {value!r}")
        return value

    @field_validator("metadata_server")
    @classmethod
    def _metadata_url(cls, value: str) -> str:
        if value == "P2PHANDSHAKE":
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "etcd", "redis") or not parts.netloc:
            raise ValueError(
                f"metadata_server must be 'P2PHANDSHAKE' or a URL such as 'http://host:port/metadata', got {value!r}"
            )
        return value

    @field_validator("local_hostname")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"local_hostname must be a host name or address, got {value!r}")
        return value


# -- object layout --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    """Consecutive layers of one group that share an object."""

    layers: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]  # where each layer's record starts in the object
    size: int
    tag: str  # last part of the object name

    @property
    def overhead(self) -> int:
        return self.size - sum(self.lengths)


def _record_bytes(length: int) -> int:
    return RECORD_HEADER + align_up(length, RECORD_ALIGN)


def _make_chunk(layout: KVLayout, layers: list[int]) -> _Chunk:
    lengths = tuple(layout.layer_nbytes(layer) for layer in layers)
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += _record_bytes(n)
    digest = xxhash.xxh32_hexdigest(",".join(map(str, layers)).encode())
    return _Chunk(tuple(layers), lengths, tuple(offsets), at, f"{layers[0]}-{layers[-1]}-{digest}")


def plan_chunks(layout: KVLayout, object_size: int) -> list[_Chunk]:
    """Cut every layer group into chunks of consecutive layers whose object fits ``object_size``."""
    chunks: list[_Chunk] = []
    for group in layout.groups:
        current: list[int] = []
        for layer in group.layers:
            if current and _make_chunk(layout, [*current, layer]).size > object_size:
                chunks.append(_make_chunk(layout, current))
                current = []
            current.append(layer)
        if current:
            chunks.append(_make_chunk(layout, current))
    return chunks


def write_record(record: np.ndarray, layer: int, length: int, seed: bytes, key: bytes, data: Buffer | None) -> None:
    """Fill one record's extent: the layer's ``length`` bytes from ``data`` (None: absent, zeros) and the header."""
    body = record[RECORD_HEADER:]
    if data is None:
        body[:] = 0
        flags, csum = 0, 0
    else:
        copy_bytes(body[:length], data)
        body[length:] = 0
        flags, csum = PRESENT, checksum(body[:length])
    head = _REC.pack(MAGIC, FORMAT_VERSION, layer, flags, 0, length, seed, key, csum)
    record[:RECORD_HEADER] = np.frombuffer(head + _SUM.pack(digest(head)), np.uint8)


def check_record(record: np.ndarray, layer: int, length: int, seed: bytes, key: bytes) -> bool | None:
    """True: an intact record of (namespace, key, layer) with its bytes; False: it says the layer
    is absent; None: not such a record (corrupt, torn, another key's or another format's)."""
    if len(record) < RECORD_HEADER + length:
        return None
    head = record[:RECORD_HEADER].tobytes()
    magic, fmt, got_layer, flags, _, got_length, got_seed, got_key, csum = _REC.unpack_from(head)
    if (magic, fmt, got_layer, got_length, got_seed, got_key) != (MAGIC, FORMAT_VERSION, layer, length, seed, key):
        return None
    if _SUM.unpack_from(head, 56)[0] != digest(head[:56]):
        return None
    if not flags & PRESENT:
        return False
    return True if checksum(record[RECORD_HEADER : RECORD_HEADER + length]) == csum else None


# -- staging buffers --------------------------------------------------------------------------


@dataclass(eq=False)
class _Slab:
    owner: _Staging
    offset: int
    size: int
    lent: bool = False  # handed to a client call that outlived its deadline: it gives the slab back

    @property
    def ptr(self) -> int:
        return self.owner.ptr + self.offset

    def view(self, at: int, n: int) -> np.ndarray:
        return self.owner.arena[self.offset + at : self.offset + at + n]


class _Staging:
    """One arena (registered with every client) cut into equal slabs; a transfer borrows one."""

    def __init__(self, total: int, slab_size: int) -> None:
        self.slab_size = align_up(slab_size, ALIGN)
        count = max(1, min(SLABS, total // self.slab_size))
        self.arena = np.empty(count * self.slab_size, dtype=np.uint8)
        self.count = count
        self._free = [_Slab(self, i * self.slab_size, self.slab_size) for i in range(count)]
        self._cond = threading.Condition()

    @property
    def ptr(self) -> int:
        return int(self.arena.ctypes.data)

    def borrow(self, timeout: float) -> _Slab | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                return None
            slab = self._free.pop()
            slab.lent = False
            return slab

    def give_back(self, slab: _Slab) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every slab is back (calls past their deadline return them when they end)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == self.count, timeout)

    @contextlib.contextmanager
    def slab(self, timeout: float) -> Iterator[_Slab]:
        slab = self.borrow(timeout)
        if slab is None:
            raise _Unavailable(f"no staging buffer free within {timeout}s")
        try:
            yield slab
        finally:
            if not slab.lent:  # a call past its deadline gives it back when it ends
                self.give_back(slab)


# -- the connection ------------------------------------------------------------------------------


class _Unavailable(Exception):
    """The pool cannot be used now (down, backing off, timed out): answer with misses."""


@dataclass(eq=False)
class _Client:
    store: Any  # MooncakeDistributedStore
    inflight: int = 0
    retired: bool = False


def _probe(address: str, timeout: float) -> None:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def _close_store(store: Any, keep: object) -> None:
    """Close a client on a helper thread. ``close()`` waits for the client's heartbeat and
    holds the GIL meanwhile (1-2 s), so clients are shared and closed rarely (see
    :func:`_open_link`). ``keep`` (registered arenas) stays alive until the client let go."""

    def run() -> None:
        try:
            store.close()
        except Exception as exc:  # pragma: no cover - best effort
            log.warning("closing a Mooncake client failed: %s", exc)
        held.clear()

    held = [store, keep]
    threading.Thread(target=run, name="kvstrata-mooncake-close", daemon=False).start()


_LinkKey = tuple[str, str, str, str, str, int, int, float]


class _Link:
    """One Mooncake client per process and master, shared by the tiers that use it.

    Sets the client up (with backoff), checks its health before every call, runs calls
    on its own threads with a deadline, trips a breaker on faults, and replaces a client
    that cannot reach the master for ``reconnect_after_s``. Every attached staging
    arena is registered with whichever client is current.
    """

    def __init__(self, key: _LinkKey, opts: MooncakeOptions) -> None:
        self.key = key
        self.opts = opts
        self.name = opts.master_address
        self.users = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstrata-mooncake")
        self._arenas: dict[int, np.ndarray] = {}  # attached staging arenas by address
        self._detached: list[np.ndarray] = []  # detached while a retired client (still registered) is open
        self._retired = 0  # replaced clients whose calls have not all ended (not closed yet)
        self._client: _Client | None = None
        self._setup_done: threading.Event | None = None
        self._down_until = 0.0
        self._backoff = BACKOFF_MIN_S
        self._unhealthy_since: float | None = None
        self._closed = False

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._client is not None

    def start(self, timeout: float) -> None:
        """Connect unless connected, waiting up to ``timeout``; a master not there yet is retried later."""
        with self._lock:
            done = self._setup_done if self._client is None else None
            if done is None and self._client is None:
                done = self._start_setup()
        if done is not None and not done.wait(timeout):
            log.warning("mooncake: master %s not ready after %.0fs; serving misses until it is", self.name, timeout)

    # -- staging arenas --------------------------------------------------------------------
    def attach(self, arena: np.ndarray) -> None:
        with self._lock:
            self._arenas[int(arena.ctypes.data)] = arena
            if self._client is not None:
                rc = self._client.store.register_buffer(int(arena.ctypes.data), arena.nbytes)
                if rc != 0:
                    log.warning("mooncake: register_buffer failed (%s); transfers will be refused", rc)

    def detach(self, arena: np.ndarray) -> None:
        """Forget an arena no call uses any more (unregistered from the current client)."""
        with self._lock:
            self._arenas.pop(int(arena.ctypes.data), None)
            if self._retired:  # a replaced client still has it registered: keep it until that one closes
                self._detached.append(arena)
            if self._client is not None and self._client.store.unregister_buffer(int(arena.ctypes.data)) != 0:
                log.debug("mooncake: unregister_buffer failed")

    # -- calls ---------------------------------------------------------------------------
    def call(self, op: Callable[[Any], T], timeout: float, slab: _Slab | None = None) -> T:
        """Run ``op(store)`` on a client thread within ``timeout``; ``_Unavailable`` when it cannot."""
        client = self._acquire()
        try:
            future = self._pool.submit(op, client.store)
        except RuntimeError:  # shut down by close()
            self._release(client)
            raise _Unavailable("closed") from None
        future.add_done_callback(lambda _: self._release(client))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            if not future.cancel() and slab is not None:  # started: it gives the slab back when it ends
                slab.lent = True
                future.add_done_callback(lambda _: slab.owner.give_back(slab))
            self.trip(f"a call took longer than {timeout}s")
            raise _Unavailable("timed out") from None
        except Exception as exc:  # the binding refused the call: our bug or a broken client
            log.warning("mooncake: client call failed: %r", exc)
            raise _Unavailable(str(exc)) from exc

    def check(self, codes: Sequence[int]) -> None:
        """Trip the breaker if any per-object result says the master was not reachable."""
        bad = next((c for c in codes if _master_fault(c)), None)
        if bad is not None:
            self.trip(f"master RPC failed (error {bad})")
        else:
            with self._lock:
                self._backoff = BACKOFF_MIN_S
                self._unhealthy_since = None

    def trip(self, why: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now >= self._down_until:
                log.warning("mooncake: master %s: %s; serving misses for %.2fs", self.name, why, self._backoff)
                self._down_until = now + self._backoff
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            if self._client is not None:
                self._unhealthy(now)

    def _acquire(self) -> _Client:
        with self._lock:
            if self._closed:
                raise _Unavailable("closed")
            now = time.monotonic()
            client = self._client
            if client is None:
                if now >= self._down_until:
                    self._start_setup()
                raise _Unavailable("not connected")
            if now < self._down_until:
                raise _Unavailable("backing off")
            if client.store.health_check() != 0:
                self._unhealthy(now)
                raise _Unavailable("master unreachable")
            client.inflight += 1
            return client

    def _unhealthy(self, now: float) -> None:
        """Lock held: the client cannot reach the master (its health check or a failed call
        says so; a successful call ends it); set up a replacement if that lasts.

        The old client stays current until a new one is set up (closing a client that cannot
        reach its master stalls the interpreter for seconds), and stays for good if it
        recovers by itself meanwhile (its segment holds objects)."""
        if self._unhealthy_since is None:
            self._unhealthy_since = now
            log.warning("mooncake: master %s unreachable", self.name)
        elif now - self._unhealthy_since > self.opts.reconnect_after_s and self._setup_done is None:
            log.warning(
                "mooncake: master %s unreachable for %.0fs; setting up a new client",
                self.name,
                now - self._unhealthy_since,
            )
            self._start_setup()

    def _release(self, client: _Client) -> None:
        with self._lock:
            client.inflight -= 1
            if client.retired and client.inflight == 0:
                self._retired -= 1
                self._close_retired(client)

    def _retire(self, client: _Client) -> None:
        """Lock held: stop handing out ``client``; close it once no call uses it."""
        self._client = None
        client.retired = True
        if client.inflight == 0:
            self._close_retired(client)
        else:
            self._retired += 1

    def _close_retired(self, client: _Client) -> None:
        """Lock held: close a retired client; the arenas it may know stay alive until it is closed."""
        _close_store(client.store, [*self._arenas.values(), *self._detached])
        if not self._retired:
            self._detached.clear()

    # -- setting up ------------------------------------------------------------------------
    def _start_setup(self) -> threading.Event | None:
        """Lock held: set up a client on a background thread (at most one at a time)."""
        if self._setup_done is not None or self._closed:
            return self._setup_done
        done = self._setup_done = threading.Event()
        threading.Thread(target=self._setup, args=(done,), name="kvstrata-mooncake-setup", daemon=True).start()
        return done

    def _setup(self, done: threading.Event) -> None:
        try:
            store = self._connect()
        except Exception as exc:
            with self._lock:
                self._setup_done = None
                self._down_until = time.monotonic() + self._backoff
                log.warning(
                    "mooncake: cannot connect to master %s (%s); retrying in %.2fs", self.name, exc, self._backoff
                )
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        else:
            with self._lock:
                self._setup_done = None
                if self._closed:
                    _close_store(store, list(self._arenas.values()))
                else:
                    self._install(store)
        finally:
            done.set()

    def _install(self, store: Any) -> None:
        """Lock held: make ``store`` the current client, with every attached arena registered."""
        old = self._client
        if old is not None:
            if old.store.health_check() == 0:  # it recovered meanwhile: keep it and its segment
                log.info("mooncake: the client of master %s recovered; keeping it", self.name)
                _close_store(store, list(self._arenas.values()))
                return
            self._retire(old)
        self._unhealthy_since = None
        for ptr, arena in self._arenas.items():
            rc = store.register_buffer(ptr, arena.nbytes)
            if rc != 0:
                log.warning("mooncake: register_buffer failed (%s); transfers will be refused", rc)
        self._client = _Client(store)
        self._down_until, self._backoff = 0.0, BACKOFF_MIN_S
        log.info("mooncake: connected to master %s", self.name)

    def _connect(self) -> Any:
        opts = self.opts
        try:  # the client's setup retries for minutes against a dead address: look first
            _probe(opts.master_address, PROBE_TIMEOUT_S)
            meta = urlsplit(opts.metadata_server)
            if meta.scheme in ("http", "https") and meta.port:
                _probe(f"{meta.hostname}:{meta.port}", PROBE_TIMEOUT_S)
        except OSError as exc:
            raise _Unavailable(f"not reachable: {exc}") from None
        store = MooncakeDistributedStore()
        rc = store.setup(
            opts.local_hostname,
            opts.metadata_server,
            opts.global_segment_size,
            opts.local_buffer_size,
            opts.protocol,
            opts.device_names,
            opts.master_address,
        )
        if rc != 0:
            raise _Unavailable(f"setup returned {rc}")
        return store

    def close(self) -> None:
        """Refuse new calls; the client closes when the last running call ends (a hung master
        holds a call for up to 30 s, past its deadline: close() does not wait for it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._client is not None:
                self._retire(self._client)
        self._pool.shutdown(wait=False, cancel_futures=True)


_LINKS: dict[_LinkKey, _Link] = {}
_LINKS_LOCK = threading.Lock()


def _open_link(opts: MooncakeOptions) -> _Link:
    """The shared client for these settings (one per process and master), set up if needed.

    A Mooncake client is heavy (a DRAM segment, a transfer engine, ports, heartbeats) and
    closing one stalls the interpreter for 1-2 s, so the tiers of one process that name
    the same master and client settings share one; it closes with the last of them."""
    key: _LinkKey = (
        opts.master_address,
        opts.metadata_server,
        opts.protocol,
        opts.device_names,
        opts.local_hostname,
        opts.global_segment_size,
        opts.local_buffer_size,
        opts.reconnect_after_s,
    )
    with _LINKS_LOCK:
        link = _LINKS.get(key)
        if link is None:
            link = _LINKS[key] = _Link(key, opts)
        link.users += 1
    return link


def _close_link(link: _Link) -> None:
    with _LINKS_LOCK:
        link.users -= 1
        last = link.users == 0
        if last:
            del _LINKS[link.key]
    if last:
        link.close()


# -- the tier ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Obj:
    """One object touched by a batch: which of its slots, for which batch items."""

    name: str
    chunk: _Chunk
    key: bytes
    slots: dict[int, list[int]] = field(default_factory=dict)  # slot -> positions in the batch
    reserved: bool = False  # this batch added the object to the space account
    seen: int = 0  # a read that failed its checks: digest of what it got

    @property
    def whole(self) -> bool:
        return len(self.slots) == len(self.chunk.layers)

    def read_bytes(self) -> int:
        return sum(_record_bytes(self.chunk.lengths[s]) for s in self.slots)


def _batches(objs: Sequence[_Obj], size: Callable[[_Obj], int], limit: int) -> Iterator[list[_Obj]]:
    batch: list[_Obj] = []
    used = 0
    for obj in objs:
        n = align_up(size(obj), RECORD_ALIGN)
        if batch and used + n > limit:
            yield batch
            batch, used = [], 0
        batch.append(obj)
        used += n
    if batch:
        yield batch


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += align_up(n, RECORD_ALIGN)
    return out


@dataclass
class _Ranges:
    """Where one object's wanted records go in a slab: consecutive records form one range."""

    src: list[int]  # range offsets in the object
    sizes: list[int]
    dst: list[int]  # range offsets in the slab
    records: list[tuple[int, int]]  # (slot, record offset in the slab)
    end: int  # first free slab offset after this object

    @classmethod
    def plan(cls, obj: _Obj, at: int) -> _Ranges:
        chunk = obj.chunk
        plan = cls([], [], [], [], at)
        for s in sorted(obj.slots):
            start, extent = chunk.offsets[s], _record_bytes(chunk.lengths[s])
            if plan.src and plan.src[-1] + plan.sizes[-1] == start:  # follows the previous record
                plan.records.append((s, plan.dst[-1] + plan.sizes[-1]))
                plan.sizes[-1] += extent
            else:
                plan.src.append(start)
                plan.sizes.append(extent)
                plan.dst.append(plan.end)
                plan.records.append((s, plan.end))
            plan.end = plan.dst[-1] + plan.sizes[-1]
        return plan


class MooncakeTier(Tier):
    """Cluster-wide DRAM pool on Mooncake Store; see the module docstring for the design.

    ``checksum_failures`` counts layer-blocks reported ``CORRUPT``; ``faults`` counts
    operations answered with misses because the pool could not be used.
    """

    capabilities = TierCapabilities(
        persistent=False, shared=True, checksums=True, alignment=RECORD_ALIGN, connection=True
    )
    Options = MooncakeOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        opts = options if isinstance(options, MooncakeOptions) else _coerce_options(options)
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.checksum_failures = 0
        self.faults = 0
        self._seed = context.namespace.seed
        self._base = f"{opts.prefix}/{self._seed.hex()}/"
        self._chunks = plan_chunks(context.layout, opts.object_size)
        self._where = {layer: (c, s) for c in self._chunks for s, layer in enumerate(c.layers)}
        # what one layer-block costs at most beyond its bytes (record header, padding) in a full object
        self._overhead = max(math.ceil(c.overhead / len(c.layers)) for c in self._chunks)
        largest = max(c.size for c in self._chunks)
        self._staging = _Staging(max(opts.staging_size, largest), max(opts.staging_size // SLABS, largest))
        self._lock = threading.Lock()  # the space account
        self._merge_lock = threading.Lock()  # read-modify-write of objects written or deleted in part
        self._objects: dict[str, int] = {}  # objects this tier put and did not delete -> size
        self._used = 0
        self._closed = False
        self._link = _open_link(opts)
        try:
            self._link.attach(self._staging.arena)
            self._link.start(opts.setup_timeout_s)
        except BaseException:
            _close_link(self._link)
            raise

    @property
    def connected(self) -> bool:
        """Whether the tier has a client now (it may still find the master unreachable)."""
        return self._link.connected

    def _fault(self) -> None:
        with self._lock:
            self.faults += 1

    def object_key(self, bid: BlockId) -> str | None:
        """The pool key of the object that holds ``bid`` (back-door access for tests and tools)."""
        where = self._locate(bid)
        return None if where is None else where[0]

    # -- bytes ---------------------------------------------------------------------------
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_open()
        ok = [False] * len(items)
        objs: dict[str, _Obj] = {}
        for i, (bid, buf) in enumerate(items):
            where = self._locate(bid)
            if where is not None and _acceptable(buf, where[1].lengths[where[2]]):
                _add(objs, where, bid[0], i)
        whole = [o for o in objs.values() if o.whole]
        part = [o for o in objs.values() if not o.whole]
        self._store(whole, items, ok, merge=False)
        if part:
            with self._merge_lock:
                self._store(part, items, ok, merge=True)
        return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._check_open()
        out = [ReadStatus.MISSING] * len(items)
        objs: dict[str, _Obj] = {}
        for i, (bid, dst) in enumerate(items):
            where = self._locate(bid)
            if where is not None and nbytes(dst) == where[1].lengths[where[2]]:
                _add(objs, where, bid[0], i)
        dsts = [dst for _, dst in items]
        again = self._fetch(list(objs.values()), dsts, out)
        if again:  # a rewrite or an eviction racing the read tears it: look once more
            first = {obj.name: obj.seen for obj in again}
            for obj in self._fetch(again, dsts, out):
                if obj.seen != first[obj.name]:  # other bytes each time: changing under us, not corrupt
                    _set(out, obj, ReadStatus.MISSING)
                    continue
                _set(out, obj, ReadStatus.CORRUPT)
                with self._lock:
                    self.checksum_failures += sum(map(len, obj.slots.values()))
                log.warning("mooncake tier %s: object %s failed its checks twice", self.name, obj.name)
        return out

    def delete(self, ids: Sequence[BlockId]) -> None:
        self._check_open()
        objs: dict[str, _Obj] = {}
        for i, bid in enumerate(ids):
            where = self._locate(bid)
            if where is not None:
                _add(objs, where, bid[0], i)
        whole = [o.name for o in objs.values() if o.whole]
        part = [o for o in objs.values() if not o.whole]
        if whole:
            self._forget(whole)  # released whatever the pool answers: a restarted master lost them anyway
            self._remove(whole)
        if part:
            with self._merge_lock:
                self._drop_layers(part)

    def contains(self, ids: Sequence[BlockId]) -> list[bool]:
        self._check_open()
        names = [self._locate(bid) for bid in ids]
        unique = list(dict.fromkeys(w[0] for w in names if w is not None))
        if not unique:
            return [False] * len(ids)
        try:
            codes = _codes(
                self._link.call(lambda store: store.batch_is_exist(unique), self.opts.timeout_s), len(unique)
            )
        except _Unavailable:
            self._fault()
            return [False] * len(ids)
        self._link.check(codes)
        present = {name for name, code in zip(unique, codes, strict=True) if code == 1}
        return [w is not None and w[0] in present for w in names]

    # -- space ---------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        need = sum(sizes)
        if live_bytes + need > self.capacity:
            return False
        with self._lock:
            return self._used + need + self._overhead * len(sizes) <= self.capacity

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # calls that outlived their deadline may still move bytes of the arena: unregister it only
        # once they ended; else it stays registered (and alive) until the client closes
        if self._staging.wait_idle(self.opts.timeout_s):
            self._link.detach(self._staging.arena)
        _close_link(self._link)

    # -- planning ----------------------------------------------------------------------------
    def _locate(self, bid: BlockId) -> tuple[str, _Chunk, int] | None:
        try:
            key, layer = bid
            where = self._where.get(int(layer))
        except (TypeError, ValueError):
            return None
        if where is None or not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return None
        chunk, slot = where
        return f"{self._base}{key.hex()}/{chunk.tag}", chunk, slot

    # -- reading -------------------------------------------------------------------------------
    def _fetch(self, objs: list[_Obj], dsts: list[Buffer], out: list[ReadStatus]) -> list[_Obj]:
        """Read ``objs`` into ``dsts``, setting ``out``; returns the parts that failed their checks."""
        bad: list[_Obj] = []
        for batch in _batches(objs, _Obj.read_bytes, self._staging.slab_size):
            try:
                bad += self._fetch_batch(batch, dsts, out)
            except _Unavailable:
                self._fault()
                for obj in batch:
                    _set(out, obj, ReadStatus.ERROR)
        return bad

    def _fetch_batch(self, batch: list[_Obj], dsts: list[Buffer], out: list[ReadStatus]) -> list[_Obj]:
        plans: list[_Ranges] = []
        at = 0
        for obj in batch:
            plans.append(_Ranges.plan(obj, at))
            at = plans[-1].end
        names = [obj.name for obj in batch]
        dst = [p.dst for p in plans]
        src = [p.src for p in plans]
        sizes = [p.sizes for p in plans]
        with self._staging.slab(self.opts.timeout_s) as slab:
            ptr = slab.ptr

            def op(store: Any) -> list[list[int]]:
                return store.get_into_ranges([ptr], [names], [dst], [src], [sizes])[0]

            results = _codes(self._link.call(op, self.opts.timeout_s, slab), len(batch))
            self._link.check([c for codes in results for c in codes])
            bad: list[_Obj] = []
            for obj, codes, plan in zip(batch, results, plans, strict=True):
                failed = self._deliver(obj, codes, plan, slab, dsts, out)
                if failed is not None:
                    bad.append(failed)
            return bad

    def _deliver(
        self, obj: _Obj, codes: list[int], plan: _Ranges, slab: _Slab, dsts: list[Buffer], out: list[ReadStatus]
    ) -> _Obj | None:
        """Check one object's records in the slab and copy the good layers out.

        Returns the part that failed its checks, with a digest of what was read (``seen``)."""
        error = next((c for c in codes if c < 0), None)
        if error is not None:
            if error in _GONE:
                _set(out, obj, ReadStatus.MISSING)
                return None
            if error != INVALID_PARAMS:  # a fault; INVALID_PARAMS: the object is not one of ours
                _set(out, obj, ReadStatus.ERROR)
                return None
            return replace(obj, seen=error)
        if list(codes) != plan.sizes:
            return replace(obj, seen=hash(tuple(codes)))
        failed: dict[int, list[int]] = {}
        digest = xxhash.xxh3_64()
        for s, at in plan.records:
            positions = obj.slots[s]
            n = obj.chunk.lengths[s]
            record = slab.view(at, RECORD_HEADER + n)
            good = check_record(record, obj.chunk.layers[s], n, self._seed, obj.key)
            if good is None:
                failed[s] = positions
                digest.update(record.data)
                continue
            status = _copy_out(dsts, positions, record[RECORD_HEADER:]) if good else ReadStatus.MISSING
            for i in positions:
                out[i] = status
        return replace(obj, slots=failed, seen=digest.intdigest()) if failed else None

    # -- writing -------------------------------------------------------------------------------
    def _store(self, objs: list[_Obj], items: Sequence[tuple[BlockId, Buffer]], ok: list[bool], merge: bool) -> None:
        for batch in _batches(self._reserve(objs), lambda o: o.chunk.size, self._staging.slab_size):
            try:
                done = self._store_batch(batch, items, merge)
            except _Unavailable:
                self._fault()
                done = [False] * len(batch)
            for obj, good in zip(batch, done, strict=True):
                if good:
                    for positions in obj.slots.values():
                        for i in positions:
                            ok[i] = True
                else:  # never put, or removed to be replaced: not ours any more
                    self._forget([obj.name])

    def _store_batch(self, batch: list[_Obj], items: Sequence[tuple[BlockId, Buffer]], merge: bool) -> list[bool]:
        offsets = _offsets([obj.chunk.size for obj in batch])
        with self._staging.slab(self.opts.timeout_s) as slab:
            present: list[list[bool] | None]
            if merge:
                present, replacing = self._load(batch, offsets, slab)
            else:  # objects this tier put before are replaced; others are new (or another writer's)
                present, replacing = [None] * len(batch), [not obj.reserved for obj in batch]
            for obj, at, found in zip(batch, offsets, present, strict=True):
                self._pack(obj, slab.view(at, obj.chunk.size), found, items)
            codes = self._put(batch, offsets, slab, replacing)
        return [code == 0 for code in codes]

    def _pack(
        self, obj: _Obj, view: np.ndarray, present: list[bool] | None, items: Sequence[tuple[BlockId, Buffer]]
    ) -> None:
        """Lay out ``obj`` in ``view``: the batch's layers, over the ``present`` records of an
        existing object loaded there (the others become absent records)."""
        chunk = obj.chunk
        for s, (layer, n, at) in enumerate(zip(chunk.layers, chunk.lengths, chunk.offsets, strict=True)):
            positions = obj.slots.get(s)
            if positions is not None:  # the last write of a layer in the batch wins
                data = items[positions[-1]][1]
            elif present is not None and present[s]:
                continue
            else:
                data = None
            write_record(view[at : at + _record_bytes(n)], layer, n, self._seed, obj.key, data)

    def _load(self, batch: list[_Obj], offsets: list[int], slab: _Slab) -> tuple[list[list[bool] | None], list[bool]]:
        """Read whole existing objects into their places in ``slab``: which of their records are
        intact and present (None: no object of ours there), and whether each exists."""
        names = [obj.name for obj in batch]
        ptrs = [slab.ptr + at for at in offsets]
        sizes = [obj.chunk.size for obj in batch]
        codes = _codes(
            self._link.call(lambda store: store.batch_get_into(names, ptrs, sizes), self.opts.timeout_s, slab),
            len(batch),
        )
        self._link.check(codes)
        if any(_master_fault(c) for c in codes):
            raise _Unavailable("master unreachable")
        present: list[list[bool] | None] = []
        for obj, at, code in zip(batch, offsets, codes, strict=True):
            if code != obj.chunk.size:
                present.append(None)
                continue
            chunk, view = obj.chunk, slab.view(at, obj.chunk.size)
            present.append(
                [
                    check_record(view[off : off + _record_bytes(n)], layer, n, self._seed, obj.key) is True
                    for layer, n, off in zip(chunk.layers, chunk.lengths, chunk.offsets, strict=True)
                ]
            )
        return present, [code not in _GONE for code in codes]

    def _put(self, batch: list[_Obj], offsets: list[int], slab: _Slab, replace: list[bool]) -> list[int]:
        """Put objects from ``slab``; those flagged ``replace`` are removed first.

        Not ``upsert``: two clients upserting one key at once leak pool space in Mooncake
        0.3.13 (and most such upserts fail), while racing put/remove pairs do not. A put of a
        name that exists keeps the object there (the first writer wins)."""
        names = [obj.name for obj in batch]
        ptrs = [slab.ptr + at for at in offsets]
        sizes = [obj.chunk.size for obj in batch]
        stale = [name for name, r in zip(names, replace, strict=True) if r]

        def op(store: Any) -> list[int]:
            if stale:
                store.batch_remove(stale, True)
            return list(store.batch_put_from(names, ptrs, sizes))

        codes = _codes(self._link.call(op, self.opts.timeout_s, slab), len(batch))
        self._link.check(codes)
        return codes

    # -- deleting -------------------------------------------------------------------------------
    def _remove(self, names: list[str]) -> None:
        try:
            codes = self._link.call(lambda store: store.batch_remove(names, True), self.opts.timeout_s)
        except _Unavailable:
            self._fault()
            return
        self._link.check(codes)

    def _drop_layers(self, objs: list[_Obj]) -> None:
        """Clear some layers of objects (merge lock held); objects left with none are removed."""
        for batch in _batches(objs, lambda o: o.chunk.size, self._staging.slab_size):
            offsets = _offsets([obj.chunk.size for obj in batch])
            try:
                with self._staging.slab(self.opts.timeout_s) as slab:
                    present, _ = self._load(batch, offsets, slab)
                    keep, gone = self._clear_slots(batch, offsets, present, slab)
                    if keep:
                        self._put([batch[k] for k in keep], [offsets[k] for k in keep], slab, [True] * len(keep))
            except _Unavailable:
                self._fault()
                continue
            if gone:
                self._forget([o.name for o in gone])
                self._remove([o.name for o in gone])

    def _clear_slots(
        self, batch: list[_Obj], offsets: list[int], present: list[list[bool] | None], slab: _Slab
    ) -> tuple[list[int], list[_Obj]]:
        """Make the batch's layers absent in the loaded objects; returns (positions to rewrite, objects to remove)."""
        keep: list[int] = []
        gone: list[_Obj] = []
        for k, (obj, at, found) in enumerate(zip(batch, offsets, present, strict=True)):
            left = [] if found is None else [s for s, p in enumerate(found) if p and s not in obj.slots]
            if not left:  # absent, not ours, or nothing else in it: remove it
                gone.append(obj)
                continue
            keeping = [s in left for s in range(len(obj.chunk.layers))]
            self._pack(replace(obj, slots={}), slab.view(at, obj.chunk.size), keeping, [])
            keep.append(k)
        return keep, gone

    # -- the space account ------------------------------------------------------------------------
    def _reserve(self, objs: list[_Obj]) -> list[_Obj]:
        """Add new objects to the account while they fit ``capacity``; returns those that do."""
        fit: list[_Obj] = []
        with self._lock:
            for obj in objs:
                if obj.name not in self._objects:
                    if self._used + obj.chunk.size > self.capacity:
                        continue
                    self._objects[obj.name] = obj.chunk.size
                    self._used += obj.chunk.size
                    obj.reserved = True
                fit.append(obj)
        return fit

    def _forget(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._used -= self._objects.pop(name, 0)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"mooncake tier {self.name!r} (master {self.opts.master_address}) is closed")


# -- helpers -------------------------------------------------------------------------------------


def _add(objs: dict[str, _Obj], where: tuple[str, _Chunk, int], key: bytes, position: int) -> None:
    name, chunk, slot = where
    obj = objs.get(name)
    if obj is None:
        obj = objs[name] = _Obj(name, chunk, key)
    obj.slots.setdefault(slot, []).append(position)


def _acceptable(buf: Buffer, length: int) -> bool:
    """A contiguous buffer of exactly one layer-block (host or device)."""
    try:
        if is_device(buf):
            if not buf.is_contiguous():
                return False
        else:
            host_bytes(buf)  # raises ValueError for a non-contiguous buffer
        return nbytes(buf) == length
    except (AttributeError, TypeError, ValueError):
        return False


def _codes(result: list[T], n: int) -> list[T]:
    """A client call's per-object results, which must be one per object asked for."""
    if len(result) != n:
        raise _Unavailable(f"the client answered {len(result)} results for {n} objects")
    return list(result)


def _set(out: list[ReadStatus], obj: _Obj, status: ReadStatus) -> None:
    for positions in obj.slots.values():
        for i in positions:
            out[i] = status


def _copy_out(dsts: list[Buffer], positions: list[int], data: np.ndarray) -> ReadStatus:
    try:
        for i in positions:
            copy_bytes(dsts[i], data)
    except (RuntimeError, TypeError, ValueError) as exc:  # e.g. a non-contiguous destination
        log.warning("mooncake tier: copying a layer-block out failed: %s", exc)
        return ReadStatus.ERROR
    return ReadStatus.OK


def _coerce_options(options: object) -> MooncakeOptions:
    data = options.model_dump() if isinstance(options, TierOptions) else options
    return MooncakeOptions.model_validate(data)
