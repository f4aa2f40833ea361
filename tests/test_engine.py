"""Engine behaviour on real tiers: lookup, store, load, eviction, movement between tiers, faults.

The layout fixture has two layers of 256-byte layer-blocks (512 bytes per block);
capacities below are given in blocks with :func:`blocks`. Faults, delays and held
transfers come from the wrapper tiers in ``kvstrata.tiers.wrappers``, which the engine is
built with (``make_engine(..., wrap={i: fn})``); a test that changes a behaviour later keeps
the wrapper (:func:`wrapper`) and sets its attributes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from conformance import (
    block_bytes,
    chain_keys,
    empty_buffers,
    mismatches,
    source_buffers,
    to_bytes,
)

from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.tiers import BlockId, ReadStatus, Tier
from kvstrata.tiers.wrappers import FaultInjectingTier, GateTier, LatencyTier, WrapperTier

EngineFactory = Callable[..., Engine]  # the `make_engine` fixture (conftest.py)
BLOCK = 512  # bytes of one block of the `layout` fixture (2 layers x 256 B)
ALL = 0b11  # layer mask of a complete block


W = TypeVar("W", bound=Tier)


def wrapper(engine: Engine, position: int, kind: type[W]) -> W:
    """The wrapper tier ``position`` was built with (``make_engine(..., wrap=...)``)."""
    tier = engine.tiers[position].tier
    assert isinstance(tier, kind)
    return tier


def blocks(n: int) -> int:
    return n * BLOCK


def dram(capacity_blocks: int, **kw: Any) -> dict[str, Any]:
    return {"name": "dram", "capacity": blocks(capacity_blocks), **kw}


def lower(capacity_blocks: int, **kw: Any) -> dict[str, Any]:
    """A second host-memory tier below the first (stands in for any slower tier)."""
    return {"name": "l2", "kind": "dram", "capacity": blocks(capacity_blocks), **kw}


def store(engine: Engine, layout: KVLayout, keys: list[Key], parent: Key | None = None, **kw: Any) -> Any:
    return engine.store_sync(keys, source_buffers(layout, keys, **kw), parent=parent)


def load(engine: Engine, layout: KVLayout, keys: list[Key], kind: str = "numpy") -> tuple[Any, dict]:
    bufs = empty_buffers(layout, len(keys), kind)
    return engine.load_sync(keys, bufs), bufs


def assert_loads(engine: Engine, layout: KVLayout, keys: list[Key], n: int | None = None) -> Any:
    """Load ``keys``; exactly ``n`` (default: all) must arrive, byte for byte."""
    n = len(keys) if n is None else n
    result, bufs = load(engine, layout, keys)
    assert result.loaded_blocks == n
    assert mismatches(layout, keys, bufs, n) == []
    return result


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def tier_stats(engine: Engine, name: str) -> dict[str, Any]:
    return engine.stats()["tiers"][name]


# --------------------------------------------------------------------------- lookup / load


def test_lookup_longest_prefix_and_tier_per_block(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4, write="write-back"), lower(64))
    a = chain_keys(layout, 1, 4)
    assert store(engine, layout, a).stored == 4
    b = chain_keys(layout, 2, 2)
    store(engine, layout, b[:1])  # one block at a time: each evicts the coldest tail of `a`
    store(engine, layout, b[1:], parent=b[0])
    engine.flush()
    found = engine.lookup(a)
    assert found.num_blocks == 4 and found.num_tokens == 4 * layout.block_size
    assert found.tiers == ["dram", "dram", "l2", "l2"]
    stranger = chain_keys(layout, 3, 1)
    assert engine.lookup(a[:2] + stranger + a[2:]).num_blocks == 2
    assert engine.lookup(stranger + a).num_blocks == 0
    assert engine.lookup([]).num_blocks == 0
    assert engine.lookup(a, layers=[1]).tiers == ["dram", "dram", "l2", "l2"]


def test_lookup_of_some_layers(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 3)
    assert store(engine, layout, keys, layers=[0]).stored == 3
    assert engine.lookup(keys).num_blocks == 0  # not restorable: layer 1 is missing
    assert engine.lookup(keys, layers=[0]).num_blocks == 3
    assert engine.lookup(keys, layers=[1]).num_blocks == 0
    assert engine.contains(keys[0]) == {"dram": 0b01}
    assert store(engine, layout, keys, layers=[1]).stored == 3
    assert engine.lookup(keys).num_blocks == 3
    assert_loads(engine, layout, keys)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        engine.lookup(keys, layers=[2])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_load_into_caller_buffers(make_engine: EngineFactory, layout: KVLayout, kind: str) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 5)
    assert store(engine, layout, keys, kind=kind).stored == 5
    result, bufs = load(engine, layout, keys, kind)
    assert result.ok and result.tiers == ["dram"] * 5 and result.failed_keys == []
    assert mismatches(layout, keys, bufs, 5) == []
    if kind == "torch":
        assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float16 for b in bufs[0])


def test_load_into_one_array_per_layer(make_engine: EngineFactory, layout: KVLayout) -> None:
    """``buffers[layer]`` may be one array whose rows are the blocks (a KV cache slice)."""
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 4)
    src = {layer: np.stack([to_bytes(b) for b in bufs]) for layer, bufs in source_buffers(layout, keys).items()}
    assert engine.store_sync(keys, src).stored == 4
    dst = {layer: np.zeros((4, 256), dtype=np.uint8) for layer in range(2)}
    assert engine.load_sync(keys, dst).ok
    for layer in range(2):
        for i, k in enumerate(keys):
            assert np.array_equal(dst[layer][i], block_bytes(k, layer, 256))


def test_load_stops_at_the_first_missing_block(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 4)
    store(engine, layout, keys[:2])
    store(engine, layout, keys[3:])
    result = assert_loads(engine, layout, keys, n=2)
    assert result.requested == 4 and not result.ok
    nothing = engine.load_sync(chain_keys(layout, 9, 2), empty_buffers(layout, 2))
    assert nothing.loaded_blocks == 0 and nothing.requested == 2


class HoldLayer(WrapperTier):
    """Holds reads of one layer until ``release`` is set (layer-wise progress without timing)."""

    def __init__(self, inner: Tier, layer: int) -> None:
        super().__init__(inner)
        self.layer = layer
        self.release = threading.Event()

    def read(self, items: Sequence[tuple[BlockId, Any]]) -> list[ReadStatus]:
        if any(bid[1] == self.layer for bid, _ in items) and not self.release.wait(30):
            raise TimeoutError("layer never released")
        return super().read(items)


def test_load_layer_by_layer(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: lambda t: HoldLayer(t, layer=1)})
    hold = wrapper(engine, 0, HoldLayer)
    keys = chain_keys(layout, 1, 3)
    store(engine, layout, keys)  # a store reads nothing: the held layer holds only the load
    bufs = empty_buffers(layout, 3)
    handle = engine.load(keys, bufs)
    assert handle.wait_layer(0, timeout=10)
    assert mismatches(layout, keys, {0: bufs[0]}, 3) == []  # layer 0 is usable now...
    assert not handle.wait_layer(1, timeout=0.05) and not handle.done()  # ...while layer 1 is held
    assert handle.elapsed_s is None  # still in flight
    hold.release.set()
    assert handle.wait_layer(1, timeout=10)
    assert handle.result(timeout=10).ok
    assert mismatches(layout, keys, bufs, 3) == []
    assert handle.elapsed_s is not None and handle.elapsed_s >= 0.05  # it waited for the held layer


def test_wait_layer_of_an_empty_load_returns_at_once(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    handle = engine.load(chain_keys(layout, 1, 2), empty_buffers(layout, 2))
    assert handle.wait_layer(0, timeout=0) and handle.wait_layer(1, timeout=0)
    assert handle.done() and handle.result().loaded_blocks == 0


def test_store_checks_buffers(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 2)
    with pytest.raises(ValueError, match="256"):
        engine.store(keys, {0: [np.zeros(100, np.uint8)] * 2})
    with pytest.raises(ValueError, match="1 buffers for 2 keys"):
        engine.store(keys, {0: [np.zeros(256, np.uint8)]})
    with pytest.raises(ValueError, match="out of range"):
        engine.store(keys, {5: [np.zeros(256, np.uint8)] * 2})
    assert engine.lookup(keys, layers=[0]).num_blocks == 0


def test_load_into_non_contiguous_buffers_is_refused_or_exact(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 2)
    store(engine, layout, keys)
    backing = {layer: np.zeros((2, 2, 300), dtype=np.uint8) for layer in range(2)}
    dst = {layer: arr[:, :, :128] for layer, arr in backing.items()}  # 2 x 128 bytes per block, not contiguous
    try:
        result = engine.load_sync(keys, dst)
    except ValueError:
        return  # refusing such buffers up front is fine
    assert result.loaded_blocks == 2
    for layer in range(2):
        for i, k in enumerate(keys):
            assert np.array_equal(dst[layer][i].reshape(-1), block_bytes(k, layer, 256))


# --------------------------------------------------------------------------- store


def test_store_of_existing_keys_reports_present(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 1, 4)
    first = store(engine, layout, keys[:2])
    assert (first.stored, first.present, first.failed, first.dropped) == (2, 0, 0, False)
    again = store(engine, layout, keys)
    assert (again.stored, again.present, again.failed) == (2, 2, 0)
    assert tier_stats(engine, "dram")["layer_blocks_written"] == 4 * 2  # layer-blocks, each written once
    assert_loads(engine, layout, keys)


def test_store_returns_at_once_and_completes_later(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: GateTier})
    gate = wrapper(engine, 0, GateTier)
    gate.writes.clear()
    keys = chain_keys(layout, 1, 2)
    future = engine.store(keys, source_buffers(layout, keys))
    wait_until(lambda: gate.waiting["write"] == 1)
    assert not future.done() and engine.stats()["pending_stores"] == 1
    gate.writes.set()
    assert future.result(timeout=10).stored == 2
    engine.flush()
    assert engine.stats()["pending_stores"] == 0 and engine.stats()["pending_bytes"] == 0


def test_a_queued_store_is_found_and_loaded_at_once(make_engine: EngineFactory, layout: KVLayout) -> None:
    """Read your own writes: a block whose store is still queued counts as a hit, and its load
    waits for the store instead of missing (vLLM re-sends a prompt right after storing it)."""
    engine = make_engine(dram(16), wrap={0: GateTier})
    gate = wrapper(engine, 0, GateTier)
    gate.writes.clear()
    keys = chain_keys(layout, 7, 4)
    future = engine.store(keys[:3], source_buffers(layout, keys[:3]))
    wait_until(lambda: gate.waiting["write"] == 1)
    found = engine.lookup(keys)
    assert found.num_blocks == 3 and found.tiers == ["dram"] * 3
    assert engine.lookup(keys, layers=[1]).num_blocks == 3
    bufs = empty_buffers(layout, 4)
    handle = engine.load(keys, bufs)
    time.sleep(0.05)
    assert not handle.done()  # waiting for the store, not missing
    gate.writes.set()
    result = handle.result(timeout=10)
    assert future.result(timeout=10).stored == 3
    assert result.loaded_blocks == 3 and mismatches(layout, keys, bufs, 3) == []


def test_a_failed_queued_store_is_a_miss_not_a_hang(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: lambda t: GateTier(FaultInjectingTier(t))})
    gate = wrapper(engine, 0, GateTier)
    fault = gate.inner
    assert isinstance(fault, FaultInjectingTier)
    gate.writes.clear()
    fault.fail_writes = 1.0
    keys = chain_keys(layout, 8, 2)
    engine.store(keys, source_buffers(layout, keys))
    wait_until(lambda: gate.waiting["write"] == 1)
    handle = engine.load(keys, empty_buffers(layout, 2))
    gate.writes.set()
    assert handle.result(timeout=10).loaded_blocks == 0
    assert engine.lookup(keys).num_blocks == 0


def test_lookup_without_counting(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16))
    keys = chain_keys(layout, 9, 3)
    store(engine, layout, keys)
    assert engine.lookup(keys, count=False).num_blocks == 3
    assert tier_stats(engine, "dram")["hits"] == 0
    assert engine.lookup(keys).num_blocks == 3
    assert tier_stats(engine, "dram")["hits"] == 3


def test_without_waiting_a_full_queue_drops_batches_per_block(make_engine: EngineFactory, layout: KVLayout) -> None:
    # the tier's writes are held until the gate opens (not slowed by a fixed time, which a loaded
    # machine could outlast while making the calls): the first batch fills the queue for sure
    engine = make_engine(dram(64), engine={"max_pending_stores": 1, "store_wait_s": 0}, wrap={0: GateTier})
    gate = wrapper(engine, 0, GateTier)
    gate.writes.clear()
    chains = [chain_keys(layout, seed, 2) for seed in range(10)]
    bufs = [source_buffers(layout, keys) for keys in chains]
    start = time.monotonic()
    futures = [engine.store(keys, b) for keys, b in zip(chains, bufs, strict=True)]
    elapsed = time.monotonic() - start
    gate.writes.set()
    results = [f.result(timeout=10) for f in futures]
    assert [r.dropped for r in results] == [False] + [True] * 9
    assert [r.dropped_blocks for r in results] == [0] + [2] * 9
    assert results[0].stored == 2 and all(r.stored == 0 for r in results[1:])
    stats = engine.stats()
    assert stats["dropped_stores"] == 9 and stats["dropped_blocks"] == 18
    assert elapsed < 10  # store() never waits for the held tier (its gate held 30 s at most)
    engine.flush()
    assert engine.lookup(chains[0]).num_blocks == 2 and engine.lookup(chains[1]).num_blocks == 0
    assert store(engine, layout, chains[1]).stored == 2  # the queue has drained: accepted again


def test_a_full_queue_makes_stores_wait_not_drop(make_engine: EngineFactory, layout: KVLayout) -> None:
    """The default: batches behind a full queue wait their turn (in order) and are all stored."""
    engine = make_engine(dram(64), engine={"max_pending_stores": 1}, wrap={0: GateTier})
    gate = wrapper(engine, 0, GateTier)
    gate.writes.clear()  # the first batch's write is held: the other four wait behind it
    chains = [chain_keys(layout, seed, 2) for seed in range(5)]
    bufs = [source_buffers(layout, keys) for keys in chains]
    start = time.monotonic()
    futures = [engine.store(keys, b) for keys, b in zip(chains, bufs, strict=True)]
    assert time.monotonic() - start < 10  # store() never waits (the gate holds 30 s at most)
    assert engine.stats()["waiting_stores"] == 4
    gate.writes.set()
    results = [f.result(timeout=10) for f in futures]
    assert [(r.stored, r.dropped_blocks) for r in results] == [(2, 0)] * 5
    assert engine.stats()["dropped_blocks"] == 0 and engine.stats()["waiting_stores"] == 0
    for keys in chains:
        assert_loads(engine, layout, keys, 2)


def test_a_batch_over_the_budget_is_split_prefix_first(make_engine: EngineFactory, layout: KVLayout) -> None:
    """Five blocks against a three-block budget: three go at once, two when the budget frees."""
    engine = make_engine(
        dram(64), engine={"max_pending_bytes": blocks(3)}, wrap={0: lambda t: LatencyTier(t, write_s=0.2)}
    )
    keys = chain_keys(layout, 1, 5)
    fut = engine.store(keys, source_buffers(layout, keys))
    stats = engine.stats()
    assert stats["pending_bytes"] == blocks(3) and stats["waiting_stores"] == 1
    assert engine.lookup(keys).num_blocks == 5  # every block counts as in flight: a load waits for it
    result = fut.result(timeout=10)
    assert (result.stored, result.dropped, result.dropped_blocks) == (5, False, 0)
    assert_loads(engine, layout, keys, 5)
    assert engine.stats()["dropped_stores"] == 0


def test_a_load_waits_for_every_part_of_a_split_store(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(
        dram(64), engine={"max_pending_bytes": blocks(2)}, wrap={0: lambda t: LatencyTier(t, write_s=0.1)}
    )
    keys = chain_keys(layout, 2, 7)
    engine.store(keys, source_buffers(layout, keys))
    assert engine.stats()["waiting_stores"] == 1
    assert_loads(engine, layout, keys, 7)  # issued while most parts still wait: all seven, exact


def test_a_stalled_split_store_drops_its_tail_after_the_wait(make_engine: EngineFactory, layout: KVLayout) -> None:
    """The tier hangs: the prefix that fit stays queued, the rest is dropped per block after
    ``store_wait_s`` (the caller's buffers come back), and the batch completes."""
    engine = make_engine(
        dram(64), engine={"max_pending_bytes": blocks(2), "store_wait_s": 0.3}, wrap={0: lambda t: GateTier(t)}
    )
    gate = wrapper(engine, 0, GateTier)
    gate.writes.clear()
    keys = chain_keys(layout, 3, 6)
    fut = engine.store(keys, source_buffers(layout, keys))
    wait_until(lambda: engine.stats()["dropped_blocks"] == 4, timeout=5)
    assert not fut.done()  # the first part is still being written
    assert engine.lookup(keys).num_blocks == 2  # only the admitted prefix is still in flight
    gate.writes.set()
    result = fut.result(timeout=10)
    assert (result.stored, result.dropped, result.dropped_blocks) == (2, True, 4)
    assert engine.stats()["dropped_stores"] == 1
    assert_loads(engine, layout, keys, 2)


def test_the_wait_runs_from_the_store_call_even_while_parts_progress(
    make_engine: EngineFactory, layout: KVLayout
) -> None:
    """A slow tier stores parts one by one; what is not admitted by ``store_wait_s`` is dropped."""
    engine = make_engine(
        dram(64),
        engine={"max_pending_bytes": blocks(1), "store_wait_s": 0.5},
        wrap={0: lambda t: LatencyTier(t, write_s=0.2)},
    )
    keys = chain_keys(layout, 4, 10)  # ten parts of one block, 0.2 s each: about three fit the wait
    result = engine.store(keys, source_buffers(layout, keys)).result(timeout=10)
    assert 1 <= result.stored <= 5 and result.stored + result.dropped_blocks == 10
    assert_loads(engine, layout, keys, result.stored)  # the stored part is a prefix


def test_a_block_larger_than_the_whole_budget_is_dropped(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(64), engine={"max_pending_bytes": blocks(1) - 1})
    keys = chain_keys(layout, 1, 4)
    result = store(engine, layout, keys)
    assert result.dropped and result.dropped_blocks == 4 and result.stored == 0
    assert engine.stats()["dropped_blocks"] == 4
    assert engine.flush(timeout=5)


def test_the_default_budget_scales_with_the_top_tier(make_engine: EngineFactory, layout: KVLayout) -> None:
    small = make_engine(dram(64))
    assert small.max_pending_bytes == 256 * 1024**2  # the floor: 64 blocks are tiny
    big = make_engine({"name": "dram", "capacity": "4GiB"})
    assert big.max_pending_bytes == 512 * 1024**2
    fixed = make_engine(dram(64), engine={"max_pending_bytes": "3MiB"})
    assert fixed.max_pending_bytes == 3 * 1024**2 == fixed.stats()["max_pending_bytes"]


# --------------------------------------------------------------------------- eviction and movement


def test_eviction_demotes_to_the_next_tier(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4, write="write-back"), lower(64))
    chains = [chain_keys(layout, seed, 2) for seed in range(6)]
    for keys in chains:
        assert store(engine, layout, keys).stored == 2
    engine.flush()
    top, low = tier_stats(engine, "dram"), tier_stats(engine, "l2")
    assert top["blocks"] == 4 and top["live_bytes"] == blocks(4)
    assert top["evictions"] == 8 and top["demotions"] == 8
    assert low["blocks"] == 8 and low["layer_blocks_written"] == 8 * 2
    for keys in chains:  # every block is in exactly one tier...
        assert [len(engine.contains(k)) for k in keys] == [1, 1]
    for keys in chains:  # ...and restorable (a hit in l2 promotes, and that evicts and demotes:
        assert_loads(engine, layout, keys)  # wait for it, or the next chain may be mid-demotion)
        engine.flush()


