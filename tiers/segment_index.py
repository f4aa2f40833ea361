"""The LMDB index of an ``nvme`` namespace directory (the format is described in
:mod:`kvstrata.tiers.segments`): its entries (:class:`Loc`, :class:`SegInfo`), the shared
environment of each directory and process, :class:`SegmentIndex`, and what a rebuild needs
(:func:`lock_namespace`, :func:`index_problem`, :class:`IndexBuilder`).

Every process that has the index open holds a shared ``flock`` on the namespace directory; a
rebuild takes it exclusively, so it never runs beside a process that uses the index.

LMDB has :data:`MAX_READERS` reader slots for all processes together; py-lmdb binds one to every
thread that reads, for the thread's life. The slots of processes that died (kill -9) stay taken
until a process clears them: each does at open, every :data:`READER_CHECK_S` seconds as it reads,
and whenever it finds the table full.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import lmdb

from kvstrata.core.native import untracked
from kvstrata.errors import CorruptIndexError, TierError
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, chmod_new, makedirs
from kvstrata.tiers.lmdb_pages import pages_past_end_are_free
from kvstrata.tiers.records import payload_extent, record_extent

__all__ = [
    "MAX_READERS",
    "READER_CHECK_S",
    "IndexBuilder",
    "Loc",
    "SegInfo",
    "SegmentIndex",
    "index_problem",
    "index_segments",
    "lock_namespace",
]

MAX_READERS = 4096  # LMDB reader slots, all processes together (64 bytes each in lock.mdb: 256 KiB, touched as used)
READER_CHECK_S = 30.0  # how often a process clears the reader slots of dead processes

_LOC = struct.Struct(">IQIQ")
_FRAMED = 1  # the flags byte of an index entry: the record has a header (format 3)
_FLAGS = bytes([_FRAMED])
_FRAMED_PLAIN = _LOC.size + 1  # an entry's size when it has a flags byte and no tag
_new_loc = tuple.__new__


LocFields = tuple[int, int, int, int, bytes, bool]  # a Loc's fields, in order, as a plain tuple


def loc_fields(loc: Loc) -> LocFields:
    """``loc``'s fields as a plain tuple, which the garbage collector does not track (unlike a Loc,
    a tuple subclass): untracked at once, not at the first collection that reaches it, so a dict
    of them (the nvme mirror) is not tracked again by each insert."""
    return untracked(tuple(loc))  # type: ignore[return-value]


def new_loc(fields: LocFields) -> Loc:
    """``Loc(*fields)`` without the NamedTuple's ``__new__`` (keywords, defaults): for the loops
    that make one per record of a batch (all six fields given, in order)."""
    return _new_loc(Loc, fields)  # type: ignore[no-any-return]


_SEG = struct.Struct(">QQ")
_U32 = struct.Struct(">I")
_LEN_AT = 12  # where ``length`` sits in a packed entry (``_LOC``: seg u32, offset u64, length u32, ...)
_NEXT_SEGMENT = b"next_segment"


class Loc(NamedTuple):
    """Where a record's payload lives, and how to check it: ``checksum`` (xxh3_64) for a record
    written without a secret, else ``tag`` (key id + keyed BLAKE3 tag, see :mod:`kvstrata.tiers.auth`).
    ``framed``: the record has a header (after the payloads of its chunk; false only for records
    of format 2), which its extent counts."""

    seg: int
    offset: int
    length: int
    checksum: int
    tag: bytes = b""
    framed: bool = False

    @property
    def extent(self) -> int:
        return record_extent(self.length) if self.framed else payload_extent(self.length)

    @property
    def end(self) -> int:
        return self.offset + payload_extent(self.length)

    def pack(self) -> bytes:
        seg, offset, length, csum, tag, framed = self
        fixed = _LOC.pack(seg, offset, length, csum)
        return fixed + _FLAGS + tag if framed else fixed + tag

    @classmethod
    def unpack(cls, raw: bytes) -> Loc:
        # tuple.__new__: a batch read decodes thousands of entries, and the NamedTuple's own
        # __new__ (keywords, defaults) costs twice the decoding itself
        if len(raw) == _FRAMED_PLAIN:  # the usual entry: framed, no tag
            return _new_loc(cls, (*_LOC.unpack_from(raw), b"", bool(raw[_LOC.size] & _FRAMED)))
        seg, offset, length, csum = _LOC.unpack_from(raw)
        rest = bytes(raw[_LOC.size :])
        if len(rest) % 2:  # a flags byte, then the tag (0 or 24 bytes)
            return _new_loc(cls, (seg, offset, length, csum, rest[1:], bool(rest[0] & _FRAMED)))
        return _new_loc(cls, (seg, offset, length, csum, rest, False))


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


def lock_namespace(directory: str, exclusive: bool = False) -> int | None:
    """Take the ``flock`` of a namespace directory without waiting: shared by every process that has
    its index open, exclusive while the index is rebuilt. Returns the descriptor that holds it
    (close it to release), or None when another process holds it in the other mode."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unreadable(path: str, why: object) -> CorruptIndexError:
    why = str(why).removeprefix(f"{path}: ")  # py-lmdb names the path first
    return CorruptIndexError(
        f"nvme index {path} is corrupt or unreadable ({why}); `kvstrata verify --repair` rebuilds it "
        "from the segment files",
        path=path,
        reason=str(why),
    )


