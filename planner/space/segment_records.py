"""The nvme tier's segment files at layer-record granularity (hybrid layouts under per-layer
policies store different layers of different blocks): what the engine's
``has_room(sizes, live_bytes)`` sees, per record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.planner.space.common import CHUNK_BYTES, MaskSizes, RecordSpace
from kvstrata.planner.space.segments import Segment, SegmentSpace
from kvstrata.tiers.segments import align_down, align_up, payload_extent, plan_batch

__all__ = ["SegmentRecordSpace", "runs_layout"]


def runs_layout(
    runs: Sequence[tuple[int, int]], limit: int, room: int | None = None, start: int = 0
) -> tuple[int, int]:
    """:func:`~kvstrata.tiers.segments.plan_batch` over records given as runs ``(extent, count)``
    (a layer-major batch: one run per layer), from record ``start``: ``(records that fit
    ``room``, bytes they take)``, in time proportional to runs and chunks, not records."""
    base = pos = placed = 0
    skip = start
    avail = room
    for ext, count in runs:
        if skip >= count:
            skip -= count
            continue
        left = count - skip
        skip = 0
        while left:
            if pos and pos + ext > limit:  # the next record opens a chunk
                base += align_up(pos)
                pos = 0
            k = min(left, max(1, (limit - pos) // ext))  # records of this chunk (a larger one: alone)
            if avail is not None:
                fit = max(0, (align_down(avail - base) - pos) // ext) if avail >= base else 0
                if fit < k:
                    placed += fit
                    pos += fit * ext
                    return placed, base + align_up(pos)
            placed += k
            pos += k * ext
            left -= k
    return placed, base + align_up(pos)


class SegmentRecordSpace(SegmentSpace, RecordSpace):
    """The nvme tier's segment files at layer-record granularity: a batch's records are laid out
    layer-major as the engine writes them, each at its offset; compaction moves a segment's live
    records in file order, one batch per run of up to 16 MiB of the old file (the tier's
    ``plan_runs``, as without ``O_DIRECT``). A delete reclaims the segments it touched judged by
    their counters right after it, as the tier does."""

    def __init__(self, capacity: int, sizes: MaskSizes, segment_size: int, compact_threshold: float) -> None:
        super().__init__(capacity, sizes.sizes, segment_size, compact_threshold)
        self.m = sizes
        self._rwhere: dict[int, dict[int, int]] = {}  # key -> {segment: layer mask there}
        # segment -> pieces of the batches appended to it, in file order: (base offset, the batch's
        # record owners and layers (or its (key, mask) items, laid out layer-major), first record, count)
        self._log: dict[int, list[tuple[int, Any, int, int]]] = {}

    def _runs(self, masks: Sequence[int]) -> list[tuple[int, int]]:
        """A layer-major batch of ``masks`` as runs (extent, records) per layer."""
        per_mask: dict[int, int] = {}
        for m in masks:
            per_mask[m] = per_mask.get(m, 0) + 1
        count = [0] * self.layers
        for m, k in per_mask.items():
            for layer in self.m.layers(m):
                count[layer] += k
        ext = self.m.extents
        return [(ext[layer], c) for layer, c in enumerate(count) if c]

    def _runs_cost(self, runs: list[tuple[int, int]]) -> int:
        """Bytes appending a batch of ``runs`` adds to the files now (the tier's ``_append_cost``)."""
        seg = self._active_seg()
        used = seg.size if seg is not None and seg.size < self.segment_size else 0
        n = sum(c for _, c in runs)
        total = lo = 0
        while lo < n:
            count, size = runs_layout(runs, CHUNK_BYTES, self.segment_size - used, start=lo)
            if count == 0:
                if used:
                    used = 0
                    continue
                count, size = 1, self._one(runs, lo)
            total += size
            used += size
            lo += count
        return total

    def _one(self, runs: list[tuple[int, int]], lo: int) -> int:
        """Bytes of record ``lo`` alone in a batch (a record larger than a segment)."""
        for ext, c in runs:
            if lo < c:
                return align_up(ext)
            lo -= c
        return 0

    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        return self._physical + self._runs_cost(self._runs(masks)) <= self._cap

    def add_records(self, items: Sequence[tuple[int, int]]) -> None:
        runs = self._runs([m for _, m in items])
        n = sum(c for _, c in runs)
        seg = self._active_seg()
        if seg is not None and seg.size < self.segment_size:
            count, size = runs_layout(runs, CHUNK_BYTES, self.segment_size - seg.size)
            if count == n:  # the usual case: the whole batch in the active segment
                sid = self._active
                assert sid is not None
                self._log[sid].append((seg.size, list(items), 0, n))
                seg.size += size
                self._physical += size
                self._written += size
                for key, m in items:
                    seg.live_bytes += self.m.extent(m)
                    seg.live_count += len(self.m.layers(m))
                    w = self._rwhere.get(key)
                    if w is None:
                        w = self._rwhere[key] = {}
                    w[sid] = w.get(sid, 0) | m
                return
        owners: list[int] = []
        layers: list[int] = []
        for layer in range(self.layers):
            bit = 1 << layer
            for key, m in items:
                if m & bit:
                    owners.append(key)
                    layers.append(layer)
        self._append_records(owners, layers, runs)

    def _append_records(self, owners: list[int], layers: list[int], runs: list[tuple[int, int]] | None = None) -> None:
        """Append records in this order (``runs``: the same as runs of equal extents, when known)."""
        n = len(owners)
        if runs is None:
            extents_of = self.m.extents
            runs = []
            for layer in layers:
                e = extents_of[layer]
                if runs and runs[-1][0] == e:
                    runs[-1] = (e, runs[-1][1] + 1)
                else:
                    runs.append((e, 1))
        extents = self.m.extents
        lo = 0
        while lo < n:
            seg = self._active_seg()
            if seg is None or seg.size >= self.segment_size:
                self._active = self._next
                self._next += 1
                seg = self._segs[self._active] = Segment()
                self._log[self._active] = []
            count, size = runs_layout(runs, CHUNK_BYTES, self.segment_size - seg.size, start=lo)
            if count == 0 and seg.size == 0:  # a record larger than a segment: a segment of its own
                count, size = 1, self._one(runs, lo)
            if count == 0:
                self._active = None
                continue
            sid = self._active
            assert sid is not None
            self._log[sid].append((seg.size, (owners, layers), lo, count))
            seg.size += size
            self._physical += size
            self._written += size
            for r in range(lo, lo + count):
                key, layer = owners[r], layers[r]
                seg.live_bytes += extents[layer]
                seg.live_count += 1
                w = self._rwhere.get(key)
                if w is None:
                    w = self._rwhere[key] = {}
                w[sid] = w.get(sid, 0) | 1 << layer
            lo += count

    def _records_of(self, piece: tuple[int, Any, int, int]) -> list[tuple[int, int, int]]:
        """(key, layer, file offset) of the records of one logged piece, in file order."""
        base, batch, lo, count = piece
        if isinstance(batch, list):  # (key, mask) items, laid out layer-major
            owners = [k for layer in range(self.layers) for k, m in batch if m >> layer & 1]
            layers = [layer for layer in range(self.layers) for _, m in batch if m >> layer & 1]
        else:
            owners, layers = batch
        lengths = [self.layer_sizes[layer] for layer in layers]
        offsets = plan_batch(lengths[: lo + count], CHUNK_BYTES, start=lo).offsets
        return [(owners[lo + i], layers[lo + i], base + at) for i, at in enumerate(offsets)]

    def remove_records(self, items: Sequence[tuple[int, int]]) -> None:
        touched: dict[int, None] = {}
        for key, mask in items:
            w = self._rwhere.get(key)
            if not w:
                continue
            for sid in sorted(w, key=lambda s: (w[s] & mask) & -(w[s] & mask)):  # ids are key-major, layer order
                held = w[sid]
                gone = held & mask
                if not gone:
                    continue
                seg = self._segs[sid]
                seg.live_bytes -= self.m.extent(gone)
                seg.live_count -= len(self.m.layers(gone))
                if held & ~gone:
                    w[sid] = held & ~gone
                else:
                    del w[sid]
                touched[sid] = None
            if not w:
                del self._rwhere[key]
        self._reclaim_touched(touched)

    def _forget(self, sid: int) -> None:
        self._log.pop(sid, None)

    def _compact(self, sid: int, seg: Segment) -> None:
        self.compactions += 1
        extents = self.m.extents
        runs: list[list[tuple[int, int]]] = []
        start = end = -1
        for piece in self._log.get(sid, ()):
            for key, layer, at in self._records_of(piece):
                if not self._rwhere.get(key, {}).get(sid, 0) >> layer & 1:
                    continue  # dead
                stop = at + payload_extent(self.layer_sizes[layer])  # where the tier's loc ends (headers come after)
                if runs and 0 <= at - end <= CHUNK_BYTES and max(end, stop) - start <= CHUNK_BYTES:
                    runs[-1].append((key, layer))
                else:
                    runs.append([(key, layer)])
                    start, end = at, -1
                end = max(end, stop)
        for run in runs:
            for key, layer in run:
                w = self._rwhere[key]
                left = w[sid] & ~(1 << layer)
                if left:
                    w[sid] = left
                else:
                    del w[sid]
                    if not w:
                        del self._rwhere[key]
                seg.live_bytes -= extents[layer]
                seg.live_count -= 1
            self._append_records([k for k, _ in run], [layer for _, layer in run])