def test_eviction_without_a_lower_tier_drops(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4))
    chains = [chain_keys(layout, seed, 2) for seed in range(4)]
    for keys in chains:
        store(engine, layout, keys)
    stats = tier_stats(engine, "dram")
    assert stats["evictions"] == 4 and stats["demotions"] == 0 and stats["blocks"] == 4
    assert stats["used_bytes"] == blocks(4) and stats["live_bytes"] == blocks(4)


def test_write_through_puts_blocks_in_both_tiers(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), lower(16), wrap={0: FaultInjectingTier})
    top = wrapper(engine, 0, FaultInjectingTier)
    keys = chain_keys(layout, 1, 4)
    store(engine, layout, keys)
    engine.flush()
    assert all(engine.contains(k) == {"dram": ALL, "l2": ALL} for k in keys)
    assert tier_stats(engine, "l2")["layer_blocks_written"] == 4 * 2
    top.fail_reads = 1.0
    assert_loads(engine, layout, keys, n=0)  # the top copy is unreadable and forgotten...
    assert engine.lookup(keys).tiers == ["l2"] * 4  # ...the lower copy still serves
    top.fail_reads = 0.0
    assert_loads(engine, layout, keys)


def test_write_back_leaves_the_lower_tier_alone(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16, write="write-back"), lower(16))
    keys = chain_keys(layout, 1, 4)
    store(engine, layout, keys)
    engine.flush()
    assert all(engine.contains(k) == {"dram": ALL} for k in keys)
    assert tier_stats(engine, "l2")["layer_blocks_written"] == 0


