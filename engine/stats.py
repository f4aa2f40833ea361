"""Counters of the engine and its tiers, and the ``Engine.stats()`` report built from them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.engine.slots import TierSlot

__all__ = ["Backlog", "TierCounters", "tier_stats"]


@dataclass
class TierCounters:
    """Monotonic counters of one tier (reported by ``Engine.stats()``)."""

    hits: int = 0  # blocks a lookup found restorable from this tier (served here)
    misses: int = 0  # blocks a lookup reached this tier for and did not find here
    layer_blocks_written: int = 0
    layer_blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0  # blocks that left this tier to make room (demoted or dropped)
    demotions: int = 0  # evicted blocks copied to the next tier
    demotions_kept: int = 0  # shared-tier victims kept there: their read or their write below failed
    promotions: int = 0  # blocks copied into this tier from a lower tier after a hit
    promotions_deferred: int = 0  # loads whose promotion from their own buffers found this tier busy
    checksum_failures: int = 0
    io_errors: int = 0
    write_failures: int = 0
    not_admitted: int = 0
    snapshots_not_admitted: int = 0  # state snapshots refused by the tier's snapshot budget
    snapshots_dropped: int = 0  # state snapshots dropped for a more valuable one (budget)
    rescans: int = 0  # scans of a shared tier for other writers' blocks when a write found no victim

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Backlog:
    """Work queued behind the caller: store batches, background copies, and batches dropped."""

    pending_stores: int = 0  # store parts queued or being written
    pending_bytes: int = 0
    waiting_stores: int = 0  # store batches waiting for the queue budget (engine/queue.py)
    waiting_bytes: int = 0
    background_bytes: int = 0  # write-through, promotion and demotion copies queued or running
    dropped_stores: int = 0  # store batches that lost blocks (all or a tail) to backpressure
    dropped_blocks: int = 0

    @property
    def idle(self) -> bool:
        return not (self.pending_stores or self.background_bytes or self.waiting_stores)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def tier_stats(slot: TierSlot, snapshots: bool) -> dict[str, Any]:
    """Lock held: capacity, usage and counters of one tier."""
    d: dict[str, Any] = {
        "kind": slot.config.kind,
        "capacity_bytes": slot.tier.capacity,
        "used_bytes": _used_bytes(slot),
        "live_bytes": slot.live_bytes,
        "blocks": len(slot.entries),
        "pinned_blocks": sum(1 for e in slot.entries.values() if e.pins),
    }
    if snapshots:
        d["snapshot_bytes"] = slot.snapshot_bytes
    d.update(slot.counters.as_dict())
    return d


def _used_bytes(slot: TierSlot) -> int | None:
    try:
        return int(slot.tier.used_bytes)
    except Exception:  # a tier that is down must not break monitoring
        slot.counters.io_errors += 1
        return None
