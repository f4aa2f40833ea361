"""Reclaiming space: unlink dead segments, compact sparse ones, sweep files of crashed writers."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import lmdb
import numpy as np

from kvstrata.tiers.nvme.options import CHUNK_BYTES, GRACE_S
from kvstrata.tiers.nvme.reader import Reader
from kvstrata.tiers.nvme.writer import Appender
from kvstrata.tiers.segment_index import new_loc
from kvstrata.tiers.segments import ALIGN, Loc, SegInfo, align_up, plan_runs, pread_into, run_span, try_flock

log = logging.getLogger("kvstrata.tiers.nvme")


class Reclaimer(Appender, Reader):
    """Frees segment space (a segment is removed only under its flock, after the index stops
    referencing it)."""

    def _reclaim(self, infos: Mapping[int, SegInfo]) -> None:
        for seg, info in infos.items():
            try:
                if info.live_count == 0:
                    self._seal_if_idle(seg)
                self._reclaim_segment(seg, info)
            except (OSError, lmdb.Error) as exc:
                log.warning("nvme tier %s: reclaiming segment %s failed: %s", self.name, info.name, exc)

    def _seal_if_idle(self, seg: int) -> None:
        with self._append_lock:
            writer = self._writer
            with self._lock:
                idle = writer is not None and writer.seg == seg and writer.pending == 0
            if idle:
                self._seal()

    def _sparse(self, info: SegInfo, size: int) -> bool:
        return info.live_count == 0 or info.live_bytes < self.opts.compact_threshold * size

    def _reclaim_segment(self, seg: int, info: SegInfo) -> None:
        """Unlink a dead segment or compact a sparse one, if no live writer holds it."""
        with self._lock:
            if seg in self._open or not self._sparse(info, self._sizes.get(info.name, 0) or 1 << 62):
                return
        if info.live_count and not self._room_to_compact(info):
            return  # copying first would overshoot capacity: wait until more of it is dead
        path = os.path.join(self.segment_dir, info.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self._odirect)
        except FileNotFoundError:
            if info.live_count == 0 and self._index.forget_segment(seg):
                self._forget_local(seg, info.name)
            return
        try:
            if not try_flock(fd, path) or not self._sparse(info, os.fstat(fd).st_size):
                return
            if info.live_count:
                self._compact(seg, fd)
            if self._index.forget_segment(seg):  # committed: nothing references the file now
                os.unlink(path)
                self._forget_local(seg, info.name)
        finally:
            os.close(fd)

    def _room_to_compact(self, info: SegInfo) -> bool:
        """Compaction writes the live records before it unlinks the old file: it needs that room."""
        copy = align_up(info.live_bytes) + ALIGN * (1 + info.live_bytes // CHUNK_BYTES)
        return self._physical() + copy <= self.capacity

    def _compact(self, seg: int, fd: int) -> None:
        """Move the live records of ``seg`` (flock held by the caller) into the active segment."""
        with self._lock:
            known = [(k, new_loc(self._mirror[k])) for k in self._by_seg.get(seg, ())]
        self._move(fd, known)
        info = self._index.segment(seg)
        if info is not None and info.live_count:  # records this process has not seen
            self._move(fd, self._index.locs_in_segment(seg))

    def _move(self, fd: int, records: list[tuple[bytes, Loc]]) -> None:
        """Copy records (verified) into the active segment; the index moves only entries still at the old place.

        Each keeps its checksum or tag: a record this tier cannot check (another secret's) is
        copied as it is, so it stays unservable here and verifiable by its owner, never re-keyed.

        Reads whole windows of up to ``CHUNK_BYTES`` (dead bytes included), so that each
        window's live records become one packed batch: compaction also squeezes out the
        page padding of small batches, which the live counters do not count as live."""
        for run in plan_runs(list(enumerate(loc for _, loc in records)), CHUNK_BYTES, CHUNK_BYTES, self._read_align):
            first, span = run_span(run, self._read_align)
            with self._pool.borrow(span) as stage:
                got = pread_into(fd, stage[:span], first)
                good: list[tuple[bytes, Loc, np.ndarray]] = []
                bad: list[tuple[bytes, Loc]] = []
                lost: list[tuple[bytes, Loc]] = []
                for i, loc in run:
                    data = stage[loc.offset - first : loc.offset - first + loc.length]
                    if loc.offset - first + loc.length > got:
                        lost.append(records[i])
                    elif self._ours(loc) and not self._intact(records[i][0], loc, data):
                        bad.append(records[i])
                    else:
                        good.append((records[i][0], loc, data))
                if good:
                    self._store(
                        [k for k, _, _ in good],
                        [d for _, _, d in good],
                        [loc for _, loc, _ in good],
                        [(loc.checksum, loc.tag) for _, loc, _ in good],
                    )
                if bad:
                    self._quarantine(bad)
                if lost:
                    self._drop([k for k, _ in lost], [loc for _, loc in lost])

    def _forget_local(self, seg: int, name: str) -> None:
        with self._lock:
            self._names.pop(seg, None)
            self._sizes.pop(name, None)
            self._by_seg.pop(seg, None)

    def _sweep(self) -> None:
        """At open: remove dead segments of crashed or closed writers, and old unregistered files."""
        files = self._list_files()
        segs = self._index.segments()
        for seg, info in segs.items():
            if info.live_count == 0:
                self._reclaim_segment(seg, info)
        self._remove_unregistered(files, {info.name for info in segs.values()}, GRACE_S)

    def _index_lost(self, files: dict[str, tuple[int, float]], registered: set[str], grace_s: float) -> bool:
        """Whether the index registers no segment while segment files that hold data and are older
        than ``grace_s`` exist: it was lost or replaced, and those files are all that is left of the
        tier's data (kept). An empty file is a writer's new segment or a crash's leftover."""
        now = time.time()
        old = [name for name, (size, mtime) in files.items() if size and now - mtime >= grace_s]
        if registered or not old:
            return False
        log.warning(
            "nvme tier %s: the index registers no segment but %d segment files exist in %s: it was lost or "
            "replaced; the files are kept (and count as used space) until `kvstrata verify --repair` rebuilds "
            "the index from them",
            self.name,
            len(old),
            self.segment_dir,
        )
        return True

    def _remove_unregistered(self, files: dict[str, tuple[int, float]], registered: set[str], grace_s: float) -> None:
        """Unlink segment files that no index entry names and that are older than ``grace_s``.

        ``registered`` may be stale (a writer registers a new file after creating and locking
        it), so each candidate is unlinked only under its flock, while its path still names the
        locked inode, and after a fresh read of the index still does not name it: a writer
        registers only while it holds the lock, so a name unregistered then is never registered."""
        now = time.time()
        if self._index_lost(files, registered, grace_s):
            return  # the files are the only copy of the index: `kvstrata verify --repair` rebuilds it from them
        for name, (_, mtime) in files.items():
            if name in registered or now - mtime < grace_s:
                continue
            path = os.path.join(self.segment_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if try_flock(fd, path) and all(info.name != name for info in self._index.segments().values()):
                    os.unlink(path)
            finally:
                os.close(fd)
