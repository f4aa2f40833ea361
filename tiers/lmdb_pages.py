"""Which pages of an LMDB data file are free, read from the file itself (py-lmdb does not expose
LMDB's free list).

LMDB counts every page it ever allocated in the meta page's ``last_pgno``, but writes only the
pages a transaction leaves in use: pages a write transaction allocated past the end of the file
and freed again before its commit go onto the free list unwritten. So ``data.mdb`` may end
before ``last_pgno`` while nothing references the pages it lacks (seen under a kill -9 of a
writer: 3 free pages past the end). A file that is really truncated lacks pages that are in use,
and an mmap read of them is a SIGBUS: :func:`pages_past_end_are_free` tells the two apart.

The format (LMDB 0.9, 64-bit): a page starts with ``pgno: u64, pad: u16, flags: u16, lower: u16,
upper: u16``; pages 0 and 1 are the two meta pages (the newer transaction id is current); a node
is ``lo: u16, hi: u16, flags: u16, ksize: u16`` then the key and the data; the free database (dbi
0) maps a transaction id to a list of page numbers (``count: u64`` then the numbers).
"""

from __future__ import annotations

import os
import struct

__all__ = ["pages_past_end_are_free"]

_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_DB = struct.Struct("<IHHQQQQQ")  # pad (the page size in the free db), flags, depth, 4 counters, root
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_P_BRANCH, _P_LEAF, _P_META = 0x01, 0x02, 0x08
_F_BIGDATA = 0x01
_NO_PAGE = 0xFFFF_FFFF_FFFF_FFFF
_MAX_DEPTH = 32


class _Unreadable(Exception):
    pass


def _meta(fd: int, psize: int, n: int) -> tuple[int, int, int]:
    """(txnid, last_pgno, free-db root) of meta page ``n``."""
    raw = os.pread(fd, psize, n * psize)
    if len(raw) < _HEADER.size + 24 + 2 * _DB.size + 16 or not _HEADER.unpack_from(raw)[2] & _P_META:
        raise _Unreadable(f"meta page {n}")
    free_root = _DB.unpack_from(raw, _HEADER.size + 24)[7]
    last_pgno, txnid = struct.unpack_from("<QQ", raw, _HEADER.size + 24 + 2 * _DB.size)
    return txnid, last_pgno, free_root


def _free_pages(fd: int, psize: int, pgno: int, end: int, out: set[int], depth: int = 0) -> None:
    """Add the page numbers listed in the free-db subtree at ``pgno`` to ``out``."""
    if pgno >= end or depth > _MAX_DEPTH:
        raise _Unreadable(f"free-list page {pgno}")
    page = os.pread(fd, psize, pgno * psize)
    _, _, flags, lower, _ = _HEADER.unpack_from(page)
    for i in range(max(0, (lower - _HEADER.size) // 2)):
        (at,) = struct.unpack_from("<H", page, _HEADER.size + 2 * i)
        lo, hi, nflags, ksize = _NODE.unpack_from(page, at)
        if flags & _P_BRANCH:
            _free_pages(fd, psize, lo | hi << 16 | nflags << 32, end, out, depth + 1)
            continue
        if not flags & _P_LEAF:
            raise _Unreadable(f"free-list page {pgno} is neither branch nor leaf")
        size, data = lo | hi << 16, at + _NODE.size + ksize
        if nflags & _F_BIGDATA:  # the list is on overflow pages
            (first,) = struct.unpack_from("<Q", page, data)
            if first + (size + _HEADER.size + psize - 1) // psize > end:
                raise _Unreadable(f"free-list overflow page {first}")
            raw = os.pread(fd, size, first * psize + _HEADER.size)
        else:
            raw = page[data : data + size]
        (count,) = struct.unpack_from("<Q", raw)
        out.update(struct.unpack_from(f"<{count}Q", raw, 8))


def pages_past_end_are_free(path: str, psize: int, txnid: int) -> bool:
    """Whether every page that transaction ``txnid``'s meta counts but ``path`` (a data.mdb)
    lacks is on that transaction's free list. The caller holds a read transaction of ``txnid``,
    so its free list stays as it is; False also when the file cannot be read as LMDB."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size // psize
        metas = {m[0]: m for m in (_meta(fd, psize, 0), _meta(fd, psize, 1))}
        if txnid not in metas:
            return False  # two commits since the caller's snapshot: it is not on disk any more
        _, last_pgno, free_root = metas[txnid]
        if last_pgno < end:
            return True
        free: set[int] = set()
        if free_root != _NO_PAGE:
            _free_pages(fd, psize, free_root, end, free)
        return all(p in free for p in range(end, last_pgno + 1))
    except (_Unreadable, struct.error, OSError):
        return False
    finally:
        os.close(fd)
