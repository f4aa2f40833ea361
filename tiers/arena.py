"""The memory tiers' slot arena: fixed-size slots carved out of one pre-reserved region.

A small size-class allocator: the arena is split into extents on demand, each extent serves
slots of one size, and freed slots go back to their size class. ``np.empty`` reserves address
space without touching pages, so an idle pool costs no RSS; slots are reused, so page faults
happen once per slot (first-touch costs ~2.3 GB/s here, reuse runs at memcpy speed). Slots
handed out together are ascending, so blocks written together lie together and a batch's
copies merge into long runs. A size's free slots are an int64 stack (numpy), so a batch of
thousands of slots costs a few array operations, not a Python step (and a list sort) per slot;
offsets come and go as int64 arrays. A host arena starts on a page boundary (``np.empty`` alone
put it 16 bytes into a page, every slot's copy then misaligned by 16 bytes).

``prefault``: the whole arena is faulted in ahead of use, from a background thread at idle
priority (``SCHED_IDLE``: it runs only on otherwise idle CPU), with
``madvise(MADV_POPULATE_WRITE)``, which maps pages without touching their bytes and so is safe
beside stores already writing into the arena. It is backed by transparent huge pages where the
kernel allows (as numpy's own large arrays are).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["EXTENT_BYTES", "PREFAULT_CHUNK", "SlotArena", "populate_write_supported"]

EXTENT_BYTES = 4 * 1024 * 1024
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
PREFAULT_CHUNK = 64 * 1024 * 1024

log = logging.getLogger("kvstrata.tiers.memory")


class SlotArena:
    """A size-class slot allocator over one contiguous arena (host numpy or device torch)."""

    def __init__(self, capacity: int, device: str = "cpu", pin: bool = False, prefault: bool = False) -> None:
        self.capacity = capacity
        self.device = device
        self._storage: Any
        self._mmap: mmap.mmap | None = None
        self.prefaulted = 0  # bytes of the arena faulted in by the prefault thread
        self._stop = threading.Event()
        self._prefaulter: threading.Thread | None = None
        if device == "cpu" and not pin and prefault and capacity > 0:
            self._mmap = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(AttributeError, OSError):  # fewer faults and TLB misses; optional
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            self._storage = np.frombuffer(self._mmap, dtype=np.uint8)
        elif device == "cpu" and not pin:
            raw = np.empty(capacity + mmap.PAGESIZE, dtype=np.uint8)
            skip = -int(raw.__array_interface__["data"][0]) % mmap.PAGESIZE
            self._storage = raw[skip : skip + capacity]  # page-aligned slots
        else:
            import torch

            self._storage = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pin)
        self.base: int | None = None  # address of a host arena
        if isinstance(self._storage, np.ndarray):
            self.base = int(self._storage.__array_interface__["data"][0])
        elif self._storage.device.type == "cpu":
            self.base = int(self._storage.data_ptr())
        self._bump = 0
        self._free: dict[int, _Stack] = {}
        self.used = 0
        self.releases = 0  # release calls so far: a slot is reused only after one
        if self._mmap is not None:
            self._prefaulter = threading.Thread(target=self._prefault, name="kvstrata-prefault", daemon=True)
            self._prefaulter.start()

    def _prefault(self) -> None:
        assert self._mmap is not None
        _idle_priority()
        offset = 0
        while offset < self.capacity and not self._stop.is_set():
            n = min(PREFAULT_CHUNK, self.capacity - offset)
            try:
                self._mmap.madvise(MADV_POPULATE_WRITE, offset, n)
            except (OSError, ValueError) as exc:  # an older kernel: stay lazily faulted
                log.info("kvstrata: arena prefault stopped at %d of %d bytes: %s", offset, self.capacity, exc)
                return
            offset += n
            self.prefaulted = offset

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Wait for the prefault thread to end; True when the whole arena is faulted in."""
        if self._prefaulter is not None:
            self._prefaulter.join(timeout)
        return self.prefaulted >= self.capacity

    def close(self) -> None:
        self._stop.set()
        if self._prefaulter is not None:
            self._prefaulter.join(5.0)  # at most one chunk's madvise

    def _extent_for(self, size: int) -> int:
        per_extent = max(1, min(EXTENT_BYTES, self.capacity // 16) // size)
        return per_extent * size

    def can_allocate(self, sizes: Sequence[int]) -> bool:
        bump = self._bump
        first = sizes[0] if sizes else 0
        need = {first: len(sizes)} if sizes.count(first) == len(sizes) else Counter(sizes)
        for size, count in need.items():
            free = self._free.get(size)
            missing = count - (free.n if free is not None else 0)
            while missing > 0:
                ext = self._extent_for(size)
                if bump + ext > self.capacity:
                    return False
                bump += ext
                missing -= ext // size
        return True

    def allocate(self, size: int) -> int | None:
        got = self.allocate_many(size, 1)
        return int(got[0]) if len(got) else None

    def allocate_many(self, size: int, count: int) -> np.ndarray:
        """Up to ``count`` slots of ``size`` bytes (fewer when the arena is full), ascending (int64),
        so blocks written together lie together and their copies merge into long runs. Freed slots
        go first; fresh extents are carved only for the rest, their lowest slots taken."""
        free = self._free.get(size)
        if free is None:
            free = self._free[size] = _Stack()
        got = free.pop(count)
        fresh: list[np.ndarray] = []
        missing = count - len(got)
        while missing > 0:
            ext = self._extent_for(size)
            if self._bump + ext > self.capacity:
                break
            start = self._bump
            self._bump += ext
            slots = np.arange(start, start + ext, size, dtype=np.int64)
            fresh.append(slots[:missing])
            if len(slots) > missing:  # the rest of the extent: lowest on top (the next batch's, ascending)
                free.push(slots[missing:][::-1])
            missing -= len(slots)
        if fresh:
            got = np.concatenate([got, *fresh])
        if len(got) > 1 and not (got[1:] > got[:-1]).all():
            got = np.sort(got)
        self.used += size * len(got)
        return got

    def release(self, offset: int, size: int) -> None:
        self.release_many([offset], size)

    def release_many(self, offsets: Sequence[int] | np.ndarray, size: int) -> None:
        free = self._free.get(size)
        if free is None:
            free = self._free[size] = _Stack()
        free.push(np.asarray(offsets, dtype=np.int64))
        self.used -= size * len(offsets)
        self.releases += 1

    def view(self, offset: int, size: int) -> Any:
        return self._storage[offset : offset + size]

    def span(self, offset: int, size: int) -> Any:
        """The bytes at ``offset`` for :func:`copy_many`: an address span in host memory (no
        view to build), a view in device memory."""
        if self.base is None:
            return self._storage[offset : offset + size]
        return (self.base + offset, size)


class _Stack:
    """A growable int64 stack: ``push`` and ``pop`` of many values at once, amortised O(values)."""

    __slots__ = ("_a", "n")

    def __init__(self) -> None:
        self._a = np.empty(64, np.int64)
        self.n = 0

    def push(self, values: np.ndarray) -> None:
        k = len(values)
        if self.n + k > len(self._a):
            grown = np.empty(max(2 * len(self._a), self.n + k), np.int64)
            grown[: self.n] = self._a[: self.n]
            self._a = grown
        self._a[self.n : self.n + k] = values
        self.n += k

    def pop(self, count: int) -> np.ndarray:
        """Up to ``count`` values from the top (a copy, in stack order: last pushed last)."""
        k = min(count, self.n)
        self.n -= k
        return self._a[self.n : self.n + k].copy()


def populate_write_supported() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (what ``prefault`` needs)."""
    try:
        with mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
            m.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _idle_priority() -> None:
    """Run the calling thread only on otherwise idle CPU (Linux applies these per thread)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
