"""Memory tiers: ``dram`` (host memory, pinned when CUDA is present) and ``hbm`` (device memory).

Both carve fixed-size slots out of one pre-reserved arena with a small size-class
allocator: the arena is split into extents on demand, each extent serves slots of
one size, and freed slots go back to their size class. ``np.empty`` reserves
address space without touching pages, so an idle pool costs no RSS; slots are
reused, so page faults happen once per slot (first-touch costs ~2.3 GB/s here,
reuse runs at memcpy speed).

``prefault = true`` (dram) faults the whole arena in ahead of use, from a background thread at
idle priority (``SCHED_IDLE``: it runs only on otherwise idle CPU), with
``madvise(MADV_POPULATE_WRITE)``, which maps pages without touching their bytes and so is safe
beside stores already writing into the arena. Stores then never pay first-touch page faults
(on a VM, a guest page's first touch can run at ~0.4 GB/s), at the price of the tier's full
capacity in RSS from the start, as a pinned arena has anyway. It needs Linux 5.14 or later;
elsewhere the arena stays lazily faulted and a log line says so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from kvstrata.core.buffers import Buffer, copy_many, nbytes
from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers.base import BlockId, ReadStatus, Tier, TierCapabilities, TierContext, TierOptions
from kvstrata.units import format_size

EXTENT_BYTES = 4 * 1024 * 1024
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
PREFAULT_CHUNK = 64 * 1024 * 1024

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available())


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
            self._storage = np.frombuffer(self._mmap, dtype=np.uint8)
        elif device == "cpu" and not pin:
            self._storage = np.empty(capacity, dtype=np.uint8)
        else:
            import torch

            self._storage = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pin)
        self._base: int | None = None  # address of a host arena
        if isinstance(self._storage, np.ndarray):
            self._base = int(self._storage.__array_interface__["data"][0])
        elif self._storage.device.type == "cpu":
            self._base = int(self._storage.data_ptr())
        self._bump = 0
        self._free: dict[int, list[int]] = {}
        self.used = 0
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
        need: dict[int, int] = {}
        for s in sizes:
            need[s] = need.get(s, 0) + 1
        bump = self._bump
        for size, count in need.items():
            missing = count - len(self._free.get(size, ()))
            while missing > 0:
                ext = self._extent_for(size)
                if bump + ext > self.capacity:
                    return False
                bump += ext
                missing -= ext // size
        return True

    def allocate(self, size: int) -> int | None:
        free = self._free.setdefault(size, [])
        if not free:
            ext = self._extent_for(size)
            if self._bump + ext > self.capacity:
                return None
            start = self._bump
            self._bump += ext
            free.extend(range(start + ext - size, start - 1, -size))
        self.used += size
        return free.pop()

    def release(self, offset: int, size: int) -> None:
        self._free.setdefault(size, []).append(offset)
        self.used -= size

    def view(self, offset: int, size: int) -> Any:
        return self._storage[offset : offset + size]

    def span(self, offset: int, size: int) -> Any:
        """The bytes at ``offset`` for :func:`copy_many`: an address span in host memory (no
        view to build), a view in device memory."""
        if self._base is None:
            return self._storage[offset : offset + size]
        return (self._base + offset, size)


class MemoryOptions(TierOptions):
    pin_memory: Literal["auto", "on", "off"] = "auto"
    prefault: bool = False  # dram: fault the arena in ahead of use, at idle priority (see the module docstring)


def available_memory() -> int | None:
    """Host memory available to a new allocation (``MemAvailable`` of ``/proc/meminfo``), in bytes;
    None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


