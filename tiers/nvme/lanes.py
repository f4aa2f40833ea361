"""How one read or write call spreads its chunks over threads: a pipeline of CPU work and I/O.

A call's chunks (runs of records to read, staging chunks to write) each pass through up to three
steps: ``before`` (CPU: for a write, copy the records into a staging buffer, checksum them, pack
their headers), ``io`` (the ``pwrite``/``pread`` of that buffer) and ``after`` (CPU: for a read,
check the records and copy them out). I/O threads (``depth`` of them, from the tier's pool) do
nothing but ``io``, one chunk after another; CPU workers (the calling thread and ``cpu - 1`` pool
threads) do the ``before``/``after`` steps. Staging buffers go round between them through queues,
``depth + cpu + 1`` of them, so an I/O thread finds its next buffer staged (or free) when its
last ``pwrite``/``pread`` returns, and the disk sees ``depth`` requests in flight all the time.
An I/O thread with nothing left to read helps deliver the runs read last (the call's tail).

What this replaced: *lanes*, in which each of ``depth + 1`` threads did all of a chunk's work and
held one of ``depth`` I/O slots (a semaphore) around its I/O. On 2 cores the disk went idle
between chunks: a lane that had finished its copy waited 1.5-5 ms for the slot another lane had
just released (the waiter needs the GIL and a core while two lanes copy; a Python semaphore lets
the releasing lane take the slot back first), so a 256 MiB read spent ~10% of its time with one
read or none in flight. Here the thread that finishes an I/O starts the next one itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, wait
from typing import Generic, TypeVar

import numpy as np

R = TypeVar("R")

__all__ = ["Pipeline", "cpu_workers"]

_STOP = -1
_EARLY = -2  # the buffer index of an early part of a chunk (see Pipeline.early)


def cpu_workers(depth: int) -> int:
    """CPU workers for a call: the cores that the ``depth`` I/O threads leave, at least one (the
    caller) and at most ``depth`` (more than that outruns the disk)."""
    return max(1, min(depth, (os.cpu_count() or 1) - depth))


class Pipeline(Generic[R]):
    """Chunks through ``before`` -> ``io`` -> ``after`` (see the module docstring).

    ``before(k, buf)`` returns chunk ``k``'s result (None where there is no ``before``); ``io(k, buf)``
    returns what ``after(k, buf, got)`` is handed. :meth:`run` does ``count`` chunks and returns
    their results in chunk order; or :meth:`start`, :meth:`feed` chunks as the caller has them
    ready (a read plans its later runs while the first ones are on the disk), then :meth:`finish`.
    Either returns once every thread has stopped, so the caller may reuse the buffers; the first
    exception any step raises stops the rest (no new chunk is started) and is raised there."""

    def __init__(
        self,
        pool: Executor,
        buffers: list[np.ndarray],
        depth: int,
        cpu: int,
        io: Callable[[int, np.ndarray], int],
        before: Callable[[int, np.ndarray], R] | None = None,
        after: Callable[[int, np.ndarray, int], None] | None = None,
    ) -> None:
        self.pool, self.buffers, self.depth, self.cpu = pool, buffers, max(1, depth), max(1, cpu)
        self.io, self.before, self.after = io, before, after
        self.failed: list[BaseException] = []
        self.results: dict[int, R] = {}
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for b in range(len(buffers)):
            self.free.put(b)
        self.jobs: queue.SimpleQueue[int] = queue.SimpleQueue()  # chunks fed, for the first step
        # (chunk, buffer, None) for io; (chunk, _EARLY, fn) for an early part of a chunk (see early)
        self.staged: queue.SimpleQueue[tuple[int, int, Callable[[], object] | None]] = queue.SimpleQueue()
        self.read: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()  # (chunk, buffer, got) for after
        self.io_left = self.depth  # I/O threads still running (the last one stops the after-workers)
        self.io_lock = threading.Lock()
        self.threads: list[Future[None]] = []
        self.helpers: list[Future[None]] = []

    def run(self, count: int, staged: Callable[[list[R | None]], None] | None = None) -> list[R | None]:
        """``staged``: called with the results in order once every chunk's ``before`` step is done,
        on the calling thread, while the last chunks' I/O still runs (a write makes its index
        entries there); an exception it raises fails the run like any step's."""
        self.start()
        try:
            self.feed(range(count))
        finally:
            self.finish(lambda: staged([self.results.get(k) for k in range(count)]) if staged else None)
        return [self.results.get(k) for k in range(count)]

    def start(self) -> None:
        self.threads = [self.pool.submit(self._io_worker) for _ in range(self.depth)]
        self.helpers = [self.pool.submit(self._cpu_worker) for _ in range(self.cpu - 1)]

    def feed(self, chunks: Iterable[int]) -> None:
        for k in chunks:
            self.jobs.put(k)

    def early(self, k: int, fn: Callable[[], object]) -> None:
        """From chunk ``k``'s ``before`` step: have an I/O thread run ``fn`` now (the I/O of the
        part of ``k``'s buffer staged so far), while the rest is staged; ``k``'s ``io`` step still
        follows (for the rest), maybe on another I/O thread at the same time. A write's first
        chunk goes to the disk this way before all of it is packed."""
        self.staged.put((k, _EARLY, fn))

    def finish(self, staged: Callable[[], None] | None = None) -> None:
        """No more chunks: the caller works as a CPU worker until all is done; raises the first
        failure. Also after an exception of the caller's own between :meth:`start` and here.
        ``staged``: see :meth:`run`."""
        for _ in range(self.cpu if self.before is not None else self.depth):  # whoever takes fed chunks
            self.jobs.put(_STOP)
        try:
            self._cpu_worker()
            if self.before is not None:  # every chunk is staged (or given up): the I/O threads stop
                wait(self.helpers)
                for _ in range(self.depth):
                    self.staged.put((_STOP, _STOP, None))
                if staged is not None and not self.failed:
                    try:
                        staged()
                    except BaseException as exc:
                        self._fail(exc)
        finally:
            wait([*self.helpers, *self.threads])
        if self.failed:
            raise self.failed[0]

    def _next(self) -> int:
        k = self.jobs.get()
        return _STOP if self.failed else k

    def _fail(self, exc: BaseException) -> None:
        self.failed.append(exc)

    def _cpu_worker(self) -> None:
        if self.before is not None:  # a write: stage chunks in order, hand them to the I/O threads
            while (k := self._next()) != _STOP:
                b = self.free.get()
                try:
                    self.results[k] = self.before(k, self.buffers[b])
                except BaseException as exc:
                    self._fail(exc)
                    self.free.put(b)
                    return
                self.staged.put((k, b, None))
        elif self.after is not None:  # a read: take what the I/O threads read
            while True:
                k, b, got = self.read.get()
                if k == _STOP:
                    return
                try:
                    if not self.failed:
                        self.after(k, self.buffers[b], got)
                except BaseException as exc:
                    self._fail(exc)
                finally:
                    self.free.put(b)

    def _io_worker(self) -> None:
        if self.before is not None:
            self._io_staged()
            return
        try:
            self._io_in_order()
        finally:
            with self.io_lock:
                self.io_left -= 1
                last = self.io_left == 0
            if last:  # no more reads: every after-worker (these I/O threads too) stops
                for _ in range(self.cpu + self.depth):
                    self.read.put((_STOP, _STOP, 0))
        if self.after is not None:  # nothing left to read: help deliver what was read (the tail)
            self._cpu_worker()

    def _io_staged(self) -> None:
        while True:
            k, b, fn = self.staged.get()
            if k == _STOP:
                return
            if fn is not None:  # an early part: the buffer stays with its chunk
                try:
                    if not self.failed:
                        fn()
                except BaseException as exc:
                    self._fail(exc)
                continue
            try:
                if not self.failed:
                    self.io(k, self.buffers[b])
            except BaseException as exc:
                self._fail(exc)
            finally:
                self.free.put(b)

    def _io_in_order(self) -> None:
        while (k := self._next()) != _STOP:
            b = self.free.get()
            try:
                got = self.io(k, self.buffers[b])
            except BaseException as exc:
                self._fail(exc)
                self.free.put(b)
                return
            if self.after is None:
                self.free.put(b)
            else:
                self.read.put((k, b, got))
