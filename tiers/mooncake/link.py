"""The connection to the pool: one Mooncake client per process and master (:class:`Link`), with
deadlines, a breaker, health checks and reconnects."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
from mooncake.store import MooncakeDistributedStore

from kvstrata.tiers.mooncake.options import BACKOFF_MAX_S, BACKOFF_MIN_S, PROBE_TIMEOUT_S, WORKERS, MooncakeOptions
from kvstrata.tiers.mooncake.staging import Slab, Unavailable

log = logging.getLogger("kvstrata.tiers.mooncake")

T = TypeVar("T")


# Mooncake error codes (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704


INVALID_PARAMS = -600  # get_into_ranges answers this for ranges outside the object: not one of ours


GONE = {-703, OBJECT_NOT_FOUND, -707, -710, -712}  # not ready, not found, lease expired, replica gone


def master_fault(code: int) -> bool:
    return -999 <= code <= -900  # RPC_FAIL, RPC_TIMEOUT, heartbeat errors


@dataclass(eq=False)
class Client:
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
    :func:`open_link`). ``keep`` (registered arenas) stays alive until the client let go."""

    def run() -> None:
        try:
            store.close()
        except Exception as exc:  # pragma: no cover - best effort
            log.warning("closing a Mooncake client failed: %s", exc)
        held.clear()

    held = [store, keep]
    threading.Thread(target=run, name="kvstrata-mooncake-close", daemon=False).start()


LinkKey = tuple[str, str, str, str, str, int, int, float]


class Link:
    """One Mooncake client per process and master, shared by the tiers that use it.

    Sets the client up (with backoff), checks its health before every call, runs calls
    on its own threads with a deadline, trips a breaker on faults, and replaces a client
    that cannot reach the master for ``reconnect_after_s``. Every attached staging
    arena is registered with whichever client is current.
    """

    def __init__(self, key: LinkKey, opts: MooncakeOptions) -> None:
        self.key = key
        self.opts = opts
        self.name = opts.master_address
        self.users = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstrata-mooncake")
        self._arenas: dict[int, np.ndarray] = {}  # attached staging arenas by address
        self._detached: list[np.ndarray] = []  # detached while a retired client (still registered) is open
        self._retired = 0  # replaced clients whose calls have not all ended (not closed yet)
        self._client: Client | None = None
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
    def call(self, op: Callable[[Any], T], timeout: float, slab: Slab | None = None) -> T:
        """Run ``op(store)`` on a client thread within ``timeout``; ``Unavailable`` when it cannot."""
        client = self._acquire()
        try:
            future = self._pool.submit(op, client.store)
        except RuntimeError:  # shut down by close()
            self._release(client)
            raise Unavailable("closed") from None
        future.add_done_callback(lambda _: self._release(client))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            if not future.cancel() and slab is not None:  # started: it gives the slab back when it ends
                slab.lent = True
                future.add_done_callback(lambda _: slab.owner.give_back(slab))
            self.trip(f"a call took longer than {timeout}s")
            raise Unavailable("timed out") from None
        except Exception as exc:  # the binding refused the call: our bug or a broken client
            log.warning("mooncake: client call failed: %r", exc)
            raise Unavailable(str(exc)) from exc

    def check(self, codes: Sequence[int]) -> None:
        """Trip the breaker if any per-object result says the master was not reachable."""
        bad = next((c for c in codes if master_fault(c)), None)
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

    def _acquire(self) -> Client:
        with self._lock:
            if self._closed:
                raise Unavailable("closed")
            now = time.monotonic()
            client = self._client
            if client is None:
                if now >= self._down_until:
                    self._start_setup()
                raise Unavailable("not connected")
            if now < self._down_until:
                raise Unavailable("backing off")
            if client.store.health_check() != 0:
                self._unhealthy(now)
                raise Unavailable("master unreachable")
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

    def _release(self, client: Client) -> None:
        with self._lock:
            client.inflight -= 1
            if client.retired and client.inflight == 0:
                self._retired -= 1
                self._close_retired(client)

    def _retire(self, client: Client) -> None:
        """Lock held: stop handing out ``client``; close it once no call uses it."""
        self._client = None
        client.retired = True
        if client.inflight == 0:
            self._close_retired(client)
        else:
            self._retired += 1

    def _close_retired(self, client: Client) -> None:
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
        self._client = Client(store)
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
            raise Unavailable(f"not reachable: {exc}") from None
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
            raise Unavailable(f"setup returned {rc}")
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


_LINKS: dict[LinkKey, Link] = {}


_LINKS_LOCK = threading.Lock()


def open_link(opts: MooncakeOptions) -> Link:
    """The shared client for these settings (one per process and master), set up if needed.

    A Mooncake client is heavy (a DRAM segment, a transfer engine, ports, heartbeats) and
    closing one stalls the interpreter for 1-2 s, so the tiers of one process that name
    the same master and client settings share one; it closes with the last of them."""
    key: LinkKey = (
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
            link = _LINKS[key] = Link(key, opts)
        link.users += 1
    return link


def close_link(link: Link) -> None:
    with _LINKS_LOCK:
        link.users -= 1
        last = link.users == 0
        if last:
            del _LINKS[link.key]
    if last:
        link.close()