def _tail_is_free(env: Any, path: str, psize: int, readonly: bool) -> bool:
    """Whether the pages LMDB counts past the end of data.mdb are all free (never written: a
    benign state, see :mod:`kvstrata.tiers.lmdb_pages`), in a transaction that keeps the snapshot's
    free list as it is (a write transaction: no reader slot, and no commit meanwhile)."""
    txn = env.begin(write=not readonly)
    try:
        snapshot = txn.id() - (0 if readonly else 1)  # a write transaction has the next id
        return pages_past_end_are_free(os.path.join(path, "data.mdb"), psize, snapshot)
    finally:
        txn.abort()


def _open_env(
    path: str, map_size: int, file_mode: int, dir_mode: int, readonly: bool = False
) -> tuple[Any, Any, Any, Any]:
    """Open (or create) the LMDB environment at ``path`` and read what an open needs (the segments
    and meta dbs), so that a damaged index fails here, as :class:`CorruptIndexError` naming it.
    ``readonly`` writes nothing: no directory, no new files, no reader check (and the writers'
    map size, so that a data file they grow stays inside this map)."""
    fresh = []
    if not readonly:
        makedirs(path, dir_mode)
        fresh = [f for f in ("data.mdb", "lock.mdb") if not os.path.exists(os.path.join(path, f))]
    env = None
    try:
        env = lmdb.open(
            path,
            max_dbs=4,
            map_size=map_size,
            subdir=True,
            lock=True,
            readonly=readonly,
            mode=file_mode,
            max_readers=MAX_READERS,
        )
        for name in fresh:  # LMDB creates them through the umask
            chmod_new(os.path.join(path, name), file_mode)
        # A data file shorter than its last page would be read beyond its end: SIGBUS, not an error.
        psize = env.stat()["psize"]
        need = (env.info()["last_pgno"] + 1) * psize
        have = os.path.getsize(os.path.join(path, "data.mdb"))
        if have < need and not _tail_is_free(env, path, psize, readonly):
            raise _unreadable(path, f"data.mdb is truncated: {have} bytes, its pages end at {need}")
        if not readonly:
            env.reader_check()  # drop reader slots of dead processes
        blocks, segments, meta = (env.open_db(name) for name in (b"blocks", b"segments", b"meta"))
        txn = env.begin(write=not readonly)  # writable: reads without taking a reader slot; never committed
        try:
            txn.stat(blocks)
            for _, raw in txn.cursor(db=segments):
                SegInfo.unpack(raw)
            txn.get(_NEXT_SEGMENT, db=meta)
        finally:
            txn.abort()
        return env, blocks, segments, meta
    except (lmdb.Error, struct.error, UnicodeDecodeError, OSError) as exc:
        if env is not None:
            env.close()
        if isinstance(exc, CorruptIndexError):
            raise
        if isinstance(exc, lmdb.ReadersFullError):  # opening reads too: the table is full of dead processes' slots
            raise TierError(
                f"nvme index {path}: all LMDB reader slots are taken ({exc}); the processes that have it open "
                f"clear those of dead processes within {READER_CHECK_S:.0f} s of their next read: open it again"
            ) from exc
        raise _unreadable(path, exc) from exc


