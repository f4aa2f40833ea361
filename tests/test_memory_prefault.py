"""DRAM arena prefault: faulted in ahead of use, in the background, without touching stored bytes."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from kvstrata.tiers.memory import PREFAULT_CHUNK, SlotArena, populate_write_supported

MiB = 1024 * 1024


def _resident_bytes(address: int, length: int) -> int:
    """Resident bytes of exactly this address range (mincore(2)), whatever mapping holds it."""
    page = mmap.PAGESIZE
    lo = address - address % page
    pages = (address + length - lo + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page


def _base(arena: SlotArena) -> int:
    return int(arena.span(0, 1)[0])


@pytest.mark.skipif(not populate_write_supported(), reason="needs Linux >= 5.14 (MADV_POPULATE_WRITE)")
def test_prefault_makes_the_arena_resident_and_keeps_stored_bytes() -> None:
    capacity = 3 * PREFAULT_CHUNK + 5 * MiB  # a partial last chunk
    arena = SlotArena(capacity, prefault=True)
    try:
        # a store racing the prefault thread: its bytes must survive
        data = np.random.default_rng(3).integers(0, 256, 8 * MiB, dtype=np.uint8)
        off = arena.allocate(len(data))
        assert off is not None
        arena.view(off, len(data))[:] = data
        assert arena.wait_prefaulted(timeout=60)
        assert arena.prefaulted == capacity
        assert _resident_bytes(_base(arena), capacity) >= capacity - MiB
        assert np.array_equal(arena.view(off, len(data)), data)
    finally:
        arena.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore via libc")
def test_without_prefault_an_idle_arena_costs_no_rss() -> None:
    arena = SlotArena(256 * MiB)
    try:
        assert not arena.wait_prefaulted(timeout=0) and arena.prefaulted == 0
        assert _resident_bytes(_base(arena), 256 * MiB) < 16 * MiB
    finally:
        arena.close()


def test_dram_tier_option_reaches_the_arena() -> None:
    from kvstrata.core.layout import uniform_layout
    from kvstrata.engine.engine import Engine

    layout = uniform_layout("t", num_layers=2, num_kv_heads=1, head_dim=8)
    tiers = [{"name": "dram", "capacity": "64MiB", "prefault": True, "pin_memory": "off"}]
    with Engine({"tiers": tiers}, layout=layout) as engine:
        arena = engine.tiers[0].tier._arena  # type: ignore[attr-defined]
        assert arena.wait_prefaulted(timeout=60) == populate_write_supported()
    with pytest.raises(ValueError, match="prefault"):
        Engine({"tiers": [{"name": "dram", "capacity": "1MiB", "prefault": "sometimes"}]}, layout=layout)
