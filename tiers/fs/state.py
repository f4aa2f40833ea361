"""The state one ``fs`` tier instance keeps (:class:`FSState`), shared by its parts."""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass

import fsspec

from kvstrata.errors import TierError
from kvstrata.tiers.auth import record_key
from kvstrata.tiers.base import Tier, TierContext, TierOptions
from kvstrata.tiers.fs.catalog import Catalog, ObjectInfo
from kvstrata.tiers.fs.format import OBJ_SUFFIX, TMP_SUFFIX, key_area, parse_name
from kvstrata.tiers.fs.options import FSOptions, _as_dict
from kvstrata.tiers.fs.store import ObjectStore
from kvstrata.tiers.records import RECORD_ALIGN, align_up

log = logging.getLogger("kvstrata.tiers.fs")


@dataclass
class FSCounters:
    """Monotonic counters of one fs tier (``FSTier.stats()``)."""

    objects_written: int = 0
    bytes_written: int = 0
    range_reads: int = 0
    bytes_read: int = 0
    checksum_failures: int = 0  # records whose xxh3_64 did not match on read or verify
    auth_failures: int = 0  # with a secret: headers, records and tombstones whose keyed check failed
    quarantined_objects: int = 0
    collected_objects: int = 0  # dead objects deleted after their grace period
    compactions: int = 0
    expired_objects: int = 0  # by TTL or capacity
    tombstones_written: int = 0
    refreshes: int = 0
    full_refreshes: int = 0


class FSState(Tier):
    """What every part of the fs tier shares: options, the store, the catalog, counters, locks
    and pending deletes; and the helpers that keep them."""

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        opts = options if isinstance(options, FSOptions) else FSOptions.model_validate(_as_dict(options))
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.root_url = f"{opts.url.rstrip('/')}/{context.namespace.fingerprint}"
        private = fsspec.core.split_protocol(opts.url)[0] == "memory"  # one process's memory: nobody else writes it
        self._key = record_key(opts, context.namespace, "fs", name, opts.url, warn=not private)
        self.area = key_area(self._key)  # "" or "k<key id>/": where this tier's objects and tombstones live
        self.store = ObjectStore.of(self.root_url, opts, f"fs tier {name!r}")
        self.counters = FSCounters()
        self.catalog = Catalog()
        self._writer = secrets.token_hex(6)
        self._seq = 0
        self._last_ts = 0
        self._lock = threading.Lock()  # catalog, counters, pending tombstones: short sections, no I/O
        self._name_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._compacting: set[str] = set()
        self._bad: set[str] = set()  # stems of quarantined objects and unreadable tombstones
        self._pending: dict[str, set[bytes]] = {}  # deletes not yet in a published tombstone: stem -> blocks
        self._flush_lock = threading.Lock()  # one tombstone publisher at a time
        self._tmp_files: dict[str, float] = {}  # temp files in the last full listing -> first seen (wall)
        self._refreshed_at = float("-inf")  # monotonic
        self._full_at = float("-inf")
        self._listed_wall = 0.0  # wall clock when the last listing started
        self._full_wall = 0.0
        self._closed = False
        self._stop = threading.Event()
        self._maintainer: threading.Thread | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"fs tier {self.name!r} at {self.root_url} is closed")

    def __repr__(self) -> str:
        return f"FSTier({self.name!r}, {self.root_url!r})"

    def _lookup_claim(self, bkeys: list[bytes | None]) -> list[bool]:
        with self._lock:
            hits = [None if k is None else self.catalog.lookup(k) for k in bkeys]
            for hit in hits:
                if hit is not None:
                    hit[0].claimed = True
        return [hit is not None for hit in hits]

    def _quarantine(self, info: ObjectInfo, why: str) -> None:
        """Stop serving ``info`` (here at once, elsewhere once it is moved aside)."""
        with self._lock:
            if info.stem in self._bad:
                return
            self._bad.add(info.stem)
            self.counters.quarantined_objects += 1
            if self.catalog.objects.get(info.stem) is info:
                self.catalog.forget(info.stem)
        log.warning("fs tier %s: quarantining %s: %s", self.name, info.rel, why)
        try:
            self.store.move(info.rel, info.name.quarantine_path(info.area))
        except FileNotFoundError:
            pass  # another node moved or collected it
        except TierError as exc:
            log.warning("fs tier %s: could not move %s aside (not served here anyway): %s", self.name, info.rel, exc)


def _as_tier_error(exc: BaseException) -> TierError:
    if isinstance(exc, TierError):
        return exc
    return TierError(f"fs tier: {type(exc).__name__}: {exc}")


def _dead_record_bytes(info: ObjectInfo) -> int:
    return sum(align_up(rec.length, RECORD_ALIGN) for k, rec in info.recs.items() if k not in info.live)


def _is_tmp(rel: str) -> bool:
    base = rel.rsplit("/", 1)[-1]
    if not (base.startswith(".") and base.endswith(TMP_SUFFIX)):
        return False
    return parse_name(base[1:].rsplit(".", 2)[0], OBJ_SUFFIX) is not None
