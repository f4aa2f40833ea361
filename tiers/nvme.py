"""The ``nvme`` tier: layer-blocks in large append-only segment files on a local disk.

Layout of ``<path>/<namespace fingerprint>/``::

    meta.json                  layout, namespace and format version (checked at open)
    index.lmdb/                the LMDB index (see :mod:`kvstrata.tiers.segments`)
    segments/<writer>-<seq>.seg

A write batch is packed into aligned staging buffers (records back to back at
64-byte offsets, see :mod:`kvstrata.tiers.segments`) and written with one ``pwrite``
per 16 MiB chunk (``O_DIRECT`` where the filesystem allows it), then the segment is
``fdatasync``-ed, then one synced LMDB transaction points the index at the
new records. Only then does ``write`` report success, so after a crash the index
never points at bytes that were not durable; torn tails of segments are unreferenced
garbage that compaction or ``verify(repair=True)`` reclaims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

import lmdb
import numpy as np
from pydantic import Field

from kvstrata.core.buffers import Buffer, copy_bytes, host_bytes, is_device, nbytes
from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers.base import (
    BlockId,
    ReadStatus,
    Tier,
    TierCapabilities,
    TierContext,
    TierOptions,
    VerifyReport,
)
from kvstrata.tiers.records import key_or_none
from kvstrata.tiers.segments import (
    ALIGN,
    SEGMENT_SUFFIX,
    AlignedBufferPool,
    BatchLayout,
    Loc,
    SegInfo,
    SegmentIndex,
    align_up,
    block_key,
    checksum,
    fsync_dir,
    pack_record,
    parse_block_key,
    plan_batch,
    plan_runs,
    pread_into,
    pread_or_error,
    prepare_root,
    probe_direct_io,
    pwrite_all,
    record_extent,
    referenced_bytes,
    run_span,
    try_flock,
)
from kvstrata.units import Size

log = logging.getLogger("kvstrata.tiers.nvme")

MiB = 1024**2
GiB = 1024**3
CHUNK_BYTES = 16 * MiB  # staging buffer size: the most bytes one pwrite/pread moves
IO_DEPTH = 2  # chunk reads/writes in flight per call, so the disk never waits for the GIL
READ_GAP = 64 * 1024  # a read may span a hole this large to save a syscall
GRACE_S = 60.0  # unreferenced files younger than this may belong to a writer starting up
RESCAN_S = 1.0  # how often used_bytes re-reads segment sizes from disk
FRESH_S = 0.02  # a view this recent is trusted when it says the tier is full
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class NVMeOptions(TierOptions):
    """Options of the ``nvme`` tier."""

    path: str  # directory; ``~`` and ``$VARS`` are expanded; data goes to <path>/<namespace fingerprint>/
    segment_size: Size = Field(256 * MiB, ge=ALIGN)  # a segment is sealed once this full (capped at capacity // 8)
    direct_io: Literal["auto", "on", "off"] = "auto"  # auto: O_DIRECT where the filesystem accepts it
    fsync: bool = True  # fdatasync segments before the index commit (off: faster, a power loss may lose acked data)
    compact_threshold: float = Field(0.5, ge=0.0, le=1.0)  # compact a sealed segment below this live fraction
    lmdb_map_size: Size = Field(64 * GiB, ge=MiB)  # LMDB address space (a file grows only as needed)


@functools.cache
def gds_available() -> bool:
    """kvikio importable and a CUDA device present (imports torch only if kvikio exists)."""
    if importlib.util.find_spec("kvikio") is None:
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available())


@dataclass
class _Writer:
    """A segment this tier appends to; its fd holds the segment's flock until closed."""

    seg: int
    name: str
    fd: int
    size: int = 0  # reserved end
    pending: int = 0  # appends not yet committed
    sealed: bool = False


