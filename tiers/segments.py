"""On-disk format of the ``nvme`` tier: segment files, record locations and the LMDB index.

A *segment* is a large append-only file ``segments/<writer-id>-<seq>.seg``. Every
layer-block is one *record*: its bytes at a 4096-aligned offset, padded to a multiple
of 4096. Records carry no header; the LMDB index (``index.lmdb``) is the only source
of truth for what a segment holds:

* db ``blocks``:   ``key (16 B) + layer (u16 BE)`` -> :class:`Loc` (segment id, offset,
  length, xxh3_64 checksum), packed with :mod:`struct`.
* db ``segments``: ``segment id (u32 BE)`` -> :class:`SegInfo` (live bytes, live
  records, file name). The live counters change in the same transaction as the
  ``blocks`` entries, so they are exact across processes.
* db ``meta``:     the next segment id.

Writers hold an exclusive ``flock`` on their active segment for as long as they may
append to it; a segment whose lock can be taken has no live writer ("sealed") and
may be compacted or removed by whoever holds its lock.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import lmdb
import numpy as np
import xxhash

from kvstrata.engine.buffers import copy_bytes
from kvstrata.engine.keys import Key, Namespace
from kvstrata.engine.layout import KVLayout
from kvstrata.errors import ConfigError, LayoutMismatchError
from kvstrata.tiers.base import BlockId

ALIGN = 4096
FORMAT_VERSION = 1
SEGMENT_SUFFIX = ".seg"
KEY_BYTES = 16

_LOC = struct.Struct(">IQIQ")
_SEG = struct.Struct(">QQ")
_U32 = struct.Struct(">I")
_NEXT_SEGMENT = b"next_segment"


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def block_key(bid: BlockId) -> bytes:
    """The 18-byte index key of a layer-block; ``ValueError`` for a malformed id."""
    key, layer = bid
    layer = int(layer)
    if not isinstance(key, bytes) or len(key) != KEY_BYTES or not 0 <= layer < 1 << 16:
        raise ValueError(f"bad block id {bid!r}")
    return key + layer.to_bytes(2, "big")


def parse_block_key(raw: bytes) -> BlockId:
    return Key(raw[:KEY_BYTES]), int.from_bytes(raw[KEY_BYTES:], "big")


class Loc(NamedTuple):
    """Where a record lives."""

    seg: int
    offset: int
    length: int
    checksum: int

    @property
    def padded(self) -> int:
        return align_up(self.length)

    def pack(self) -> bytes:
        return _LOC.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> Loc:
        return cls(*_LOC.unpack(raw))


class SegInfo(NamedTuple):
    """A segment's file name and live counters (bytes count whole padded records)."""

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


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (anonymous mmap), usable with ``O_DIRECT``."""
    return np.frombuffer(mmap.mmap(-1, max(align_up(nbytes), ALIGN)), dtype=np.uint8)


class StagingPool:
    """Reusable aligned staging buffers of ``chunk`` bytes (larger requests get a one-off)."""

    def __init__(self, chunk: int, keep: int = 4) -> None:
        self.chunk = align_up(chunk)
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self, nbytes: int) -> Iterator[np.ndarray]:
        if nbytes > self.chunk:
            yield aligned_buffer(nbytes)
            return
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = aligned_buffer(self.chunk)
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buf)


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at offset {offset + done}")
        done += n


def pread_into(fd: int, out: np.ndarray, offset: int) -> int:
    """Fill ``out`` from ``offset``; returns the bytes read (less only at end of file)."""
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        done += max(n, 0)
        if n <= 0 or n % ALIGN:  # end of file (an unaligned retry would fail under O_DIRECT)
            break
    return done


def try_flock(fd: int) -> bool:
    """Take an exclusive, non-blocking ``flock``; False if a live writer holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def probe_direct_io(directory: str) -> bool:
    """Whether ``directory`` accepts an ``O_DIRECT`` aligned write. ``OSError`` if it is not writable."""
    path = os.path.join(directory, f".probe-{os.getpid()}-{threading.get_ident()}")
    buffered = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.close(buffered)
    try:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        try:
            fd = os.open(path, os.O_WRONLY | flag)
        except OSError:
            return False
        try:
            pwrite_all(fd, aligned_buffer(ALIGN), 0)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True
    finally:
        os.unlink(path)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_or_error(fd: int, out: np.ndarray, offset: int) -> int:
    """Like :func:`pread_into`, but -1 for an I/O error."""
    try:
        return pread_into(fd, out, offset)
    except OSError:
        return -1


