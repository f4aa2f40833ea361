"""State every room of the engine shares: the tier stack, the lock, and what spans tiers.

One lock (``lock``) guards every index; bytes move outside it (see :mod:`kvstrata.engine.mover`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.config import KVStrataConfig
from kvstrata.core import native
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.core.masks import MaskBytes
from kvstrata.engine.plans import Pin
from kvstrata.engine.slots import TierSlot
from kvstrata.engine.stats import Backlog

__all__ = ["EngineState"]


class EngineState:
    """The tiers (top first), the engine lock, the complete-block map and the in-flight stores."""

    def __init__(self, config: KVStrataConfig, layout: KVLayout, tiers: list[TierSlot], mask_bytes: MaskBytes) -> None:
        self.config = config
        self.layout = layout
        self.tiers = tiers
        self.names = tuple(idx.name for idx in tiers)
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self.mask_bytes = mask_bytes
        one: dict[int, int] = {}  # equal sizes as one int object: a list of them counts by identity
        self.layer_bytes = [one.setdefault(spec.nbytes, spec.nbytes) for spec in layout.layers]
        self.all_mask = layout.all_layers_mask
        # key -> position of the fastest tier holding all layers (probed on every lookup: a C table)
        self.best: native.KeyIndex = native.key_index()
        # keys of store batches queued or being written to the top tier -> (layer mask, done event):
        # lookups count them and loads wait for them (a process reads its own writes at once)
        self.inflight: dict[Key, tuple[int, threading.Event]] = {}
        self.backlog = Backlog()
        # tiers other processes write to (a directory on disk, a cluster pool): asked on a miss
        self.shared = [idx for idx in tiers if idx.tier.capabilities.persistent or idx.tier.capabilities.shared]

    def mask(self, layers: Sequence[int] | Mapping[int, Any]) -> int:
        n = self.layout.num_layers
        mask = 0
        for layer in layers:
            if not 0 <= layer < n:
                raise ValueError(f"layer {layer} out of range 0..{n - 1}")
            mask |= 1 << layer
        return mask

    def below(self, idx: TierSlot) -> TierSlot | None:
        return self.tiers[idx.position + 1] if idx.position + 1 < len(self.tiers) else None

    # -- lock held from here on
    def mark_complete(self, key: Key, pos: int) -> None:
        cur = self.best.get(key)
        if cur is None or pos < cur:
            self.best[key] = pos

    def refresh_best(self, key: Key) -> None:
        for idx in self.tiers:
            e = idx.entries.get(key)
            if e is not None and e.layers == self.all_mask:
                self.best[key] = idx.position
                return
        self.best.pop(key, None)

    def refresh_best_many(self, keys: Sequence[Key]) -> None:
        """:meth:`refresh_best` of each of ``keys``."""
        if len(self.tiers) == 1:  # the only tier lost them
            pop = self.best.pop
            for key in keys:
                if key not in self.tiers[0].entries or self.tiers[0].entries[key].layers != self.all_mask:
                    pop(key, None)
            return
        for key in keys:
            self.refresh_best(key)

    def record_blocks(self, idx: TierSlot, keys: Sequence[Key], layers: int, parents: Sequence[Key | None]) -> None:
        """:meth:`record` of the same ``layers`` for each of ``keys`` (a uniform store's batch), in
        one call when they are every layer."""
        if layers != self.all_mask or layers & idx.snap_mask:
            for key, parent in zip(keys, parents, strict=True):
                self.record(idx, key, layers, parent)
            return
        idx.add_blocks(keys, layers, self.mask_bytes(layers), parents)
        if idx.position == 0:  # the fastest tier: it serves them now
            native.set_many(self.best, keys, 0)
        else:
            for key in keys:
                self.mark_complete(key, idx.position)

    def record(
        self, idx: TierSlot, key: Key, layers: int, parent: Key | None, position: int = 0, nbytes: int | None = None
    ) -> None:
        """``layers`` of ``key`` are on ``idx`` now (written, adopted or found at start-up)."""
        size = self.mask_bytes(layers) if nbytes is None else nbytes
        entry = idx.add(key, layers, size, parent, position)
        if entry.layers == self.all_mask:
            self.mark_complete(key, idx.position)

    def serving_tier(self, key: Key, mask: int) -> int | None:
        for idx in self.tiers:
            e = idx.entries.get(key)
            if e is not None and e.layers & mask == mask:
                return idx.position
        return None

    def pin(self, idx: TierSlot, keys: Sequence[Key | None]) -> list[Pin]:
        """Pin the entries of ``keys`` that ``idx`` holds (they cannot be evicted)."""
        return [(idx, k, e) for k, e in idx.pin(keys)]

    def cold(self, key: Key) -> None:
        for idx in self.tiers:
            if key in idx.entries:
                idx.eviction.cold(key)

    def count_lookup(self, served: list[int], missing: int) -> None:
        below = missing
        for idx in reversed(self.tiers):
            n = served.count(idx.position) if len(self.tiers) > 1 else len(served)
            idx.counters.hits += n
            idx.counters.misses += below
            below += n

    def notify_if_idle(self) -> None:
        """Wake ``flush`` waiters when nothing is queued any more."""
        if self.backlog.idle:
            self.idle.notify_all()
