"""The engine-side index of one tier: entries, pins, live bytes, policies, counters.

This is the "manager" half of the manager/mover split: pure Python, no I/O. All
methods must be called with the engine lock held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from kvstrata.config import TierConfig
from kvstrata.core.keys import Key
from kvstrata.policies import AdmissionPolicy, EvictionPolicy
from kvstrata.tiers.base import Tier


@dataclass
class Entry:
    """What one tier holds of one block."""

    layers: int  # bitmask of the layers present
    nbytes: int
    parent: Key | None = None
    pins: int = 0
    doomed: bool = False  # forgotten while pinned: delete its bytes at the last unpin


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
    promotions: int = 0  # blocks copied into this tier from a lower tier after a hit
    checksum_failures: int = 0
    io_errors: int = 0
    write_failures: int = 0
    not_admitted: int = 0
    snapshots_not_admitted: int = 0  # state snapshots refused by the tier's snapshot budget
    snapshots_dropped: int = 0  # state snapshots dropped for a more valuable one (budget)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class TierIndex:
    """Engine-side state of one tier."""

    position: int
    config: TierConfig
    tier: Tier
    eviction: EvictionPolicy[Key]
    admission: AdmissionPolicy[Key]
    entries: dict[Key, Entry] = field(default_factory=dict)
    live_bytes: int = 0  # committed + reserved + being evicted
    evicting: set[Key] = field(default_factory=set)
    counters: TierCounters = field(default_factory=TierCounters)
    space_lock: threading.Lock = field(default_factory=threading.Lock)
    # per-layer policies (hybrid layouts): which layers are state snapshots, and what this tier holds of them
    snap_mask: int = 0
    layer_sizes: tuple[int, ...] = ()  # bytes of each layer's layer-block (set for hybrid layouts)
    snapshot_bytes: int = 0
    snapshots: dict[Key, int] = field(default_factory=dict)  # key -> position (blocks) of its snapshot

    @property
    def name(self) -> str:
        return self.config.name

    def add(self, key: Key, layers: int, nbytes: int, parent: Key | None, position: int = 0) -> Entry:
        """Record ``layers`` of ``key`` (layers the entry already holds must not be added again).
        ``position``: the block count a state snapshot among ``layers`` restores (its value)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = Entry(layers, nbytes, parent)
            self.entries[key] = entry
            self.eviction.insert(key, parent)
        else:
            entry.layers |= layers
            entry.nbytes += nbytes
            self.eviction.access(key)
        if layers & self.snap_mask:
            self.snapshot_bytes += self.snap_nbytes(layers)
            self.snapshots[key] = max(position, self.snapshots.get(key, 0))
        return entry

    def pop(self, key: Key) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.eviction.remove(key)
            if key in self.snapshots:
                del self.snapshots[key]
                self.snapshot_bytes -= self.snap_nbytes(entry.layers)
        return entry

    def shed(self, key: Key, layers: int) -> int:
        """Drop ``layers`` of ``key`` from the index, keeping the rest of its entry; returns their bytes
        (the caller deletes them from the tier and releases ``live_bytes``)."""
        entry = self.entries[key]
        layers &= entry.layers
        size = sum(self.layer_sizes[layer] for layer in range(len(self.layer_sizes)) if layers >> layer & 1)
        entry.layers &= ~layers
        entry.nbytes -= size
        if key in self.snapshots and layers & self.snap_mask:
            self.snapshot_bytes -= self.snap_nbytes(layers)
            if not entry.layers & self.snap_mask:
                del self.snapshots[key]
        return size

    def snap_nbytes(self, layers: int) -> int:
        mask = layers & self.snap_mask
        return sum(self.layer_sizes[layer] for layer in range(len(self.layer_sizes)) if mask >> layer & 1)

    def pick_victims(self, need_bytes: int) -> list[tuple[Key, Entry]]:
        """Unpinned keys to evict, in policy order, until ``need_bytes`` are covered."""
        out: list[tuple[Key, Entry]] = []
        got = 0
        for key in self.eviction.victims():
            entry = self.entries.get(key)
            if entry is None or entry.pins:
                continue
            out.append((key, entry))
            got += entry.nbytes
            if got >= need_bytes:
                break
        return out
