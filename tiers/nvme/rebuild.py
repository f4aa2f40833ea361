"""Rebuilding the ``nvme`` index from the segment files (``kvstrata verify --repair``).

A rebuild runs when the index cannot be opened (damaged, truncated, not an LMDB file), when it
registers no segment while segment files older than the grace period exist (it was deleted or
replaced by an empty one), or when asked (``kvstrata verify --repair --rebuild``).

It holds the namespace directory's exclusive lock (every process with the index open holds it
shared), so it never runs beside a process that uses the index: it refuses, naming the directory,
while one does. It then

1. scans every segment file for record headers at every 64-byte position (the magic, then the
   header's own xxh3_64, then a layer and length of this layout): an intact header whose payload
   (which it points back at) checks (xxh3_64; with a secret, the keyed BLAKE3 tag) becomes an
   index entry. A damaged header or payload costs that record only: every header stands alone;
2. keeps one copy of a key found twice: one this tier could check over one it could not (written
   with another secret), else the one written last (the later file by modification time, then
   the later offset). Every copy holds the same KV (keys are content addresses), so either is right;
3. gives the files new segment ids in that order, recounts their live bytes, writes the new index
   beside the old one, moves the old one aside (``index.lmdb.broken-<UTC time>``, kept for
   inspection) and puts the new one in its place.

Records written before a format-2 directory was upgraded have no header: a rebuild cannot find
them, and counts their bytes as unrecovered. Blocks deleted before the index was lost come back
if their bytes are still in a segment; that is still the right KV for their key.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstrata.errors import CorruptIndexError, TierError
from kvstrata.tiers.auth import KID_BYTES, RecordKey, record_prefix
from kvstrata.tiers.base import VerifyReport
from kvstrata.tiers.nvme.root import upgraded_from
from kvstrata.tiers.records import HEADER_MAGIC, RECORD_ALIGN, RECORD_HEADER, RecordHeader, digest, parse_header
from kvstrata.tiers.segment_index import (
    IndexBuilder,
    Loc,
    SegmentIndex,
    index_problem,
    index_segments,
    lock_namespace,
)
from kvstrata.tiers.segments import SEGMENT_SUFFIX, fsync_dir, referenced_bytes, try_flock

__all__ = ["FileScan", "Rebuild", "rebuild_index", "scan_segment"]

_RECORD = b"N"  # the kind byte of an nvme record's tag (as kvstrata.tiers.nvme.state writes it)
_MAGIC = int(np.frombuffer(HEADER_MAGIC, "<u4")[0])
_WINDOW = 64 << 20  # bytes of a file searched for headers at once


@dataclass
class FileScan:
    """What one segment file holds: its intact records (block key, payload offset, header,
    whether the payload was checked) and what could not be used."""

    name: str
    size: int
    records: list[tuple[bytes, int, RecordHeader, bool]] = field(default_factory=list)
    damaged: int = 0  # intact header, payload that fails its checksum or tag
    bad_headers: int = 0  # a header's magic with a header that fails its own checksum


def scan_segment(path: str, key: RecordKey | None, lengths: Sequence[int]) -> FileScan:
    """Every record of the segment file at ``path`` with an intact header that is a layer-block of
    the layout whose layer sizes are ``lengths`` (see the module docstring); ``TierError`` when a
    live writer holds the file's lock."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not try_flock(fd):
            raise TierError(f"segment {path} is locked by a live writer; stop it before rebuilding the index")
        st = os.fstat(fd)
        scan = FileScan(os.path.basename(path), st.st_size)
        if st.st_size >= RECORD_HEADER:
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
            try:
                _scan(mm, scan, key, lengths)
            finally:
                with contextlib.suppress(BufferError):  # a view still held by a traceback: unmapped when freed
                    mm.close()
        return scan
    finally:
        os.close(fd)


