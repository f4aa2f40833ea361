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
tiers and per record for the segment files.

Approximations (stated, small): compaction moves a segment's live blocks in batches of up
to 16 MiB of the old file in their order of arrival, where the tier groups records by file
offset; with layer groups of different sizes the records of one block are spread evenly
over the segments a batch spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.tiers import TIERS
from kvstrata.tiers.base import SpaceModel
from kvstrata.tiers.memory import EXTENT_BYTES
from kvstrata.tiers.segments import ALIGN, align_down, align_up, plan_batch, record_extent

__all__ = [
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
    "make_record_space",
    "make_space",
    "runs_layout",
    "space_model",
]

CHUNK_BYTES = 16 * 1024**2  # the nvme tier's staging chunk (kvstrata.tiers.nvme.options.CHUNK_BYTES)


class Space:
    """Physical space of one tier; the engine asks ``fits`` before writing ``n`` more blocks."""

    capacity: int | None = None

    def fits(self, live_blocks: int, n: int) -> bool:
        raise NotImplementedError

    def added(self, keys: Sequence[int]) -> None:
        """``keys`` were written (one write batch)."""

    def removed(self, keys: Sequence[int]) -> None:
        """``keys`` were deleted (one delete call)."""

    @property
    def physical_bytes(self) -> int | None:
        return None

    @property
    def physical_written(self) -> int | None:
        """Bytes written to the medium (padding and compaction included), where modelled."""
        return None

    def max_blocks(self) -> int | None:
        """Most blocks the tier can ever hold (``None``: no fixed bound)."""
        return None


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


def space_model(kind: str) -> SpaceModel:
    """How a tier of ``kind`` spends its capacity, as its class declares (``capabilities.space``).

    A kind whose class cannot be loaded here (planning for a machine with an optional
    dependency this one lacks) is modelled by its bytes."""
    try:
        return TIERS.get(kind).capabilities.space
    except Exception:  # a kind without an importable class: its bytes
        return "bytes"


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


class _Segment:
    __slots__ = ("live_bytes", "live_count", "members", "partial", "size")

    def __init__(self) -> None:
        self.size = 0
        self.live_bytes = 0
        self.live_count = 0
        self.members: dict[int, int] = {}  # key -> offset at append (file order)
        self.partial: dict[int, int] = {}  # key -> records here, for blocks split over segments


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
        self._segs: dict[int, _Segment] = {}
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

    def _active_seg(self) -> _Segment | None:
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
        self._append(keys, [self.layers] * len(keys), self._lengths(len(keys)), layer_major=True)

    def _append(self, keys: list[int], records: list[int], lengths: list[int] | None, layer_major: bool) -> None:
        """Append the records of ``keys`` as one batch (the tier's ``_appending``)."""
        n_records = sum(records)
        lo = 0
        while lo < n_records:
            seg = self._active_seg()
            if seg is None or seg.size >= self.segment_size:
                self._active = self._next
                self._next += 1
                seg = self._segs[self._active] = _Segment()
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
            self._assign(self._active, seg, keys, records, lo, count, offset, layer_major)
            lo += count

    def _assign(
        self,
        sid: int,
        seg: _Segment,
        keys: list[int],
        records: list[int],
        lo: int,
        count: int,
        at: int,
        layer_major: bool,
    ) -> None:
        """Records ``lo .. lo+count-1`` of the batch went to segment ``sid``: count them per key."""
        n = len(keys)
        hi = lo + count
        layers = self.layers
        if lo == 0 and hi == n * layers and all(r == layers for r in records):  # the usual case
            seg.live_bytes += n * self.block_extent
            seg.live_count += count
            seg.members.update(dict.fromkeys(keys, at))
            self._where.update(dict.fromkeys(keys, sid))
            return
        shares: list[tuple[int, int]] = []
        if layer_major:  # record r is layer r // n of block r % n
            for b, key in enumerate(keys):
                got = (hi - 1 - b) // n - (lo - 1 - b) // n
                if got:
                    shares.append((key, got))
        else:  # key-major (compaction moves)
            first = 0
            for key, r in zip(keys, records, strict=True):
                got = min(first + r, hi) - max(first, lo)
                if got > 0:
                    shares.append((key, got))
                first += r
        for key, got in shares:
            seg.live_bytes += self._bytes(got)
            seg.live_count += got
            seg.members.setdefault(key, at)
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

    def _compact(self, sid: int, seg: _Segment) -> None:
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
        seg.live_bytes = seg.live_count = 0

    def _move(self, sid: int, seg: _Segment, keys: list[int]) -> None:
        records = []
        for key in keys:
            w = self._where.get(key)
            if isinstance(w, dict):
                got = w.pop(sid, 0)
                if not w:
                    del self._where[key]
            else:
                got = self.layers
                del self._where[key]
            records.append(got)
        lengths = None if self.uniform else [self.ext] * sum(records)
        self._append(keys, records, lengths, layer_major=False)

    # -- reporting -----------------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int | None:
        return self._physical

    @property
    def physical_written(self) -> int | None:
        return self._written

    def max_blocks(self) -> int | None:
        return self._cap // self.block_extent


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