def test_promotion_on_a_hit_in_a_lower_tier(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4, write="write-back"), lower(64))
    a = chain_keys(layout, 1, 2)
    store(engine, layout, a)
    for seed in range(2, 6):  # push `a` down
        store(engine, layout, chain_keys(layout, seed, 1))
    engine.flush()
    assert engine.lookup(a).tiers == ["l2", "l2"]
    result = assert_loads(engine, layout, a)
    assert result.tiers == ["l2", "l2"]
    engine.flush()
    assert all("dram" in engine.contains(k) for k in a)
    assert engine.lookup(a).tiers == ["dram", "dram"]
    assert tier_stats(engine, "dram")["promotions"] == 2
    assert_loads(engine, layout, a)


def test_no_promotion_into_a_tier_that_opts_out(make_engine: EngineFactory, layout: KVLayout) -> None:
    """``hbm`` tiers default to ``promote = false``: a hit below is not copied up."""
    engine = make_engine({"name": "hbm", "capacity": blocks(2), "write": "write-back"}, lower(64))
    assert engine.config.tiers[0].promote is False
    a = chain_keys(layout, 1, 2)
    store(engine, layout, a)
    store(engine, layout, chain_keys(layout, 2, 2))
    engine.flush()
    assert engine.lookup(a).tiers == ["l2", "l2"]
    assert_loads(engine, layout, a)
    engine.flush()
    assert engine.lookup(a).tiers == ["l2", "l2"]
    assert tier_stats(engine, "hbm")["promotions"] == 0


