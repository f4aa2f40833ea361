"""How many blocks fit in a tier: the physical space rules of the engine's tiers, at block granularity.

* :class:`MemorySpace` (``hbm``, ``dram``): the slot allocator of :mod:`kvstrata.tiers.memory`
  carves extents of one size class out of the arena and never returns them, so a tier holds
  ``n`` blocks when ``n`` blocks' bytes fit *and* their layer-blocks fit whole extents.
* :class:`SegmentSpace` (``nvme``): the segment files of :mod:`kvstrata.tiers.nvme`. A write
  batch is laid out as the tier lays it out (records packed at 64 bytes inside 16 MiB chunks
  padded to 4 KiB, segments sealed when full, the segment size capped at capacity / 8); a
  deleted record's bytes stay on disk until its segment holds no live record (unlinked) or
  falls below ``compact_threshold`` live (compacted into the active segment). ``fits``
  answers the tier's ``has_room``: physical bytes + the batch's cost <= capacity.
* :class:`ByteSpace` (``mooncake``, ``fs`` and others): live bytes <= capacity.
* :class:`UnboundedSpace`: ``inf``.

Hybrid layouts under per-layer policies store different layers of different blocks, so the
simulator asks the ``*RecordSpace`` variants instead, at layer-record granularity (what the
engine's ``has_room(sizes, live_bytes)`` sees): the same rules, per size class for the memory
tiers and per record for the segment files. The stated approximations are in :mod:`.segments`.

Modules: :mod:`.common` (the interfaces, :class:`MaskSizes`, :func:`space_model`), :mod:`.slots`
(memory arenas), :mod:`.segments` and :mod:`.segment_records` (the nvme segment files, per block
and per layer record), :mod:`.objects` (bytes and unbounded); the factories are here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.planner.space.common import CHUNK_BYTES, MaskSizes, RecordSpace, Space, space_model
from kvstrata.planner.space.objects import ByteRecordSpace, ByteSpace, UnboundedRecordSpace, UnboundedSpace
from kvstrata.planner.space.segment_records import SegmentRecordSpace, runs_layout
from kvstrata.planner.space.segments import SegmentSpace
from kvstrata.planner.space.slots import MemoryRecordSpace, MemorySpace, arena_max_blocks, capacity_for_blocks

__all__ = [
    "CHUNK_BYTES",
    "ByteRecordSpace",
    "ByteSpace",
    "MaskSizes",
    "MemoryRecordSpace",
    "MemorySpace",
    "RecordSpace",
    "SegmentRecordSpace",
    "SegmentSpace",
    "Space",
    "UnboundedRecordSpace",
    "UnboundedSpace",
    "arena_max_blocks",
    "capacity_for_blocks",
    "make_record_space",
    "make_space",
    "runs_layout",
    "space_model",
]


def make_space(kind: str, capacity: int | None, layer_sizes: Sequence[int], **nvme: float) -> Space:
    """The space model of a tier ``kind`` of ``capacity`` bytes (``None``: unbounded)."""
    if capacity is None:
        return UnboundedSpace()
    model = space_model(kind)
    if model == "slots":
        return MemorySpace(capacity, layer_sizes)
    if model == "segments":
        return SegmentSpace(
            capacity,
            layer_sizes,
            int(nvme.get("segment_size", 256 * 1024**2)),
            float(nvme.get("compact_threshold", 0.5)),
        )
    return ByteSpace(capacity, sum(layer_sizes))


def make_record_space(kind: str, capacity: int | None, sizes: MaskSizes, **nvme: float) -> RecordSpace:
    """The layer-record space model of a tier ``kind`` of ``capacity`` bytes (``None``: unbounded)."""
    if capacity is None:
        return UnboundedRecordSpace()
    model = space_model(kind)
    if model == "slots":
        return MemoryRecordSpace(capacity, sizes)
    if model == "segments":
        return SegmentRecordSpace(
            capacity,
            sizes,
            int(nvme.get("segment_size", 256 * 1024**2)),
            float(nvme.get("compact_threshold", 0.5)),
        )
    return ByteRecordSpace(capacity, sizes)
