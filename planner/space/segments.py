"""The nvme tier's segment files (:mod:`kvstrata.tiers.nvme`) at block granularity.

A write batch is laid out as the tier lays it out (records packed at 64 bytes inside 16 MiB chunks
padded to 4 KiB, segments sealed when full, the segment size capped at capacity / 8); a deleted
record's bytes stay on disk until its segment holds no live record (unlinked) or falls below
``compact_threshold`` live (compacted into the active segment). ``fits`` answers the tier's
``has_room``: physical bytes + the batch's cost <= capacity.

Approximations (stated, small): compaction moves a segment's live blocks in batches of up to
16 MiB of the old file in their order of arrival, where the tier groups records by file offset
(inside a batch the records keep the tier's file order: layer-major per write they came in);
with layer groups of different sizes the records of one block are spread evenly over the
segments a batch spans.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.planner.space.common import CHUNK_BYTES, Space
from kvstrata.tiers.segments import ALIGN, align_up, plan_batch, record_extent

__all__ = ["Segment", "SegmentSpace"]

# A batch as runs of blocks written together: (block indices, None) for whole blocks laid out
# layer-major, or (block indices, (block, layer) of each record in file order).
Groups = list[tuple[list[int], list[tuple[int, int]] | None]]


class Segment:
    __slots__ = ("first", "live_bytes", "live_count", "members", "partial", "size")

    def __init__(self) -> None:
        self.size = 0
        self.live_bytes = 0
        self.live_count = 0
        self.members: dict[int, int] = {}  # key -> offset of the write it came in (file order)
        self.partial: dict[int, int] = {}  # key -> records here, for blocks split over segments
        self.first: dict[int, int] = {}  # key -> its first layer here, for blocks split over segments


class SegmentSpace(Space):
    """The nvme tier's segment files, at block granularity."""

    def __init__(self, capacity: int, layer_sizes: Sequence[int], segment_size: int, compact_threshold: float) -> None:
        self.capacity = capacity
        self._cap = capacity
        cap = capacity // 8 if capacity > 0 else segment_size
        self.segment_size = max(ALIGN, min(segment_size, cap) // ALIGN * ALIGN)
        self.threshold = compact_threshold
        self.layer_sizes = list(layer_sizes)
        self.layers = len(layer_sizes)
        self.uniform = len(set(layer_sizes)) == 1
        self.block_extent = sum(record_extent(s) for s in layer_sizes)
        # equal records: the closed form of plan_batch (mixed sizes call plan_batch itself)
        self.ext = record_extent(layer_sizes[0]) if self.uniform else max(1, self.block_extent // self.layers)
        self.per_chunk = max(1, CHUNK_BYTES // self.ext)
        self.chunk_bytes = align_up(self.per_chunk * self.ext)
        self._segs: dict[int, Segment] = {}
        # key -> its segment (whole block), or {segment: records} for a block split over segments
        self._where: dict[int, int | dict[int, int]] = {}
        self._active: int | None = None
        self._next = 0
        self._physical = 0
        self._written = 0
        self.compactions = 0

    # -- layout of one batch ---------------------------------------------------------------
    def _size(self, count: int) -> int:
        full, rem = divmod(count, self.per_chunk)
        return full * self.chunk_bytes + align_up(rem * self.ext)

    def _fit(self, lengths: list[int] | None, lo: int, n: int, room: int) -> int:
        """Records ``lo ..`` (of ``n``) that fit ``room`` bytes, as ``plan_batch`` counts them."""
        if lengths is not None:
            return plan_batch(lengths, CHUNK_BYTES, room, start=lo).count
        left = n - lo
        if room <= 0:
            return 0
        full = min(room // self.chunk_bytes, left // self.per_chunk)
        count = full * self.per_chunk
        if count < left:
            rest = room - full * self.chunk_bytes
            count += min(left - count, self.per_chunk, (rest // ALIGN * ALIGN) // self.ext)
        while count > 0 and self._size(count) > room:
            count -= 1
        return count

    def _batch_size(self, lengths: list[int] | None, lo: int, count: int) -> int:
        if lengths is None:
            return self._size(count)
        return plan_batch(lengths[lo : lo + count], CHUNK_BYTES).size

    def _lengths(self, n_blocks: int) -> list[int] | None:
        if self.uniform:
            return None
        return [s for s in self.layer_sizes for _ in range(n_blocks)]  # layer-major, as the engine writes

    def _active_seg(self) -> Segment | None:
        return self._segs.get(self._active) if self._active is not None else None

    def _cost(self, n_records: int, lengths: list[int] | None) -> int:
        """Bytes an append of these records adds to the files now (the tier's ``_append_cost``)."""
        seg = self._active_seg()
        used = seg.size if seg is not None and seg.size < self.segment_size else 0
        total = lo = 0
        while lo < n_records:
            count = self._fit(lengths, lo, n_records, self.segment_size - used)
            if count == 0:
                if used:
                    used = 0
                    continue
                count = 1  # a record larger than a segment gets a segment of its own
            size = self._batch_size(lengths, lo, count)
            total += size
            used += size
            lo += count
        return total

    def fits(self, live_blocks: int, n: int) -> bool:
        return self._physical + self._cost(n * self.layers, self._lengths(n)) <= self._cap

    # -- writing ---------------------------------------------------------------------------
    def added(self, keys: Sequence[int]) -> None:
        keys = list(keys)
        self._append(keys, [self.layers] * len(keys), self._lengths(len(keys)), None)

    def _append(self, keys: list[int], records: list[int], lengths: list[int] | None, groups: Groups | None) -> None:
        """Append the records of ``keys`` as one batch (the tier's ``_appending``): whole blocks
        layer-major (an engine write), or ``groups`` after one another (a move, see :meth:`_move`)."""
        n_records = sum(records)
        lo = 0
        while lo < n_records:
            seg = self._active_seg()
            if seg is None or seg.size >= self.segment_size:
                self._active = self._next
                self._next += 1
                seg = self._segs[self._active] = Segment()
            count = self._fit(lengths, lo, n_records, self.segment_size - seg.size)
            if count == 0 and seg.size == 0:
                count = 1
            if count == 0:
                self._active = None  # sealed: the next record starts a new segment
                continue
            size = self._batch_size(lengths, lo, count)
            offset = seg.size
            seg.size += size
            self._physical += size
            self._written += size
            assert self._active is not None
            self._assign(self._active, seg, keys, lo, count, offset, groups or [(list(range(len(keys))), None)])
            lo += count

    def _assign(self, sid: int, seg: Segment, keys: list[int], lo: int, count: int, at: int, groups: Groups) -> None:
        """Records ``lo .. lo+count-1`` of the batch went to segment ``sid``: count them per key. A
        block's ``members`` offset is where its group starts here (a later move sorts by it)."""
        hi = lo + count
        layers = self.layers
        if len(groups) == 1 and groups[0][1] is None and lo == 0 and hi == len(keys) * layers:  # the usual case
            seg.live_bytes += len(keys) * self.block_extent
            seg.live_count += count
            seg.members.update(dict.fromkeys(keys, at))
            self._where.update(dict.fromkeys(keys, sid))
            return
        shares: list[tuple[int, int, int, int]] = []  # key, records here, first layer here, its group's offset
        r0 = 0
        for blocks, spans in groups:
            size = len(blocks) * layers if spans is None else len(spans)
            a, z = max(lo, r0) - r0, min(hi, r0 + size) - r0
            where = at + (max(lo, r0) - lo) * self.ext
            if a < z and spans is None:  # whole blocks, layer-major: record r is layer r // g of block r % g
                g = len(blocks)
                if a == 0 and z == size:
                    shares += [(keys[b], layers, 0, where) for b in blocks]
                else:
                    for i, b in enumerate(blocks):
                        got = (z - 1 - i) // g - (a - 1 - i) // g
                        if got:
                            shares.append((keys[b], got, (a - i + g - 1) // g, where))
            elif a < z and spans is not None:  # (block, layer) per record
                here: dict[int, list[int]] = {}
                for b, layer in spans[a:z]:
                    got_first = here.get(b)
                    if got_first is None:
                        here[b] = [1, layer]
                    else:
                        got_first[0] += 1
                shares += [(keys[b], got, first, where) for b, (got, first) in here.items()]
            r0 += size
        for key, got, first, where in shares:
            seg.live_bytes += self._bytes(got)
            seg.live_count += got
            seg.members.setdefault(key, where)
            if got == layers and key not in seg.partial:
                self._where[key] = sid
                continue
            seg.first.setdefault(key, first)
            seg.partial[key] = seg.partial.get(key, 0) + got
            w = self._where.get(key)
            if not isinstance(w, dict):
                w = self._where[key] = {}
            w[sid] = w.get(sid, 0) + got

    def _bytes(self, records: int) -> int:
        return self.block_extent if records == self.layers else round(self.block_extent * records / self.layers)

    # -- deleting and reclaiming -------------------------------------------------------------
    def removed(self, keys: Sequence[int]) -> None:
        touched: dict[int, None] = {}
        segs = self._segs
        where = self._where
        full = self.block_extent
        layers = self.layers
        for key in keys:
            w = where.pop(key, None)
            if w is None:
                continue
            if isinstance(w, int):
                seg = segs[w]
                seg.live_bytes -= full
                seg.live_count -= layers
                del seg.members[key]
                touched[w] = None
                continue
            for sid, got in w.items():
                seg = segs[sid]
                seg.live_bytes -= self._bytes(got)
                seg.live_count -= got
                seg.members.pop(key, None)
                seg.partial.pop(key, None)
                seg.first.pop(key, None)
                touched[sid] = None
        self._reclaim_touched(touched)

    def _reclaim_touched(self, touched: Sequence[int] | dict[int, None]) -> None:
        """Reclaim the segments one delete touched, as the tier does: each judged by its counters
        right after the delete (a compaction of another one may have moved records in since)."""
        infos = [(sid, self._segs[sid].live_bytes, self._segs[sid].live_count) for sid in touched]
        for sid, live_bytes, live_count in infos:
            self._reclaim_as(sid, live_bytes, live_count)

    def _reclaim(self, sid: int) -> None:
        seg = self._segs.get(sid)
        if seg is not None:
            self._reclaim_as(sid, seg.live_bytes, seg.live_count)

    def _reclaim_as(self, sid: int, live_bytes: int, live_count: int) -> None:
        """The tier's ``_reclaim_segment`` given the live counters it read."""
        seg = self._segs.get(sid)
        if seg is None:
            return
        if live_count == 0 and sid == self._active:
            self._active = None  # an empty active segment is sealed, then removed
        if sid == self._active:
            return
        if live_count and live_bytes >= self.threshold * seg.size:
            return
        if live_count:
            copy = align_up(live_bytes) + ALIGN * (1 + live_bytes // CHUNK_BYTES)
            if self._physical + copy > self._cap:
                return  # no room to copy first: wait until more of it is dead
            self._compact(sid, seg)
        if seg.live_count:
            return  # records live there (moved in since the delete): the index keeps the segment
        self._physical -= seg.size
        del self._segs[sid]
        self._forget(sid)

    def _forget(self, sid: int) -> None:
        """A segment was unlinked."""

    def _compact(self, sid: int, seg: Segment) -> None:
        """Move the live blocks of ``seg`` into the active segment, one batch per 16 MiB of the old file."""
        self.compactions += 1
        batch: list[int] = []
        start = 0
        for key, at in list(seg.members.items()):
            if batch and at - start >= CHUNK_BYTES:
                self._move(sid, seg, batch)
                batch = []
            if not batch:
                start = at
            batch.append(key)
        if batch:
            self._move(sid, seg, batch)
        seg.members.clear()
        seg.partial.clear()
        seg.first.clear()
        seg.live_bytes = seg.live_count = 0

    def _move(self, sid: int, seg: Segment, keys: list[int]) -> None:
        """Copy ``keys`` (their records in ``seg``) as one batch in the tier's file order: the
        groups they were written in one after another, each layer-major."""
        records = []
        by_group: dict[int, list[int]] = {}
        for b, key in enumerate(keys):
            w = self._where.get(key)
            if isinstance(w, dict):
                got = w.pop(sid, 0)
                if not w:
                    del self._where[key]
            else:
                got = self.layers
                del self._where[key]
            records.append(got)
            by_group.setdefault(seg.members.get(key, 0), []).append(b)
        groups: Groups = []
        for _, blocks in sorted(by_group.items()):
            if all(records[b] == self.layers for b in blocks):
                groups.append((blocks, None))
                continue
            firsts = [seg.first.get(keys[b], 0) if records[b] < self.layers else 0 for b in blocks]
            spans = sorted(
                ((b, layer) for b, f in zip(blocks, firsts, strict=True) for layer in range(f, f + records[b])),
                key=lambda r: (r[1], r[0]),
            )
            groups.append((blocks, spans))
        lengths = None if self.uniform else [self.ext] * sum(records)
        self._append(keys, records, lengths, groups)

    # -- reporting -----------------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int | None:
        return self._physical

    @property
    def physical_written(self) -> int | None:
        return self._written

    def max_blocks(self) -> int | None:
        return self._cap // self.block_extent
