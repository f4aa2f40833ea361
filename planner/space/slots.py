"""The memory tiers' slot arenas (``hbm``, ``dram``): the slot allocator of
:mod:`kvstrata.tiers.memory` carves extents of one size class out of the arena and never returns
them, so a tier holds ``n`` blocks when ``n`` blocks' bytes fit *and* their layer-blocks fit whole
extents."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.planner.space.common import MaskSizes, RecordSpace, Space, space_model
from kvstrata.tiers.memory import EXTENT_BYTES

__all__ = ["MemoryRecordSpace", "MemorySpace", "arena_max_blocks", "capacity_for_blocks"]


def _size_classes(layer_sizes: Sequence[int]) -> dict[int, int]:
    classes: dict[int, int] = {}
    for s in layer_sizes:
        classes[s] = classes.get(s, 0) + 1
    return classes


def arena_max_blocks(capacity: int, layer_sizes: Sequence[int]) -> int:
    """Most blocks (every layer present) a memory tier of ``capacity`` bytes can hold."""
    block = sum(layer_sizes)
    classes = _size_classes(layer_sizes)
    per = {s: max(1, min(EXTENT_BYTES, capacity // 16) // s) for s in classes}  # slots per extent

    def arena_bytes(m: int) -> int:
        return sum(-(-m * k // per[s]) * per[s] * s for s, k in classes.items())

    lo, hi = 0, capacity // block
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if arena_bytes(mid) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


class MemorySpace(Space):
    def __init__(self, capacity: int, layer_sizes: Sequence[int]) -> None:
        self.capacity = capacity
        self._max = arena_max_blocks(capacity, layer_sizes)

    def fits(self, live_blocks: int, n: int) -> bool:
        return live_blocks + n <= self._max

    def max_blocks(self) -> int | None:
        return self._max


def capacity_for_blocks(blocks: int, layer_sizes: Sequence[int], kind: str) -> int:
    """The smallest capacity (bytes) of a memory tier that holds ``blocks`` blocks (others: their bytes)."""
    need = blocks * sum(layer_sizes)
    if space_model(kind) != "slots" or blocks <= 0:
        return need
    lo, hi = need, 2 * need + 16 * EXTENT_BYTES
    while lo < hi:
        mid = (lo + hi) // 2
        if arena_max_blocks(mid, layer_sizes) >= blocks:
            hi = mid
        else:
            lo = mid + 1
    return lo


class MemoryRecordSpace(RecordSpace):
    """The memory tiers' slot arena (:class:`kvstrata.tiers.memory.SlotArena`) per size class:
    extents carved on demand and never returned, freed slots reused within their class."""

    def __init__(self, capacity: int, sizes: MaskSizes) -> None:
        self.capacity = self._cap = capacity
        self.m = sizes
        classes = set(sizes.sizes)
        self._per = {s: max(1, min(EXTENT_BYTES, capacity // 16) // s) for s in classes}
        self._carved = dict.fromkeys(classes, 0)
        self._used = dict.fromkeys(classes, 0)
        self._bump = 0
        self._classes: dict[int, list[tuple[int, int]]] = {}

    def _of(self, mask: int) -> list[tuple[int, int]]:
        got = self._classes.get(mask)
        if got is None:
            counts: dict[int, int] = {}
            for layer in self.m.layers(mask):
                s = self.m.sizes[layer]
                counts[s] = counts.get(s, 0) + 1
            got = self._classes[mask] = list(counts.items())
        return got

    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        nbytes = self.m.nbytes
        if live_bytes + sum(nbytes(m) for m in masks) > self._cap:
            return False
        need: dict[int, int] = {}
        for m in masks:
            for s, c in self._of(m):
                need[s] = need.get(s, 0) + c
        bump = self._bump
        for s, count in need.items():
            missing = count - (self._carved[s] - self._used[s])
            if missing > 0:
                per = self._per[s]
                bump += -(-missing // per) * per * s
        return bump <= self._cap

    def add_records(self, items: Sequence[tuple[int, int]]) -> None:
        for _, m in items:
            for s, c in self._of(m):
                free = self._carved[s] - self._used[s]
                if c > free:
                    per = self._per[s]
                    n = -(-(c - free) // per) * per
                    self._carved[s] += n
                    self._bump += n * s
                self._used[s] += c

    def remove_records(self, items: Sequence[tuple[int, int]]) -> None:
        for _, m in items:
            for s, c in self._of(m):
                self._used[s] -= c