def _scan(mm: mmap.mmap, scan: FileScan, key: RecordKey | None, lengths: Sequence[int]) -> None:
    bad: list[int] = []
    with memoryview(mm) as view:
        for window in range(0, scan.size, _WINDOW):
            for pos in _magic_at(mm, window, min(_WINDOW, scan.size - window)):
                if not _take(view, pos, scan, key, lengths):
                    bad.append(pos)
    # a header's magic inside a payload found intact is that payload's bytes, not a damaged header
    spans = sorted((at, at + h.length) for _, at, h, _ in scan.records)
    starts = [lo for lo, _ in spans]
    for pos in bad:
        i = bisect.bisect_right(starts, pos) - 1
        scan.bad_headers += not (i >= 0 and pos < spans[i][1])


def _magic_at(mm: mmap.mmap, at: int, nbytes: int) -> list[int]:
    """The 64-byte aligned positions in ``at .. at + nbytes`` that start with the header magic."""
    words = np.frombuffer(mm, "<u4", nbytes // 64 * 16, at)
    return (np.flatnonzero(words[::16] == _MAGIC) * 64 + at).tolist()


def _take(view: memoryview, pos: int, scan: FileScan, key: RecordKey | None, lengths: Sequence[int]) -> bool:
    """Take the record whose header may be at ``pos`` (its payload checked); False: not a header
    (damaged, or not of a layer-block of this layout)."""
    head = parse_header(view, pos)
    layer = int.from_bytes(head.bkey[-2:], "big") if head is not None else -1
    if head is None or not 0 <= layer < len(lengths) or head.length != lengths[layer] or head.back > pos:
        return False
    start = pos - head.back
    if start % RECORD_ALIGN or start + head.length > pos:
        return False
    data = view[start : start + head.length]
    checked = True
    if not head.tag:
        good = digest(data) == head.checksum
    elif key is not None and head.tag[:KID_BYTES] == key.kid:
        good = key.check(head.tag[KID_BYTES:], record_prefix(_RECORD, head.bkey, head.length), data)
    else:  # another secret's record (or a keyed one, and no secret here): never served by this tier
        good, checked = True, False
    data.release()
    if good:
        scan.records.append((head.bkey, start, head, checked))
    else:
        scan.damaged += 1
    return True


@dataclass
class Rebuild:
    """What a rebuild did."""

    reason: str
    files: int = 0
    records: int = 0  # index entries written
    unchecked: int = 0  # of them, written with another secret: kept, never served by this tier
    duplicates: int = 0  # copies of a key found again (one kept)
    damaged: int = 0  # records whose header or payload failed its check
    unrecovered_bytes: int = 0  # segment bytes no intact record accounts for
    moved_to: str | None = None
    headerless: bool = False  # the directory was upgraded from format 2

    def report(self, tier: str) -> VerifyReport:
        lines = [
            f"index rebuilt from {self.files} segment files ({self.reason}): {self.records} records indexed"
            + (f", {self.unchecked} of them written with another secret (never served here)" if self.unchecked else "")
            + (f", {self.duplicates} duplicate copies left out" if self.duplicates else ""),
        ]
        if self.moved_to:
            lines.append(f"the old index was moved to {self.moved_to}")
        if self.damaged:
            lines.append(f"{self.damaged} damaged records left out (a header or payload failed its check)")
        if self.unrecovered_bytes:
            why = (
                "records of format 2 (from before this directory was upgraded) have no header, "
                if self.headerless
                else ""
            )
            lines.append(f"{self.unrecovered_bytes} bytes of segments hold no intact record ({why}torn or damaged)")
        return VerifyReport(
            tier=tier,
            blocks_checked=self.records,
            bad_checksums=self.damaged,
            orphan_bytes=self.unrecovered_bytes,
            repaired=True,
            problems=lines,
        )


def rebuild_index(
    root: str,
    key: RecordKey | None,
    lengths: Sequence[int],
    map_size: int,
    file_mode: int,
    dir_mode: int,
    grace_s: float,
    force: bool = False,
) -> Rebuild | None:
    """Rebuild the index of the namespace directory ``root`` (layer-blocks of ``lengths`` bytes per
    layer) if it needs it (see the module docstring; ``force``: in any case). None when it was left
    alone; ``TierError`` when a process has the index open or a writer holds a segment."""
    index = os.path.join(root, "index.lmdb")
    modes = (file_mode, dir_mode)
    reason = "asked to" if force else _why_rebuild(root, index, map_size, modes, grace_s)
    if reason is None:
        return None
    lock = lock_namespace(root, exclusive=True)
    if lock is None:
        raise TierError(
            f"cannot rebuild the nvme index {index} ({reason}): a process has it open (an inference engine, "
            "the kvstrata daemon); stop the processes that use it and run `kvstrata verify --repair` again"
        )
    try:
        if not force:  # again, now that nobody else can open it
            reason = index_problem(index, map_size, *modes) or _lost(root, index, map_size, modes, grace_s)
            if reason is None:
                return None
        result = Rebuild(reason, headerless=upgraded_from(root) is not None)
        fresh = f"{index}.rebuild-{os.getpid()}"
        shutil.rmtree(fresh, ignore_errors=True)  # a rebuild that died before its swap
        builder = IndexBuilder(fresh, map_size, file_mode, dir_mode)
        try:
            _scan_all(os.path.join(root, "segments"), key, lengths, builder, result)
            builder.finish()
        finally:
            builder.close()
        if os.path.lexists(index):
            result.moved_to = _aside(index)
            os.rename(index, result.moved_to)
        os.rename(fresh, index)
        fsync_dir(root)
        return result
    finally:
        os.close(lock)


def _why_rebuild(root: str, index: str, map_size: int, modes: tuple[int, int], grace_s: float) -> str | None:
    """Why the index needs a rebuild, as seen without the exclusive lock (beside live processes)."""
    try:
        opened = SegmentIndex(index, map_size, *modes)
    except CorruptIndexError as exc:
        return exc.reason
    try:
        registered = len(opened.segments())
    finally:
        opened.close()
    return None if registered else _unindexed(root, grace_s)


def _lost(root: str, index: str, map_size: int, modes: tuple[int, int], grace_s: float) -> str | None:
    return None if index_segments(index, map_size, *modes) else _unindexed(root, grace_s)


def _unindexed(root: str, grace_s: float) -> str | None:
    """The reason to rebuild an index that registers no segment: old segment files with data exist."""
    now = time.time()
    files = _files(os.path.join(root, "segments"))
    old = [n for n, (size, mtime) in files.items() if size and now - mtime >= grace_s]
    if not old:
        return None
    return f"it registers no segment, but {len(old)} segment files exist: it was lost or replaced"


def _files(directory: str) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.endswith(SEGMENT_SUFFIX) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    out[entry.name] = (st.st_size, st.st_mtime)
    return out


def _scan_all(
    directory: str, key: RecordKey | None, lengths: Sequence[int], builder: IndexBuilder, result: Rebuild
) -> None:
    """Scan every segment file (oldest first: they get ids in that order) into ``builder``, one file
    at a time (memory stays bounded by one file's records)."""
    files = _files(directory)
    order = sorted(files, key=lambda name: (files[name][1], name))

    def checkable(loc: Loc) -> bool:  # this tier checked it (its own secret, or none and no tag)
        return not loc.tag or (key is not None and loc.tag[:KID_BYTES] == key.kid)

    def prefer(new: Loc, old: Loc) -> bool:  # files and offsets come in write order: the later copy
        return checkable(new) or not checkable(old)

    for seg, name in enumerate(order, start=1):
        scan = scan_segment(os.path.join(directory, name), key, lengths)
        builder.add_segment(seg, name)
        found = [(bkey, Loc(seg, at, h.length, h.checksum, h.tag, framed=True)) for bkey, at, h, _ in scan.records]
        result.unrecovered_bytes += scan.size - referenced_bytes([loc for _, loc in found], scan.size)
        result.damaged += scan.damaged + scan.bad_headers
        result.duplicates += builder.offer(found, prefer)
        result.records += len(found)
        result.unchecked += sum(not checked for *_, checked in scan.records)
    result.files = len(order)
    result.records -= result.duplicates
    if result.unchecked:  # some were replaced by checked copies: count what the index holds
        result.unchecked = builder.count(lambda loc: not checkable(loc))


def _aside(index: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{index}.broken-{stamp}"
    n = 1
    while os.path.lexists(target):
        n += 1
        target = f"{index}.broken-{stamp}-{n}"
    return target
