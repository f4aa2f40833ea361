"""On-disk format of the ``nvme`` tier: segment files, record locations and the LMDB index.

A *segment* is a large append-only file ``segments/<writer-id>-<seq>.seg``. Every
layer-block is one *record*: its payload and a 64-byte header (:data:`~kvstrata.tiers.records.RECORD_HEADER`:
magic, block key, length, where the payload is and its checksum or keyed tag, itself
checksummed; see :mod:`kvstrata.tiers.records`). A write batch is appended as a run of
4096-aligned *chunks* (at most one staging buffer each, written with one ``pwrite``,
``O_DIRECT`` where possible); inside a chunk, the payloads lie back to back at
``RECORD_ALIGN``-byte offsets from its start, then the headers of those records, one after
another, and the chunk's tail is zero-padded to the next 4096 boundary. So the payloads are
where format 2 put them (a layer-block of 4096-multiple size stays page-aligned for
``O_DIRECT`` and GPUDirect reads), a batch costs its records' sizes (rounded up to 64 bytes
each, plus 64 for the header) plus under 4 KiB per chunk, and a record's *extent* is its
length rounded up to ``RECORD_ALIGN`` plus its header. Batches never share a 4096-byte page:
appending to a page that holds acknowledged records would put them at risk if the rewrite of
that page were torn by a crash.

The LMDB index (``index.lmdb``) says what a segment holds; the headers make the records
self-describing, so ``kvstrata verify --repair`` can rebuild a lost or damaged index from the
segment files (:mod:`kvstrata.tiers.nvme.rebuild`):

* db ``blocks``:   ``key (16 B) + layer (u16 BE)`` -> :class:`Loc` (segment id, offset of the
  payload, length, xxh3_64 checksum), packed with :mod:`struct`; a record written by a tier with
  a secret has checksum 0 and 24 more bytes, its *tag*: the key id (8 B) and the keyed BLAKE3
  tag (16 B) of :mod:`kvstrata.tiers.auth`. An entry of a record with a header (format 3) has
  one flags byte (1) between the fixed fields and the tag; an entry without it points at a
  headerless record of format 2, which stays readable where it is (compaction rewrites it
  with a header).
* db ``segments``: ``segment id (u32 BE)`` -> :class:`SegInfo` (live bytes, i.e. the
  sum of live extents without padding, live records, file name). The live counters
  change in the same transaction as the ``blocks`` entries, so they are exact across
  processes.
* db ``meta``:     the next segment id.

Formats (``meta.json``): 1 one record per 4096-aligned slot (refused); 2 packed records without
headers; 3 packed records with headers. A format-2 directory is upgraded in place when a tier
opens it (``"upgraded_from": 2`` in its meta), and its old records are read as before.

Writers hold an exclusive ``flock`` on their active segment for as long as they may
append to it; a segment whose lock can be taken has no live writer ("sealed") and
may be compacted or removed by whoever holds its lock. The index itself, its locking and its
reader slots: :mod:`kvstrata.tiers.segment_index`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvstrata.tiers.fileio import (
    AlignedBufferPool,
    aligned_buffer,
    copy_staged,
    fsync_dir,
    pread_into,
    pread_or_error,
    probe_direct_io,
    pwrite_all,
    try_flock,
)
from kvstrata.tiers.records import (
    ALIGN,
    KEY_BYTES,
    RECORD_ALIGN,
    RECORD_HEADER,
    align_down,
    align_up,
    block_key,
    checksum,
    legacy_meta,
    meta_document,
    parse_block_key,
    payload_extent,
    record_extent,
)
from kvstrata.tiers.segment_index import (
    MAX_READERS,
    IndexBuilder,
    Loc,
    SegInfo,
    SegmentIndex,
    lock_namespace,
)

__all__ = [  # the record, I/O and index helpers are re-exported: callers of this module have always found them here
    "ALIGN",
    "FORMAT_VERSION",
    "KEY_BYTES",
    "MAX_READERS",
    "RECORD_ALIGN",
    "RECORD_HEADER",
    "SEGMENT_SUFFIX",
    "AlignedBufferPool",
    "BatchLayout",
    "IndexBuilder",
    "Loc",
    "SegInfo",
    "SegmentIndex",
    "align_down",
    "align_up",
    "aligned_buffer",
    "block_key",
    "checksum",
    "copy_record",
    "copy_staged",
    "fsync_dir",
    "headers_at",
    "legacy_meta",
    "lock_namespace",
    "meta_document",
    "pack_record",
    "parse_block_key",
    "payload_extent",
    "plan_batch",
    "plan_runs",
    "pread_into",
    "pread_or_error",
    "probe_direct_io",
    "pwrite_all",
    "record_extent",
    "referenced_bytes",
    "run_span",
    "try_flock",
]

FORMAT_VERSION = 3  # 1: one record per 4096-aligned slot; 2: packed in 4096-aligned chunks; 3: and with headers
HEADERLESS_FORMAT = 2  # the format this one upgrades in place (its records stay readable)
SEGMENT_SUFFIX = ".seg"

T = TypeVar("T")  # the tag a caller pairs with each record's Loc (plan_runs)


# -- aligned buffers and raw I/O -----------------------------------------------------------


def pack_record(dst: np.ndarray, buf: Any, n: int) -> int:
    """Copy one record (numpy array or torch tensor, host or device) into its staging
    slot ``dst`` (its extent; the bytes past ``n`` are zeroed); returns its checksum."""
    copy_staged(dst[:n], buf)
    dst[n:] = 0
    return checksum(dst[:n])


def copy_record(dst: np.ndarray, buf: Any, n: int) -> None:
    """:func:`pack_record` without the checksum (a keyed tier tags the staged bytes itself)."""
    copy_staged(dst[:n], buf)
    dst[n:] = 0


def plan_runs(
    locs: Sequence[tuple[T, Loc]], max_bytes: int, max_gap: int = 0, align: int = 1
) -> list[list[tuple[T, Loc]]]:
    """Group (tag, loc) pairs of ONE segment into runs that one read can cover.

    A run's read (see :func:`run_span`) spans at most ``max_bytes`` unless it holds a
    single larger record, and skips holes of at most ``max_gap`` bytes."""
    runs: list[list[tuple[T, Loc]]] = []
    run: list[tuple[T, Loc]] = []
    end = start = -1
    ra = RECORD_ALIGN - 1  # Loc.end, inlined: this loop sees every record of a batch read
    for item in sorted(locs, key=_BY_OFFSET):
        offset, length = item[1][1], item[1][2]
        stop = offset + (length + ra) // RECORD_ALIGN * RECORD_ALIGN
        if run and 0 <= offset - end <= max_gap and -(-max(end, stop) // align) * align - start <= max_bytes:
            run.append(item)
        else:
            run = [item]
            runs.append(run)
            start = offset // align * align
            end = -1
        if stop > end:
            end = stop
    return runs


def _by_offset(item: tuple[object, Loc]) -> int:
    return item[1][1]


_BY_OFFSET = _by_offset


def run_span(run: Sequence[tuple[object, Loc]], align: int = 1) -> tuple[int, int]:
    """(file offset, bytes) of one read covering a run (its tags are not looked at): ``align`` is :data:`ALIGN` for
    ``O_DIRECT`` (the records' exact range, widened to whole pages) and 1 otherwise."""
    first = align_down(min(loc.offset for _, loc in run), align)
    return first, align_up(max(loc.offset + loc.length for _, loc in run), align) - first


@dataclass(frozen=True)
class BatchLayout:
    """Where the records of one append go, relative to the batch's 4096-aligned start.

    ``offsets`` are where the records' payloads go; ``chunks`` are ``(first, end, offset, bytes)``:
    records ``first:end`` of the batch (counted from its first record) are written by one
    ``pwrite`` of ``bytes`` (a multiple of 4096) at ``offset``, their headers after the payload of
    record ``end - 1`` (see :func:`headers_at`)."""

    offsets: list[int]
    chunks: list[tuple[int, int, int, int]]
    size: int  # bytes the batch adds to its segment (a multiple of 4096)

    @property
    def count(self) -> int:
        return len(self.offsets)


def plan_batch(lengths: Sequence[int], limit: int, room: int | None = None, start: int = 0) -> BatchLayout:
    """Lay out records ``lengths[start:]`` (each its payload and header, :func:`record_extent`):
    payloads packed at :data:`RECORD_ALIGN`, then their headers, in chunks of at most ``limit``
    bytes (a larger record gets a chunk of its own) that start 4096-aligned.

    With ``room``, stop before the first record that would take the batch past ``room`` bytes
    (the layout of a prefix is the prefix of the layout, so this is the part that fits).

    Records of one length (a uniform layout's layer-blocks) are laid out in closed form
    (:func:`_plan_uniform`, the same layout): the engine plans a 4,096-record store twice (room
    check, then reservation), and this loop took ~0.5 ms each time per segment it touched."""
    if type(lengths) is list and len(lengths) > start + 1:
        rest = lengths[start:] if start else lengths
        if rest.count(rest[0]) == len(rest):
            return _plan_uniform(len(rest), rest[0], limit, room)
    return _plan_records(lengths, limit, room, start)


def _plan_uniform(count: int, length: int, limit: int, room: int | None) -> BatchLayout:
    """:func:`plan_batch` of ``count`` records of ``length`` bytes each: ``per`` records a chunk
    (one if a record is larger than ``limit``), every chunk but the last ``full`` bytes."""
    ext = record_extent(length)
    per = max(1, limit // ext)
    full = align_up(per * ext)
    i = np.arange(count, dtype=np.int64)
    chunk, j = np.divmod(i, per)
    if room is not None:  # the batch's size with record i as its last, for each i
        need = chunk * full + ((j + 1) * ext + ALIGN - 1) // ALIGN * ALIGN
        count = int(np.searchsorted(need, room, side="right"))
        chunk, j = chunk[:count], j[:count]
    offsets = (chunk * full + j * (ext - RECORD_HEADER)).tolist()
    chunks = [(lo, min(count, lo + per), c * full, full) for c, lo in enumerate(range(0, count, per))]
    if chunks:
        lo, hi, base, _ = chunks[-1]
        chunks[-1] = (lo, hi, base, align_up((hi - lo) * ext))
    return BatchLayout(offsets, chunks, chunks[-1][2] + chunks[-1][3] if chunks else 0)


def _plan_records(lengths: Sequence[int], limit: int, room: int | None, start: int) -> BatchLayout:
    """:func:`plan_batch`, record by record."""
    offsets: list[int] = []
    chunks: list[tuple[int, int, int, int]] = []
    base = pos = lo = 0  # current chunk: offset, bytes packed into it (payloads and headers), first record
    heads = 0  # headers of the current chunk's records so far
    limited = room is not None
    ra, pa = RECORD_ALIGN - 1, ALIGN - 1  # record_extent and align_up, inlined: this loop sees every record
    append = offsets.append
    for n in itertools.islice(lengths, start, None):
        ext = (n + ra) // RECORD_ALIGN * RECORD_ALIGN + RECORD_HEADER
        if pos and pos + ext > limit:
            size = (pos + pa) // ALIGN * ALIGN
            chunks.append((lo, len(offsets), base, size))
            base, pos, lo, heads = base + size, 0, len(offsets), 0
        if limited and base + (pos + ext + pa) // ALIGN * ALIGN > room:  # type: ignore[operator]
            break
        append(base + pos - heads)  # after the payloads before it
        pos += ext
        heads += RECORD_HEADER
    if pos:
        chunks.append((lo, len(offsets), base, align_up(pos)))
    return BatchLayout(offsets, chunks, base + align_up(pos))


def headers_at(layout: BatchLayout, lengths: Sequence[int], chunk: int, first: int = 0) -> int:
    """Where the headers of chunk ``chunk`` of ``layout`` (of records ``lengths[first:]``, counted
    from its first record) begin, relative to the batch: after the payload of its last record."""
    end = layout.chunks[chunk][1] - 1
    return layout.offsets[end] + payload_extent(lengths[first + end])


def referenced_bytes(locs: Sequence[Loc], size: int) -> int:
    """Bytes of a segment file of ``size`` bytes that records at ``locs`` account for.

    That is their payloads plus, after the last payload of a chunk, the chunk's headers and the
    zero padding that closes it: the headers of the records since the previous chunk's end (taken
    to lie right after that payload) and the bytes from there to the next 4096 boundary, unless
    another of ``locs`` starts first (then that record is in the same chunk, and the bytes between
    held records that are gone). A dead record's header or payload in that tail counts as
    padding, so orphan bytes may be under-reported by less than 4 KiB per live record."""
    total = covered = heads = 0
    ordered = sorted(locs, key=lambda loc: loc.offset)
    for i, loc in enumerate(ordered):
        lo, hi = max(loc.offset, covered), loc.end
        heads += RECORD_HEADER if loc.framed else 0
        if i + 1 == len(ordered) or ordered[i + 1].offset >= align_up(hi + heads):
            hi, heads = align_up(hi + heads), 0
        hi = min(hi, size)
        if hi > lo:
            total += hi - lo
            covered = hi
    return total
