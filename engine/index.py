"""The engine-side index of one tier: entries, pins, live bytes, policies, counters.

This is the "manager" half of the manager/mover split: pure Python, no I/O. All
methods must be called with the engine lock held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from kvstrata.config import TierConfig
from kvstrata.engine.keys import Key
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

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class TierIndex:
    """Engine-side state of one tier."""

    position: int
    config: TierConfig
    tier: Tier
    eviction: EvictionPolicy
    admission: AdmissionPolicy
    entries: dict[Key, Entry] = field(default_factory=dict)
    live_bytes: int = 0  # committed + reserved + being evicted
    evicting: set[Key] = field(default_factory=set)
    counters: TierCounters = field(default_factory=TierCounters)
    space_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.config.name

    def add(self, key: Key, layers: int, nbytes: int, parent: Key | None) -> Entry:
        entry = self.entries.get(key)
        if entry is None:
            entry = Entry(layers, nbytes, parent)
            self.entries[key] = entry
            self.eviction.insert(key, parent)
        else:
            entry.layers |= layers
            entry.nbytes += nbytes
            self.eviction.access(key)
        return entry

    def pop(self, key: Key) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.eviction.remove(key)
        return entry

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
