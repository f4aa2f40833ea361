"""The ``fs`` tier: layer-blocks in objects on a shared filesystem or object store (fsspec).

Any fsspec URL works: ``file:///mnt/lustre/kv`` (NFS, Lustre, 3FS, ... mounted on every
node), ``s3://bucket/prefix`` (s3fs; any S3-compatible server through
``storage_options = {client_kwargs = {endpoint_url = "..."}}``), ``memory://name``
(tests). Data goes to ``<url>/<namespace fingerprint>/`` so models and tenants never
share keys; the on-store format is in :mod:`kvstrata.tiers.fs_format`.

Objects of useful size
    A write batch becomes objects of up to ``object_size`` bytes (default 4 MiB), each a
    header table (block key, offset, length, xxh3_64) followed by the records, published
    atomically (one PUT; temp file + fsync + rename on a mounted filesystem). Objects
    never change; deletes are recorded in small tombstone objects.

Finding what others published
    Each process keeps a catalog (:mod:`kvstrata.tiers.fs_catalog`) of every object's
    header. ``contains`` answers from it; for blocks it lacks it first *refreshes*, at
    most once every ``refresh_s`` (default 1 s): it lists the one to three newest epoch
    directories of objects and tombstones (names start with the writer's clock, see
    fs_format) and fetches the headers of new objects with one ranged GET each. So a
    block another node published becomes visible here within ``refresh_s`` and a
    lookup never lists the namespace. Every ``full_refresh_s`` (default 60 s, and at
    open) the whole namespace is listed, which also notices objects others removed
    and writers whose clocks are off by more than ``SKEW_S``.

Checksums and quarantine
    Every record read is checked against its xxh3_64; a mismatch is reported
    ``CORRUPT`` (the engine counts it and treats it as a miss), counted in
    ``checksum_failures``, and its object is quarantined: moved to ``quarantine/``
    (so no node serves it again; others see it vanish, a miss) and dropped from the
    catalog, so a second read costs no I/O. A damaged header is handled the same way.

Space, deletes and garbage collection
    ``used_bytes`` is the size of every object in the namespace that holds a live block
    (objects of all nodes, as far as the last refresh knows them). ``delete`` records a
    tombstone; an object whose live records fall below ``compact_threshold`` of its size
    is compacted (live records rewritten into a new object), an object with none is
    dead and stops counting at once. Dead objects are deleted ``gc_grace_s`` after this
    process saw them die (by the background thread every ``gc_interval_s``, or by
    :meth:`FSTier.maintain`), so a node still reading one from a stale view has that
    long to finish; a reader that finds an object gone reports a miss. Physical usage
    may therefore exceed ``capacity`` by what was deleted within the grace period.
    Objects older than ``ttl_s`` expire. If the namespace holds more than ``capacity``
    (other nodes wrote), the oldest objects are expired until it is back under 90 %;
    and ``has_room`` may expire objects of other nodes that this engine never adopted
    (it cannot evict those itself). Give every node sharing a namespace the same
    capacity. The grace period should exceed ``full_refresh_s + timeout_s``.

Faults
    Every remote call is bounded by ``timeout_s``; s3fs gets short connect/read timeouts
    and few retries by default. After a fault the store is considered down for
    ``retry_after_s``: lookups answer "absent", reads ``ERROR``, writes raise
    ``TierError``, all without waiting. Deletes made while it is down are kept and
    their tombstones published later (or at close).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import numpy as np
from pydantic import Field, field_validator

from kvstrata.core.buffers import Buffer, copy_bytes, host_bytes, is_device, nbytes
from kvstrata.errors import LayoutMismatchError, TierError
from kvstrata.tiers.base import (
    BlockId,
    ReadStatus,
    Tier,
    TierCapabilities,
    TierContext,
    TierOptions,
    VerifyReport,
)
from kvstrata.tiers.fs_catalog import Catalog, ObjectInfo, TombInfo
from kvstrata.tiers.fs_format import (
    EPOCH_S,
    FORMAT_VERSION,
    HEAD_PROBE,
    META,
    OBJ_SUFFIX,
    OBJECTS,
    RECORD_ALIGN,
    TMP_SUFFIX,
    TOMB_SUFFIX,
    TOMBS,
    FormatError,
    Name,
    Rec,
    batch_cost,
    epoch_of,
    header_length,
    pack_header,
    pack_tomb,
    parse_name,
    plan_object,
    split_batch,
    unpack_header,
    unpack_tomb,
)
from kvstrata.tiers.fs_store import ObjectStore
from kvstrata.tiers.records import align_up, block_key, checksum, key_or_none, parse_block_key
from kvstrata.units import parse_size

log = logging.getLogger("kvstrata.tiers.fs")

MiB = 1024**2
SKEW_S = 30.0  # clock difference between nodes that incremental refreshes tolerate
MAX_EPOCHS = 8  # an incremental refresh spanning more epoch directories lists everything instead
READ_GAP = 256 * 1024  # one ranged GET may span a hole this large to save a request
MAX_READ = 16 * MiB  # the most bytes one ranged GET asks for (unless one record is larger)
LOW_WATERMARK = 0.9  # an over-full namespace is expired down to this fraction of capacity
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a string like ``"500ms"``, ``"30s"``, ``"5m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"not a duration: {value!r} (expected seconds or e.g. '500ms', '30s', '5m', '24h')")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"duration must be a finite number of seconds >= 0: {value!r}")
    return seconds


class FSOptions(TierOptions):
    """Options of the ``fs`` tier (durations in seconds, or strings such as ``"30s"``)."""

    url: str  # fsspec URL: file:///mnt/shared/kv, s3://bucket/prefix, memory://name
    storage_options: dict[str, Any] = Field(default_factory=dict)  # passed to the fsspec filesystem
    object_size: int = 4 * MiB  # target size of one data object
    timeout_s: float = Field(10.0, gt=0)  # bound on every remote call
    open_timeout_s: float = Field(30.0, gt=0)  # bound on the calls made while opening (first contact can be slow)
    retry_after_s: float = Field(2.0, ge=0)  # after a fault, calls fail at once for this long
    retries: int = Field(2, ge=1, le=10)  # attempts per call inside s3fs/botocore
    refresh_s: float = Field(1.0, ge=0)  # blocks others publish are seen within this (0: every miss lists)
    full_refresh_s: float = Field(60.0, gt=0)  # list the whole namespace this often
    gc_grace_s: float = Field(120.0, ge=0)  # dead objects are deleted this long after they died
    gc_interval_s: float = Field(10.0, ge=0)  # background housekeeping period (0: only maintain() calls)
    ttl_s: float | None = Field(None, gt=0)  # objects older than this expire (None: never)
    compact_threshold: float = Field(0.5, ge=0.0, le=1.0)  # rewrite live objects filled below this
    max_concurrency: int = Field(8, ge=1, le=256)  # remote calls in flight per tier
    fsync: bool = True  # file:// only: fsync each object before renaming it into place

    @field_validator("url")
    @classmethod
    def _known_url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("object_size", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        size = parse_size(value)
        if not 64 * 1024 <= size <= 5 * 1024**3:
            raise ValueError(f"object_size must be between 64KiB and 5GiB, got {value!r}")
        return size

    @field_validator(
        "timeout_s",
        "open_timeout_s",
        "retry_after_s",
        "refresh_s",
        "full_refresh_s",
        "gc_grace_s",
        "gc_interval_s",
        mode="before",
    )
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _ttl(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    @property
    def path(self) -> str | None:
        """The local directory of a ``file://`` URL (so ``capacity = "auto"`` sizes from its disk)."""
        protocol, rest = fsspec.core.split_protocol(self.url)
        return rest if protocol in (None, "file", "local") else None


