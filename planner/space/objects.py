"""Tiers whose space is their live bytes (``mooncake``, ``fs`` and others; their overheads are not
modelled), and unbounded tiers, at block and at layer-record granularity."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.planner.space.common import MaskSizes, RecordSpace, Space

__all__ = ["ByteRecordSpace", "ByteSpace", "UnboundedRecordSpace", "UnboundedSpace"]


class UnboundedSpace(Space):
    def fits(self, live_blocks: int, n: int) -> bool:
        return True


class ByteSpace(Space):
    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity = capacity
        self._max = capacity // block_bytes

    def fits(self, live_blocks: int, n: int) -> bool:
        return live_blocks + n <= self._max

    def max_blocks(self) -> int | None:
        return self._max


class UnboundedRecordSpace(RecordSpace):
    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        return True


class ByteRecordSpace(RecordSpace):
    """Live bytes <= capacity (``mooncake``, ``fs`` and other kinds: their overheads are not modelled)."""

    def __init__(self, capacity: int, sizes: MaskSizes) -> None:
        self.capacity = self._cap = capacity
        self.m = sizes

    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        nbytes = self.m.nbytes
        return live_bytes + sum(nbytes(m) for m in masks) <= self._cap
