"""What a big engine index costs Python's garbage collector: the time of a full collection with
an index of 500K blocks against the same collection without it, in the same process (README,
"The garbage collector and the index"). The index's entries and its eviction order hold only keys
and ints in objects the collector does not track, so the index should add next to nothing."""

from __future__ import annotations

import gc
import time

import pytest

from kvstrata.core import native
from kvstrata.engine.index import BlockIndex
from kvstrata.policies import EVICTION
from kvstrata.policies.admission import AdmitAll

BLOCKS = 500_000


def _full_collection_ms(repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


@pytest.mark.parametrize("policy", ["lru", "prefix-aware"])
def test_full_collection_with_a_big_index(benchmark, policy: str) -> None:  # type: ignore[no-untyped-def]
    before = _full_collection_ms()
    index: BlockIndex[bytes] = BlockIndex(EVICTION.get(policy)(), AdmitAll())
    keys = [i.to_bytes(8, "little") * 2 for i in range(BLOCKS)]
    for start in range(0, BLOCKS, 4096):
        part = keys[start : start + 4096]
        index.add_blocks(part, (1 << 80) - 1, 5 << 20, [keys[start - 1] if start else None, *part[:-1]])
    del keys, part
    benchmark.pedantic(gc.collect, rounds=5, iterations=1)
    with_index = _full_collection_ms()
    benchmark.extra_info.update(
        {
            "native": native.native_path(),
            "blocks": BLOCKS,
            "full_collection_ms_without_index": before,
            "full_collection_ms_with_index": with_index,
            "added_ms_per_million_blocks": (with_index - before) * 1e6 / BLOCKS,
        }
    )
    assert len(index.entries) == BLOCKS
    if native.NATIVE is not None:  # nothing of the index for a collection to walk
        assert not gc.is_tracked(index.entries)


def test_full_collection_with_an_engine_of_many_blocks(benchmark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A DRAM + NVMe engine holding 100K blocks (one 1 KiB layer each: the collector's cost is per
    block, not per byte), its process frozen after start-up as vLLM freezes its heap (gc.freeze):
    what a full collection walks is what the engine made since. Before the index, the eviction
    order, the DRAM slot table and the nvme mirror left the collector's walk, 200K blocks cost
    55-88 ms a full collection here; ~1 ms after."""
    from kvstrata.engine.engine import Engine
    from kvstrata.workload.benchkit import KiB, MiB, batch, layout_for, salted_keys

    blocks, step = 100_000, 4096
    layout = layout_for(KiB, num_layers=1)
    src = batch(layout, step, 0)
    cfg = {
        "engine": {"max_pending_bytes": 64 * MiB},
        "tiers": [
            {"name": "dram", "capacity": blocks * KiB + 64 * MiB},
            {"name": "nvme", "kind": "nvme", "path": str(tmp_path), "capacity": 4 * blocks * 4 * KiB + 1024 * MiB},
        ],
    }
    with Engine(cfg, layout=layout) as engine:
        gc.collect()
        gc.freeze()
        try:
            before = _full_collection_ms()
            for start in range(0, blocks, step):
                engine.store_sync(salted_keys(engine, step, start), src)
            benchmark.pedantic(gc.collect, rounds=5, iterations=1)
            with_blocks = _full_collection_ms()
            counts = [len(slot.entries) for slot in engine.tiers]
        finally:
            gc.unfreeze()
    benchmark.extra_info.update(
        {
            "native": native.native_path(),
            "blocks_per_tier": counts,
            "full_collection_ms_without_blocks": before,
            "full_collection_ms_with_blocks": with_blocks,
            "added_ms_per_million_blocks": (with_blocks - before) * 1e6 / max(1, sum(counts)),
        }
    )
    assert counts[0] >= blocks and counts[1] > 0  # (the nvme tier may still be taking the last stores)