class _MemoryTier(Tier):
    """Shared implementation of the memory tiers."""

    Options: ClassVar[type[TierOptions]] = MemoryOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        super().__init__(name, capacity, options, context)
        self._lock = threading.Lock()
        self._slots: dict[BlockId, tuple[int, int, int]] = {}  # id -> (offset, size, generation)
        self._generation = itertools.count()
        available, where = self._available_memory()
        if available is not None and capacity > available:
            raise ConfigError(
                f"tier {name!r}: capacity {format_size(capacity)} exceeds this machine's available {where} "
                f"({format_size(available)})",
                field=f"tiers.{name}.capacity",
                value=capacity,
            )
        try:
            self._arena = self._make_arena(capacity)
        except (MemoryError, ValueError, RuntimeError) as exc:  # RuntimeError: torch's out-of-memory error
            raise TierError(f"tier {name!r}: cannot reserve {format_size(capacity)} of memory: {exc}") from None

    def _available_memory(self) -> tuple[int | None, str]:
        """What the arena may take at most, and where it lives (refused at open beyond it)."""
        return available_memory(), "memory"

    def _make_arena(self, capacity: int) -> SlotArena:
        raise NotImplementedError

    def close(self) -> None:
        self._arena.close()

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        placed: list[tuple[BlockId, int, int] | None] = []
        with self._lock:
            for bid, buf in items:
                size = nbytes(buf)
                old = self._slots.pop(bid, None)
                if old is not None:
                    self._arena.release(old[0], old[1])
                off = self._arena.allocate(size)
                placed.append(None if off is None else (bid, off, size))
        pairs = [
            (self._arena.span(slot[1], slot[2]), buf) for (_, buf), slot in zip(items, placed, strict=True) if slot
        ]
        copy_many(pairs, background=True)  # a store: never ahead of a load
        ok = [slot is not None for slot in placed]
        with self._lock:
            for slot in placed:
                if slot is not None:
                    self._slots[slot[0]] = (slot[1], slot[2], next(self._generation))
        return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        with self._lock:
            locs = [self._slots.get(bid) for bid, _ in items]
        out: list[ReadStatus] = []
        pairs = []
        for (_, dst), loc in zip(items, locs, strict=True):
            if loc is None or loc[1] != nbytes(dst):
                out.append(ReadStatus.MISSING)
                continue
            pairs.append((dst, self._arena.span(loc[0], loc[1])))
            out.append(ReadStatus.OK)
        copy_many(pairs)
        with self._lock:  # a slot freed and reused while we copied: those bytes are not this block's
            for i, ((bid, _), loc) in enumerate(zip(items, locs, strict=True)):
                if loc is not None and out[i] is ReadStatus.OK and self._slots.get(bid) != loc:
                    out[i] = ReadStatus.MISSING
        return out

    def peek(self, ids: Sequence[BlockId]) -> list[Buffer | None]:
        """Zero-copy views of stored blocks (valid while the engine keeps them pinned)."""
        with self._lock:
            locs = [self._slots.get(bid) for bid in ids]
        return [None if loc is None else self._arena.view(loc[0], loc[1]) for loc in locs]

    def delete(self, ids: Sequence[BlockId]) -> None:
        with self._lock:
            for bid in ids:
                loc = self._slots.pop(bid, None)
                if loc is not None:
                    self._arena.release(loc[0], loc[1])

    @property
    def used_bytes(self) -> int:
        return self._arena.used

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        if live_bytes + sum(sizes) > self.capacity:
            return False
        with self._lock:
            return self._arena.can_allocate(sizes)


class DRAMTier(_MemoryTier):
    """Host-memory pool; pinned (page-locked) when CUDA is present so H2D/D2H copies are DMA."""

    capabilities = TierCapabilities(alignment=64, peek=True, space="slots")

    def _make_arena(self, capacity: int) -> SlotArena:
        mode = getattr(self.options, "pin_memory", "auto")
        pin = mode == "on" or (mode == "auto" and cuda_available())
        return SlotArena(capacity, "cpu", pin=pin, prefault=bool(getattr(self.options, "prefault", False)))


class HBMTier(_MemoryTier):
    """Device-memory block pool: CUDA memory when present, a host stand-in otherwise.

    Inside vLLM the GPU cache is vLLM's own; standalone (``kvstrata replay``) this
    tier models an inference engine's GPU prefix cache.
    """

    capabilities = TierCapabilities(device_memory=True, alignment=256, peek=True, space="slots")

    def _available_memory(self) -> tuple[int | None, str]:
        if not cuda_available():  # the host stand-in
            return available_memory(), "memory"
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free), "GPU memory"

    def _make_arena(self, capacity: int) -> SlotArena:
        device = "cuda" if cuda_available() else "cpu"
        return SlotArena(capacity, device)
