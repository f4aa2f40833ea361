"""Small handles passed between the engine's rooms: write jobs, pinned load plans, pins."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.core.keys import Key
from kvstrata.engine.index import Entry

if TYPE_CHECKING:
    from kvstrata.engine.slots import TierSlot

__all__ = ["BlockRead", "LoadPlan", "Pin", "RestoreRead", "WriteJob"]

Pin = tuple["TierSlot", Key, Entry[Key]]  # (tier, key, entry) of a pinned block


@dataclass
class WriteJob:
    """Blocks to write into one tier: keys, their chain parents, and where the bytes come from."""

    keys: list[Key]
    parents: list[Key | None]
    mask: int
    layer_bufs: list[tuple[int, Any]]  # (layer, caller buffers or None when copying from a tier)
    src_index: list[int]  # position of each key in the caller's buffers
    done: threading.Event = field(default_factory=threading.Event)  # set once the job has finished
    masks: list[int] | None = None  # per-key layer masks (per-layer policies); None: ``mask`` for every key
    positions: list[int] | None = None  # per key, the block count a state snapshot after it restores

    def mask_of(self, j: int) -> int:
        return self.mask if self.masks is None else self.masks[j]

    def position_of(self, j: int) -> int:
        return 0 if self.positions is None else self.positions[j]


@dataclass
class BlockRead:
    """Every requested layer of each block of a prefix from one tier: (key, tier, pinned entry)."""

    blocks: list[tuple[Key, TierSlot, Entry[Key]]]
    tier: TierSlot | None = None  # the tier of every block, where it is one (the usual prefix)

    @property
    def n(self) -> int:
        return len(self.blocks)

    def pins(self) -> list[Pin]:
        return [(idx, k, e) for k, idx, e in self.blocks]


@dataclass
class RestoreRead:
    """A restore of ``n`` blocks: what each block needs and where each part of it is read from."""

    keys: list[Key]
    n: int
    need: list[int]  # per block, the layers the restore needs
    parts: list[list[tuple[TierSlot, Entry[Key], int]]]  # per block: (tier, pinned entry, layers read there)

    def pins(self) -> list[Pin]:
        return [(idx, k, e) for k, mine in zip(self.keys, self.parts, strict=True) for idx, e, _ in mine]


@dataclass
class LoadPlan:
    """What a load of ``keys`` reads, pinned at lookup time (:meth:`Engine.lookup_pinned`).

    ``waits``: queued stores the prefix depends on; the load waits for them and plans again
    (``read`` is then None). A plan is consumed by one load, or given back with
    :meth:`Engine.release`."""

    keys: list[Key]
    mask: int
    restore: bool  # every layer under per-layer policies: a restore
    waits: list[threading.Event]
    read: BlockRead | RestoreRead | None
    used: bool = False
