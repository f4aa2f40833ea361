"""Housekeeping: tombstones published, TTL and capacity expiry, compaction of sparse objects,
garbage collection of dead objects after their grace period."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np

from kvstrata.core.buffers import Buffer
from kvstrata.errors import TierError
from kvstrata.tiers.base import ReadStatus
from kvstrata.tiers.fs.catalog import ObjectInfo
from kvstrata.tiers.fs.discover import Discovery
from kvstrata.tiers.fs.format import MAX_LINEAGE
from kvstrata.tiers.fs.options import LOW_WATERMARK
from kvstrata.tiers.fs.reader import Reader
from kvstrata.tiers.fs.writer import Publisher
from kvstrata.tiers.records import parse_block_key

log = logging.getLogger("kvstrata.tiers.fs")


class Housekeeper(Publisher, Reader, Discovery):
    """The background work of the fs tier (``maintain``, ``shrink``) and compaction."""

    on_expired: Callable[[list[bytes]], None] | None = None  # told the block keys TTL/capacity expired

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
        gone: list[bytes] = []
        with self._lock:
            for info in self.catalog.live_objects():
                if info.written_s + ttl < now:
                    gone += self.catalog.expire(info, now)
                    self.counters.expired_objects += 1
        self._tell_expired(gone)

    def _tell_expired(self, bkeys: list[bytes]) -> None:
        hook = self.on_expired
        if hook is not None and bkeys:
            try:
                hook(bkeys)
            except Exception:  # a listener (the daemon's KV events) never breaks housekeeping
                log.exception("fs tier %s: on_expired failed", self.name)

    def _expire(self, candidates: list[ObjectInfo], need: int, why: str, publish: bool = True) -> None:
        """Expire objects from ``candidates`` (in order) until ``need`` bytes are uncharged, in
        one tombstone (published now, or left pending)."""
        groups: dict[str, list[bytes]] = {}
        gone: list[bytes] = []
        with self._lock:
            now = time.time()
            for info in candidates:
                if need <= 0:
                    break
                if info.live and self.catalog.objects.get(info.stem) is info:
                    need -= info.size
                    gone += info.live
                    for stem, bkeys in self.catalog.remove(list(info.live), now).items():
                        groups.setdefault(stem, []).extend(bkeys)
                    self.counters.expired_objects += 1
        if groups:
            log.info("fs tier %s: expired %d objects (%s)", self.name, len(groups), why)
            with self._lock:
                for stem, bkeys in groups.items():
                    self._pending.setdefault(stem, set()).update(bkeys)
            try:
                if publish:
                    self._flush_pending()
            finally:
                self._tell_expired(gone)  # gone from this node's view, the tombstone out or pending

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
        """Delete tombstones whose objects (and their heirs, see the catalog) are all gone, as a
        full listing that started after this process saw the tombstone confirms (objects precede
        the tombstones naming them), once the grace period has passed; and stale temp files of
        local writers."""
        cutoff = min(now - self.opts.gc_grace_s, self._full_wall)
        with self._lock:
            doomed = [t for t in self.catalog.tombs.values() if t.seen < cutoff and not self.catalog.needed(t)]
            stale_tmp = [rel for rel, written in self._tmp_files.items() if written < now - self.opts.gc_grace_s]
        calls = [self.store.delete_call(t.name.tomb_path(self.area)) for t in doomed]
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
        if good:  # the new object names this one (and its lineage): tombstones for it apply to the new one
            new, data = self._build(good, lineage=(info.stem, *info.lineage)[:MAX_LINEAGE])
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
