"""The ``fs`` tier's public face: :class:`FSTier` (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence

from kvstrata.core.buffers import Buffer, nbytes
from kvstrata.errors import TierError
from kvstrata.tiers.base import BlockId, ReadStatus, TierCapabilities, TierContext, TierOptions, VerifyReport
from kvstrata.tiers.fs.catalog import ObjectInfo
from kvstrata.tiers.fs.format import Rec, batch_cost, split_batch
from kvstrata.tiers.fs.housekeeping import Housekeeper
from kvstrata.tiers.fs.namespaces import stored_namespaces
from kvstrata.tiers.fs.options import FSOptions, _as_dict
from kvstrata.tiers.fs.state import _as_tier_error, _dead_record_bytes
from kvstrata.tiers.records import RECORD_ALIGN, key_or_none, parse_block_key

log = logging.getLogger("kvstrata.tiers.fs")


class FSTier(Housekeeper):
    """Shared tier on any fsspec filesystem; see the module docstring for the design."""

    capabilities = TierCapabilities(persistent=True, shared=True, checksums=True, alignment=RECORD_ALIGN, shrink=True)

    Options = FSOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        super().__init__(name, capacity, options, context)
        opts = self.opts
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

    @classmethod
    def stored_namespaces(
        cls, options: TierOptions, label: str, timeout_s: float | None = None
    ) -> list[tuple[str, str, bytes]]:
        """(fingerprint, URL, raw meta.json) of every namespace under ``options.url``, listed within
        the tier's timeouts; ``TierError`` when the store cannot be listed (see :mod:`.namespaces`)."""
        opts = options if isinstance(options, FSOptions) else FSOptions.model_validate(_as_dict(options))
        return stored_namespaces(opts, label, timeout_s)

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_open()
        ok = [self._acceptable(bid, buf) for bid, buf in items]
        chosen = [items[i] for i, good in enumerate(ok) if good]
        where = [i for i, good in enumerate(ok) if good]
        runs = split_batch([nbytes(buf) for _, buf in chosen], self.opts.object_size, keyed=self._key is not None)
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
        cost = batch_cost(list(sizes), self.opts.object_size, keyed=self._key is not None)
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
