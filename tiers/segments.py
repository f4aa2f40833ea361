"""On-disk format of the ``nvme`` tier: segment files, record locations and the LMDB index.

A *segment* is a large append-only file ``segments/<writer-id>-<seq>.seg``. Every
layer-block is one *record*. A write batch is appended as a run of 4096-aligned
*chunks* (at most one staging buffer each, written with one ``pwrite``, ``O_DIRECT``
where possible); inside a chunk, records lie back to back at ``RECORD_ALIGN``-byte
offsets, and the chunk's tail is zero-padded to the next 4096 boundary. So a batch
costs its records' sizes (rounded up to 64 bytes each) plus under 4 KiB per chunk,
and a record's *extent* is its length rounded up to ``RECORD_ALIGN``. Batches never
share a 4096-byte page: appending to a page that holds acknowledged records would
put them at risk if the rewrite of that page were torn by a crash. Records carry no
header; the LMDB index (``index.lmdb``) is the only source of truth for what a
segment holds:

* db ``blocks``:   ``key (16 B) + layer (u16 BE)`` -> :class:`Loc` (segment id, offset,
  length, xxh3_64 checksum), packed with :mod:`struct`; a record written by a tier with a
  secret has checksum 0 and 24 more bytes, its *tag*: the key id (8 B) and the keyed BLAKE3
  tag (16 B) of :mod:`kvstrata.tiers.auth`.
* db ``segments``: ``segment id (u32 BE)`` -> :class:`SegInfo` (live bytes, i.e. the
  sum of live extents without padding, live records, file name). The live counters
  change in the same transaction as the ``blocks`` entries, so they are exact across
  processes.
* db ``meta``:     the next segment id.

Writers hold an exclusive ``flock`` on their active segment for as long as they may
append to it; a segment whose lock can be taken has no live writer ("sealed") and
may be compacted or removed by whoever holds its lock.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import lmdb
import numpy as np

from kvstrata.core.buffers import copy_bytes
from kvstrata.tiers.fileio import (
    AlignedBufferPool,
    aligned_buffer,
    fsync_dir,
    pread_into,
    pread_or_error,
    probe_direct_io,
    pwrite_all,
    try_flock,
)
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, chmod_new, makedirs
from kvstrata.tiers.records import (
    ALIGN,
    KEY_BYTES,
    RECORD_ALIGN,
    align_down,
    align_up,
    block_key,
    checksum,
    legacy_meta,
    meta_document,
    parse_block_key,
    record_extent,
)

__all__ = [  # the record helpers are re-exported: callers of this module have always found them here
    "ALIGN",
    "FORMAT_VERSION",
    "KEY_BYTES",
    "RECORD_ALIGN",
    "SEGMENT_SUFFIX",
    "AlignedBufferPool",
    "BatchLayout",
    "Loc",
    "SegInfo",
    "SegmentIndex",
    "align_down",
    "align_up",
    "aligned_buffer",
    "block_key",
    "checksum",
    "copy_record",
    "fsync_dir",
    "legacy_meta",
    "meta_document",
    "pack_record",
    "parse_block_key",
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

FORMAT_VERSION = 2  # 1: one record per 4096-aligned slot; 2: records packed inside 4096-aligned chunks
SEGMENT_SUFFIX = ".seg"

_LOC = struct.Struct(">IQIQ")
_SEG = struct.Struct(">QQ")
_U32 = struct.Struct(">I")
_NEXT_SEGMENT = b"next_segment"

T = TypeVar("T")  # the tag a caller pairs with each record's Loc (plan_runs)


class Loc(NamedTuple):
    """Where a record lives, and how to check it: ``checksum`` (xxh3_64) for a record written
    without a secret, else ``tag`` (key id + keyed BLAKE3 tag, see :mod:`kvstrata.tiers.auth`)."""

    seg: int
    offset: int
    length: int
    checksum: int
    tag: bytes = b""

    @property
    def extent(self) -> int:
        return record_extent(self.length)

    @property
    def end(self) -> int:
        return self.offset + self.extent

    def pack(self) -> bytes:
        return _LOC.pack(self.seg, self.offset, self.length, self.checksum) + self.tag

    @classmethod
    def unpack(cls, raw: bytes) -> Loc:
        seg, offset, length, csum = _LOC.unpack_from(raw)
        return cls(seg, offset, length, csum, bytes(raw[_LOC.size :]))


class SegInfo(NamedTuple):
    """A segment's file name and live counters (bytes count record extents)."""

    name: str
    live_bytes: int = 0
    live_count: int = 0

    def pack(self) -> bytes:
        return _SEG.pack(self.live_bytes, self.live_count) + self.name.encode()

    @classmethod
    def unpack(cls, raw: bytes) -> SegInfo:
        live_bytes, live_count = _SEG.unpack_from(raw)
        return cls(bytes(raw[_SEG.size :]).decode(), live_bytes, live_count)


