"""DRAM arena prefault: faulted in ahead of use, in the background, without touching stored bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.memory import PREFAULT_CHUNK, SlotArena, populate_write_supported

MiB = 1024 * 1024


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and len(line.split()) >= 5 and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


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
        assert _rss_of_mapping(_base(arena)) >= capacity - MiB
        assert np.array_equal(arena.view(off, len(data)), data)
    finally:
        arena.close()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux-only smaps")
def test_without_prefault_an_idle_arena_costs_no_rss() -> None:
    arena = SlotArena(256 * MiB)
    try:
        assert not arena.wait_prefaulted(timeout=0) and arena.prefaulted == 0
        assert _rss_of_mapping(_base(arena)) < 16 * MiB
    finally:
        arena.close()


def test_dram_tier_option_reaches_the_arena() -> None:
    from kvstrata.engine.engine import Engine
    from kvstrata.engine.layout import uniform_layout

    layout = uniform_layout("t", num_layers=2, num_kv_heads=1, head_dim=8)
    tiers = [{"name": "dram", "capacity": "64MiB", "prefault": True, "pin_memory": "off"}]
    with Engine({"tiers": tiers}, layout=layout) as engine:
        arena = engine.tiers[0].tier._arena  # type: ignore[attr-defined]
        assert arena.wait_prefaulted(timeout=60) == populate_write_supported()
    with pytest.raises(ValueError, match="prefault"):
        Engine({"tiers": [{"name": "dram", "capacity": "1MiB", "prefault": "sometimes"}]}, layout=layout)
