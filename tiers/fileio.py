"""File I/O of the ``nvme`` tier's segments: page-aligned buffers, whole writes and reads that
survive short reads, the writers' ``flock``, the ``O_DIRECT`` probe and directory fsync."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvstrata.core import native
from kvstrata.core.buffers import Buffer, copy_bytes, host_bytes, is_device, is_torch
from kvstrata.tiers.files import DEFAULT_FILE_MODE, open_new
from kvstrata.tiers.records import ALIGN, RECORD_ALIGN, align_up

__all__ = [
    "AlignedBufferPool",
    "aligned_buffer",
    "copy_staged",
    "fsync_dir",
    "hash_at",
    "hash_records",
    "pread_into",
    "pread_or_error",
    "preadv_all",
    "probe_direct_io",
    "probe_memory_alignment",
    "pwrite_all",
    "pwritev_all",
    "record_addresses",
    "stage_in",
    "stage_out",
    "try_flock",
]


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (anonymous mmap), usable with ``O_DIRECT``."""
    return np.frombuffer(mmap.mmap(-1, max(align_up(nbytes), ALIGN)), dtype=np.uint8)


class AlignedBufferPool:
    """Reusable page-aligned I/O buffers of ``chunk`` bytes (larger requests get a one-off)."""

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


_ALIASED = 32  # a copy whose destination lies 1 to this many bytes past its source, modulo a page, is slow


def copy_staged(dst: Buffer, src: Buffer) -> None:
    """:func:`~kvstrata.core.buffers.copy_bytes` of a record into or out of a staging buffer,
    around a slow case of ``memcpy``.

    Staging buffers are page-aligned and so are the records in them; a caller's numpy array from
    ``malloc`` starts 16 bytes into a page. A copy whose destination sits 1 to 31 bytes past its
    source modulo 4096 (reading a record out to such an array) runs 2.5-3x slower in glibc's
    ``memcpy`` here (AMD EPYC: 4K aliasing of its ``rep movsb``); a uint8 -> int8 numpy cast,
    which copies the same bytes with a vector loop, runs at full speed there."""
    if is_device(dst) or is_device(src):
        copy_bytes(dst, src)
        return
    d, s = host_bytes(dst), host_bytes(src)
    if 0 < (d.ctypes.data - s.ctypes.data) % ALIGN < _ALIASED and d.nbytes == s.nbytes:
        np.copyto(d.view(np.int8), s, casting="unsafe")
    else:
        np.copyto(d, s, casting="no")


_NOT_HOST = (TypeError, ValueError, BufferError)  # a buffer the extension cannot take by buffer protocol


def _as_spans(bufs: Sequence[Buffer]) -> list[Buffer] | None:
    """``bufs`` with CPU torch tensors as (address, size) spans (torch has no buffer protocol);
    None when one is a device or strided tensor."""
    out = [_host_span(buf) if is_torch(buf) else buf for buf in bufs]
    return None if any(buf is None for buf in out) else out


def stage_in(
    stage: np.ndarray, positions: Sequence[int], bufs: Sequence[Buffer], lengths: Sequence[int], checksums: bool
) -> list[int] | None:
    """Copy records (host buffers or spans) into ``stage`` at ``positions``, each zeroed up to its
    :data:`RECORD_ALIGN` extent, in one call of the extension without the GIL; returns their
    xxh3_64 checksums (of the staged bytes) when ``checksums``, else ``[]``.

    None when the extension is not there or a buffer is not host memory it can take (a device
    tensor): nothing was copied, and the caller copies record by record. ``ValueError`` for a
    layout that does not fit ``stage`` (a caller's bug, never taken for a buffer to fall back on)."""
    mod = native.NATIVE
    if mod is None:
        return None
    offs = np.asarray(positions, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    ext = (lens + (RECORD_ALIGN - 1)) & ~(RECORD_ALIGN - 1)
    # the layout is the caller's: checked here, so that a ValueError below is only ever a buffer's
    if len(offs) != len(lens) or len(bufs) != len(lens):
        raise ValueError(f"{len(bufs)} records but {len(offs)} positions and {len(lens)} lengths")
    bad = np.flatnonzero((offs < 0) | (lens < 0) | (offs + ext > stage.nbytes))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"record {i}: position {int(offs[i])}, length {int(lens[i])} is outside a stage of {stage.nbytes} bytes"
        )
    sums = np.empty(len(lens), np.uint64) if checksums else None
    try:
        mod.stage_in(stage, offs, bufs, lens, ext, sums)
    except _NOT_HOST:
        spans = _as_spans(bufs)
        if spans is None:
            return None
        try:
            mod.stage_in(stage, offs, spans, lens, ext, sums)
        except _NOT_HOST:
            return None
    return [] if sums is None else sums.tolist()