# -- aligned buffers and raw I/O -----------------------------------------------------------


def pack_record(dst: np.ndarray, buf: Any, n: int) -> int:
    """Copy one record (numpy array or torch tensor, host or device) into its staging
    slot ``dst`` (its extent; the bytes past ``n`` are zeroed); returns its checksum."""
    copy_bytes(dst[:n], buf)
    dst[n:] = 0
    return checksum(dst[:n])


def copy_record(dst: np.ndarray, buf: Any, n: int) -> None:
    """:func:`pack_record` without the checksum (a keyed tier tags the staged bytes itself)."""
    copy_bytes(dst[:n], buf)
    dst[n:] = 0


def plan_runs(
    locs: Sequence[tuple[T, Loc]], max_bytes: int, max_gap: int = 0, align: int = 1
) -> list[list[tuple[T, Loc]]]:
    """Group (tag, loc) pairs of ONE segment into runs that one read can cover.

    A run's read (see :func:`run_span`) spans at most ``max_bytes`` unless it holds a
    single larger record, and skips holes of at most ``max_gap`` bytes."""
    runs: list[list[tuple[T, Loc]]] = []
    end = start = -1
    for item in sorted(locs, key=lambda t: t[1].offset):
        loc = item[1]
        if runs and 0 <= loc.offset - end <= max_gap and align_up(max(end, loc.end), align) - start <= max_bytes:
            runs[-1].append(item)
        else:
            runs.append([item])
            start = align_down(loc.offset, align)
            end = -1
        end = max(end, loc.end)
    return runs


def run_span(run: Sequence[tuple[object, Loc]], align: int = 1) -> tuple[int, int]:
    """(file offset, bytes) of one read covering a run (its tags are not looked at): ``align`` is :data:`ALIGN` for
    ``O_DIRECT`` (the records' exact range, widened to whole pages) and 1 otherwise."""
    first = align_down(min(loc.offset for _, loc in run), align)
    return first, align_up(max(loc.offset + loc.length for _, loc in run), align) - first


@dataclass(frozen=True)
class BatchLayout:
    """Where the records of one append go, relative to the batch's 4096-aligned start.

    ``chunks`` are ``(first, end, offset, bytes)``: records ``first:end`` of the batch
    (counted from its first record) are written by one ``pwrite`` of ``bytes`` (a multiple
    of 4096) at ``offset``."""

    offsets: list[int]
    chunks: list[tuple[int, int, int, int]]
    size: int  # bytes the batch adds to its segment (a multiple of 4096)

    @property
    def count(self) -> int:
        return len(self.offsets)


def plan_batch(lengths: Sequence[int], limit: int, room: int | None = None, start: int = 0) -> BatchLayout:
    """Lay out records ``lengths[start:]``: packed at :data:`RECORD_ALIGN`, in chunks of at
    most ``limit`` bytes (a larger record gets a chunk of its own) that start 4096-aligned.

    With ``room``, stop before the first record that would take the batch past ``room`` bytes
    (the layout of a prefix is the prefix of the layout, so this is the part that fits)."""
    offsets: list[int] = []
    chunks: list[tuple[int, int, int, int]] = []
    base = pos = lo = 0  # current chunk: offset, bytes packed into it, first record
    for n in itertools.islice(lengths, start, None):
        ext = record_extent(n)
        if pos and pos + ext > limit:
            chunks.append((lo, len(offsets), base, align_up(pos)))
            base, pos, lo = base + align_up(pos), 0, len(offsets)
        if room is not None and base + align_up(pos + ext) > room:
            break
        offsets.append(base + pos)
        pos += ext
    if pos:
        chunks.append((lo, len(offsets), base, align_up(pos)))
    return BatchLayout(offsets, chunks, base + align_up(pos))


def referenced_bytes(locs: Sequence[Loc], size: int) -> int:
    """Bytes of a segment file of ``size`` bytes that records at ``locs`` account for.

    That is their extents plus the zero padding that closes their chunk: the bytes from a
    record's end to the next 4096 boundary, unless another of ``locs`` starts first (then
    those bytes held records that are gone). A dead record in that tail counts as
    padding, so orphan bytes may be under-reported by less than 4 KiB per live record."""
    total = covered = 0
    ordered = sorted(locs, key=lambda loc: loc.offset)
    for i, loc in enumerate(ordered):
        lo, hi = max(loc.offset, covered), loc.end
        if i + 1 == len(ordered) or ordered[i + 1].offset >= align_up(hi):
            hi = align_up(hi)
        hi = min(hi, size)
        if hi > lo:
            total += hi - lo
            covered = hi
    return total