def test_prefix_aware_eviction_takes_tails_first(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4))
    a = chain_keys(layout, 1, 4)
    store(engine, layout, a)
    for seed in range(2, 4):  # each new block evicts one: the tail of `a`, then its new tail
        store(engine, layout, chain_keys(layout, seed, 1))
    assert engine.lookup(a).num_blocks == 2
    assert [bool(engine.contains(k)) for k in a] == [True, True, False, False]


def test_lru_eviction_takes_the_oldest(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4, eviction="lru"))
    a = chain_keys(layout, 1, 4)
    store(engine, layout, a)
    store(engine, layout, chain_keys(layout, 2, 1))
    assert [bool(engine.contains(k)) for k in a] == [False, True, True, True]
    assert engine.lookup(a).num_blocks == 0  # LRU broke the chain at its root


def test_prefix_aware_multi_block_eviction_keeps_the_prefix(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4))
    a = chain_keys(layout, 1, 4)
    store(engine, layout, a)
    store(engine, layout, chain_keys(layout, 2, 2))  # one batch of two blocks: two victims at once
    assert [bool(engine.contains(k)) for k in a] == [True, True, False, False]
    assert engine.lookup(a).num_blocks == 2


def test_store_never_evicts_its_own_present_blocks(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4))
    a = chain_keys(layout, 1, 3)
    store(engine, layout, a[:1])
    store(engine, layout, chain_keys(layout, 2, 3))  # the tier is full now
    result = store(engine, layout, a)
    assert (result.present, result.stored) == (1, 2)
    assert engine.lookup(a).num_blocks == 3


