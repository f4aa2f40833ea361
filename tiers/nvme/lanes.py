"""Lanes: how one read or write call spreads its chunks over threads.

A call's chunks (runs of records to read, staging chunks to write) are taken in order by
``lanes`` workers (the calling thread and ``lanes - 1`` I/O threads), each with a staging buffer
of its own. A worker does all of a chunk's work: for a write, copy the records in, checksum them,
pack their headers, ``pwrite``; for a read, ``pread``, check, copy the records out. Only the
``pwrite``/``pread`` holds one of the call's ``depth`` I/O slots, so ``depth`` chunks are on their
way to or from the disk while the other lanes copy and checksum (numpy copies and xxh3/BLAKE3 let
go of the GIL): the disk sees the queue depth it would get from ``depth`` threads doing nothing
but I/O, and no single thread copies every byte.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import TypeVar

R = TypeVar("R")

__all__ = ["in_lanes"]


def in_lanes(
    pool: Executor,
    count: int,
    lanes: int,
    depth: int,
    job: Callable[[int, int, threading.Semaphore], R],
) -> list[R]:
    """``[job(k, lane, io_slots) for k in range(count)]``, run on up to ``lanes`` workers (the caller
    is lane 0); ``io_slots`` is a semaphore of ``depth`` that a job holds around its I/O.

    Returns once every worker has stopped (so the caller may reuse the lanes' buffers). The first
    exception a job raises stops the others from taking more chunks and is raised here."""
    lanes = max(1, min(lanes, count))
    io_slots = threading.Semaphore(depth)
    results: list[R | None] = [None] * count
    taken = iter(range(count))
    take = threading.Lock()
    failed: list[BaseException] = []

    def worker(lane: int) -> None:
        while not failed:
            with take:
                k = next(taken, None)
            if k is None:
                return
            try:
                results[k] = job(k, lane, io_slots)
            except BaseException as exc:
                failed.append(exc)
                raise

    helpers: Sequence[Future[None]] = [pool.submit(worker, lane) for lane in range(1, lanes)]
    try:
        worker(0)
    except BaseException:
        pass  # kept in ``failed``; the helpers stop at their next chunk
    finally:
        wait(helpers)
    if failed:
        raise failed[0]
    return results  # type: ignore[return-value]  # every slot filled: no job failed
