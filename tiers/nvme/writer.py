"""Appending records: reserve space in the active segment, pack staging chunks (each record's
header beside its payload, so one ``pwrite`` per chunk still writes both), write, sync, then commit
the index (data durable before the index points at it)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence

import lmdb
import numpy as np

from kvstrata.core.buffers import Buffer, nbytes
from kvstrata.core.native import untrack_each
from kvstrata.errors import TierError
from kvstrata.tiers.base import BlockId
from kvstrata.tiers.fileio import hash_records, pwritev_all, stage_in
from kvstrata.tiers.files import open_new
from kvstrata.tiers.nvme.lanes import Pipeline, cpu_workers
from kvstrata.tiers.nvme.options import CHUNK_BYTES, IO_DEPTH
from kvstrata.tiers.nvme.state import NVMeState, OpenSegment
from kvstrata.tiers.records import KEY_BYTES, RECORD_HEADER, acceptable_buffer, key_or_none, pack_headers_into
from kvstrata.tiers.segment_index import LocFields, new_loc
from kvstrata.tiers.segments import (
    ALIGN,
    SEGMENT_SUFFIX,
    BatchLayout,
    Loc,
    SegInfo,
    copy_record,
    fsync_dir,
    headers_at,
    payload_extent,
    plan_batch,
    pwrite_all,
    try_flock,
)

log = logging.getLogger("kvstrata.tiers.nvme")
_CREATE_TRIES = 16  # new segment files swept away before they were locked, before a write gives up


class Appender(NVMeState):
    """Writes records into this process's own segments."""

    def _accepted_keys(self, items: Sequence[tuple[BlockId, Buffer]]) -> tuple[list[bytes | None], list[int]]:
        """:meth:`_accepted_key` of each item, and each accepted item's length in bytes (0 for the
        others); the usual item (a 16-byte key, a layer of this layout, a contiguous numpy row of
        that layer's size) without its function calls (4,096 items: ~4 ms through
        ``_accepted_key``, and ~1 ms more to ask each buffer its length again)."""
        layout = self.context.layout
        sizes = [layout.layer_nbytes(i) for i in range(layout.num_layers)]
        tails = [i.to_bytes(2, "big") for i in range(layout.num_layers)]
        out: list[bytes | None] = []
        lengths: list[int] = []
        append, took = out.append, lengths.append
        ndarray = np.ndarray
        for item in items:
            try:
                (key, layer), buf = item
            except (TypeError, ValueError):
                append(None)
                took(0)
                continue
            if (
                type(key) is bytes
                and type(layer) is int
                and len(key) == KEY_BYTES
                and 0 <= layer < len(sizes)
                and type(buf) is ndarray
                and buf.nbytes == sizes[layer]
                and buf.flags.c_contiguous
            ):
                append(key + tails[layer])
                took(sizes[layer])
            else:
                got = self._accepted_key((key, layer), buf)
                append(got)
                took(0 if got is None else nbytes(buf))
        return out, lengths

    def _accepted_key(self, bid: BlockId, buf: Buffer) -> bytes | None:
        """The index key of a layer-block this tier can write from ``buf``, else None."""
        key = key_or_none(bid)
        if key is None or bid[1] >= self.context.layout.num_layers:
            return None
        return key if acceptable_buffer(buf, self.context.layout.layer_nbytes(bid[1])) else None

    def _store(
        self,
        keys: list[bytes],
        bufs: Sequence[Buffer],
        expect: Sequence[Loc | None] | None = None,
        seals: Sequence[tuple[int, bytes]] | None = None,
        lengths: list[int] | None = None,
    ) -> tuple[list[bool], dict[int, SegInfo]]:
        """Append records, make them durable, then commit the index.

        ``seals``: each record's (checksum, tag) as it was (compaction copies records it checked,
        or cannot check, as they are); by default they are computed from the staged bytes.
        ``lengths``: each buffer's length in bytes, where the caller has them already.
        Returns which records were applied and the segments whose records they replaced."""
        if lengths is None:
            lengths = [nbytes(b) for b in bufs]
        done: list[tuple[list[bool], dict[int, SegInfo]]] = []
        try:
            with self._appending(lengths) as spans, contextlib.ExitStack() as commit:

                def entries(locs: list[Loc]) -> None:
                    """The index entries, made while the last chunks are still on their way to
                    the disk; committed (and the mirror updated) when ``commit`` closes, after the
                    sync."""
                    fields = loc_fields_many(locs)  # the mirror's entries, made before the lock
                    commit.enter_context(self._index.write_lock)
                    commit.push(lambda failed, *_: None if failed else self._mirrored(keys, fields, done[0][0]))
                    done.append(commit.enter_context(self._index.putting(list(zip(keys, locs, strict=True)), expect)))

                self._write_records(spans, bufs, lengths, keys, seals, entries)
                if not done:  # nothing to write
                    entries([])
                if self.opts.fsync:
                    for fd in dict.fromkeys(w.fd for w, *_ in spans):
                        os.fdatasync(fd)
            self._make_spare()
            return done[0]
        except (OSError, lmdb.Error) as exc:
            raise TierError(f"nvme tier {self.name!r}: write to {self.segment_dir} failed: {exc}") from exc

    def _write_records(
        self,
        spans: Sequence[tuple[OpenSegment, int, int, BatchLayout]],
        bufs: Sequence[Buffer],
        lengths: list[int],
        keys: Sequence[bytes],
        seals: Sequence[tuple[int, bytes]] | None,
        staged: Callable[[list[Loc]], None],
    ) -> None:
        """Pack the records of every span into aligned staging chunks as its layout says (payloads
        here, their headers after them once they are sealed), one pwrite per chunk. Where the
        records went, with their (checksum, tag) (``seals`` when given), in record order, is handed
        to ``staged`` once every chunk is packed, while the last ones are still being written.

        The chunks of all spans go through one :class:`~kvstrata.tiers.nvme.lanes.Pipeline`: CPU
        workers (the caller among them) pack and checksum (or tag) each chunk into a free staging
        buffer; ``IO_DEPTH`` I/O threads write staged chunks one after another, so a batch that
        fills one segment and starts the next keeps the disk busy across the boundary. The first
        chunk's first half is written as soon as it is staged (:func:`early_cut`), the rest after."""
        work = [(span, k) for span in spans for k in range(len(span[3].chunks))]
        cpu = cpu_workers(IO_DEPTH)
        with contextlib.ExitStack() as stack:
            size = max(span[3].chunks[k][3] for span, k in work)
            count = min(len(work), IO_DEPTH + cpu + 1)
            stages = [stack.enter_context(self._pool.borrow(size)) for _ in range(count)]
            gathered: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # chunks written from the caller's memory
            early: dict[int, int] = {}  # chunk -> bytes of it written early (see early_cut)

            def pack(i: int, stage: np.ndarray) -> list[Loc]:
                (writer, base, first, layout), k = work[i]
                lo, hi, offset, nb = layout.chunks[k]  # records of the span, counted from ``first``
                where = [(keys[first + j], layout.offsets[j] - offset, lengths[first + j]) for j in range(lo, hi)]
                plain = seals is None and self._key is None  # checksums taken as the records are staged
                heads = headers_at(layout, lengths, k, first) - offset
                chunk_bufs = bufs[first + lo : first + hi]
                made = self._direct(where, chunk_bufs, heads, nb, stage, gathered, i) if plain else None
                if made is None:
                    positions, chunk_lengths = [p for _, p, _ in where], lengths[first + lo : first + hi]
                    half = early_cut(positions, nb) if i == 0 and plain else 0
                    head = (
                        stage_in(stage, positions[:half], chunk_bufs[:half], chunk_lengths[:half], plain)
                        if half
                        else None
                    )
                    if head is not None:  # the first half to the disk while the rest is packed
                        cut = early[i] = positions[half]
                        pipe.early(i, lambda: pwrite_all(writer.fd, stage[:cut], base + offset))
                    else:  # no early part (or not host memory: the whole chunk record by record, below)
                        half = 0
                    sums = stage_in(stage, positions[half:], chunk_bufs[half:], chunk_lengths[half:], plain)
                    if head is not None and sums is not None:
                        sums = head + sums
                    if sums is None:  # no extension, or device buffers: record by record
                        for j in range(lo + half, hi):
                            n, pos = lengths[first + j], layout.offsets[j] - offset
                            copy_record(stage[pos : pos + payload_extent(n)], bufs[first + j], n)
                    stage[heads + (hi - lo) * RECORD_HEADER : nb] = 0
                    if seals is not None:
                        made = list(seals[first + lo : first + hi])
                    elif plain and sums:
                        made = [(c, b"") for c in sums]
                    else:
                        made = [self._sealed(key, stage[p : p + n]) for key, p, n in where]
                    pack_headers_into(stage, heads, where, made)
                seg = writer.seg
                return [
                    new_loc((seg, base + offset + p, n, csum, tag, True))
                    for (_, p, n), (csum, tag) in zip(where, made, strict=True)
                ]

            def write(i: int, stage: np.ndarray) -> int:
                (writer, base, _, layout), k = work[i]
                _, _, offset, nb = layout.chunks[k]
                pieces = gathered.pop(i, None)
                if pieces is None:
                    cut = early.pop(i, 0)  # the bytes before it went early
                    pwrite_all(writer.fd, stage[cut:nb], base + offset + cut)
                else:
                    pwritev_all(writer.fd, *pieces, base + offset)
                return nb

            def made(parts: list[list[Loc] | None]) -> None:
                staged([loc for part in parts if part is not None for loc in part])

            pipe = Pipeline(self._io_pool, stages, IO_DEPTH, cpu, write, before=pack)
            pipe.run(len(work), made)

    def _direct(
        self,
        where: list[tuple[bytes, int, int]],
        bufs: Sequence[Buffer],
        heads: int,
        nb: int,
        stage: np.ndarray,
        gathered: dict[int, tuple[np.ndarray, np.ndarray]],
        i: int,
    ) -> list[tuple[int, bytes]] | None:
        """Zero copy: when every record of a chunk lies in host memory that ``O_DIRECT`` takes as it
        is (addresses at the probed alignment, whole pages long, so that each one starts where the
        last ends), the chunk is written from there in one gathered write, the records followed by
        their headers, packed into the first bytes of ``stage``; ``gathered[i]`` is then the
        pieces (addresses, lengths) for chunk ``i``'s write. Returns the records' seals (their
        checksums, taken from the caller's memory), or None: stage the chunk as usual.

        Against a staged write this saves a copy of every byte (CPU time and memory bandwidth
        beside the disk's DMA), and it is what the engine's demotions from the dram tier get (its
        arena's slots are page-aligned) and pinned host buffers would; off by default (see
        :func:`~kvstrata.tiers.nvme.state._zero_copy_alignment`: slower on this project's VMs). The bytes
        written are the caller's at the time of the write; a caller that changes them meanwhile
        leaves a record that fails its checksum (a miss), never a wrong one."""
        align = self._mem_align
        if not align or any(n % ALIGN for _, _, n in where):
            return None
        at = 0
        for _, pos, n in where:  # whole pages one after another (what the plan gives such records)
            if pos != at:
                return None
            at += n
        got = hash_records(bufs, [n for _, _, n in where], align)
        if got is None:  # not all host memory at that alignment: staged
            return None
        sums, addrs = got
        made = [(c, b"") for c in sums.tolist()]
        tail = nb - heads
        if tail > len(stage):
            return None
        stage[(len(where)) * RECORD_HEADER : tail] = 0
        pack_headers_into(stage, heads, where, made, base=heads)
        gathered[i] = (
            np.append(addrs, np.uint64(stage.ctypes.data)),
            np.array([n for _, _, n in where] + [tail], dtype=np.int64),
        )
        with self._lock:
            self.zero_copy_records += len(where)
        return made

    def _mirrored(self, keys: Sequence[bytes], fields: Sequence[LocFields], applied: Sequence[bool]) -> None:
        """Cache the committed entries (caller holds the index's ``write_lock``)."""
        with self._lock:
            self._mirror_set_many(keys, fields, applied)

    @contextlib.contextmanager
    def _appending(self, lengths: list[int]) -> Iterator[list[tuple[OpenSegment, int, int, BatchLayout]]]:
        """Reserve space for records, filling segments up to ``segment_size``.

        Yields spans ``(writer, base offset, first record, layout)`` covering the records
        in order (records ``first : first + layout.count`` at ``base + layout.offsets``);
        the segments stay open (and locked) until the caller's commit is done."""
        spans: list[tuple[OpenSegment, int, int, BatchLayout]] = []
        try:
            with self._append_lock:
                lo = 0
                while lo < len(lengths):
                    span = self._reserve(lengths, lo)
                    if span is not None:
                        spans.append(span)
                        lo += span[3].count
            yield spans
        finally:
            for writer, *_ in spans:
                self._release(writer)

    def _reserve(self, lengths: list[int], lo: int) -> tuple[OpenSegment, int, int, BatchLayout] | None:
        """Reserve the records from ``lo`` that fit the active segment (caller holds ``_append_lock``)."""
        writer = self._writer
        if writer is None or writer.size >= self.segment_size:
            self._seal()
            writer = self._writer = self._next_segment()
        layout = self._fit(lengths, lo, writer.size)
        if layout is None:  # the next record does not fit: start a new segment
            self._seal()
            return None
        with self._lock:
            base = writer.size  # a multiple of ALIGN: every batch starts on a fresh page
            writer.size += layout.size
            writer.pending += 1
            self._sizes[writer.name] = writer.size
        return writer, base, lo, layout

    def _release(self, writer: OpenSegment) -> None:
        with self._lock:
            writer.pending -= 1
            done = writer.sealed and writer.pending == 0 and self._open.pop(writer.seg, None) is not None
        if done:
            os.close(writer.fd)

    def _next_segment(self) -> OpenSegment:
        """The segment to append to next (caller holds ``_append_lock``): the spare made ahead,
        else a new one made now. A new segment costs ~1 ms (its file, a directory fsync, a synced
        index transaction), which a write that starts one would spend before its first ``pwrite``
        (every 256 MiB write, at the default segment size). So once this tier has filled a
        segment, the write that takes the next one makes the spare after it (:meth:`_make_spare`)
        once its own records are committed. (Made while its last chunks were on their way to the
        disk, as until 2026-12-08, the spare's fsyncs waited ~15-20 ms for them, and the write's
        index entries waited behind it: ~6% of a 512 MiB write.) An unused spare is removed at
        close, or by the next open's sweep after a crash."""
        writer, self._spare = self._spare, None
        if writer is None:
            writer = self._new_segment()
        self._spare_wanted = self._sealed_any
        return writer

    def _make_spare(self) -> None:
        """Make the spare segment if a rollover took the last one; a failure here leaves the next
        rollover to make its segment itself (and fail there, as a write, if it must)."""
        if not self._spare_wanted:
            return
        try:
            with self._append_lock:
                if self._spare is None and self._spare_wanted and not self._closed:
                    self._spare = self._new_segment()
                self._spare_wanted = False
        except (OSError, lmdb.Error, TierError) as exc:
            log.warning("nvme tier %s: making a spare segment in %s failed: %s", self.name, self.segment_dir, exc)

    def _new_segment(self) -> OpenSegment:
        """Create, lock, then register a new segment file (caller holds ``_append_lock``).

        Between the create and the lock, a sweep (``verify --repair`` with ``grace_s=0``, or
        one of another process) may take the new, unregistered file for a dead writer's and
        unlink it: the lock is then refused or lands on an unlinked inode. Either way that file
        is left to the sweep and a new one (a new name) is made."""
        for _ in range(_CREATE_TRIES):
            self._seq += 1
            name = f"{self._writer_id}-{self._seq:06d}{SEGMENT_SUFFIX}"
            path = os.path.join(self.segment_dir, name)
            fd = open_new(path, os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC | self._odirect, self.opts.file_mode)
            try:
                if not try_flock(fd, path):  # swept (or being swept) between the create and the lock
                    os.close(fd)
                    continue
                if self.opts.fsync:
                    fsync_dir(self.segment_dir)
                seg = self._index.register_segment(name)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            writer = OpenSegment(seg, name, fd)
            with self._lock:
                self._names[seg] = name
                self._sizes[name] = 0
                self._open[seg] = writer
            return writer
        raise TierError(f"nvme tier {self.name!r}: {_CREATE_TRIES} new segments in {self.segment_dir} were swept away")

    def _seal(self) -> None:
        """Stop appending to the active segment (caller holds ``_append_lock``)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self._sealed_any = True
        with self._lock:
            writer.sealed = True
            done = writer.pending == 0 and self._open.pop(writer.seg, None) is not None
        if done:
            os.close(writer.fd)  # releases the flock: the segment is sealed for everyone

    def _append_cost(self, lengths: list[int]) -> int:
        """Bytes that appending ``lengths`` in one batch would add to the segment files now:
        the layout ``_reserve`` would choose, split over segments the same way."""
        writer = self._writer
        used = 0
        if writer is not None:
            with self._lock:
                used = writer.size if writer.size < self.segment_size else 0
        total = lo = 0
        while lo < len(lengths):
            layout = self._fit(lengths, lo, used)
            if layout is None:
                used = 0  # a new segment
                continue
            total += layout.size
            used += layout.size
            lo += layout.count
        return total

    def _fit(self, lengths: list[int], lo: int, used: int) -> BatchLayout | None:
        """Layout of the records from ``lo`` that fit a segment holding ``used`` bytes; None: seal it."""
        layout = plan_batch(lengths, CHUNK_BYTES, self.segment_size - used, start=lo)
        if layout.count == 0 and used == 0:  # a record larger than a segment gets a fresh segment of its own
            layout = plan_batch(lengths[: lo + 1], CHUNK_BYTES, start=lo)
        return layout if layout.count else None


#: The least a chunk's early part is worth a ``pwrite`` of its own (see :func:`early_cut`).
EARLY_MIN = 1 << 20


def early_cut(positions: Sequence[int], size: int) -> int:
    """How many of a chunk's records (payloads at ``positions``, the chunk ``size`` bytes) go to the
    disk before the rest is packed: those before the first record from the middle on that starts
    on a page (``O_DIRECT`` writes whole pages), if they come to :data:`EARLY_MIN` bytes; else 0.

    Only the first chunk of a write does this: the disk would otherwise wait for all of it to be
    copied and checksummed (16 MiB: ~3 ms on this project's VMs) before its first ``pwrite``,
    where the raw baseline's first ``pwrite`` starts at once; later chunks are packed while the
    chunks before them are on the disk."""
    mid = len(positions) // 2
    for j in range(mid, min(len(positions), mid + 64)):  # records of a page or more: the first is one
        at = positions[j]
        if at % ALIGN == 0:
            return j if EARLY_MIN <= at < size else 0
    return 0


def loc_fields_many(locs: Sequence[Loc]) -> list[LocFields]:
    """:func:`~kvstrata.tiers.segment_index.loc_fields` of each of ``locs`` (a write's 4,096)
    without a Python call each: plain tuples, untracked at once. Not the Locs themselves: a dict
    counts a tuple subclass as trackable whatever its state, and the mirror would be tracked again
    by each insert."""
    out: list[LocFields] = [tuple(loc) for loc in locs]  # type: ignore[misc]
    untrack_each(out)
    return out