def checksum(data: np.ndarray) -> int:
    """xxh3_64 of a contiguous uint8 array."""
    return xxhash.xxh3_64_intdigest(data.data)


def pack_record(dst: np.ndarray, buf: Any, n: int) -> int:
    """Copy one record (numpy array or torch tensor, host or device) into its padded
    staging slot ``dst``; returns its checksum."""
    copy_bytes(dst[:n], buf)
    dst[n:] = 0
    return checksum(dst[:n])


def plan_runs(locs: Sequence[tuple[int, Loc]], max_bytes: int, max_gap: int = 0) -> list[list[tuple[int, Loc]]]:
    """Group (tag, loc) pairs of ONE segment into runs that one read can cover."""
    runs: list[list[tuple[int, Loc]]] = []
    end = start = -1
    for item in sorted(locs, key=lambda t: t[1].offset):
        loc = item[1]
        if runs and 0 <= loc.offset - end <= max_gap and loc.offset + loc.padded - start <= max_bytes:
            runs[-1].append(item)
        else:
            runs.append([item])
            start = loc.offset
        end = max(end, loc.offset + loc.padded)
    return runs


def run_span(run: Sequence[tuple[int, Loc]]) -> tuple[int, int]:
    """(first offset, bytes) that one read of a run covers."""
    first = run[0][1].offset
    return first, max(loc.offset + loc.padded for _, loc in run) - first


def write_chunks(lengths: Sequence[int], base: int, limit: int) -> list[tuple[int, int, int, int]]:
    """Split consecutive records into write chunks ``(first, end, file offset, bytes)`` of at most ``limit`` bytes."""
    out: list[tuple[int, int, int, int]] = []
    lo, offset, nb = 0, base, 0
    for i, n in enumerate(lengths):
        if nb and nb + align_up(n) > limit:
            out.append((lo, i, offset, nb))
            lo, offset, nb = i, offset + nb, 0
        nb += align_up(n)
    out.append((lo, len(lengths), offset, nb))
    return out


# -- the namespace directory -------------------------------------------------------------------


def prepare_root(path: str, layout: KVLayout, namespace: Namespace) -> str:
    """Create ``<path>/<namespace fingerprint>/segments`` and check or write ``meta.json``.

    ``ConfigError`` (naming the path) when ``path`` cannot hold the tier;
    ``LayoutMismatchError`` when ``meta.json`` describes other data."""
    base = os.path.expandvars(os.path.expanduser(path))
    if os.path.exists(base) and not os.path.isdir(base):
        raise ConfigError(f"nvme tier path {base!r} exists and is not a directory", field="path", value=path)
    root = os.path.join(base, namespace.fingerprint)
    try:
        os.makedirs(os.path.join(root, "segments"), exist_ok=True)
        _check_meta(root, layout, namespace)
    except OSError as exc:
        raise ConfigError(
            f"nvme tier path {base!r} is not usable: {exc.strerror or exc}", field="path", value=path
        ) from exc
    return root


def _check_meta(root: str, layout: KVLayout, namespace: Namespace) -> None:
    meta = {"format": FORMAT_VERSION, "layout": layout.to_dict(), "namespace": namespace.canonical()}
    expected = json.loads(json.dumps(meta))
    path = os.path.join(root, "meta.json")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                stored = json.load(f)
        except ValueError as exc:
            raise LayoutMismatchError(f"{path}: unreadable ({exc}); refusing to serve its data") from exc
        if stored != expected:
            raise LayoutMismatchError(f"{path}: stored layout/namespace/format differs from this engine's")
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


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


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str, map_size: int) -> _SharedEnv:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is None:
            env = lmdb.open(path, max_dbs=4, map_size=map_size, subdir=True, lock=True)
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
    """

    def __init__(self, path: str, map_size: int) -> None:
        self.path = path
        self._shared = _acquire_env(path, map_size)
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
        (compare-and-swap, for compaction). Returns which records were applied and the
        updated counters of the segments whose records were replaced.
        """
        sh = self._shared
        applied: list[bool] = []
        losers: set[int] = set()
        with self.write_lock, sh.env.begin(write=True) as txn:
            deltas: dict[int, list[int]] = {}
            for i, (key, loc) in enumerate(records):
                raw = txn.get(key, db=sh.blocks)
                old = None if raw is None else Loc.unpack(raw)
                if expect is not None and old != expect[i]:
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
    d[0] += sign * loc.padded
    d[1] += sign