def test_second_touch_admission_on_the_lower_tier(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(2), lower(64, admission="second-touch"))
    a = chain_keys(layout, 1, 2)
    store(engine, layout, a)
    engine.flush()  # write-through offered `a` once: refused
    assert tier_stats(engine, "l2")["not_admitted"] == 2 and tier_stats(engine, "l2")["blocks"] == 0
    b = chain_keys(layout, 2, 2)
    store(engine, layout, b)  # evicts `a` from dram: the demotion is the second offer, admitted
    engine.flush()
    low = tier_stats(engine, "l2")
    assert all(engine.contains(k) == {"l2": ALL} for k in a)
    assert low["blocks"] == 2 and tier_stats(engine, "dram")["demotions"] == 2
    assert low["not_admitted"] == 4  # plus b's first offer
    assert_loads(engine, layout, a)


def test_capacity_larger_batches_stream_through(make_engine: EngineFactory, layout: KVLayout) -> None:
    """A batch larger than the top tier is written in parts; the tail of it stays, capacity holds."""
    engine = make_engine(dram(4, write="write-back"), lower(64))
    keys = chain_keys(layout, 1, 12)
    result = store(engine, layout, keys)
    engine.flush()
    assert result.stored == 12 and result.failed == 0
    assert tier_stats(engine, "dram")["live_bytes"] <= blocks(4)
    assert engine.lookup(keys).num_blocks == 12
    assert_loads(engine, layout, keys)


# --------------------------------------------------------------------------- faults


def test_a_tier_that_is_down_never_raises(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: FaultInjectingTier})
    faulty = wrapper(engine, 0, FaultInjectingTier)
    a, b = chain_keys(layout, 1, 3), chain_keys(layout, 2, 3)
    store(engine, layout, a)
    before = engine.lookup(a + b)
    faulty.down = True
    result = store(engine, layout, b)
    assert result.failed == 3 and result.stored == 0 and not result.dropped
    after = engine.lookup(a + b)
    assert (after.num_blocks, after.tiers) == (before.num_blocks, before.tiers) == (3, ["dram"] * 3)
    assert all(engine.contains(k) == {} for k in b)
    loaded, _ = load(engine, layout, a)
    assert loaded.loaded_blocks == 0 and loaded.failed_keys == a  # unreadable: misses, forgotten
    assert faulty.injected["down"] > 0
    faulty.down = False
    assert store(engine, layout, b).stored == 3
    assert_loads(engine, layout, b)
    assert tier_stats(engine, "dram")["io_errors"] > 0


@pytest.mark.parametrize("raise_errors", [False, True])
def test_failed_writes_leave_the_index_unchanged(
    make_engine: EngineFactory, layout: KVLayout, raise_errors: bool
) -> None:
    keys = chain_keys(layout, 1, 3)
    engine = make_engine(
        dram(16),
        wrap={0: lambda t: FaultInjectingTier(t, fail_writes=1.0, raise_errors=raise_errors, targets={keys[1]})},
    )
    inner = wrapper(engine, 0, FaultInjectingTier).inner
    result = store(engine, layout, keys)
    good = [] if raise_errors else [keys[0], keys[2]]  # a raising write fails its whole batch
    assert (result.stored, result.failed) == (len(good), 3 - len(good))
    assert [k for k in keys if engine.contains(k)] == good
    assert engine.lookup(keys).num_blocks == len(good[:1])
    stats = tier_stats(engine, "dram")
    assert stats["write_failures"] >= 1
    assert stats["live_bytes"] == inner.used_bytes == blocks(len(good))
    assert stats["io_errors"] == (1 if raise_errors else 0)


def test_a_half_written_block_is_rolled_back(make_engine: EngineFactory, layout: KVLayout) -> None:
    keys = chain_keys(layout, 1, 2)
    engine = make_engine(dram(16), wrap={0: lambda t: FaultInjectingTier(t, fail_writes=1.0, targets={(keys[0], 1)})})
    inner = wrapper(engine, 0, FaultInjectingTier).inner
    result = store(engine, layout, keys)
    assert (result.stored, result.failed) == (1, 1)
    assert engine.contains(keys[0]) == {} and engine.contains(keys[1]) == {"dram": ALL}
    assert inner.used_bytes == blocks(1)  # layer 0 of keys[0] was written, then deleted again


@pytest.mark.parametrize("raise_errors", [False, True])
def test_read_errors_become_misses(make_engine: EngineFactory, layout: KVLayout, raise_errors: bool) -> None:
    engine = make_engine(dram(16), wrap={0: lambda t: FaultInjectingTier(t, raise_errors=raise_errors)})
    keys = chain_keys(layout, 1, 3)
    store(engine, layout, keys)
    wrapper(engine, 0, FaultInjectingTier).fail_reads = 1.0
    result, _ = load(engine, layout, keys)
    assert result.loaded_blocks == 0 and result.failed_keys == keys
    assert tier_stats(engine, "dram")["io_errors"] == 2 * 3  # per layer-block
    assert engine.lookup(keys).num_blocks == 0


def test_corrupt_reads_are_counted_and_forgotten(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: FaultInjectingTier})
    faulty = wrapper(engine, 0, FaultInjectingTier)
    keys = chain_keys(layout, 1, 4)
    store(engine, layout, keys)
    faulty.corrupt_reads, faulty.targets = 1.0, {keys[2]}
    result = assert_loads(engine, layout, keys, n=2)
    assert result.failed_keys == [keys[2]] and result.tiers == ["dram", "dram"]
    assert faulty.injected["corrupt"] == 2
    stats = tier_stats(engine, "dram")
    assert stats["checksum_failures"] == 2 and stats["blocks"] == 3
    assert engine.lookup(keys).num_blocks == 2
    assert engine.contains(keys[2]) == {}
    wait_until(lambda: faulty.used_bytes == blocks(3))  # its bytes are released too