def check_url(url: str) -> str:
    """``url`` if fsspec can open it; a ``ValueError`` naming it (and a package to install) if not."""
    protocol, rest = fsspec.core.split_protocol(url)
    if not rest.strip("/"):
        raise ValueError(f"url {url!r} names no directory or bucket")
    if protocol is None:
        return url
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ValueError(f"url {url!r}: protocol {protocol!r} needs a package that is not installed ({exc})") from exc
    except ValueError:
        raise ValueError(f"url {url!r}: unknown protocol {protocol!r}") from None
    return url


@dataclass
class FSCounters:
    """Monotonic counters of one fs tier (``FSTier.stats()``)."""

    objects_written: int = 0
    bytes_written: int = 0
    range_reads: int = 0
    bytes_read: int = 0
    checksum_failures: int = 0  # records whose xxh3_64 did not match on read or verify
    quarantined_objects: int = 0
    collected_objects: int = 0  # dead objects deleted after their grace period
    compactions: int = 0
    expired_objects: int = 0  # by TTL or capacity
    tombstones_written: int = 0
    refreshes: int = 0
    full_refreshes: int = 0


class FSTier(Tier):
    """Shared tier on any fsspec filesystem; see the module docstring for the design."""

    capabilities = TierCapabilities(persistent=True, shared=True, checksums=True, alignment=RECORD_ALIGN, shrink=True)
    Options = FSOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        opts = options if isinstance(options, FSOptions) else FSOptions.model_validate(_as_dict(options))
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.root_url = f"{opts.url.rstrip('/')}/{context.namespace.fingerprint}"
        self.store = ObjectStore(
            self.root_url,
            opts.storage_options,
            timeout_s=opts.timeout_s,
            retry_after_s=opts.retry_after_s,
            concurrency=opts.max_concurrency,
            retries=opts.retries,
            fsync=opts.fsync,
            label=f"fs tier {name!r}",
        )
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
        try:
            # Opening is not on the inference path, and a store's first contact can be slow (an
            # object store creating its first volume, a cold mount): these calls get longer.
            opening = max(opts.timeout_s, opts.open_timeout_s)
            self._check_meta(opening)
            self._refresh(full=True, timeout_s=opening)
        except BaseException:
            self.store.close()
            raise
        if opts.gc_interval_s > 0:
            self._maintainer = threading.Thread(target=self._maintain_loop, name=f"kvstrata-fs-gc-{name}", daemon=True)
            self._maintainer.start()

    # -- bytes ---------------------------------------------------------------------------
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_open()
        ok = [self._acceptable(bid, buf) for bid, buf in items]
        chosen = [items[i] for i, good in enumerate(ok) if good]
        where = [i for i, good in enumerate(ok) if good]
        runs = split_batch([nbytes(buf) for _, buf in chosen], self.opts.object_size)
        errors: list[BaseException] = []
        for wave in range(0, len(runs), self.opts.max_concurrency):  # bounded memory: one wave at a time
            part = runs[wave : wave + self.opts.max_concurrency]
            built = [self._build(chosen[lo:hi]) for lo, hi in part]
            results = self.store.run_all([self.store.put_call(info.rel, data) for info, data in built])
            now = time.time()
            with self._lock:
                for (lo, hi), (info, data), res in zip(part, built, results, strict=True):
                    if isinstance(res, BaseException):
                        errors.append(res)
                        for j in range(lo, hi):
                            ok[where[j]] = False
                        continue
                    info.claimed = True
                    self.catalog.add(info, now)
                    self.counters.objects_written += 1
                    self.counters.bytes_written += len(data)
        if errors and not any(ok):
            raise _as_tier_error(errors[0])
        return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._check_open()
        out = [ReadStatus.MISSING] * len(items)
        jobs: dict[str, tuple[ObjectInfo, list[tuple[int, Rec]]]] = {}
        with self._lock:
            for i, (bid, _) in enumerate(items):
                bkey = key_or_none(bid)
                hit = None if bkey is None else self.catalog.lookup(bkey)
                if hit is not None:
                    jobs.setdefault(hit[0].stem, (hit[0], []))[1].append((i, hit[1]))
        if not jobs:
            return out
        if not self.store.available:
            for _, recs in jobs.values():
                for i, _ in recs:
                    out[i] = ReadStatus.ERROR
            return out
        corrupt = self._fetch(list(jobs.values()), [buf for _, buf in items], out)
        for info in corrupt:
            self._quarantine(info, "a record failed its checksum")
        return out

    def delete(self, ids: Sequence[BlockId]) -> None:
        self._check_open()
        bkeys = list(dict.fromkeys(k for k in map(key_or_none, ids) if k is not None))
        if not bkeys:
            return
        with self._lock:
            groups = self.catalog.remove(bkeys, time.time())
            sparse = self.catalog.sparse(self.opts.compact_threshold, groups)
        if not groups:
            return
        failure: TierError | None = None
        try:
            self._publish_tomb(groups)
        except TierError as exc:
            failure = exc  # kept in _pending: published by the next maintain() or close()
        if failure is None:
            for info in sparse:
                self._compact(info)
            if self.opts.gc_grace_s == 0:
                self._collect(time.time(), among=set(groups))
        if failure is not None:
            raise failure

    def contains(self, ids: Sequence[BlockId]) -> list[bool]:
        """Present according to the catalog, refreshed first (at most every ``refresh_s``)
        when some block is unknown. While the store is down every answer is False."""
        self._check_open()
        bkeys = [key_or_none(bid) for bid in ids]
        hits = self._lookup_claim(bkeys)
        if not all(hits) and time.monotonic() - self._refreshed_at >= self.opts.refresh_s:
            with contextlib.suppress(TierError):  # logged by _refresh; the breaker is open now
                self._refresh(full=False)
            hits = self._lookup_claim(bkeys)
        if not self.store.available:
            return [False] * len(ids)
        return hits

    # -- space ---------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self.catalog.charged

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        """Whether the objects one write of ``sizes`` publishes fit beside the live objects.

        When they do not, objects of other nodes that this engine never adopted (it could
        not evict them) are expired first, oldest first. No remote I/O (the engine holds its
        lock here): their tombstone goes out with the next delete, ``maintain`` or ``close``."""
        self._check_open()
        cost = batch_cost(list(sizes), self.opts.object_size)
        if cost > self.capacity:
            return False
        with self._lock:
            over = self.catalog.charged + cost - self.capacity
            if over <= 0:
                return True
            foreign = sorted((o for o in self.catalog.live_objects() if not o.claimed), key=lambda o: o.name)
        if foreign:
            self._expire(foreign, over, "space for this node's writes", publish=False)
        with self._lock:
            return self.catalog.charged + cost <= self.capacity

    # -- persistence ---------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[BlockId, int]]:
        """Every live block of the namespace; its objects count as adopted by this engine."""
        with self._lock:
            snapshot = [(parse_block_key(bkey), rec.length) for bkey, rec, _ in self.catalog.live_items()]
            for info in self.catalog.live_objects():
                info.claimed = True
        return iter(snapshot)

    def verify(self, repair: bool = False) -> VerifyReport:
        """Read every live record and check it; count bytes of dead objects and records.

        With ``repair``: quarantine objects with bad records, forget missing ones, publish
        pending tombstones and run :meth:`maintain` (collection still honours the grace period)."""
        self._check_open()
        self._refresh(full=True)
        report = VerifyReport(tier=self.name)
        with self._lock:
            live = [(info, [info.recs[k] for k in info.live]) for info in self.catalog.live_objects()]
            dead = self.catalog.dead_objects()
        report.orphan_bytes = sum(o.size for o in dead) + sum(_dead_record_bytes(o) for o, _ in live)
        bad: list[ObjectInfo] = []
        for info, recs in live:
            report.blocks_checked += len(recs)
            self._verify_object(info, recs, report, bad)
        if repair:
            for info in bad:
                self._quarantine(info, "verify found damaged records")
            self.maintain()
            report.repaired = True
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join(self.opts.timeout_s * 4)
        with contextlib.suppress(TierError):
            self._flush_pending()
        self.store.close()

    # -- housekeeping ---------------------------------------------------------------------------
    def maintain(self, now: float | None = None) -> None:
        """One round of housekeeping: publish pending tombstones, refresh, expire (TTL,
        capacity), compact sparse objects, delete objects dead for over ``gc_grace_s`` and
        tombstones nobody needs. ``now`` (wall clock) lets tests look into the future."""
        self._check_open()
        now = time.time() if now is None else now
        self._flush_pending()
        self._refresh(full=False)
        self._expire_old(now)
        with self._lock:
            over = self.catalog.charged - int(LOW_WATERMARK * self.capacity)
            oldest = sorted(self.catalog.live_objects(), key=lambda o: o.name)
            full = self.catalog.charged > self.capacity
            sparse = self.catalog.sparse(self.opts.compact_threshold)
        if full:
            self._expire(oldest, over, "the namespace is over capacity")
        for info in sparse:
            self._compact(info)
        self._collect(now)
        self._collect_tombs(now)

    def shrink(self, target_bytes: int, why: str = "below the low watermark") -> int:
        """Expire the oldest live objects (whole objects, publication order) until the namespace
        charges at most ``target_bytes``; their tombstone is published now. Returns the number of
        objects expired. For the daemon's watermarks: ``maintain`` only acts over ``capacity``."""
        self._check_open()
        with self._lock:
            over = self.catalog.charged - max(0, target_bytes)
            oldest = sorted(self.catalog.live_objects(), key=lambda o: o.name)
            before = self.counters.expired_objects
        if over > 0:
            self._expire(oldest, over, why)
        with self._lock:
            return self.counters.expired_objects - before

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = asdict(self.counters)
            out.update(
                live_blocks=len(self.catalog),
                live_objects=len(self.catalog.live_objects()),
                dead_objects=len(self.catalog.dead_objects()),
                used_bytes=self.catalog.charged,
                pending_tombstones=len(self._pending),
                faults=self.store.faults,
            )
        return out

    def _maintain_loop(self) -> None:
        while not self._stop.wait(self.opts.gc_interval_s):
            try:
                self.maintain()
            except TierError as exc:
                log.debug("fs tier %s: housekeeping skipped: %s", self.name, exc)
            except Exception:  # pragma: no cover - never let the thread die silently
                log.exception("fs tier %s: housekeeping failed", self.name)

    def _expire_old(self, now: float) -> None:
        ttl = self.opts.ttl_s
        if ttl is None:
            return
        with self._lock:
            for info in self.catalog.live_objects():
                if info.written_s + ttl < now:
                    self.catalog.expire(info, now)
                    self.counters.expired_objects += 1

    def _expire(self, candidates: list[ObjectInfo], need: int, why: str, publish: bool = True) -> None:
        """Expire objects from ``candidates`` (in order) until ``need`` bytes are uncharged, in
        one tombstone (published now, or left pending)."""
        groups: dict[str, list[bytes]] = {}
        with self._lock:
            now = time.time()
            for info in candidates:
                if need <= 0:
                    break
                if info.live and self.catalog.objects.get(info.stem) is info:
                    need -= info.size
                    groups.update(self.catalog.remove(list(info.live), now))
                    self.counters.expired_objects += 1
        if groups:
            log.info("fs tier %s: expired %d objects (%s)", self.name, len(groups), why)
            with self._lock:
                for stem, bkeys in groups.items():
                    self._pending.setdefault(stem, set()).update(bkeys)
            if publish:
                self._flush_pending()

    def _collect(self, now: float, among: set[str] | None = None) -> None:
        """Delete objects that have been dead for longer than the grace period."""
        cutoff = now - self.opts.gc_grace_s
        with self._lock:
            if among is None:
                pool = self.catalog.dead_objects()
            else:
                pool = [o for o in map(self.catalog.objects.get, among) if o is not None]
            doomed = [o for o in pool if not o.live and o.dead_since is not None and o.dead_since <= cutoff]
        if not doomed or not self.store.available:
            return
        results = self.store.run_all([self.store.delete_call(o.rel) for o in doomed])
        with self._lock:
            for info, res in zip(doomed, results, strict=True):
                if isinstance(res, TierError):
                    continue
                if self.catalog.objects.get(info.stem) is info:
                    self.catalog.forget(info.stem)
                    self.counters.collected_objects += 1

    def _collect_tombs(self, now: float) -> None:
        """Delete tombstones whose objects are all gone, as a full listing that started after
        this process saw the tombstone confirms (objects precede the tombstones naming them),
        once the grace period has passed; and stale temp files of local writers."""
        cutoff = min(now - self.opts.gc_grace_s, self._full_wall)
        with self._lock:
            doomed = [
                t
                for t in self.catalog.tombs.values()
                if t.seen < cutoff and not any(s in self.catalog.objects for s in t.objects)
            ]
            stale_tmp = [rel for rel, written in self._tmp_files.items() if written < now - self.opts.gc_grace_s]
        calls = [self.store.delete_call(t.name.tomb_path()) for t in doomed]
        calls += [self.store.delete_call(rel) for rel in stale_tmp]
        if not calls or not self.store.available:
            return
        results = self.store.run_all(calls)
        with self._lock:
            for tomb, res in zip(doomed, results, strict=False):
                if not isinstance(res, TierError):
                    self.catalog.forget_tomb(tomb.name.stem)
            for rel in stale_tmp:
                self._tmp_files.pop(rel, None)

    # -- writing ----------------------------------------------------------------------------------
    def _next_name(self) -> Name:
        with self._name_lock:
            self._last_ts = max(int(time.time() * 1000), self._last_ts)
            self._seq += 1
            return Name(self._last_ts, self._writer, self._seq)

    def _build(self, items: Sequence[tuple[BlockId, Buffer]]) -> tuple[ObjectInfo, memoryview]:
        """Pack records into one object: header table, then records at 64-byte offsets."""
        lengths = [nbytes(buf) for _, buf in items]
        size, offsets = plan_object(lengths)
        data = np.zeros(size, dtype=np.uint8)
        entries: list[tuple[bytes, Rec]] = []
        for (bid, buf), off, n in zip(items, offsets, lengths, strict=True):
            dst = data[off : off + n]
            copy_bytes(dst, buf)
            entries.append((block_key(bid), Rec(off, n, checksum(dst))))
        header = pack_header(entries)
        data[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        return ObjectInfo(self._next_name(), size, dict(entries)), data.data

    def _publish_tomb(self, groups: dict[str, list[bytes]]) -> None:
        """Record deletes (already applied to the catalog) in a tombstone; TierError if the store
        fails, in which case they stay pending and go into the next tombstone published."""
        with self._lock:
            for stem, bkeys in groups.items():
                self._pending.setdefault(stem, set()).update(bkeys)
        self._flush_pending()

    def _flush_pending(self) -> None:
        """Publish every pending delete in one tombstone; TierError when the store fails."""
        with self._flush_lock:
            with self._lock:
                groups = {stem: sorted(bkeys) for stem, bkeys in self._pending.items()}
            if not groups:
                return
            name = self._next_name()
            self.store.put(name.tomb_path(), pack_tomb(groups))
            with self._lock:
                for stem, bkeys in groups.items():
                    left = self._pending.get(stem, set())
                    left.difference_update(bkeys)
                    if not left:
                        self._pending.pop(stem, None)
                now = time.time()
                self.catalog.add_tomb(TombInfo(name, frozenset(groups), now), {}, now)
                self.counters.tombstones_written += 1

    def _acceptable(self, bid: BlockId, buf: Buffer) -> bool:
        key = key_or_none(bid)
        if key is None or bid[1] >= self.context.layout.num_layers:
            return False
        try:
            if is_device(buf) and not buf.is_contiguous():
                return False
            if not is_device(buf):
                host_bytes(buf)  # raises ValueError for a non-contiguous buffer
            return nbytes(buf) == self.context.layout.layer_nbytes(bid[1])
        except (AttributeError, TypeError, ValueError):
            return False

    # -- reading ------------------------------------------------------------------------------------
    def _fetch(
        self, jobs: list[tuple[ObjectInfo, list[tuple[int, Rec]]]], bufs: list[Buffer], out: list[ReadStatus]
    ) -> list[ObjectInfo]:
        """Ranged GETs for ``jobs``, verified and delivered into ``bufs``; returns corrupt objects."""
        runs = [(info, run) for info, recs in jobs for run in _plan_reads(recs)]
        calls = [self.store.get_call(info.rel, run[0][1].offset, _run_end(run)) for info, run in runs]
        try:
            results = self.store.run_all(calls)
        except TierError:
            results = [TierError("store down")] * len(calls)
        corrupt: dict[str, ObjectInfo] = {}
        vanished: dict[str, ObjectInfo] = {}
        for (info, run), res in zip(runs, results, strict=True):
            if isinstance(res, FileNotFoundError):
                vanished[info.stem] = info  # collected by another node: a miss
                continue
            if isinstance(res, BaseException):
                for i, _ in run:
                    out[i] = ReadStatus.ERROR
                continue
            with self._lock:
                self.counters.range_reads += 1
                self.counters.bytes_read += len(res)
            if not self._deliver(run, np.frombuffer(res, dtype=np.uint8), bufs, out):
                corrupt[info.stem] = info
        if vanished:
            with self._lock:
                for stem, info in vanished.items():
                    if self.catalog.objects.get(stem) is info:
                        self.catalog.forget(stem)
        return list(corrupt.values())

    def _deliver(self, run: list[tuple[int, Rec]], data: np.ndarray, bufs: list[Buffer], out: list[ReadStatus]) -> bool:
        """Check and copy the records of one ranged GET; False if any failed its checksum."""
        first = run[0][1].offset
        intact = True
        for i, rec in run:
            piece = data[rec.offset - first : rec.end - first]
            if len(piece) != rec.length or checksum(piece) != rec.checksum:
                out[i] = ReadStatus.CORRUPT
                intact = False
                continue
            try:
                if nbytes(bufs[i]) != rec.length:
                    out[i] = ReadStatus.ERROR
                    continue
                copy_bytes(bufs[i], piece)
            except (ValueError, TypeError, RuntimeError):
                out[i] = ReadStatus.ERROR
                continue
            out[i] = ReadStatus.OK
        if not intact:
            with self._lock:
                self.counters.checksum_failures += sum(1 for i, _ in run if out[i] is ReadStatus.CORRUPT)
        return intact

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
            self.store.move(info.rel, info.name.quarantine_path())
        except FileNotFoundError:
            pass  # another node moved or collected it
        except TierError as exc:
            log.warning("fs tier %s: could not move %s aside (not served here anyway): %s", self.name, info.rel, exc)

    def _compact(self, info: ObjectInfo) -> None:
        """Rewrite the live records of a sparse object into a new one; the old one dies."""
        with self._lock:
            if info.stem in self._compacting or not info.live or self.catalog.objects.get(info.stem) is not info:
                return
            self._compacting.add(info.stem)
            keys = sorted(info.live, key=lambda k: info.recs[k].offset)
        try:
            self._compact_records(info, keys)
        except TierError as exc:
            log.warning("fs tier %s: compacting %s failed: %s", self.name, info.rel, exc)
        finally:
            with self._lock:
                self._compacting.discard(info.stem)

    def _compact_records(self, info: ObjectInfo, keys: list[bytes]) -> None:
        recs = [(i, info.recs[k]) for i, k in enumerate(keys)]
        bufs: list[Buffer] = [np.empty(rec.length, dtype=np.uint8) for _, rec in recs]
        out = [ReadStatus.MISSING] * len(keys)
        corrupt = self._fetch([(info, recs)], bufs, out)
        good = [(parse_block_key(keys[i]), bufs[i]) for i in range(len(keys)) if out[i] is ReadStatus.OK]
        if any(s is ReadStatus.ERROR for s in out):
            return  # the store failed: try again later
        if good:
            new, data = self._build(good)
            self.store.put(new.rel, data)
            with self._lock:
                new.claimed = info.claimed
                refused = self.catalog.add(new, time.time(), expect=info)
                self.counters.objects_written += 1
                self.counters.bytes_written += len(data)
                self.counters.compactions += 1
            if refused:  # deleted while we copied: the new copy must not bring them back
                self._publish_tomb({new.stem: refused})
        for bad in corrupt:
            self._quarantine(bad, "a record failed its checksum during compaction")

    def _verify_object(self, info: ObjectInfo, recs: list[Rec], report: VerifyReport, bad: list[ObjectInfo]) -> None:
        bufs: list[Buffer] = [np.empty(rec.length, dtype=np.uint8) for rec in recs]
        indexed = list(enumerate(recs))
        out = [ReadStatus.MISSING] * len(recs)
        self._fetch([(info, indexed)], bufs, out)
        missing = sum(1 for s in out if s in (ReadStatus.MISSING, ReadStatus.ERROR))
        corrupt = sum(1 for s in out if s is ReadStatus.CORRUPT)
        if missing:
            report.missing_data += missing
            report.problems.append(f"{info.rel}: {missing} records unreadable or the object is gone")
        if corrupt:
            report.bad_checksums += corrupt
            report.problems.append(f"{info.rel}: {corrupt} records fail their checksum")
            bad.append(info)

    # -- discovering --------------------------------------------------------------------------------
    def _lookup_claim(self, bkeys: list[bytes | None]) -> list[bool]:
        with self._lock:
            hits = [None if k is None else self.catalog.lookup(k) for k in bkeys]
            for hit in hits:
                if hit is not None:
                    hit[0].claimed = True
        return [hit is not None for hit in hits]

    def _refresh(self, full: bool, timeout_s: float | None = None) -> None:
        """Learn what other processes published (and, on a full listing, removed)."""
        with self._refresh_lock:
            started = time.monotonic()
            if not full and started - self._refreshed_at < self.opts.refresh_s:
                return  # another thread refreshed while we waited for the lock
            wall = time.time()
            epochs = range(epoch_of(self._listed_wall - SKEW_S), epoch_of(wall + SKEW_S) + 1)
            full = full or started - self._full_at >= self.opts.full_refresh_s or len(epochs) > MAX_EPOCHS
            with self._lock:
                known = set(self.catalog.objects)
                known_tombs = set(self.catalog.tombs)
            faults = self.store.faults
            try:
                objects, tombs = self._list(full, epochs, timeout_s)
                self._absorb(objects, tombs, full, known, known_tombs)
            except TierError as exc:
                if self.store.faults != faults:  # a new fault, not a call the breaker skipped
                    log.warning("fs tier %s: refresh failed: %s", self.name, exc)
                raise
            self._refreshed_at = started
            self._listed_wall = wall
            with self._lock:
                self.counters.refreshes += 1
                if full:
                    self.counters.full_refreshes += 1
            if full:
                self._full_at = started
                self._full_wall = wall

    def _list(self, full: bool, epochs: range, timeout_s: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """(object rel -> size, tombstone rel -> size) under the epochs to look at."""
        if full:
            calls = [self.store.list_call(OBJECTS, recursive=True), self.store.list_call(TOMBS, recursive=True)]
        else:
            calls = [self.store.list_call(f"{d}/{e:08x}") for d in (OBJECTS, TOMBS) for e in epochs]
        listed = self.store.run_all(calls, raise_first=True, timeout_s=timeout_s)
        objects: dict[str, int] = {}
        tombs: dict[str, int] = {}
        for rels in listed:  # anything else (directory markers some stores list) is ignored
            for rel, size in rels.items():
                if rel.startswith(OBJECTS + "/"):
                    objects[rel] = size
                elif rel.startswith(TOMBS + "/"):
                    tombs[rel] = size
        return objects, tombs

    def _absorb(
        self, objects: dict[str, int], tombs: dict[str, int], full: bool, known: set[str], known_tombs: set[str]
    ) -> None:
        names = {rel: parse_name(rel, OBJ_SUFFIX) for rel in objects}
        tomb_names = {rel: parse_name(rel, TOMB_SUFFIX) for rel in tombs}
        if full and self.store.local:
            self._note_tmp_files([rel for rel, n in names.items() if n is None])
        with self._lock:
            new_tombs = [n for n in tomb_names.values() if n and n.stem not in known_tombs and n.stem not in self._bad]
            new_objects = [
                (n, objects[rel]) for rel, n in names.items() if n and n.stem not in known and n.stem not in self._bad
            ]
        groups = self._fetch_tombs(new_tombs)
        infos = self._fetch_headers(new_objects)
        now = time.time()
        ttl = self.opts.ttl_s
        with self._lock:
            for tomb, group in groups:
                self.catalog.add_tomb(TombInfo(tomb, frozenset(group), now), group, now)
            for info in infos:
                if info.stem not in self.catalog.objects:
                    self.catalog.add(info, now, expired=ttl is not None and info.written_s + ttl < now)
            if full:
                listed = {n.stem for n in names.values() if n}
                for stem in known - listed:
                    self.catalog.forget(stem)  # removed by another node
                listed_tombs = {n.stem for n in tomb_names.values() if n}
                for stem in known_tombs - listed_tombs:
                    self.catalog.forget_tomb(stem)  # collected by another node

    def _fetch_tombs(self, names: list[Name]) -> list[tuple[Name, dict[str, list[bytes]]]]:
        results = self.store.run_all([self.store.get_call(n.tomb_path()) for n in names])
        out: list[tuple[Name, dict[str, list[bytes]]]] = []
        for name, res in zip(names, results, strict=True):
            if isinstance(res, FileNotFoundError):
                continue  # collected meanwhile
            if isinstance(res, BaseException):
                raise _as_tier_error(res)
            try:
                out.append((name, unpack_tomb(res)))
            except (FormatError, UnicodeDecodeError, ValueError) as exc:
                log.warning("fs tier %s: ignoring damaged tombstone %s: %s", self.name, name.tomb_path(), exc)
                with self._lock:
                    self._bad.add(name.stem)
        return out

    def _fetch_headers(self, found: list[tuple[Name, int]]) -> list[ObjectInfo]:
        """One ranged GET per new object (two if its header is larger than ``HEAD_PROBE``)."""
        calls = [self.store.get_call(n.object_path(), 0, min(size, HEAD_PROBE)) for n, size in found]
        results = self.store.run_all(calls)
        out: list[ObjectInfo] = []
        for (name, size), res in zip(found, results, strict=True):
            if isinstance(res, FileNotFoundError):
                continue
            if isinstance(res, BaseException):
                raise _as_tier_error(res)
            info = ObjectInfo(name, size, {})
            try:
                head = res
                need = header_length(head)
                if need > len(head):
                    head = self.store.get(name.object_path(), 0, need)
                info.recs = unpack_header(head, size)
            except FileNotFoundError:
                continue
            except FormatError as exc:
                self._quarantine(info, f"damaged header: {exc}")
                continue
            out.append(info)
        return out

    def _note_tmp_files(self, rels: list[str]) -> None:
        """Remember when full listings first saw temp files of local writers
        (``.<object name>.<random>.tmp``): one still there ``gc_grace_s`` later is a crashed
        writer's leftover (a live writer renames it within ``timeout_s``)."""
        now = time.time()
        with self._lock:
            seen = self._tmp_files
            self._tmp_files = {rel: seen.get(rel, now) for rel in rels if _is_tmp(rel)}

    # -- the namespace ------------------------------------------------------------------------------
    def _check_meta(self, timeout_s: float) -> None:
        meta = {
            "format": FORMAT_VERSION,
            "kind": "fs",
            "layout": self.context.layout.to_dict(),
            "namespace": self.context.namespace.canonical(),
        }
        expected = json.loads(json.dumps(meta))
        where = f"{self.root_url}/{META}"
        try:
            raw = self.store.get(META, timeout_s=timeout_s)
        except FileNotFoundError:
            self.store.put(META, json.dumps(meta, indent=1, sort_keys=True).encode(), timeout_s=timeout_s)
            return
        try:
            stored = json.loads(raw)
        except ValueError as exc:
            raise LayoutMismatchError(f"{where}: unreadable ({exc}); refusing to serve its data") from exc
        found = stored.get("format") if isinstance(stored, dict) else None
        if found != FORMAT_VERSION:
            raise LayoutMismatchError(
                f"{where}: format {found!r}, this engine reads format {FORMAT_VERSION} only; refusing to serve its data"
            )
        if stored != expected:
            raise LayoutMismatchError(f"{where}: stored layout/namespace differs from this engine's")

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"fs tier {self.name!r} at {self.root_url} is closed")

    def __repr__(self) -> str:
        return f"FSTier({self.name!r}, {self.root_url!r})"


# -- helpers -------------------------------------------------------------------------------------


def _as_dict(options: object) -> Any:
    return options.model_dump() if isinstance(options, TierOptions) else options


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


def _plan_reads(recs: list[tuple[int, Rec]]) -> list[list[tuple[int, Rec]]]:
    """Group the records of one object into runs that one ranged GET covers."""
    runs: list[list[tuple[int, Rec]]] = []
    start = end = -1
    for item in sorted(recs, key=lambda t: t[1].offset):
        rec = item[1]
        if runs and rec.offset - end <= READ_GAP and max(end, rec.end) - start <= MAX_READ:
            runs[-1].append(item)
            end = max(end, rec.end)
        else:
            runs.append([item])
            start, end = rec.offset, rec.end
    return runs


def _run_end(run: list[tuple[int, Rec]]) -> int:
    return max(rec.end for _, rec in run)


__all__ = ["EPOCH_S", "FSOptions", "FSTier", "parse_duration"]