# -- the LMDB index --------------------------------------------------------------------------


@dataclass
class _SharedEnv:
    """One LMDB environment per directory and process (LMDB forbids opening it twice)."""

    env: Any
    blocks: Any
    segments: Any
    meta: Any
    lock: threading.RLock
    refs: int = 0
    readonly: bool = False


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str, map_size: int, file_mode: int, dir_mode: int, readonly: bool = False) -> _SharedEnv:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is not None and shared.readonly and not readonly:
            raise lmdb.ReadonlyError(f"{path}: opened read-only in this process (by verify); close that first")
        if shared is None and readonly:  # writes nothing: no directory, no new files, no reader check;
            # the writers' map size, so that a data file they grow stays inside this map
            env = lmdb.open(path, max_dbs=4, map_size=map_size, subdir=True, lock=True, readonly=True)
            blocks, segments, meta = (env.open_db(name) for name in (b"blocks", b"segments", b"meta"))
            shared = _ENVS[path] = _SharedEnv(env, blocks, segments, meta, threading.RLock(), readonly=True)
        if shared is None:
            makedirs(path, dir_mode)
            fresh = [f for f in ("data.mdb", "lock.mdb") if not os.path.exists(os.path.join(path, f))]
            env = lmdb.open(path, max_dbs=4, map_size=map_size, subdir=True, lock=True, mode=file_mode)
            for name in fresh:  # LMDB creates them through the umask
                chmod_new(os.path.join(path, name), file_mode)
            env.reader_check()  # drop reader slots of dead processes
            blocks, segments, meta = (env.open_db(name) for name in (b"blocks", b"segments", b"meta"))
            shared = _ENVS[path] = _SharedEnv(env, blocks, segments, meta, threading.RLock())
        shared.refs += 1
        return shared


def _release_env(path: str) -> None:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is None:
            return
        shared.refs -= 1
        if shared.refs <= 0:
            del _ENVS[path]
            shared.env.close()


def _seg_key(seg: int) -> bytes:
    return _U32.pack(seg)