def test_failed_demotions_do_not_block_eviction(make_engine: EngineFactory, layout: KVLayout) -> None:
    """Demotion into a tier whose writes fail: the top tier still evicts, stays within capacity and serves."""
    engine = make_engine(
        dram(4, write="write-back"),
        lower(64),
        wrap={1: lambda t: FaultInjectingTier(t, fail_writes=1.0, raise_errors=True)},
    )
    broken = wrapper(engine, 1, FaultInjectingTier)
    chains = [chain_keys(layout, seed, 1) for seed in range(12)]
    for keys in chains:
        assert store(engine, layout, keys).stored == 1
        top = tier_stats(engine, "dram")
        assert top["live_bytes"] == top["used_bytes"] == blocks(top["blocks"]) <= blocks(4)
    top, low = tier_stats(engine, "dram"), tier_stats(engine, "l2")
    assert top["evictions"] == 8 and top["demotions"] == 0
    assert low["blocks"] == 0 and low["io_errors"] == 8 and broken.injected["write"] == 16
    assert engine.lookup(chains[0]).num_blocks == 0
    assert_loads(engine, layout, chains[-1])


def test_a_raising_lower_tier_does_not_leak_top_capacity(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(4, write="write-back"), lower(64), wrap={1: FaultInjectingTier})
    dead = wrapper(engine, 1, FaultInjectingTier)
    first = chain_keys(layout, 0, 4)
    store(engine, layout, first)
    dead.down = True  # has_room raises too, like a remote pool that went away
    for seed in range(1, 9):
        store(engine, layout, chain_keys(layout, seed, 1))
    dead.down = False  # back up (stats() itself does not survive a down tier, see below)
    top = tier_stats(engine, "dram")
    assert top["live_bytes"] == blocks(top["blocks"]) <= blocks(4)
    assert engine.stats()["tiers"]["dram"]["used_bytes"] <= blocks(4)
    assert store(engine, layout, first).stored == 4  # evicted keys can come back


def test_stats_survive_a_tier_that_is_down(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), lower(16), wrap={1: FaultInjectingTier})
    dead = wrapper(engine, 1, FaultInjectingTier)
    dead.down = True
    stats = engine.stats()
    assert stats["tiers"]["dram"]["used_bytes"] == 0


def test_quarantine_never_turns_a_pending_copy_into_wrong_bytes(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), lower(16), engine={"io_threads": 2}, wrap={0: FaultInjectingTier, 1: GateTier})
    top, gate = wrapper(engine, 0, FaultInjectingTier), wrapper(engine, 1, GateTier)
    k, other = chain_keys(layout, 1, 1), chain_keys(layout, 2, 1)
    gate.writes.clear()
    store(engine, layout, k)  # the write-through of k now holds views of k's bytes in the top tier
    wait_until(lambda: gate.waiting["write"] == 1)
    top.fail_reads, top.targets = 1.0, set(k)
    assert load(engine, layout, k)[0].loaded_blocks == 0  # quarantines k in the top tier
    top.fail_reads = 0.0
    assert engine.lookup(k).num_blocks == 0 or engine.lookup(k).tiers != ["dram"]
    assert top.inner.used_bytes == blocks(1)  # still pinned by the copy: its bytes stay put
    store(engine, layout, other)  # must not get k's slots while the copy reads them
    gate.writes.set()
    engine.flush()
    wait_until(lambda: top.inner.used_bytes == blocks(1))  # k's bytes released after the copy
    result, bufs = load(engine, layout, k)
    if result.loaded_blocks:  # k may be lost; it must never come back with other bytes
        assert mismatches(layout, k, bufs, 1) == []


# --------------------------------------------------------------------------- stats, lifecycle, threads


def test_stats_counters(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16, write="write-back"), lower(16))
    keys = chain_keys(layout, 1, 3)
    store(engine, layout, keys)
    found = engine.lookup(keys + chain_keys(layout, 2, 2))
    assert found.num_blocks == 3
    assert_loads(engine, layout, keys)
    stats = engine.stats()
    top, low = stats["tiers"]["dram"], stats["tiers"]["l2"]
    assert top["kind"] == "dram" and top["capacity_bytes"] == blocks(16)
    assert (top["hits"], top["misses"]) == (3, 2)
    assert (low["hits"], low["misses"]) == (0, 2)
    assert top["layer_blocks_written"] == 6 and top["bytes_written"] == blocks(3)
    assert top["layer_blocks_read"] == 6 and top["bytes_read"] == blocks(3)
    assert top["blocks"] == 3 and top["used_bytes"] == top["live_bytes"] == blocks(3)
    assert top["pinned_blocks"] == 0 and low["blocks"] == 0
    assert stats["dropped_stores"] == 0 and stats["pending_stores"] == 0
    assert stats["namespace"] == engine.namespace.fingerprint


def test_context_manager_closes_every_tier(tmp_path: Path, layout: KVLayout) -> None:
    config = {"tiers": [dram(4), lower(4)]}
    with Engine.with_tiers(config, layout=layout, wrap={0: FaultInjectingTier, 1: FaultInjectingTier}) as engine:
        wrapped = [wrapper(engine, i, FaultInjectingTier) for i in range(2)]
        keys = chain_keys(layout, 1, 1)
        store(engine, layout, keys)
    assert all(w.closed for w in wrapped)
    engine.close()  # idempotent


def test_close_finishes_queued_work(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(16), wrap={0: lambda t: LatencyTier(t, write_s=0.05)})
    keys = chain_keys(layout, 1, 2)
    future = engine.store(keys, source_buffers(layout, keys))
    engine.close()
    assert future.done() and future.result().stored == 2


