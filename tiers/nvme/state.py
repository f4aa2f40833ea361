"""The state one ``nvme`` tier instance keeps (:class:`NVMeState`), shared by its writer,
reader, reclaimer and verifier."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import lmdb
import numpy as np

from kvstrata.core import native
from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers.auth import KID_BYTES, record_key, record_prefix
from kvstrata.tiers.base import Tier, TierContext, TierOptions
from kvstrata.tiers.fileio import probe_memory_alignment
from kvstrata.tiers.nvme.native_reads import native_reads_enabled
from kvstrata.tiers.nvme.options import (
    _O_DIRECT,
    CHUNK_BYTES,
    RESCAN_S,
    NVMeOptions,
    _choose_direct_io,
    _coerce_options,
    _effective_segment_size,
    gds_available,
)
from kvstrata.tiers.nvme.root import existing_root, prepare_root
from kvstrata.tiers.segment_index import LocFields, loc_fields, new_loc
from kvstrata.tiers.segments import (
    ALIGN,
    SEGMENT_SUFFIX,
    AlignedBufferPool,
    Loc,
    SegInfo,
    SegmentIndex,
    checksum,
)

log = logging.getLogger("kvstrata.tiers.nvme")
_RECORD = b"N"  # the kind byte of an nvme record's tag (kvstrata.tiers.auth.record_prefix)
#: Index entries (layer-blocks) this process keeps in its mirror of the shared LMDB index, ~0.5
#: KiB each: a cache of what it wrote and read, emptied when full. The index stays the truth (a
#: read that misses here asks it), so the mirror costs neither a full load nor memory that grows
#: with the directory (10M entries took 137 s and ~4.9 GB to mirror whole).
MIRROR_MAX = 1 << 20
ZERO_COPY_ENV = "KVSTRATA_NVME_ZERO_COPY"  # 1: records in memory O_DIRECT takes are written from there
CLOSE_WAIT_S = 30.0  # close() waits this long for calls in flight, then leaves the release to the last one


def _zero_copy_alignment(directory: str, opts: NVMeOptions) -> int:
    """The memory alignment at which this directory's ``O_DIRECT`` writes take a record straight
    from the caller's memory, and its reads land a record straight there
    (:func:`~kvstrata.tiers.fileio.probe_memory_alignment`), when ``KVSTRATA_NVME_ZERO_COPY=1``;
    0 (always stage) by default and without the extension.

    Off by default: on this project's VMs a zero-copy 256 MiB write cost 27% less CPU (58 against
    78-80 ms, all threads) but took 25-30% longer, because the virtual disk reads guest memory it
    has not read lately more slowly than the few staging buffers it reads again and again (raw
    ``O_DIRECT`` from the caller's 256 MiB: ~10% slower than from four reused 16 MiB buffers).
    Reads the same way: a zero-copy 256 MiB read into page-aligned arrays took 0.151-0.153 CPU-s
    a GB against 0.175-0.179 staged, but 76-82 ms against 61-71 ms (interleaved), as raw
    ``O_DIRECT`` into the caller's 256 MiB took 63-70 ms against 47-56 ms into the staging
    buffers. On a disk not behind a hypervisor the copy is the cost, and ``1`` saves it."""
    raw = os.environ.get(ZERO_COPY_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{ZERO_COPY_ENV}={raw!r}: use 1 (write from the caller's memory) or 0 (stage)")
    if raw == "0" or native.NATIVE is None:
        return 0
    try:
        return probe_memory_alignment(directory, opts.file_mode)
    except OSError:
        return 0


# Staging buffers for every NVMe tier of this process (a process with several tiers, or a tier opened
# and closed many times, keeps at most ``keep`` of them between calls, not that many per tier).
STAGING = AlignedBufferPool(CHUNK_BYTES, keep=8)


@dataclass
class OpenSegment:
    """A segment this tier appends to; its fd holds the segment's flock until closed."""

    seg: int
    name: str
    fd: int
    size: int = 0  # reserved end
    pending: int = 0  # appends not yet committed
    sealed: bool = False


class NVMeState(Tier):
    """What every part of the NVMe tier shares: options, the open segments, the index and
    this process's mirror of it, segment sizes; and the small helpers that keep them."""

    def __init__(
        self, name: str, capacity: int, options: TierOptions, context: TierContext, read_only: bool = False
    ) -> None:
        opts = options if isinstance(options, NVMeOptions) else _coerce_options(options)
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.read_only = read_only  # opened to check it (verify without repair): nothing on disk changes
        self.checksum_failures = 0
        self.auth_failures = 0  # records whose keyed tag did not verify (forged or damaged; with a secret)
        self.zero_copy_records = 0  # records written straight from the caller's memory (no staging copy)
        self.zero_copy_reads = 0  # records read straight into the caller's memory (no staging copy)
        self.native_reads = 0  # records read, checked and copied out by the extension's threads (no GIL)
        if read_only:
            self.root = existing_root(opts.path, context.layout, context.namespace)
        else:
            self.root = prepare_root(opts.path, context.layout, context.namespace, opts.file_mode, opts.dir_mode)
        base = os.path.dirname(self.root)
        # only a directory other users may write is "shared" storage that needs a secret
        self._key = record_key(opts, context.namespace, "nvme", name, base, warn=_writable_by_others(self.root))
        self.segment_dir = os.path.join(self.root, "segments")
        # a read-only open probes nothing (the probe writes a file) and reads through the page cache
        self.direct_io = False if read_only else _choose_direct_io(self.segment_dir, opts)
        self.segment_size = _effective_segment_size(opts.segment_size, capacity)
        self._odirect = _O_DIRECT if self.direct_io else 0
        self._read_align = ALIGN if self.direct_io else 1  # O_DIRECT reads whole pages
        # records whose memory has this alignment go to the disk from there and come back there,
        # with no staging copy (0: always staged)
        self._mem_align = _zero_copy_alignment(self.segment_dir, opts) if self.direct_io else 0
        # staged reads through the extension's threads (records checked with xxh3_64, not a keyed tag)
        self._native_reads = self._key is None and native_reads_enabled()
        self._writer_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = 0
        self._lock = threading.Lock()  # mirror, names, sizes, writers: short sections only
        self._append_lock = threading.Lock()  # reservation and segment rollover
        # key -> its Loc's fields as a plain tuple, untracked by the garbage collector (a Loc, a
        # tuple subclass, stays tracked: a full collection over 1M mirrored Locs took 188 ms, on
        # the thread that happened to allocate, holding the GIL); the keys of each segment as a
        # dict of key -> None, not a set: a dict of bytes is never tracked, a set always is (and
        # each full collection walked every key of it)
        self._mirror: dict[bytes, LocFields] = {}
        self._by_seg: dict[int, dict[bytes, None]] = {}
        self._names: dict[int, str] = {}
        self._sizes: dict[str, int] = {}
        self._open: dict[int, OpenSegment] = {}
        self._writer: OpenSegment | None = None
        self._spare: OpenSegment | None = None  # the next segment, made ahead (see Appender._next_segment)
        self._spare_wanted = False  # a rollover took the spare: the write that did makes the next
        self._sealed_any = False  # this tier has filled a segment: it makes spares from then on
        self._pool = STAGING
        self._io_pool_obj: ThreadPoolExecutor | None = None  # started by the first read or write
        self._scanned_at = 0.0
        self._closed = False
        self._calls = threading.Condition()  # calls in flight (``_using``), watched by ``close``
        self._in_flight = 0
        self._release_by_last = False  # close() timed out: the last call in flight releases the files
        self._gds = gds_available()
        self._index = SegmentIndex(
            os.path.join(self.root, "index.lmdb"), opts.lmdb_map_size, opts.file_mode, opts.dir_mode, read_only
        )

    # -- record integrity: xxh3_64 without a secret, keyed BLAKE3 with one ------------------------
    def _sealed(self, key: bytes, data: np.ndarray) -> tuple[int, bytes]:
        """(checksum, tag) of a staged record: what its :class:`Loc` keeps to check it."""
        if self._key is None:
            return checksum(data), b""
        return 0, self._key.kid + self._key.mac(record_prefix(_RECORD, key, len(data)), data)

    def _ours(self, loc: Loc) -> bool:
        """Whether this tier can check ``loc``'s record: written without a secret when it has none,
        with its key when it has one. Other records are misses here and are left alone."""
        if self._key is None:
            return not loc.tag
        return loc.tag[:KID_BYTES] == self._key.kid

    def _intact(self, key: bytes, loc: Loc, data: np.ndarray) -> bool:
        """Whether the bytes read for ``loc`` (a record :meth:`_ours`) are the ones written under ``key``."""
        if self._key is None:
            return checksum(data) == loc.checksum
        return self._key.check(loc.tag[KID_BYTES:], record_prefix(_RECORD, key, loc.length), data)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "checksum_failures": self.checksum_failures,
                "auth_failures": self.auth_failures,
                "zero_copy_records": self.zero_copy_records,
                "zero_copy_reads": self.zero_copy_reads,
                "native_reads": self.native_reads,
                "mirror_blocks": len(self._mirror),  # index entries cached here (at most MIRROR_MAX)
            }

    @property
    def staging_pool(self) -> AlignedBufferPool:
        """Where this tier's reads and writes borrow their page-aligned staging buffers."""
        return self._pool

    @property
    def _io_pool(self) -> ThreadPoolExecutor:
        """The I/O threads, started on first use: a tier opened only to ask ``contains`` starts none."""
        pool = self._io_pool_obj
        if pool is None:
            with self._lock:
                if self._io_pool_obj is None:
                    self._io_pool_obj = ThreadPoolExecutor(4, thread_name_prefix=f"kvstrata-nvme-{self.name}")
                pool = self._io_pool_obj
        return pool

    def _drop(self, keys: list[bytes], expect: Sequence[Loc] | None = None) -> dict[int, SegInfo]:
        if self.read_only:  # a check changes nothing: what a read finds bad stays for verify to report
            return {}
        with self._index.write_lock:
            removed, infos = self._index.drop(keys, expect)
            with self._lock:
                for key, old in zip(keys, removed, strict=True):
                    if old is not None or expect is None:
                        self._mirror_pop(key)
        return infos

    def _mirror_set(self, key: bytes, loc: Loc) -> None:
        if len(self._mirror) >= MIRROR_MAX and key not in self._mirror:
            self._forget_mirror()  # a cache: what it forgets is fetched from the index again
        self._mirror_pop(key)
        self._mirror[key] = loc_fields(loc)
        self._by_seg.setdefault(loc.seg, {})[key] = None

    def _mirror_set_many(self, keys: Sequence[bytes], fields: Sequence[LocFields], applied: Sequence[bool]) -> None:
        """Lock held: :meth:`_mirror_set` of each applied entry (``fields``: their
        :func:`~kvstrata.tiers.nvme.writer.loc_fields_many`, made before the lock), in a few
        dict calls while the mirror is far from its bound (a write's 4,096 entries, after its
        commit, before it returns: 0.6 us an entry one at a time)."""
        if not all(applied):
            keys = list(itertools.compress(keys, applied))
            fields = list(itertools.compress(fields, applied))
        mirror, by_seg = self._mirror, self._by_seg
        if len(mirror) + len(keys) >= MIRROR_MAX:  # one at a time, forgetting as it goes
            self._mirror_set_each(keys, fields)
            return
        for key in mirror.keys() & keys:  # rewritten keys leave their old segment's members
            self._mirror_pop(key)
        before = len(mirror)
        mirror.update(zip(keys, fields, strict=True))
        if len(mirror) - before != len(keys):  # a key twice in the batch: the last one counts
            for key in keys:
                self._mirror_pop(key)
            self._mirror_set_each(keys, fields)
            return
        segs = [f[0] for f in fields]
        for seg in dict.fromkeys(segs):
            lo, count = segs.index(seg), segs.count(seg)
            if segs[lo : lo + count].count(seg) == count:  # one run (a write's spans come in order)
                joined = dict.fromkeys(keys[lo : lo + count])
            else:
                joined = dict.fromkeys(itertools.compress(keys, map(seg.__eq__, segs)))
            members = by_seg.get(seg)
            if members is None:
                by_seg[seg] = joined
            else:
                members.update(joined)

    def _mirror_set_each(self, keys: Sequence[bytes], fields: Sequence[LocFields]) -> None:
        for key, loc in zip(keys, fields, strict=True):
            self._mirror_set(key, new_loc(loc))

    def _mirror_pop(self, key: bytes) -> None:
        old = self._mirror.pop(key, None)
        if old is not None:
            members = self._by_seg.get(old[0])  # its segment
            if members is not None:
                members.pop(key, None)
                if not members:
                    del self._by_seg[old[0]]

    def _forget_mirror(self) -> None:
        """Lock held: empty the mirror (it caches index entries; the index stays authoritative)."""
        self._mirror.clear()
        self._by_seg.clear()

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

    @contextlib.contextmanager
    def _index_faults(self, what: str) -> Iterator[None]:
        """Report LMDB failures as ``TierError`` (a fault the engine turns into misses)."""
        try:
            yield
        except lmdb.Error as exc:
            raise TierError(f"nvme tier {self.name!r}: {what} failed, index {self.root}/index.lmdb: {exc}") from exc

    def _check_open(self, writes: bool = False) -> None:
        if self._closed:
            raise TierError(f"nvme tier {self.name!r} at {self.root} is closed")
        if writes and self.read_only:
            raise TierError(f"nvme tier {self.name!r} at {self.root} is open read-only (to verify it)")

    @contextlib.contextmanager
    def _using(self, writes: bool = False) -> Iterator[None]:
        """One public call: refused (``TierError``) once ``close`` has begun; ``close`` waits for
        the calls in flight before it closes their segment fds, the I/O threads and the index."""
        with self._calls:
            self._check_open(writes)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._calls:
                self._in_flight -= 1
                last = self._in_flight == 0 and self._release_by_last
                self._calls.notify_all()
            if last:
                self._release_files()

    def _close_after_calls(self) -> None:
        """Refuse new calls, wait (at most ``CLOSE_WAIT_S``) for those in flight, then release the
        files. A call still running after that keeps its fds: the last one to finish releases them."""
        with self._calls:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._calls.wait(left)
            if self._in_flight:
                self._release_by_last = True
                log.warning(
                    "nvme tier %s: closed with %d calls still running; they finish first", self.name, self._in_flight
                )
                return
        self._release_files()

    def _release_files(self) -> None:
        """Close the open segments (releasing their flocks: sealed for everyone), the I/O threads
        and the index. Only once no call is in flight: none of these fds is in use any more."""
        with self._append_lock, self._lock:
            writers = list(self._open.values())
            self._open.clear()
            self._writer = None
            spare, self._spare = self._spare, None
        if spare is not None:  # never written: out of the index, then unlinked under its flock
            with contextlib.suppress(OSError, lmdb.Error):
                if self._index.forget_segment(spare.seg):
                    os.unlink(os.path.join(self.segment_dir, spare.name))
        for w in writers:
            w.sealed = True
            with contextlib.suppress(OSError):
                os.close(w.fd)
        if self._io_pool_obj is not None:
            self._io_pool_obj.shutdown(wait=True)
        self._index.close()


def _writable_by_others(root: str) -> bool:
    """Whether a user other than this one may write into the namespace directory ``root`` or its parent."""
    me = os.getuid()
    for path in (root, os.path.dirname(root), os.path.join(root, "segments")):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != me or stat.S_IMODE(st.st_mode) & 0o022:
            return True
    return False