# ----------------------------------------------------------------------------------------------
# Layer-record granularity (hybrid layouts under per-layer policies: blocks hold different layers)


class MaskSizes:
    """Bytes and layers of a layer mask, cached (masks are unions of a few groups' masks)."""

    def __init__(self, layer_sizes: Sequence[int], rank_independent: int = 0) -> None:
        self.sizes = list(layer_sizes)
        self.extents = [record_extent(s) for s in self.sizes]
        self.rank_independent = rank_independent  # mask of layers stored once for all tp ranks
        self._layers: dict[int, tuple[int, ...]] = {}
        self._nbytes: dict[int, int] = {}
        self._extent: dict[int, int] = {}
        self._ri: dict[int, int] = {}

    def _fill(self, mask: int) -> None:
        layers = tuple(i for i in range(len(self.sizes)) if mask >> i & 1)
        self._layers[mask] = layers
        self._nbytes[mask] = sum(self.sizes[i] for i in layers)
        self._extent[mask] = sum(self.extents[i] for i in layers)
        self._ri[mask] = sum(self.sizes[i] for i in layers if self.rank_independent >> i & 1)

    def layers(self, mask: int) -> tuple[int, ...]:
        got = self._layers.get(mask)
        if got is None:
            self._fill(mask)
            got = self._layers[mask]
        return got

    def nbytes(self, mask: int) -> int:
        got = self._nbytes.get(mask)
        if got is None:
            self._fill(mask)
            got = self._nbytes[mask]
        return got

    def extent(self, mask: int) -> int:
        got = self._extent.get(mask)
        if got is None:
            self._fill(mask)
            got = self._extent[mask]
        return got

    def ri_bytes(self, mask: int) -> int:
        """Bytes of the rank-independent layers of ``mask``."""
        got = self._ri.get(mask)
        if got is None:
            self._fill(mask)
            got = self._ri[mask]
        return got


class RecordSpace(Space):
    """Physical space at layer-record granularity: what the engine's ``has_room(sizes, live_bytes)``
    answers for one write of the layer-blocks of ``masks`` (one mask per key)."""

    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        raise NotImplementedError

    def add_records(self, items: Sequence[tuple[int, int]]) -> None:
        """One write batch: ``(key, layer mask)`` pairs (the engine writes them layer-major)."""

    def remove_records(self, items: Sequence[tuple[int, int]]) -> None:
        """One delete call: ``(key, layer mask)`` pairs."""


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
                seg = self._segs[self._active] = _Segment()
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

    def _compact(self, sid: int, seg: _Segment) -> None:
        self.compactions += 1
        extents = self.m.extents
        runs: list[list[tuple[int, int]]] = []
        start = end = -1
        for piece in self._log.get(sid, ()):
            for key, layer, at in self._records_of(piece):
                if not self._rwhere.get(key, {}).get(sid, 0) >> layer & 1:
                    continue  # dead
                stop = at + extents[layer]
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