def stage_out(
    stage: np.ndarray,
    positions: Sequence[int],
    bufs: Sequence[Buffer],
    lengths: Sequence[int],
    expect: Sequence[int] | None,
) -> np.ndarray | None:
    """Check records in ``stage`` against their xxh3_64 ``expect`` (None: no check) and copy the
    intact ones out to ``bufs``, in one call of the extension without the GIL. Returns a status
    per record: 1 copied, 0 corrupt (not copied), 2 intact but not copied (a destination the
    extension cannot take: the caller delivers it). None without the extension."""
    mod = native.NATIVE
    if mod is None:
        return None
    status = np.empty(len(positions), np.uint8)
    want = None if expect is None else np.asarray(expect, dtype=np.uint64)
    mod.stage_out(stage, np.asarray(positions, np.int64), bufs, np.asarray(lengths, np.int64), want, status)
    return status


def hash_records(
    bufs: Sequence[Buffer], lengths: Sequence[int], align: int = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """The xxh3_64 checksums and the addresses (uint64 arrays) of records in host memory, in one
    call of the extension without the GIL; None without the extension, where a record is not
    host memory of its length that it can take (a device tensor: the caller stages, and its
    staging reports a record of the wrong size), or, with ``align``, where a record's address is
    not a multiple of it (found before anything is hashed)."""
    mod = native.NATIVE
    if mod is None:
        return None
    lens = np.asarray(lengths, dtype=np.int64)
    if len(bufs) != len(lens):
        raise ValueError(f"{len(bufs)} records but {len(lens)} lengths")
    sums = np.empty(len(lens), np.uint64)
    addrs = np.empty(len(lens), np.uint64)
    try:
        hashed = mod.hash_records(bufs, lens, sums, addrs, align)
    except _NOT_HOST:
        spans = _as_spans(bufs)
        if spans is None:
            return None
        try:
            hashed = mod.hash_records(spans, lens, sums, addrs, align)
        except _NOT_HOST:
            return None
    return (sums, addrs) if hashed else None


def pwritev_all(fd: int, addrs: np.ndarray, lengths: np.ndarray, offset: int) -> None:
    """Write the memory at ``addrs`` (``lengths`` bytes each) one piece after another from
    ``offset`` (the extension's gathered write; the caller keeps that memory alive)."""
    mod = native.NATIVE
    assert mod is not None, "pwritev_all needs kvstrata._native: check hash_records first"
    mod.pwritev_all(fd, addrs, lengths, offset)


def record_addresses(bufs: Sequence[Buffer], lengths: Sequence[int], align: int) -> np.ndarray | None:
    """The address (uint64) of each record that is writable host memory of its length at a multiple
    of ``align`` (a buffer, a CPU torch tensor or an (address, size) span), 0 for any other (a device
    tensor, a read-only or strided buffer, another size); None without the extension."""
    mod = native.NATIVE
    if mod is None:
        return None
    lens = np.asarray(lengths, dtype=np.int64)
    addrs = np.empty(len(lens), np.uint64)
    mod.record_addresses([_host_span(buf) if is_torch(buf) else buf for buf in bufs], lens, addrs, align)
    return addrs


def _host_span(buf: Any) -> Buffer | None:
    """A CPU torch tensor as an (address, size) span; None (not host memory) for other tensors."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    return (buf.data_ptr(), buf.numel() * buf.element_size())


def preadv_all(fd: int, addrs: np.ndarray, lengths: np.ndarray, offset: int) -> int:
    """Fill the memory at ``addrs`` (``lengths`` bytes each) one piece after another from
    ``offset`` (the extension's scattered read; the caller keeps that memory alive). Returns the
    bytes read: fewer where the file ends, or where a read after a short one fails; ``OSError``
    when the first read fails."""
    mod = native.NATIVE
    assert mod is not None, "preadv_all needs kvstrata._native: check record_addresses first"
    return int(mod.preadv_all(fd, addrs, lengths, offset))


def hash_at(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The xxh3_64 (uint64) of the memory at each of ``addrs`` (``lengths`` bytes), without the GIL."""
    mod = native.NATIVE
    assert mod is not None, "hash_at needs kvstrata._native: check record_addresses first"
    sums = np.empty(len(addrs), np.uint64)
    mod.hash_at(addrs, lengths, sums)
    return sums


def probe_memory_alignment(directory: str, mode: int = DEFAULT_FILE_MODE) -> int:
    """The least memory alignment (8 .. :data:`ALIGN` bytes) at which ``directory`` takes an
    ``O_DIRECT`` write (the device's DMA alignment: 512 bytes on virtio disks, often 4 on NVMe
    with a recent kernel); 0 where ``O_DIRECT`` is refused outright."""
    path = os.path.join(directory, f".probe-align-{os.getpid()}-{threading.get_ident()}")
    os.close(open_new(path, os.O_WRONLY | os.O_TRUNC, mode))
    try:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return 0
        try:
            fd = os.open(path, os.O_WRONLY | flag)
        except OSError:
            return 0
        try:
            page = aligned_buffer(2 * ALIGN)
            for align in (8, 16, 64, 512, ALIGN):
                try:
                    pwrite_all(fd, page[align : align + ALIGN], 0)
                    return align
                except OSError:
                    continue
            return 0
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at offset {offset + done}")
        done += n


def pread_into(fd: int, out: np.ndarray, offset: int) -> int:
    """Fill ``out`` from ``offset``; returns the bytes read, fewer only where the file ends.

    A short read is not the end of the file (NFS, FUSE and signals cut reads short): reading goes
    on until ``out`` is full or a read returns nothing, and then the file's size (``fstat``)
    decides: a file that holds more is read again. ``OSError`` (EIO) when it keeps returning less
    than it holds, so that a caller never takes records it could not read for truncated ones."""
    view = out.data.cast("B")
    done = stalls = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:  # O_DIRECT refuses to go on from the unaligned end of a short read
            if exc.errno != errno.EINVAL or not (offset + done) % ALIGN:
                raise
            n = -1
        if n > 0:
            done += n
            continue
        size = os.fstat(fd).st_size
        if size <= offset + done:
            break  # the end of the file
        stalls += 1
        if stalls > _READ_STALLS:
            raise OSError(errno.EIO, f"reads stop at offset {offset + done} of a file of {size} bytes")
        if n < 0:
            done -= (offset + done) % ALIGN  # read that page again, from its start
    return done


_READ_STALLS = 8  # reads in a row that return nothing (or cannot go on) before a file that holds more is an error


def try_flock(fd: int, path: str | None = None) -> bool:
    """Take an exclusive, non-blocking ``flock``; False if a live writer holds it.

    With ``path``, also False (lock released) when ``path`` no longer names the locked file: it
    was unlinked (or replaced) between the open and the lock, e.g. by a sweep of a new file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    if path is None:
        return True
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    mine = os.fstat(fd)
    if st is None or (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def probe_direct_io(directory: str, mode: int = DEFAULT_FILE_MODE) -> bool:
    """Whether ``directory`` accepts an ``O_DIRECT`` aligned write. ``OSError`` if it is not writable."""
    path = os.path.join(directory, f".probe-{os.getpid()}-{threading.get_ident()}")
    buffered = open_new(path, os.O_WRONLY | os.O_TRUNC, mode)
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