def test_threads_storing_and_loading_different_chains(make_engine: EngineFactory, layout: KVLayout) -> None:
    engine = make_engine(dram(40), lower(160), engine={"io_threads": 4})  # room for every pin in flight
    errors: list[str] = []

    def worker(tid: int) -> None:
        try:
            chains = [chain_keys(layout, 100 * tid + i, 1 + i % 4) for i in range(12)]
            for i, keys in enumerate(chains):
                result = store(engine, layout, keys)
                if result.failed or result.dropped:
                    errors.append(f"thread {tid}: store {i} {result}")
                for old in (keys, chains[i // 2]):
                    res, bufs = load(engine, layout, old)
                    if mismatches(layout, old, bufs, res.loaded_blocks):
                        errors.append(f"thread {tid}: wrong bytes")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"thread {tid}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    engine.flush()
    stats = engine.stats()
    assert stats["tiers"]["dram"]["evictions"] > 0  # the threads really competed for space
    for name, cap in (("dram", blocks(40)), ("l2", blocks(160))):
        assert stats["tiers"][name]["live_bytes"] <= cap and stats["tiers"][name]["used_bytes"] <= cap
        assert stats["tiers"][name]["pinned_blocks"] == 0
    assert stats["background_bytes"] == 0 and stats["pending_stores"] == 0


# --------------------------------------------------------------------------- with an nvme tier


@pytest.fixture
def nvme_available() -> None:
    pytest.importorskip("kvstrata.tiers.nvme", reason="nvme tier not available")


@pytest.mark.usefixtures("nvme_available")
def test_restart_serves_from_nvme_then_promotes(make_engine: EngineFactory, layout: KVLayout, tmp_path: Path) -> None:
    nvme = {"name": "nvme", "capacity": 1024**2, "path": str(tmp_path / "nvme")}  # records are padded to 4 KiB
    engine = make_engine(dram(16), nvme)
    chains = [chain_keys(layout, seed, 3) for seed in range(3)]
    for keys in chains:
        store(engine, layout, keys)
    engine.flush()
    assert tier_stats(engine, "nvme")["blocks"] == 9
    engine.close()
    engine = make_engine(dram(16), nvme)
    for keys in chains:
        assert engine.lookup(keys).tiers == ["nvme"] * 3
        assert_loads(engine, layout, keys)
    engine.flush()
    assert all(engine.lookup(keys).tiers == ["dram"] * 3 for keys in chains)
    assert all(r["ok"] for r in engine.verify())


@pytest.mark.usefixtures("nvme_available")
@pytest.mark.parametrize("top", ["dram", "nvme"])
def test_load_into_pages_of_a_cache(make_engine: EngineFactory, layout: KVLayout, tmp_path: Path, top: str) -> None:
    """vLLM's restore: ``buffers[layer]`` is :class:`Pages` of that layer's cache (pages 256 B
    apart from the other layer's, in block-id order of the request), read by address from dram and
    page by page (views) from nvme; every page lands, and no page outside the request is touched."""
    from kvstrata.core.buffers import Pages

    tier = dram(16) if top == "dram" else {"name": "nvme", "capacity": 1024**2, "path": str(tmp_path / "nvme")}
    engine = make_engine(tier)
    keys = chain_keys(layout, 3, 4)
    store(engine, layout, keys)
    cache = torch.full((10, 2, 128), 7, dtype=torch.float16)  # 10 pages, both layers' 256 B per page
    ids = [8, 1, 5, 2]
    bufs = {layer: Pages(cache[:, layer], ids) for layer in range(2)}
    assert engine.load_sync(keys, bufs).loaded_blocks == 4
    got = {layer: [cache[b, layer] for b in ids] for layer in range(2)}
    assert mismatches(layout, keys, got, 4) == []
    others = [b for b in range(10) if b not in ids]
    assert bool((cache[others] == 7).all())


@pytest.mark.usefixtures("nvme_available")
def test_nvme_corruption_is_a_miss(make_engine: EngineFactory, layout: KVLayout, tmp_path: Path) -> None:
    """Bytes damaged on disk: the checksum catches them, the block is a miss, never wrong bytes."""
    path = tmp_path / "nvme"
    engine = make_engine({"name": "nvme", "capacity": 1024**2, "path": str(path)})
    keys = chain_keys(layout, 1, 3)
    store(engine, layout, keys)
    segments = sorted(path.rglob("*.seg"))
    assert segments
    for seg in segments:  # damage the first record of every segment file
        with open(seg, "r+b") as f:
            f.write(b"\xff" * 16)
    result, bufs = load(engine, layout, keys)
    assert mismatches(layout, keys, bufs, result.loaded_blocks) == []
    assert result.loaded_blocks < 3 and result.failed_keys
    assert tier_stats(engine, "nvme")["checksum_failures"] >= 1
    assert all(engine.contains(k) == {} for k in result.failed_keys)
    assert engine.lookup(keys).num_blocks == result.loaded_blocks


@pytest.mark.usefixtures("nvme_available")
def test_a_victim_that_cannot_be_read_for_its_demotion_stays_on_its_shared_tier(
    make_engine: EngineFactory, layout: KVLayout, tmp_path: Path
) -> None:
    """Eviction copies a victim down, then deletes it. When the copy's read fails with an I/O
    error (not a miss), the block may be the only copy: it stays on the shared tier (another
    engine or the daemon can still move it), never deleted with nothing below."""
    nvme = {"name": "nvme", "capacity": 32 * 1024, "path": str(tmp_path / "nvme"), "write": "write-back"}
    first = chain_keys(layout, 1, 4)
    engine = make_engine(nvme, lower(64), wrap={0: lambda t: FaultInjectingTier(t, fail_reads=1.0, targets=first)})
    store(engine, layout, first)
    for seed in range(2, 12):  # 40 more blocks: each store is a 4 KiB-aligned batch, 10 of them push ``first`` out
        store(engine, layout, chain_keys(layout, seed, 4))
    engine.flush()
    assert tier_stats(engine, "nvme")["evictions"] >= 4
    assert engine.lookup(first).num_blocks == 0  # it left this engine's index, and went nowhere below
    # the fault is the source's read, counted there; the tier below refused nothing
    assert tier_stats(engine, "nvme")["io_errors"] >= 4
    assert tier_stats(engine, "l2")["write_failures"] == 0
    engine.close()
    engine = make_engine(nvme, lower(64))
    assert engine.lookup(first).tiers == ["nvme"] * 4
    assert_loads(engine, layout, first)


@pytest.mark.usefixtures("nvme_available")
@pytest.mark.parametrize("raise_errors", [False, True], ids=["write-refused", "write-raised"])
def test_a_victim_whose_write_below_fails_stays_on_its_shared_tier(
    make_engine: EngineFactory, layout: KVLayout, tmp_path: Path, raise_errors: bool
) -> None:
    """Eviction out of a shared tier into a tier whose writes fail (a store timing out, a
    mount gone): the victims may be the only copies of acknowledged blocks, so they stay on the
    shared tier, counted, and a fresh engine serves them; the writer that needed the room gets
    at worst a failed write. Out of a private tier the same fault loses only a cache copy
    (test_failed_demotions_do_not_block_eviction)."""
    nvme = {"name": "nvme", "capacity": 32 * 1024, "path": str(tmp_path / "nvme"), "write": "write-back"}
    engine = make_engine(
        nvme, lower(64), wrap={1: lambda t: FaultInjectingTier(t, fail_writes=1.0, raise_errors=raise_errors)}
    )
    chains = [chain_keys(layout, seed, 4) for seed in range(1, 12)]
    for keys in chains:  # 44 blocks of 4 KiB-aligned batches into 32 KiB: the first ones are pushed out
        store(engine, layout, keys)
    engine.flush()
    top = tier_stats(engine, "nvme")
    assert top["evictions"] >= 4 and top["demotions"] == 0
    assert top["demotions_kept"] == top["evictions"], top
    assert tier_stats(engine, "l2")["blocks"] == 0
    engine.close()
    engine = make_engine(nvme, lower(64))
    stored = [keys for keys in chains if engine.lookup(keys).num_blocks == 4]
    assert chains[0] in stored  # evicted first, never written below: still on the shared tier
    for keys in stored:
        assert engine.lookup(keys).tiers == ["nvme"] * 4
        assert_loads(engine, layout, keys)


def test_a_tier_configured_with_latency_delays_its_reads_and_writes(
    make_engine: EngineFactory, layout: KVLayout
) -> None:
    """``read_latency_s`` / ``write_latency_s`` (an emulated slower medium) wrap the tier in
    :class:`LatencyTier`: a load that reaches it takes at least the read latency, and the bytes are
    the same."""
    engine = make_engine(dram(2), lower(16, read_latency_s=0.3, write_latency_s=0.05))
    slow = wrapper(engine, 1, LatencyTier)
    assert (slow.read_s, slow.write_s) == (0.3, 0.05)
    assert not isinstance(engine.tiers[0].tier, LatencyTier)  # 0 adds nothing: no wrapper
    keys = chain_keys(layout, 1, 6)
    assert store(engine, layout, keys).stored == 6
    assert engine.flush(timeout=30)
    assert engine.lookup(keys).tiers[0] == "l2"  # the head of the chain was evicted from dram
    t0 = time.monotonic()
    assert_loads(engine, layout, keys)
    assert time.monotonic() - t0 >= 0.3


class CountReads(FaultInjectingTier):
    """Records the layers of every read call (and injects faults like its base)."""

    def __init__(self, inner: Tier, **kw: Any) -> None:
        super().__init__(inner, **kw)
        self.calls: list[list[int]] = []

    def read(self, items: Sequence[tuple[BlockId, Any]]) -> list[ReadStatus]:
        self.calls.append([bid[1] for bid, _ in items])
        return super().read(items)


@pytest.mark.usefixtures("nvme_available")
def test_waited_nvme_load_reads_every_layer_in_one_call(
    make_engine: EngineFactory, layout: KVLayout, tmp_path: Path
) -> None:
    """``load_sync`` from a tier without host spans (nvme) reads all layers in one call, so the
    tier keeps its queue full across layers; a layer-wise load still makes one call a layer (its
    layers are usable one by one); a bad record anywhere in the one call still ends the prefix
    right there (statuses come back layer-major)."""
    nvme = {"name": "nvme", "capacity": 1024**2, "path": str(tmp_path / "nvme")}
    engine = make_engine(nvme, wrap={0: CountReads})
    counted = wrapper(engine, 0, CountReads)
    assert not engine.tiers[0].tier.capabilities.host_spans
    keys = chain_keys(layout, 7, 4)
    store(engine, layout, keys)
    counted.calls.clear()
    assert_loads(engine, layout, keys)
    assert [sorted(set(c)) for c in counted.calls] == [[0, 1]] and len(counted.calls[0]) == 8

    counted.calls.clear()
    bufs = empty_buffers(layout, len(keys))
    assert engine.load(keys, bufs).result(timeout=10).loaded_blocks == 4
    assert mismatches(layout, keys, bufs, 4) == []
    assert counted.calls == [[0] * 4, [1] * 4]  # two layers: one a call

    counted.targets = {(keys[2], 1)}  # layer 1 of the third block reads corrupt
    counted.corrupt_reads = 1.0
    result, bufs = load(engine, layout, keys)
    assert result.loaded_blocks == 2 and result.failed_keys == [keys[2]]
    assert mismatches(layout, keys, bufs, 2) == []


class GateCall(CountReads):
    """Holds read call number ``held`` (from 0) until ``release`` is set."""

    def __init__(self, inner: Tier, held: int) -> None:
        super().__init__(inner)
        self.held = held
        self.release = threading.Event()

    def read(self, items: Sequence[tuple[BlockId, Any]]) -> list[ReadStatus]:
        if len(self.calls) == self.held and not self.release.wait(30):
            raise TimeoutError("call never released")
        return super().read(items)


@pytest.mark.usefixtures("nvme_available")
def test_layerwise_nvme_load_reads_doubling_groups_of_layers(tmp_path: Path, make_engine: EngineFactory) -> None:
    """A layer-wise load from nvme reads 1, 2, 4, ... layers a call (8 layers: 1, 2, 5), and each
    group's layers are usable as soon as its call is done, before the later groups arrive."""
    eight = uniform_layout("test-model", num_layers=8, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    nvme = {"name": "nvme", "capacity": 1024**2, "path": str(tmp_path / "nvme")}
    engine = make_engine(nvme, layout=eight, wrap={0: lambda t: GateCall(t, held=2)})
    gate = wrapper(engine, 0, GateCall)
    keys = chain_keys(eight, 3, 5)
    store(engine, eight, keys)
    bufs = empty_buffers(eight, len(keys))
    handle = engine.load(keys, bufs)
    assert all(handle.wait_layer(layer, timeout=10) for layer in (0, 1, 2))
    assert mismatches(eight, keys, {layer: bufs[layer] for layer in (0, 1, 2)}, 5) == []
    assert not handle.wait_layer(3, timeout=0.05) and not handle.done()  # the third call is held
    gate.release.set()
    assert handle.result(timeout=10).loaded_blocks == 5
    assert mismatches(eight, keys, bufs, 5) == []
    assert [sorted(set(c)) for c in gate.calls] == [[0], [1, 2], [3, 4, 5, 6, 7]]
