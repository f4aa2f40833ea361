"""Copies of host memory by address: runs merged, moved by ``memmove`` without the GIL, on a few threads.

The ``memmove`` calls are one call per batch (or per piece a thread takes) into
:mod:`kvstrata._native` when it is built (see :mod:`kvstrata.core.native`), else one
``ctypes.memmove`` per run (~0.3 us of argument work each). The extension's copies of 32 KiB and
more use non-temporal stores (a tier's slot or a restored KV cache is memory no cache holds and
the CPU does not read next: 1.2-1.6x glibc's copy into such memory here), and those glibc would
run slowly (a destination 1-31 bytes past its source modulo a page, from 2 KiB up to a core's L2:
4K aliasing of ``rep movsb`` on AMD, 5-8x slower) take a loop of its own (``move_bytes`` in
``core/_native.c``).

A batch of layer-blocks is a list of (destination address, source address, size) copies.
:func:`merge_runs` merges neighbours that are adjacent on both sides (a layer's rows in a
caller's array, slots allocated together in an arena) into runs, with numpy for large batches so
a batch costs a few microseconds, not a Python step per block. A :class:`Copy` cuts the runs
into pieces that the copy threads and the calling thread take in turn (whoever is free takes the
next piece), so a caller with bookkeeping to do starts the copy first and joins in after, and a
caller is never left waiting for a thread that has not started while pieces remain.

Two pools: one for loads (someone waits), one for stores (``background``), so a load never
queues behind a store's copy: with one shared pool a 512 MiB store into fresh memory made a
50 ms DRAM load take ~0.9 s. Store threads keep normal priority: at nice 10 they starved beside
vLLM's compute threads, and a later load of those blocks waited for the store (vLLM TTFT
benchmark: a DRAM restore took 1.19 s instead of 0.67 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstrata.core import native

__all__ = [
    "COPY_THREADS_ENV",
    "Copy",
    "Run",
    "copy_runs",
    "copy_threads",
    "int64_array",
    "merge_runs",
    "move_runs",
    "set_copy_threads",
    "square_runs",
    "using_copy_threads",
]

Run = tuple[int, int, int]  # (destination address, source address, size)

#: Below this many bytes a batch is copied by the calling thread alone (a hand-off to another
#: thread costs ~20-50 us; 4 MiB take ~200-400 us at 10-20 GB/s).
PARALLEL_MIN_BYTES = 4 * 1024 * 1024
#: Threads that copy one batch, the calling thread included: memory bandwidth, not cores, is the
#: limit, and 2-4 threads reach it on the machines measured (README, "Benchmarks"); see
#: :func:`copy_threads`.
COPY_THREADS = 4
#: Pieces the threads take in turn: about four per thread, and no smaller than this.
PIECE_MIN_BYTES = 1024 * 1024
MERGE_VECTOR_MIN = 32  # from this many copies on, runs are found with numpy instead of a Python loop

_POOLS: dict[bool, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (a container's share)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_CPUS = _usable_cpus()
#: The environment variable that sets the copy threads of this process (``auto`` or 1..64).
COPY_THREADS_ENV = "KVSTRATA_COPY_THREADS"
MAX_COPY_THREADS = 64


def _threads_setting(value: str | None) -> int | None:
    """``KVSTRATA_COPY_THREADS`` read: None for unset or ``auto``, else a thread count."""
    text = (value or "").strip().lower()
    if text in ("", "auto"):
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_COPY_THREADS:
        raise ValueError(f"{COPY_THREADS_ENV} must be auto or a whole number 1..{MAX_COPY_THREADS}, got {value!r}")
    return n


_SET: int | None = _threads_setting(os.environ.get(COPY_THREADS_ENV))


def copy_threads() -> int:
    """Threads one large copy uses, the calling thread included. Set by ``KVSTRATA_COPY_THREADS``
    or :func:`set_copy_threads`; by default (``auto``) at most :data:`COPY_THREADS` and at most
    half the CPUs (the inference engine needs the rest; on a busy 2-core machine two copy threads
    moved less than one, 2.6 against 3.9 GB/s). On a quiet 2-core machine 2 threads move
    1.1-1.3x what one does: ``kvstrata bench`` measures both."""
    if _SET is not None:
        return _SET
    return max(1, min(COPY_THREADS, _CPUS // 2))


def set_copy_threads(threads: int | None) -> None:
    """Set this process's copy threads (None: ``auto``). The pools are made anew at their next use;
    copies running now finish on the old ones."""
    global _SET
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= MAX_COPY_THREADS):
        raise ValueError(f"copy threads must be None (auto) or 1..{MAX_COPY_THREADS}, got {threads!r}")
    with _POOL_LOCK:
        _SET = threads
        old = list(_POOLS.values())
        _POOLS.clear()
    for pool in old:
        pool.shutdown(wait=False)  # its queued work still runs; the threads end after it


@contextlib.contextmanager
def using_copy_threads(threads: int | None) -> Iterator[None]:
    """:func:`set_copy_threads` for the ``with`` block, then the setting before it."""
    before = _SET
    set_copy_threads(threads)
    try:
        yield
    finally:
        set_copy_threads(before)


def copy_pool(background: bool = False) -> ThreadPoolExecutor:
    """The copy threads of loads (``background=False``) or of stores."""
    with _POOL_LOCK:
        pool = _POOLS.get(background)
        if pool is None:
            pool = ThreadPoolExecutor(
                max(1, copy_threads() - 1),  # the calling thread copies too
                thread_name_prefix="kvstrata-copy-bg" if background else "kvstrata-copy",
            )
            _POOLS[background] = pool
        return pool


Addresses = Sequence[int] | np.ndarray


def merge_runs(dst: Addresses, src: Addresses, sizes: Addresses | int) -> list[Run]:
    """Copies of ``sizes[i]`` bytes ``src[i] -> dst[i]`` as runs, neighbours adjacent on both sides
    merged. Lists, ranges or int64 arrays of one length; ``sizes`` may be one size for all."""
    n = len(dst)
    if len(src) != n or (not isinstance(sizes, int) and len(sizes) != n):
        raise ValueError(f"{n} destinations for {len(src)} sources")
    if isinstance(sizes, int) and n and _contiguous(dst, sizes) and _contiguous(src, sizes):
        return [(int(dst[0]), int(src[0]), n * sizes)]  # usual: a layer's rows into (or from) slots taken together
    if n < MERGE_VECTOR_MIN:
        runs: list[list[int]] = []
        each = itertools.repeat(sizes) if isinstance(sizes, int) else sizes
        for d, s, k in zip(dst, src, each, strict=False):  # ``each`` may repeat one size
            if runs:
                last = runs[-1]
                if last[0] + last[2] == d and last[1] + last[2] == s:
                    last[2] += k
                    continue
            runs.append([int(d), int(s), int(k)])
        return [(r[0], r[1], r[2]) for r in runs]
    d_arr = int64_array(dst)
    s_arr = int64_array(src)
    if isinstance(sizes, int):
        breaks = (d_arr[:-1] + sizes != d_arr[1:]) | (s_arr[:-1] + sizes != s_arr[1:])
        starts = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(breaks) + 1))
        lengths = np.diff(np.append(starts, n)) * sizes
    else:
        k_arr = int64_array(sizes)
        step = k_arr[:-1]
        breaks = (d_arr[:-1] + step != d_arr[1:]) | (s_arr[:-1] + step != s_arr[1:])
        starts = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(breaks) + 1))
        lengths = np.add.reduceat(k_arr, starts)
    return list(zip(d_arr[starts].tolist(), s_arr[starts].tolist(), lengths.tolist(), strict=True))


def square_runs(rows: Sequence[Addresses], slots: np.ndarray, size: int, to_slots: bool) -> list[Run]:
    """The runs of a keys x layers batch: ``rows[j]``, the caller's addresses of layer ``j``
    (one per key), and ``slots[j]`` (an int64 ``[layers, keys]`` array), the arena's addresses of
    the same blocks; ``to_slots``: rows -> slots (a store), else slots -> rows (a load). Where each
    layer is one run on both sides (a caller's array of rows, slots taken together) the runs come
    from one comparison over the whole block, not from merging every block's copy."""
    n = slots.shape[1]
    if (
        n
        and all(type(r) is range and (r.step == size or n < 2) for r in rows)
        and (n < 2 or bool((slots[:, 1:] - slots[:, :-1] == size).all()))
    ):
        starts = slots[:, 0].tolist()
        pairs = zip(starts, (r.start for r in rows), strict=True)  # type: ignore[union-attr]
        return [(s, r, n * size) if to_slots else (r, s, n * size) for s, r in pairs]
    mine = np.concatenate([int64_array(r) for r in rows])
    theirs = slots.ravel()
    return merge_runs(theirs, mine, size) if to_slots else merge_runs(mine, theirs, size)


def _contiguous(addresses: Addresses, size: int) -> bool:
    """Whether ``addresses`` step by ``size`` (a range says so without looking at its values)."""
    if isinstance(addresses, range):
        return addresses.step == size or len(addresses) < 2
    if len(addresses) < 2:
        return True
    arr = int64_array(addresses)
    return bool(arr[-1] - arr[0] == (len(arr) - 1) * size and (np.diff(arr) == size).all())


def int64_array(values: Addresses) -> np.ndarray:
    """``values`` as an int64 array (a range without a Python step per value)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    if isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    return np.fromiter(values, np.int64, len(values))


def _pieces(runs: list[Run], total: int, threads: int) -> list[Run]:
    piece = max(PIECE_MIN_BYTES, -(-total // (4 * threads)))
    out: list[Run] = []
    for d, s, n in runs:
        if n <= piece:
            out.append((d, s, n))
            continue
        out.extend((d + o, s + o, min(piece, n - o)) for o in range(0, n, piece))
    return out


class Copy:
    """Runs being copied: started at construction (on the pool's threads when the batch is large),
    finished by :meth:`finish`, where the calling thread takes pieces too and then waits for the
    pieces others took. A small batch is all copied in :meth:`finish`, by the calling thread."""

    __slots__ = ("_done", "_left", "_lock", "_next", "_pieces")

    def __init__(self, runs: list[Run], background: bool = False) -> None:
        self._pieces = runs
        self._lock: threading.Lock | None = None
        total = sum(r[2] for r in runs) if len(runs) > 1 else (runs[0][2] if runs else 0)
        threads = copy_threads()
        if total < PARALLEL_MIN_BYTES or threads < 2:
            return
        self._pieces = pieces = _pieces(runs, total, threads)
        self._next = itertools.count()  # next() on a count is atomic under the GIL
        self._left = len(pieces)
        self._lock = threading.Lock()
        self._done = threading.Event()
        pool = copy_pool(background)
        try:
            for _ in range(min(threads - 1, len(pieces) - 1)):
                pool.submit(self._work)
        except RuntimeError:  # the pool was shut down by set_copy_threads just now: the caller copies the rest
            pass

    def _work(self) -> None:
        pieces = self._pieces
        n = len(pieces)
        ext = native.NATIVE
        move = ctypes.memmove  # a C call that releases the GIL while it copies
        lock = self._lock
        assert lock is not None
        for i in self._next:
            if i >= n:
                return
            if ext is not None:
                ext.memmove_runs(pieces, i, i + 1)  # the GIL released too, without ctypes' argument work
            else:
                d, s, k = pieces[i]
                move(d, s, k)
            with lock:
                self._left -= 1
                if not self._left:
                    self._done.set()

    def finish(self) -> None:
        """Copy what no thread took yet, then wait until every piece is copied."""
        if self._lock is None:
            _memmove_all(self._pieces)
            return
        self._work()
        self._done.wait()


def _memmove_all(runs: Sequence[Run]) -> None:
    ext = native.NATIVE
    if ext is not None:
        ext.memmove_runs(runs)  # one call for the batch, the GIL released while it copies
        return
    move = ctypes.memmove
    for d, s, k in runs:
        move(d, s, k)


def move_runs(runs: list[Run], background: bool = False) -> None:
    """Copy ``runs`` now (see :class:`Copy`)."""
    Copy(runs, background).finish()


def copy_runs(dst: Addresses, src: Addresses, sizes: Addresses | int, background: bool = False) -> None:
    """Copy ``sizes[i]`` bytes from host address ``src[i]`` to ``dst[i]``, merged into runs."""
    move_runs(merge_runs(dst, src, sizes), background)