class SegmentIndex:
    """The LMDB index of one namespace directory.

    ``write_lock`` (re-entrant, shared by every tier of this process on the directory)
    serializes write transactions; callers hold it to keep derived state in commit order.
    ``readonly``: LMDB opened read-only (its writes fail); it reuses an environment this process
    already has open for writing, and one open read-only makes a later writable open fail.
    """

    def __init__(
        self,
        path: str,
        map_size: int,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        readonly: bool = False,
    ) -> None:
        self.path = path
        self._shared = _acquire_env(path, map_size, file_mode, dir_mode, readonly)
        self.write_lock = self._shared.lock
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_env(self.path)

    # -- reads ---------------------------------------------------------------------------
    def blocks(self) -> list[tuple[bytes, Loc]]:
        with self._shared.env.begin(db=self._shared.blocks) as txn:
            return [(bytes(k), Loc.unpack(v)) for k, v in txn.cursor()]

    def segments(self) -> dict[int, SegInfo]:
        with self._shared.env.begin(db=self._shared.segments) as txn:
            return {_U32.unpack(k)[0]: SegInfo.unpack(v) for k, v in txn.cursor()}

    def get_many(self, keys: Sequence[bytes]) -> list[Loc | None]:
        with self._shared.env.begin(db=self._shared.blocks) as txn:
            raws = [txn.get(k) for k in keys]
        return [None if r is None else Loc.unpack(r) for r in raws]

    def locs_in_segment(self, seg: int) -> list[tuple[bytes, Loc]]:
        """Every record of ``seg`` (a full scan; for the rare case the caller's view is stale)."""
        return [(k, loc) for k, loc in self.blocks() if loc.seg == seg]

    def segment(self, seg: int) -> SegInfo | None:
        with self._shared.env.begin(db=self._shared.segments) as txn:
            raw = txn.get(_seg_key(seg))
        return None if raw is None else SegInfo.unpack(raw)

    # -- writes ----------------------------------------------------------------------------
    def register_segment(self, name: str) -> int:
        """Allocate a segment id for file ``name`` (ids are never reused)."""
        sh = self._shared
        with self.write_lock, sh.env.begin(write=True) as txn:
            raw = txn.get(_NEXT_SEGMENT, db=sh.meta)
            seg = _U32.unpack(raw)[0] if raw else 1
            txn.put(_NEXT_SEGMENT, _U32.pack(seg + 1), db=sh.meta)
            txn.put(_seg_key(seg), SegInfo(name).pack(), db=sh.segments)
        return seg

    def put(
        self, records: Sequence[tuple[bytes, Loc]], expect: Sequence[Loc | None] | None = None
    ) -> tuple[list[bool], dict[int, SegInfo]]:
        """Point each key at its new location (all in one synced transaction).

        With ``expect``, a key moves only if it still points at the expected location
        (compare-and-swap, for compaction). A record whose segment is not registered (never,
        or reclaimed since) is refused: the index never points into a segment that a sweep
        may delete. Returns which records were applied and the updated counters of the
        segments whose records were replaced.
        """
        sh = self._shared
        applied: list[bool] = []
        losers: set[int] = set()
        with self.write_lock, sh.env.begin(write=True) as txn:
            deltas: dict[int, list[int]] = {}
            registered: dict[int, bool] = {}
            for i, (key, loc) in enumerate(records):
                if loc.seg not in registered:
                    registered[loc.seg] = txn.get(_seg_key(loc.seg), db=sh.segments) is not None
                raw = txn.get(key, db=sh.blocks)
                old = None if raw is None else Loc.unpack(raw)
                if not registered[loc.seg] or (expect is not None and old != expect[i]):
                    applied.append(False)
                    continue
                if old is not None:
                    _add(deltas, old, -1)
                    losers.add(old.seg)
                _add(deltas, loc, +1)
                txn.put(key, loc.pack(), db=sh.blocks)
                applied.append(True)
            infos = self._apply_deltas(txn, deltas)
        return applied, {seg: info for seg, info in infos.items() if seg in losers}

    def drop(
        self, keys: Sequence[bytes], expect: Sequence[Loc] | None = None
    ) -> tuple[list[Loc | None], dict[int, SegInfo]]:
        """Remove keys (only those still at ``expect`` if given); returns the removed
        locations and the updated counters of every segment that lost records."""
        sh = self._shared
        removed: list[Loc | None] = []
        with self.write_lock, sh.env.begin(write=True) as txn:
            deltas: dict[int, list[int]] = {}
            for i, key in enumerate(keys):
                raw = txn.get(key, db=sh.blocks)
                old = None if raw is None else Loc.unpack(raw)
                if old is None or (expect is not None and old != expect[i]):
                    removed.append(None)
                    continue
                txn.delete(key, db=sh.blocks)
                _add(deltas, old, -1)
                removed.append(old)
            infos = self._apply_deltas(txn, deltas)
        return removed, infos

    def forget_segment(self, seg: int, require_empty: bool = True) -> bool:
        """Remove a segment's entry if no record references it; True when it is gone."""
        sh = self._shared
        with self.write_lock, sh.env.begin(write=True) as txn:
            raw = txn.get(_seg_key(seg), db=sh.segments)
            if raw is None:
                return True
            if require_empty and SegInfo.unpack(raw).live_count:
                return False
            txn.delete(_seg_key(seg), db=sh.segments)
        return True

    def recount(self) -> dict[int, SegInfo]:
        """Recompute every segment's live counters from the ``blocks`` db (repair)."""
        sh = self._shared
        with self.write_lock, sh.env.begin(write=True) as txn:
            totals: dict[int, list[int]] = {}
            for _, raw in txn.cursor(db=sh.blocks):
                _add(totals, Loc.unpack(raw), +1)
            out: dict[int, SegInfo] = {}
            for k, raw in list(txn.cursor(db=sh.segments)):
                seg, info = _U32.unpack(k)[0], SegInfo.unpack(raw)
                live_bytes, live_count = totals.get(seg, (0, 0))
                out[seg] = SegInfo(info.name, live_bytes, live_count)
                txn.put(k, out[seg].pack(), db=sh.segments)
        return out

    def _apply_deltas(self, txn: Any, deltas: dict[int, list[int]]) -> dict[int, SegInfo]:
        out: dict[int, SegInfo] = {}
        for seg, (dbytes, dcount) in deltas.items():
            raw = txn.get(_seg_key(seg), db=self._shared.segments)
            if raw is None:  # a forgotten segment: nothing to count
                continue
            info = SegInfo.unpack(raw)
            info = SegInfo(info.name, max(0, info.live_bytes + dbytes), max(0, info.live_count + dcount))
            txn.put(_seg_key(seg), info.pack(), db=self._shared.segments)
            out[seg] = info
        return out


def _add(deltas: dict[int, list[int]], loc: Loc, sign: int) -> None:
    d = deltas.setdefault(loc.seg, [0, 0])
    d[0] += sign * loc.extent
    d[1] += sign
