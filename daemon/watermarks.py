"""Watermarks: keep every persistent tier between its low and high watermark.

When the NVMe tier of a namespace passes its high watermark, the oldest blocks are moved to
the next persistent tier (the shared ``fs`` tier) or dropped, until usage is back at the low
watermark. "Oldest" is write order: the NVMe index's ``(segment id, offset)`` order (segment ids
only grow), so demotion empties whole segments, which are then unlinked and the space really
comes back. Blocks hinted active (see :mod:`kvstrata.daemon.hints`) within ``hint_ttl_s`` are
skipped. Per-layer policies decide, per layer group, whether a layer-block may live in the tier
below: one that may not is dropped, never copied. When the ``fs`` tier passes its own high
watermark, its oldest objects are expired down to its low watermark (it is the bottom tier).

Why a live writer or reader never loses a block or reads a wrong one
--------------------------------------------------------------------
Inference processes pin blocks in their own memory; the daemon cannot see those pins, so it
relies on the tiers' process-safe protocol instead:

1. **Copy, then delete by compare-and-swap.** A batch snapshot ``(block, location)`` is read
   from the shared LMDB index. The bytes are read (checksum verified) and written to the tier
   below, which acknowledges only once they are durable (fs: one atomic publication, fsynced on
   a mount). Only then is the NVMe entry removed, in one index transaction and only where the
   entry still points at the snapshot's location (:meth:`NVMeTier.delete_at`). A writer that
   stored the block again meanwhile moved its entry, so its newer copy stays; the copy below is
   a second copy of the same key (keys are prefix hashes: same key, same bytes), never a loss.
   A crash (kill -9) between the copy and the delete leaves the block in both tiers.
2. **Files go only after the index stops naming them.** Deleting index entries frees no file;
   a segment file is unlinked only when it has no live record, under its ``flock`` (a live
   writer holds the lock on the segment it appends to, so those are never touched), and after
   the transaction that forgot it. A reader that already opened the file keeps reading valid
   bytes (POSIX unlink); one that opens it afterwards gets ``ENOENT``, re-reads the index, and
   either finds the block's new place (compaction) or reports a miss, which the engine turns
   into a recompute or a lookup in the tier below. Compaction never overwrites: it appends the
   live records elsewhere and moves each entry by the same compare-and-swap.
3. **A block is moved whole or not at all.** A key whose copy of any layer failed keeps every
   layer on NVMe (retried next cycle); a key is never left half in each tier by a failure.
4. The ``fs`` tier's deletes are tombstones, and objects are removed only ``gc_grace_s`` after
   they died, so a node still reading an expired object from a stale view has that long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.errors import TierError
from kvstrata.tiers import BlockId, ReadStatus, Tier, indexed, shrinkable
from kvstrata.tiers.records import parse_block_key

from .metrics import DaemonMetrics
from .namespaces import ManagedNamespace, TierPlan

log = logging.getLogger("kvstrata.daemon.watermarks")


@dataclass
class MoveResult:
    demoted: int = 0  # layer-blocks copied below and removed here
    demoted_bytes: int = 0
    dropped: int = 0  # layer-blocks removed without a copy below
    dropped_bytes: int = 0
    failed: int = 0  # layer-blocks kept because their key's copy failed
    corrupt: int = 0  # found damaged while copying (the tier quarantined them)
    expired_objects: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, other: MoveResult) -> None:
        for name in ("demoted", "demoted_bytes", "dropped", "dropped_bytes", "failed", "corrupt", "expired_objects"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.reasons.items():
            self.reasons[k] = self.reasons.get(k, 0) + v


Protected = Callable[[str, bytes], bool]  # (namespace fingerprint, key) -> keep it where it is
# (namespace fingerprint, (tier kind, keys that left it), (tier kind, keys now whole in it) or None)
Moved = Callable[[str, tuple[str, list[bytes]], tuple[str, list[bytes]] | None], None]


class Watermarks:
    """Enforces the watermarks of one namespace's tiers (called from the daemon's main loop)."""

    def __init__(self, metrics: DaemonMetrics, move_batch: int, stop: threading.Event) -> None:
        self.metrics = metrics
        self.move_batch = move_batch
        self.stop = stop
        self.on_moved: Moved | None = None  # the daemon's KV events (kv_events.py), when on

    # -- NVMe: demote the oldest blocks -----------------------------------------------------
    def enforce(
        self,
        ns: ManagedNamespace,
        plan: TierPlan,
        protected: Protected,
        between_batches: Callable[[], None] | None = None,
        need: int = 0,
    ) -> MoveResult:
        """Bring ``plan``'s tier of ``ns`` down to its low watermark if it is above the high one
        (or if ``need`` more bytes would take it there: room for a promotion)."""
        result = MoveResult()
        src = ns.tier(plan)
        if src is None:
            return result
        try:
            used = src.refresh_used() if indexed(src) else src.used_bytes
        except TierError as exc:  # the store is down: nothing to do until it is back
            log.debug("tier %s of %s: usage unknown: %s", plan.name, ns.label, exc)
            return result
        if used + need <= plan.high:
            return result
        index = src if indexed(src) else None  # what the tier can do, as it declares (capabilities)
        if index is None:
            if shrinkable(src):
                self.listen_expiry(ns, plan, src)
                try:
                    result.expired_objects = src.shrink(max(0, plan.low - need))
                except TierError as exc:  # expired here; the tombstone goes out with the next maintain()
                    log.warning("tier %s of %s: shrinking failed: %s", plan.name, ns.label, exc)
                self.metrics.expired.labels(plan.name).inc(result.expired_objects)
            return result
        below = self._below(ns, plan)
        target = used + need - plan.low  # oldest-first deletes empty whole segments: freed ~ deleted
        groups = self._oldest_first(index.records(), ns.fingerprint, protected)
        freed = i = 0
        while i < len(groups) and freed < target and not self.stop.is_set():
            batch: list[list[tuple[BlockId, Any]]] = []
            size, limit = 0, min(self.move_batch, target - freed)
            while i < len(groups) and size < limit:
                batch.append(groups[i])
                size += sum(loc.length for _, loc in groups[i])
                i += 1
            moved = self._move(ns, plan, src, below, batch)
            result.add(moved)
            freed += moved.demoted_bytes + moved.dropped_bytes
            if moved.failed and not (moved.demoted or moved.dropped):
                break  # the tier below refuses: try again next cycle instead of reading everything
            if src.used_bytes + need <= plan.low:
                break
            if between_batches is not None:
                between_batches()
        if result.demoted or result.dropped or result.failed:
            log.info(
                "tier %s of %s: demoted %d, dropped %d, kept %d layer-blocks; used %d -> %d bytes",
                plan.name,
                ns.label,
                result.demoted,
                result.dropped,
                result.failed,
                used,
                src.used_bytes,
                extra={
                    "event": "watermark",
                    "namespace": ns.fingerprint,
                    "tier": plan.name,
                    "demoted": result.demoted,
                    "demoted_bytes": result.demoted_bytes,
                    "dropped": result.dropped,
                    "failed": result.failed,
                    "used_before": used,
                    "used_after": src.used_bytes,
                    "high": plan.high,
                    "low": plan.low,
                },
            )
        return result

    def listen_expiry(self, ns: ManagedNamespace, plan: TierPlan, tier: Any) -> None:
        """Blocks a tier expires by itself (fs: TTL, capacity) are announced as having left it."""
        on_moved = self.on_moved
        if on_moved is None or not hasattr(tier, "on_expired"):
            return

        def expired(bkeys: list[bytes]) -> None:
            on_moved(
                ns.fingerprint, (plan.kind, list(dict.fromkeys(bytes(parse_block_key(b)[0]) for b in bkeys))), None
            )

        tier.on_expired = expired

    def _below(self, ns: ManagedNamespace, plan: TierPlan) -> tuple[TierPlan, Tier] | None:
        """The next persistent tier under ``plan`` (opened, created if need be)."""
        for lower in ns.chain[plan.position + 1 :]:
            tier = ns.tier(lower, create=True)
            if tier is not None:
                return lower, tier
        return None

    def _oldest_first(
        self, records: list[tuple[BlockId, Any]], fingerprint: str, protected: Protected
    ) -> list[list[tuple[BlockId, Any]]]:
        """Each unprotected key's layer records, keys in order of their oldest record."""
        by_key: dict[bytes, list[tuple[BlockId, Any]]] = {}
        for bid, loc in records:
            by_key.setdefault(bytes(bid[0]), []).append((bid, loc))
        return [recs for key, recs in by_key.items() if not protected(fingerprint, key)]

    def _move(
        self,
        ns: ManagedNamespace,
        plan: TierPlan,
        src: Any,
        below: tuple[TierPlan, Tier] | None,
        groups: list[list[tuple[BlockId, Any]]],
    ) -> MoveResult:
        """Copy the layer-blocks the tier below may hold, then delete the keys whose copy is safe."""
        res = MoveResult()
        mask = ns.mask(below[0]) if below is not None else 0
        copy = [(bid, loc) for recs in groups for bid, loc in recs if mask >> bid[1] & 1]
        unsafe: set[bytes] = set()
        if copy and below is not None:
            unsafe, res.corrupt = self._copy(src, below[1], copy)
        removals = [(bid, loc) for recs in groups if bytes(recs[0][0][0]) not in unsafe for bid, loc in recs]
        try:
            removed = src.delete_at(removals)
        except TierError as exc:
            log.warning("tier %s of %s: delete failed: %s", plan.name, ns.label, exc)
            self.metrics.errors.labels("demote").inc()
            return res
        copied = {bid for bid, _ in copy}
        to = below[0].name if below is not None else ""
        reason = "policy" if below is not None else "bottom"
        for (bid, loc), gone in zip(removals, removed, strict=True):
            if not gone:
                continue
            if bid in copied:
                res.demoted += 1
                res.demoted_bytes += loc.length
            else:
                res.dropped += 1
                res.dropped_bytes += loc.length
        if self.on_moved is not None:
            self._announce(ns, plan, below, removals, removed, copied)
        res.failed = sum(len(recs) for recs in groups if bytes(recs[0][0][0]) in unsafe)
        res.reasons[reason] = res.dropped
        m = self.metrics
        m.demoted_blocks.labels(plan.name, to).inc(res.demoted)
        m.demoted_bytes.labels(plan.name, to).inc(res.demoted_bytes)
        m.dropped_blocks.labels(plan.name, reason).inc(res.dropped)
        m.dropped_bytes.labels(plan.name, reason).inc(res.dropped_bytes)
        m.move_failures.labels(plan.name).inc(res.failed)
        return res

    def _announce(
        self,
        ns: ManagedNamespace,
        plan: TierPlan,
        below: tuple[TierPlan, Tier] | None,
        removals: list[tuple[BlockId, Any]],
        removed: list[bool],
        copied: set[BlockId],
    ) -> None:
        """Keys whose every record left ``plan``'s tier; those whose every layer went below too."""
        gone: dict[bytes, bool] = {}  # key -> all its records removed here
        whole: dict[bytes, bool] = {}  # key -> all its records copied below
        for (bid, _), ok in zip(removals, removed, strict=True):
            key = bytes(bid[0])
            gone[key] = gone.get(key, True) and bool(ok)
            whole[key] = whole.get(key, True) and bid in copied
        left = [k for k, ok in gone.items() if ok]
        if not left:
            return
        stored = (below[0].kind, [k for k in left if whole[k]]) if below is not None else None
        assert self.on_moved is not None
        self.on_moved(ns.fingerprint, (plan.kind, left), stored)

    def _copy(self, src: Any, dst: Tier, copy: list[tuple[BlockId, Any]]) -> tuple[set[bytes], int]:
        """Make ``copy`` present in ``dst``; returns the keys whose copy failed and the corrupt count."""
        ids = [bid for bid, _ in copy]
        unsafe: set[bytes] = set()
        try:
            present = dst.contains(ids) or [False] * len(ids)
        except TierError:
            present = [False] * len(ids)
        need = [(bid, loc) for (bid, loc), p in zip(copy, present, strict=True) if not p]
        if not need:
            return unsafe, 0
        bufs = [np.empty(loc.length, dtype=np.uint8) for _, loc in need]
        try:
            statuses = src.read([(bid, buf) for (bid, _), buf in zip(need, bufs, strict=True)])
        except TierError:
            statuses = [ReadStatus.ERROR] * len(need)
        corrupt = sum(1 for s in statuses if s is ReadStatus.CORRUPT)  # quarantined by the tier: gone
        readable = [(bid, buf) for (bid, _), buf, s in zip(need, bufs, statuses, strict=True) if s is ReadStatus.OK]
        unsafe.update(bytes(bid[0]) for (bid, _), s in zip(need, statuses, strict=True) if s is ReadStatus.ERROR)
        if readable:
            try:
                written = dst.write(readable)
            except TierError as exc:
                log.warning("copy into tier %s failed: %s", dst.name, exc)
                written = [False] * len(readable)
            unsafe.update(bytes(bid[0]) for (bid, _), ok in zip(readable, written, strict=True) if not ok)
        return unsafe, corrupt