class NVMeTier(Tier):
    """Local-disk tier: append-only segment files plus an LMDB index, checksummed records.

    Space policy: ``used_bytes`` is the physical size of all segment files of this
    namespace directory (live records, padding, deleted-but-not-reclaimed records and
    torn tails). Records are packed (see :mod:`kvstrata.tiers.segments`), so a batch
    costs its bytes rounded up to 64 per record plus under 4 KiB of padding per 16 MiB
    chunk and per segment it spans. ``has_room`` answers ``used_bytes + cost(sizes) <=
    capacity``, where ``cost`` lays the batch out exactly as an append now would, so the
    disk never holds more than ``capacity`` segment bytes (the LMDB index is not
    counted). ``delete`` reclaims space inline: a sealed segment with no live record is
    unlinked, one whose live fraction falls below ``compact_threshold`` is compacted
    (live records copied into the active segment, index updated, old file unlinked);
    the active segment is sealed and unlinked once it holds no live record. Deleting
    every block therefore brings ``used_bytes`` to zero, so the engine's evict-until-
    ``has_room`` loop terminates. Compaction needs up to ``compact_threshold`` of a
    segment in free space while it runs. The effective segment size is capped at
    ``capacity // 8`` so that dead space in the active segment stays small.

    Several processes (or tier instances) may share a directory: each appends only to
    its own segments (named ``<pid>-<random>-<seq>.seg``, flock-ed while in use);
    blocks written by others are found through the index on a miss and by ``scan``
    after reopening. Segment files are removed only under their flock and only after
    the index transaction that stops referencing them.

    ``checksum_failures`` counts records whose xxh3_64 did not match on read; such a
    record is reported ``CORRUPT`` once and dropped from the index (then ``MISSING``).
    """

    capabilities = TierCapabilities(persistent=True, checksums=True, alignment=ALIGN, records=True, space="segments")
    Options = NVMeOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        opts = options if isinstance(options, NVMeOptions) else _coerce_options(options)
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.checksum_failures = 0
        self.root = prepare_root(opts.path, context.layout, context.namespace)
        self.segment_dir = os.path.join(self.root, "segments")
        self.direct_io = _choose_direct_io(self.segment_dir, opts)
        self.segment_size = _effective_segment_size(opts.segment_size, capacity)
        self._odirect = _O_DIRECT if self.direct_io else 0
        self._read_align = ALIGN if self.direct_io else 1  # O_DIRECT reads whole pages
        self._writer_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = 0
        self._lock = threading.Lock()  # mirror, names, sizes, writers: short sections only
        self._append_lock = threading.Lock()  # reservation and segment rollover
        self._mirror: dict[bytes, Loc] = {}
        self._by_seg: dict[int, set[bytes]] = {}
        self._names: dict[int, str] = {}
        self._sizes: dict[str, int] = {}
        self._open: dict[int, _Writer] = {}
        self._writer: _Writer | None = None
        self._pool = AlignedBufferPool(CHUNK_BYTES, keep=8)
        self._io_pool = ThreadPoolExecutor(4, thread_name_prefix=f"kvstrata-nvme-{name}")
        self._scanned_at = 0.0
        self._closed = False
        self._index = SegmentIndex(os.path.join(self.root, "index.lmdb"), opts.lmdb_map_size)
        try:
            self._reload_mirror()
            self._sweep()
            self._rescan()
        except BaseException:
            self._index.close()
            raise
        self._gds = gds_available()
        # This machine's abilities, for this instance only (the class keeps what every NVMe tier can do).
        self.capabilities = dataclasses.replace(type(self).capabilities, gpu_direct=self._gds, direct_io=self.direct_io)

    # -- bytes ---------------------------------------------------------------------------
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_open()
        ok = [self._acceptable(bid, buf) for bid, buf in items]
        chosen = [i for i, good in enumerate(ok) if good]
        if chosen:
            applied, replaced = self._store([block_key(items[i][0]) for i in chosen], [items[i][1] for i in chosen])
            for i, done in zip(chosen, applied, strict=True):
                ok[i] = done  # False: the index refused a segment that was reclaimed under us
            self._reclaim(replaced)  # rewritten blocks leave dead records behind
        return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._check_open()
        out = [ReadStatus.MISSING] * len(items)
        keys = [key_or_none(bid) for bid, _ in items]
        bufs = [buf for _, buf in items]
        with self._index_faults("read"):
            locs = self._lookup(keys)
            gone = self._read_jobs([(i, loc) for i, loc in enumerate(locs) if loc is not None], keys, bufs, out)
            if gone:
                self._retry_moved(gone, locs, keys, bufs, out)
        return out

    def delete(self, ids: Sequence[BlockId]) -> None:
        self._check_open()
        keys = list(dict.fromkeys(k for k in map(key_or_none, ids) if k is not None))
        if keys:
            with self._index_faults("delete"):
                infos = self._drop(keys)
            self._reclaim(infos)

    def records(self) -> list[tuple[BlockId, Loc]]:
        """Every block in the shared index (all writers) with its location, oldest write first.

        Segment ids only grow and a segment is appended to in order, so ``(segment, offset)``
        order is write order (compaction rewrites a record and so makes it young again). For
        the daemon: watermarks demote in this order, so whole segments die and are unlinked."""
        self._check_open()
        with self._index_faults("records"):
            entries = self._index.blocks()
        entries.sort(key=lambda e: (e[1].seg, e[1].offset))
        return [(parse_block_key(key), loc) for key, loc in entries]

    def delete_at(self, records: Sequence[tuple[BlockId, Loc]]) -> list[bool]:
        """Delete blocks only where they still are at the given location (compare-and-swap in
        one index transaction), then reclaim space; True where a block was removed. A block
        another process rewrote (or compaction moved) since ``records`` was read is kept."""
        self._check_open()
        keys = [block_key(bid) for bid, _ in records]
        if not keys:
            return []
        with self._index_faults("delete"), self._index.write_lock:
            removed, infos = self._index.drop(keys, [loc for _, loc in records])
            with self._lock:
                for key, old in zip(keys, removed, strict=True):
                    if old is not None:
                        self._mirror_pop(key)
        self._reclaim(infos)
        return [old is not None for old in removed]

    def compact(self) -> int:
        """Unlink dead segments and compact sparse ones of every writer of the directory (a
        delete reclaims only the segments it touched; sealed segments of writers that have
        gone stay sparse otherwise). Returns how many segments went away (live records moved)."""
        self._check_open()
        with self._index_faults("compact"):
            infos = self._index.segments()
            self._reclaim(infos)
            gone = len(set(infos) - set(self._index.segments()))
        self._rescan()
        return gone

    # -- space ---------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._physical()

    def refresh_used(self) -> int:
        """``used_bytes`` re-read from disk now (``used_bytes`` may lag other processes by
        ``RESCAN_S``): for a process that watches the directory's usage, like the daemon."""
        self._check_open()
        self._rescan()
        return self._physical()

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        """Whether the segment files stay within ``capacity`` after appending ``sizes`` in one write.

        A "no" from the cached view (up to ``RESCAN_S`` old) is checked against the disk first:
        the daemon or another writer may have reclaimed segments since, and a stale "full" would
        make the engine evict blocks for room that is already there."""
        cost = self._append_cost(list(sizes))
        if self._physical() + cost <= self.capacity:
            return True
        if time.monotonic() - self._scanned_at > FRESH_S:
            self._rescan()
        return self._physical() + cost <= self.capacity

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

    # -- persistence ---------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[BlockId, int]]:
        with self._lock:
            snapshot = [(k, loc.length) for k, loc in self._mirror.items()]
        for raw, length in snapshot:
            yield parse_block_key(raw), length

    def verify(self, repair: bool = False, grace_s: float = GRACE_S) -> VerifyReport:
        """Read every indexed record and check it; count unreferenced bytes.

        With ``repair``: drop bad and missing entries, recount the live counters,
        reclaim dead or sparse segments, and delete unregistered segment files older
        than ``grace_s`` seconds (younger ones may belong to a writer that is starting
        up; pass 0 when no other process uses the directory).
        """
        self._check_open()
        with self._index_faults("verify"):
            return self._verify(repair, grace_s)

    def _verify(self, repair: bool, grace_s: float) -> VerifyReport:
        report = VerifyReport(tier=self.name)
        files = self._list_files()  # before the index snapshot: a listed file is registered or young
        segs = self._index.segments()
        entries = self._index.blocks()
        report.blocks_checked = len(entries)
        by_seg: dict[int, list[tuple[bytes, Loc]]] = {}
        for key, loc in entries:
            by_seg.setdefault(loc.seg, []).append((key, loc))
        bad: list[tuple[bytes, Loc]] = []
        referenced: dict[str, int] = {}
        for seg, recs in by_seg.items():
            info = segs.get(seg)
            name = info.name if info is not None else f"<unregistered segment {seg}>"
            referenced[name] = self._verify_segment(name, recs, files.get(name, (-1, 0.0))[0], report, bad)
        report.orphan_bytes = sum(max(0, size - referenced.get(n, 0)) for n, (size, _) in files.items())
        if repair:
            self._repair(bad, files, grace_s)
            report.repaired = True
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._append_lock:
            self._seal()
        with self._lock:
            writers = list(self._open.values())
            self._open.clear()
        for w in writers:  # writes still in flight lose their segment (they fail at commit)
            with contextlib.suppress(OSError):
                os.close(w.fd)
        self._io_pool.shutdown(wait=True)
        self._index.close()

    # -- writing ---------------------------------------------------------------------------
    def _acceptable(self, bid: BlockId, buf: Buffer) -> bool:
        key = key_or_none(bid)
        layer = bid[1]
        if key is None or layer >= self.context.layout.num_layers:
            return False
        try:
            if is_device(buf) and not buf.is_contiguous():
                return False
            if not is_device(buf):
                host_bytes(buf)  # raises ValueError for a non-contiguous buffer
            return nbytes(buf) == self.context.layout.layer_nbytes(layer)
        except (AttributeError, TypeError, ValueError):
            return False

    def _store(
        self, keys: list[bytes], bufs: Sequence[Buffer], expect: Sequence[Loc | None] | None = None
    ) -> tuple[list[bool], dict[int, SegInfo]]:
        """Append records, make them durable, then commit the index.

        Returns which records were applied and the segments whose records they replaced."""
        lengths = [nbytes(b) for b in bufs]
        try:
            with self._appending(lengths) as spans:
                locs: list[Loc] = []
                for writer, base, lo, layout in spans:
                    hi = lo + layout.count
                    checksums = self._write_records(writer.fd, base, bufs[lo:hi], lengths[lo:hi], layout)
                    offsets = (base + off for off in layout.offsets)
                    locs += map(Loc, itertools.repeat(writer.seg), offsets, lengths[lo:hi], checksums)
                if self.opts.fsync:
                    for fd in dict.fromkeys(w.fd for w, *_ in spans):
                        os.fdatasync(fd)
                return self._commit(keys, locs, expect)
        except (OSError, lmdb.Error) as exc:
            raise TierError(f"nvme tier {self.name!r}: write to {self.segment_dir} failed: {exc}") from exc

    def _write_records(
        self, fd: int, base: int, bufs: Sequence[Buffer], lengths: list[int], layout: BatchLayout
    ) -> list[int]:
        """Pack records into aligned staging chunks as ``layout`` says, one pwrite per chunk;
        returns their checksums.

        Up to ``IO_DEPTH`` chunks are being written while the next one is packed."""
        chunks = layout.chunks
        checksums: list[int] = []
        with contextlib.ExitStack() as stack:
            size = max(c[3] for c in chunks)
            stages = [stack.enter_context(self._pool.borrow(size)) for _ in range(min(IO_DEPTH + 1, len(chunks)))]
            inflight: deque[Future[None]] = deque()
            try:
                for k, (lo, hi, offset, nb) in enumerate(chunks):
                    stage = stages[k % len(stages)]
                    for buf, n, at in zip(bufs[lo:hi], lengths[lo:hi], layout.offsets[lo:hi], strict=True):
                        pos = at - offset
                        checksums.append(pack_record(stage[pos : pos + record_extent(n)], buf, n))
                    stage[layout.offsets[hi - 1] - offset + record_extent(lengths[hi - 1]) : nb] = 0
                    if len(chunks) == 1:
                        pwrite_all(fd, stage[:nb], base + offset)
                        break
                    while len(inflight) >= IO_DEPTH:
                        inflight.popleft().result()
                    inflight.append(self._io_pool.submit(pwrite_all, fd, stage[:nb], base + offset))
                while inflight:
                    inflight.popleft().result()
            finally:
                wait(inflight)
        return checksums

    @contextlib.contextmanager
    def _appending(self, lengths: list[int]) -> Iterator[list[tuple[_Writer, int, int, BatchLayout]]]:
        """Reserve space for records, filling segments up to ``segment_size``.

        Yields spans ``(writer, base offset, first record, layout)`` covering the records
        in order (records ``first : first + layout.count`` at ``base + layout.offsets``);
        the segments stay open (and locked) until the caller's commit is done."""
        spans: list[tuple[_Writer, int, int, BatchLayout]] = []
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

    def _reserve(self, lengths: list[int], lo: int) -> tuple[_Writer, int, int, BatchLayout] | None:
        """Reserve the records from ``lo`` that fit the active segment (caller holds ``_append_lock``)."""
        writer = self._writer
        if writer is None or writer.size >= self.segment_size:
            self._seal()
            writer = self._writer = self._new_segment()
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

    def _release(self, writer: _Writer) -> None:
        with self._lock:
            writer.pending -= 1
            done = writer.sealed and writer.pending == 0 and self._open.pop(writer.seg, None) is not None
        if done:
            os.close(writer.fd)

    def _new_segment(self) -> _Writer:
        """Create, lock, then register a new segment file (caller holds ``_append_lock``)."""
        self._seq += 1
        name = f"{self._writer_id}-{self._seq:06d}{SEGMENT_SUFFIX}"
        path = os.path.join(self.segment_dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | self._odirect, 0o644)
        try:
            if not try_flock(fd):
                raise TierError(f"segment {path} is locked by another process")
            if self.opts.fsync:
                fsync_dir(self.segment_dir)
            seg = self._index.register_segment(name)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        writer = _Writer(seg, name, fd)
        with self._lock:
            self._names[seg] = name
            self._sizes[name] = 0
            self._open[seg] = writer
        return writer

    def _seal(self) -> None:
        """Stop appending to the active segment (caller holds ``_append_lock``)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        with self._lock:
            writer.sealed = True
            done = writer.pending == 0 and self._open.pop(writer.seg, None) is not None
        if done:
            os.close(writer.fd)  # releases the flock: the segment is sealed for everyone

    def _commit(
        self, keys: list[bytes], locs: list[Loc], expect: Sequence[Loc | None] | None
    ) -> tuple[list[bool], dict[int, SegInfo]]:
        with self._index.write_lock:
            applied, replaced = self._index.put(list(zip(keys, locs, strict=True)), expect)
            with self._lock:
                for key, loc, ok in zip(keys, locs, applied, strict=True):
                    if ok:
                        self._mirror_set(key, loc)
        return applied, replaced

    # -- reading ---------------------------------------------------------------------------
    def contains(self, ids: Sequence[BlockId]) -> list[bool]:
        """Present now according to the shared LMDB index (authoritative across processes;
        refreshes this process's mirror, so entries others deleted are forgotten here too)."""
        return [loc is not None for loc in self._fetch([block_key(bid) for bid in ids])]

    def _lookup(self, keys: list[bytes | None]) -> list[Loc | None]:
        with self._lock:
            locs = [None if k is None else self._mirror.get(k) for k in keys]
        misses = {i: k for i, (k, loc) in enumerate(zip(keys, locs, strict=True)) if k is not None and loc is None}
        if misses:  # maybe written by another process since we opened
            for i, loc in zip(misses, self._fetch(list(misses.values())), strict=True):
                locs[i] = loc
        return locs

    def _fetch(self, keys: list[bytes]) -> list[Loc | None]:
        """Current index entries of ``keys``; refreshes the mirror with them."""
        with self._index.write_lock:
            fresh = self._index.get_many(keys)
            with self._lock:
                for key, loc in zip(keys, fresh, strict=True):
                    if loc is None:
                        self._mirror_pop(key)
                    else:
                        self._mirror_set(key, loc)
        return fresh

    def _retry_moved(
        self,
        gone: list[int],
        locs: list[Loc | None],
        keys: list[bytes | None],
        bufs: list[Buffer],
        out: list[ReadStatus],
    ) -> None:
        """Segment files vanished under us: re-read moved records, drop lost ones."""
        gone_keys = [k for k in (keys[i] for i in gone) if k is not None]
        fresh = self._fetch(gone_keys)
        retry = [(i, loc) for i, loc in zip(gone, fresh, strict=True) if loc is not None and loc != locs[i]]
        lost = [
            (k, loc) for i, k, loc in zip(gone, gone_keys, fresh, strict=True) if loc is not None and loc == locs[i]
        ]
        if lost:
            log.warning("nvme tier %s: %d blocks point at missing segment files", self.name, len(lost))
            self._drop([k for k, _ in lost], [loc for _, loc in lost])
        for i in gone:
            out[i] = ReadStatus.MISSING
        self._read_jobs(retry, keys, bufs, out)

    def _read_jobs(
        self, jobs: list[tuple[int, Loc]], keys: list[bytes | None], bufs: list[Buffer], out: list[ReadStatus]
    ) -> list[int]:
        """Read, verify and deliver; returns the items whose segment file is missing."""
        gone: list[int] = []
        by_seg: dict[int, list[tuple[int, Loc]]] = {}
        for job in self._gds_jobs(jobs, bufs, out) if self._gds else jobs:
            by_seg.setdefault(job[1].seg, []).append(job)
        work: list[tuple[int, list[tuple[int, Loc]]]] = []
        try:
            for seg, group in by_seg.items():
                fd = self._open_for_read(seg, group, gone, out)
                if fd >= 0:
                    work += [(fd, run) for run in plan_runs(group, CHUNK_BYTES, READ_GAP, self._read_align)]
            if work:
                self._read_runs(work, bufs, out)
        finally:
            for fd in dict.fromkeys(fd for fd, _ in work):
                os.close(fd)
        corrupt = [(k, loc) for i, loc in jobs if out[i] is ReadStatus.CORRUPT and (k := keys[i]) is not None]
        if corrupt:
            self._quarantine(corrupt)
        return gone

    def _open_for_read(self, seg: int, group: list[tuple[int, Loc]], gone: list[int], out: list[ReadStatus]) -> int:
        path = self._segment_path(seg)
        try:
            return os.open(path or "", os.O_RDONLY | os.O_CLOEXEC | self._odirect)
        except FileNotFoundError:
            gone.extend(i for i, _ in group)
        except OSError:
            for i, _ in group:
                out[i] = ReadStatus.ERROR
        return -1

    def _read_runs(
        self, work: list[tuple[int, list[tuple[int, Loc]]]], bufs: list[Buffer], out: list[ReadStatus]
    ) -> None:
        """Read runs into staging buffers, keeping ``IO_DEPTH`` reads in flight while one is delivered."""
        spans = [run_span(run, self._read_align) for _, run in work]
        with contextlib.ExitStack() as stack:
            size = max(n for _, n in spans)
            stages = [stack.enter_context(self._pool.borrow(size)) for _ in range(min(IO_DEPTH + 1, len(work)))]
            if len(work) == 1:  # nothing to overlap: stay on this thread
                first, n = spans[0]
                _deliver_run(work[0][1], stages[0], first, pread_or_error(work[0][0], stages[0][:n], first), bufs, out)
                return

            def start(k: int) -> Future[int]:
                first, n = spans[k]
                return self._io_pool.submit(pread_or_error, work[k][0], stages[k % len(stages)][:n], first)

            inflight = deque(start(k) for k in range(min(IO_DEPTH, len(work))))
            try:
                for k in range(len(work)):
                    got = inflight.popleft().result()
                    if k + IO_DEPTH < len(work):  # reuses the buffer of run k-1, delivered already
                        inflight.append(start(k + IO_DEPTH))
                    _deliver_run(work[k][1], stages[k % len(stages)], spans[k][0], got, bufs, out)
            finally:
                wait(inflight)

    def _gds_jobs(
        self, jobs: list[tuple[int, Loc]], bufs: list[Buffer], out: list[ReadStatus]
    ) -> list[tuple[int, Loc]]:
        """Serve device destinations with GPUDirect Storage; returns the other jobs."""
        rest: list[tuple[int, Loc]] = []
        for i, loc in jobs:
            path = self._segment_path(loc.seg) if is_device(bufs[i]) else None
            if path is None:
                rest.append((i, loc))
                continue
            try:
                out[i] = _gds_read(path, loc, bufs[i])
            except FileNotFoundError:
                rest.append((i, loc))  # the host path notices the file is gone
            except (OSError, RuntimeError) as exc:
                log.warning("nvme tier %s: GDS read failed: %s", self.name, exc)
                out[i] = ReadStatus.ERROR
        return rest

    def _quarantine(self, corrupt: list[tuple[bytes, Loc]]) -> None:
        with self._lock:
            self.checksum_failures += len(corrupt)
        log.warning("nvme tier %s: %d blocks failed their checksum; dropped from the index", self.name, len(corrupt))
        try:
            self._drop([k for k, _ in corrupt], [loc for _, loc in corrupt])
        except lmdb.Error as exc:
            log.warning("nvme tier %s: could not drop corrupt blocks: %s", self.name, exc)

    # -- index and mirror --------------------------------------------------------------------
    def _drop(self, keys: list[bytes], expect: Sequence[Loc] | None = None) -> dict[int, SegInfo]:
        with self._index.write_lock:
            removed, infos = self._index.drop(keys, expect)
            with self._lock:
                for key, old in zip(keys, removed, strict=True):
                    if old is not None or expect is None:
                        self._mirror_pop(key)
        return infos

    def _mirror_set(self, key: bytes, loc: Loc) -> None:
        self._mirror_pop(key)
        self._mirror[key] = loc
        self._by_seg.setdefault(loc.seg, set()).add(key)

    def _mirror_pop(self, key: bytes) -> None:
        old = self._mirror.pop(key, None)
        if old is not None:
            members = self._by_seg.get(old.seg)
            if members is not None:
                members.discard(key)
                if not members:
                    del self._by_seg[old.seg]

    def _reload_mirror(self) -> None:
        with self._index.write_lock:
            entries = self._index.blocks()
            names = {seg: info.name for seg, info in self._index.segments().items()}
            with self._lock:
                self._mirror.clear()
                self._by_seg.clear()
                for key, loc in entries:
                    self._mirror_set(key, loc)
                self._names.update(names)

    def _segment_path(self, seg: int) -> str | None:
        with self._lock:
            name = self._names.get(seg)
        if name is None:
            info = self._index.segment(seg)
            if info is None:
                return None
            name = info.name
            with self._lock:
                self._names[seg] = name
        return os.path.join(self.segment_dir, name)

    # -- reclaiming space -------------------------------------------------------------------
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
            if not try_flock(fd) or not self._sparse(info, os.fstat(fd).st_size):
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
            known = [(k, self._mirror[k]) for k in self._by_seg.get(seg, ())]
        self._move(fd, known)
        info = self._index.segment(seg)
        if info is not None and info.live_count:  # records this process has not seen
            self._move(fd, self._index.locs_in_segment(seg))

    def _move(self, fd: int, records: list[tuple[bytes, Loc]]) -> None:
        """Copy records (verified) into the active segment; the index moves only entries still at the old place.

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
                    elif checksum(data) != loc.checksum:
                        bad.append(records[i])
                    else:
                        good.append((records[i][0], loc, data))
                if good:
                    self._store([k for k, _, _ in good], [d for _, _, d in good], [loc for _, loc, _ in good])
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

    def _remove_unregistered(self, files: dict[str, tuple[int, float]], registered: set[str], grace_s: float) -> None:
        now = time.time()
        for name, (_, mtime) in files.items():
            if name in registered or now - mtime < grace_s:
                continue
            path = os.path.join(self.segment_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if try_flock(fd):
                    os.unlink(path)
            finally:
                os.close(fd)

    def _list_files(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        with os.scandir(self.segment_dir) as it:
            for entry in it:
                if entry.name.endswith(SEGMENT_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        out[entry.name] = (st.st_size, st.st_mtime)
        return out

    def _rescan(self) -> None:
        """Re-read segment sizes from disk (other processes' segments grow too)."""
        files = self._list_files()
        with self._lock:
            sizes = {name: size for name, (size, _) in files.items()}
            for writer in self._open.values():  # reserved space may not be written yet
                sizes[writer.name] = max(sizes.get(writer.name, 0), writer.size)
            self._sizes = sizes
            self._scanned_at = time.monotonic()

    def _physical(self) -> int:
        if time.monotonic() - self._scanned_at > RESCAN_S:
            self._rescan()
        with self._lock:
            return sum(self._sizes.values())

    # -- verify ----------------------------------------------------------------------------
    def _verify_segment(
        self, name: str, recs: list[tuple[bytes, Loc]], size: int, report: VerifyReport, bad: list[tuple[bytes, Loc]]
    ) -> int:
        """Check one segment's records; returns the bytes they reference."""
        path = os.path.join(self.segment_dir, name)
        fd = -1
        with contextlib.suppress(OSError):  # also a segment created after the listing (a live writer)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self._odirect)
        if fd < 0:
            report.missing_data += len(recs)
            report.problems.append(f"{path}: missing, {len(recs)} blocks lost")
            bad.extend(recs)
            return 0
        try:
            for run in plan_runs(list(enumerate(loc for _, loc in recs)), CHUNK_BYTES, READ_GAP, self._read_align):
                self._verify_run(fd, path, [(recs[i][0], loc) for i, loc in run], report, bad)
        finally:
            os.close(fd)
        return referenced_bytes([loc for _, loc in recs], size)

    def _verify_run(
        self, fd: int, path: str, run: list[tuple[bytes, Loc]], report: VerifyReport, bad: list[tuple[bytes, Loc]]
    ) -> None:
        first, span = run_span(run, self._read_align)
        with self._pool.borrow(span) as stage:
            got = pread_or_error(fd, stage[:span], first)
            for key, loc in run:
                rel = loc.offset - first
                if rel + loc.length > got:
                    report.missing_data += 1
                    report.problems.append(f"{path}@{loc.offset}: truncated (key {key[:16].hex()})")
                elif checksum(stage[rel : rel + loc.length]) != loc.checksum:
                    report.bad_checksums += 1
                    report.problems.append(f"{path}@{loc.offset}: checksum mismatch (key {key[:16].hex()})")
                else:
                    continue
                bad.append((key, loc))

    def _repair(self, bad: list[tuple[bytes, Loc]], files: dict[str, tuple[int, float]], grace_s: float) -> None:
        if bad:
            self._drop([k for k, _ in bad], [loc for _, loc in bad])
        infos = self._index.recount()
        self._reload_mirror()
        for seg, info in infos.items():
            self._reclaim_segment(seg, info)
        self._remove_unregistered(files, {info.name for info in infos.values()}, grace_s)
        self._rescan()

    @contextlib.contextmanager
    def _index_faults(self, what: str) -> Iterator[None]:
        """Report LMDB failures as ``TierError`` (a fault the engine turns into misses)."""
        try:
            yield
        except lmdb.Error as exc:
            raise TierError(f"nvme tier {self.name!r}: {what} failed, index {self.root}/index.lmdb: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"nvme tier {self.name!r} at {self.root} is closed")


# -- helpers -----------------------------------------------------------------------------------


def _deliver_run(
    run: list[tuple[int, Loc]], stage: np.ndarray, first: int, got: int, bufs: list[Buffer], out: list[ReadStatus]
) -> None:
    for i, loc in run:
        rel = loc.offset - first
        if got < 0:
            out[i] = ReadStatus.ERROR
        elif rel + loc.length > got:
            out[i] = ReadStatus.ERROR  # truncated segment
        else:
            out[i] = _deliver(stage[rel : rel + loc.length], loc, bufs[i])


def _gds_read(path: str, loc: Loc, dst: Buffer) -> ReadStatus:
    """GPUDirect Storage read (kvikio) straight into device memory. Untested: no GPU here.

    The checksum is verified on a device-to-host copy, which costs as much PCIe
    traffic as the host bounce it replaces; it spares host staging memory only."""
    import kvikio
    import torch

    flat = dst.detach().reshape(-1).view(torch.uint8)
    if flat.numel() != loc.length:
        return ReadStatus.ERROR
    with kvikio.CuFile(path, "r") as f:
        got = f.pread(flat, loc.length, loc.offset).get()
    if got != loc.length:
        return ReadStatus.ERROR
    ok = checksum(flat.cpu().numpy()) == loc.checksum
    return ReadStatus.OK if ok else ReadStatus.CORRUPT


def _deliver(data: np.ndarray, loc: Loc, dst: Buffer) -> ReadStatus:
    if checksum(data) != loc.checksum:
        return ReadStatus.CORRUPT
    try:
        if nbytes(dst) != loc.length:
            return ReadStatus.ERROR
        copy_bytes(dst, data)
    except (ValueError, TypeError, RuntimeError):
        return ReadStatus.ERROR
    return ReadStatus.OK


def _coerce_options(options: object) -> NVMeOptions:
    data = options.model_dump() if isinstance(options, TierOptions) else options
    return NVMeOptions.model_validate(data)


def _effective_segment_size(segment_size: int, capacity: int) -> int:
    cap = capacity // 8 if capacity > 0 else segment_size
    return max(ALIGN, min(segment_size, cap) // ALIGN * ALIGN)


def _choose_direct_io(directory: str, opts: NVMeOptions) -> bool:
    try:
        supported = probe_direct_io(directory)
    except OSError as exc:
        raise ConfigError(
            f"nvme tier path {directory!r} is not writable: {exc.strerror or exc}", field="path", value=opts.path
        ) from exc
    if opts.direct_io == "on" and not supported:
        raise ConfigError(f"O_DIRECT is not supported under {directory!r}", field="direct_io", value="on")
    return supported and opts.direct_io != "off"