def index_problem(
    path: str, map_size: int, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE
) -> str | None:
    """Why the index at ``path`` cannot be used (it is missing, or opening it fails), or None.
    For a process that holds the namespace directory's exclusive lock (a rebuild)."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return "it is missing"
    try:
        env, *_ = _open_env(path, map_size, file_mode, dir_mode)
    except CorruptIndexError as exc:
        return exc.reason
    env.close()
    return None


def index_segments(
    path: str, map_size: int, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE
) -> int:
    """How many segments the (readable) index at ``path`` registers; for a rebuild's lock holder."""
    env, _, segments, _ = _open_env(path, map_size, file_mode, dir_mode)
    try:
        with env.begin(db=segments) as txn:
            return int(txn.stat(segments)["entries"])
    finally:
        env.close()


class IndexBuilder:
    """A whole new index written at ``path`` (which must not exist), for a rebuild: segments with
    their ids, then entries one batch (one transaction) at a time, a key offered again replacing
    its entry when ``prefer(new, old)`` says so; the live counters follow. :meth:`finish` writes
    the segments and the next segment id (above every given one) and syncs."""

    def __init__(
        self, path: str, map_size: int, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE
    ) -> None:
        if os.path.exists(path):
            raise TierError(f"cannot build an index at {path}: it exists")
        self.env, self._blocks, self._segs, self._meta = _open_env(path, map_size, file_mode, dir_mode)
        self.segments: dict[int, SegInfo] = {}

    def add_segment(self, seg: int, name: str) -> None:
        self.segments[seg] = SegInfo(name)

    def offer(self, entries: Sequence[tuple[bytes, Loc]], prefer: Callable[[Loc, Loc], bool]) -> int:
        """Put ``entries`` (of added segments); returns how many keys were there already."""
        again = 0
        deltas: dict[int, list[int]] = {}
        with self.env.begin(write=True, db=self._blocks) as txn:
            for key, loc in entries:
                raw = txn.get(key)
                if raw is not None:
                    again += 1
                    old = Loc.unpack(raw)
                    if not prefer(loc, old):
                        continue
                    _add(deltas, old, -1)
                _add(deltas, loc, +1)
                txn.put(key, loc.pack())
        for seg, (dbytes, dcount) in deltas.items():
            info = self.segments[seg]
            self.segments[seg] = SegInfo(info.name, info.live_bytes + dbytes, info.live_count + dcount)
        return again

    def count(self, which: Callable[[Loc], bool]) -> int:
        """How many entries ``which`` holds for."""
        with self.env.begin(db=self._blocks) as txn:
            return sum(1 for _, raw in txn.cursor() if which(Loc.unpack(raw)))

    def finish(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(_NEXT_SEGMENT, _U32.pack(max(self.segments, default=0) + 1), db=self._meta)
            for seg, info in sorted(self.segments.items()):
                txn.put(_seg_key(seg), info.pack(), db=self._segs)
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()


@dataclass
class _SharedEnv:
    """One LMDB environment per directory and process (LMDB forbids opening it twice), and the
    shared ``flock`` of the namespace directory that this process holds while it is open."""

    path: str
    env: Any
    blocks: Any
    segments: Any
    meta: Any
    lock: threading.RLock
    dir_lock: int
    refs: int = 0
    checked_at: float = 0.0
    readonly: bool = False

    def begin_read(self, db: Any) -> Any:
        """A read transaction; the reader slots of dead processes are cleared every
        ``READER_CHECK_S`` seconds and when none is free."""
        now = time.monotonic()
        if now - self.checked_at > READER_CHECK_S and not self.readonly:  # read-only: writes nothing
            self.checked_at = now
            self.env.reader_check()
        try:
            return self.env.begin(db=db)
        except lmdb.ReadersFullError:
            if self.readonly:
                raise
            self.env.reader_check()  # slots of processes killed while they held a read transaction
            self.checked_at = time.monotonic()
        try:
            return self.env.begin(db=db)
        except lmdb.ReadersFullError as exc:
            raise TierError(
                f"nvme index {self.path}: all {self.env.info()['max_readers']} LMDB reader slots are held by "
                f"live processes ({exc})"
            ) from exc


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str, map_size: int, file_mode: int, dir_mode: int, readonly: bool = False) -> _SharedEnv:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is not None and shared.readonly and not readonly:
            raise lmdb.ReadonlyError(f"{path}: opened read-only in this process (by verify); close that first")
        if shared is None:
            directory = os.path.dirname(os.path.abspath(path))
            dir_lock = lock_namespace(directory)
            if dir_lock is None:
                raise TierError(
                    f"nvme index {path} is being rebuilt (`kvstrata verify --repair` holds {directory}); "
                    "open it again when that has finished"
                )
            try:
                env, blocks, segments, meta = _open_env(path, map_size, file_mode, dir_mode, readonly)
            except BaseException:
                os.close(dir_lock)
                raise
            lock = threading.RLock()
            shared = _SharedEnv(
                path, env, blocks, segments, meta, lock, dir_lock, checked_at=time.monotonic(), readonly=readonly
            )
            _ENVS[path] = shared
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
            os.close(shared.dir_lock)


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
        with self._shared.begin_read(self._shared.blocks) as txn:
            return [(bytes(k), Loc.unpack(v)) for k, v in txn.cursor()]

    def owned_lengths(self, kid: bytes | None) -> list[tuple[bytes, int]]:
        """(key, payload length) of every record a tier with key id ``kid`` can check (None:
        written without a secret), read from the raw entries without decoding each into a
        :class:`Loc` (a tier's ``scan``: ~5x faster than :meth:`blocks`)."""
        base = _LOC.size
        out: list[tuple[bytes, int]] = []
        append = out.append
        with self._shared.begin_read(self._shared.blocks) as txn:
            for k, v in txn.cursor():
                extra = len(v) - base  # a flags byte (odd), then the tag
                if kid is None:
                    if extra > 1:
                        continue
                elif extra <= 1 or v[base + (extra & 1) : base + (extra & 1) + len(kid)] != kid:
                    continue
                append((bytes(k), int.from_bytes(v[_LEN_AT : _LEN_AT + 4], "big")))
        return out

    def segments(self) -> dict[int, SegInfo]:
        with self._shared.begin_read(self._shared.segments) as txn:
            return {_U32.unpack(k)[0]: SegInfo.unpack(v) for k, v in txn.cursor()}

    def get_many(self, keys: Sequence[bytes]) -> list[Loc | None]:
        with self._shared.begin_read(self._shared.blocks) as txn:
            raws = [txn.get(k) for k in keys]
        return [None if r is None else Loc.unpack(r) for r in raws]

    def locs_in_segment(self, seg: int) -> list[tuple[bytes, Loc]]:
        """Every record of ``seg`` (a full scan; for the rare case the caller's view is stale)."""
        want = _U32.pack(seg)  # an entry's first field: filter on it before decoding
        with self._shared.begin_read(self._shared.blocks) as txn:
            return [(bytes(k), Loc.unpack(v)) for k, v in txn.cursor() if v[:4] == want]

    def segment(self, seg: int) -> SegInfo | None:
        with self._shared.begin_read(self._shared.segments) as txn:
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
        segments whose records they replaced.
        """
        with self.putting(records, expect) as done:
            pass
        return done

    @contextlib.contextmanager
    def putting(
        self, records: Sequence[tuple[bytes, Loc]], expect: Sequence[Loc | None] | None = None
    ) -> Iterator[tuple[list[bool], dict[int, SegInfo]]]:
        """:meth:`put` in a transaction that commits when the with-block ends, and is aborted
        if it raises: a writer makes its entries while its last chunks are still on their way to
        the disk, and commits once they are durable (``write_lock`` is held meanwhile). Yields
        what :meth:`put` returns, final once the block has ended without an exception."""
        sh = self._shared
        applied: list[bool] = []
        losers: set[int] = set()
        with self.write_lock, sh.env.begin(write=True) as txn:
            deltas: dict[int, list[int]] = {}
            registered: dict[int, bool] = {}
            cur = txn.cursor(db=sh.blocks)
            replace, unpack = cur.replace, Loc.unpack
            for i, (key, loc) in enumerate(records):
                ok = registered.get(loc.seg)
                if ok is None:
                    ok = registered[loc.seg] = txn.get(_seg_key(loc.seg), db=sh.segments) is not None
                if not ok:
                    applied.append(False)
                    continue
                packed = loc.pack()
                if expect is None:  # one descent of the tree: the old value comes back with the write
                    raw = replace(key, packed)
                    old = None if raw is None else unpack(raw)
                else:
                    raw = txn.get(key, db=sh.blocks)
                    old = None if raw is None else unpack(raw)
                    if old != expect[i]:
                        applied.append(False)
                        continue
                    txn.put(key, packed, db=sh.blocks)
                if old is not None:
                    _add(deltas, old, -1)
                    losers.add(old.seg)
                _add(deltas, loc, +1)
                applied.append(True)
            infos = self._apply_deltas(txn, deltas)
            yield applied, {seg: info for seg, info in infos.items() if seg in losers}

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
