"""The stateful Hypothesis model of the conformance suite: random store / load / lookup on a
one-tier engine, checked against the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine
from kvstrata.testing.oracle import chain_keys, empty_buffers, engine_layout, mismatches, source_buffers, tier_usage
from kvstrata.tiers import Tier

N_CHAINS = 6
MAX_BLOCKS = 8
MODEL_CAPACITY_BLOCKS = 16  # a store of MAX_BLOCKS fits even where a record costs twice its bytes (nvme, 4 KiB)


class EngineModel(RuleBasedStateMachine):
    """Random store / load / lookup on a one-tier engine, checked against the oracle.

    Invariants: the tier never holds more than its capacity (live and physical), every
    byte loaded equals the byte written for that (key, layer), and a lookup is exactly
    what the next load delivers (the engine is idle in between).
    """

    def __init__(self, kind: str, options: dict[str, Any], wrap: Callable[[Tier], Tier] | None = None) -> None:
        super().__init__()
        self.layout = engine_layout()
        self.kind = kind
        self.capacity = MODEL_CAPACITY_BLOCKS * self.layout.block_nbytes
        tier = {"name": kind, "kind": kind, "capacity": self.capacity, **options}
        cfg = {"engine": {"io_threads": 2}, "tiers": [tier]}
        self.engine = Engine.with_tiers(cfg, layout=self.layout, wrap={0: wrap} if wrap is not None else None)
        shared = list(range(2 * self.layout.block_size))  # chains 0-2 share two blocks
        self.chains = [
            chain_keys(self.layout, seed, MAX_BLOCKS, shared=shared if seed < 3 else ()) for seed in range(N_CHAINS)
        ]
        self.recent: list[list[Key]] = []  # the latest stored slices, newest first

    @initialize()
    def start_empty(self) -> None:
        assert self.engine.lookup(self.chains[0]).num_blocks == 0

    @rule(c=st.integers(0, N_CHAINS - 1), start=st.integers(0, MAX_BLOCKS - 1), n=st.integers(1, MAX_BLOCKS))
    def store(self, c: int, start: int, n: int) -> None:
        keys = self.chains[c][start : start + n]
        parent = self.chains[c][start - 1] if start else None
        new = [k for k in keys if not self.engine.contains(k)]
        result = self.engine.store_sync(keys, source_buffers(self.layout, keys), parent=parent)
        self.recent = [keys, *self.recent[:5]]
        assert not result.dropped and result.failed == 0
        assert result.stored == len(new) and result.stored + result.present == len(keys)
        if n <= MODEL_CAPACITY_BLOCKS // 2:  # one write batch: making room cannot evict what it writes
            assert all(self.engine.contains(k) for k in new)

    @rule(
        c=st.integers(0, N_CHAINS - 1),
        start=st.integers(0, MAX_BLOCKS - 1),
        n=st.integers(1, MAX_BLOCKS),
        kind=st.sampled_from(["numpy", "torch"]),
    )
    def lookup_then_load(self, c: int, start: int, n: int, kind: str) -> None:
        keys = self.chains[c][start : start + n]
        n = len(keys)
        found = self.engine.lookup(keys)
        assert found.tiers == [self.kind] * found.num_blocks
        bufs = empty_buffers(self.layout, n, kind)
        result = self.engine.load_sync(keys, bufs)
        assert result.loaded_blocks == found.num_blocks and not result.failed_keys
        assert mismatches(self.layout, keys, bufs, result.loaded_blocks) == []

    @precondition(lambda self: self.recent)
    @rule(i=st.integers(0, 5), kind=st.sampled_from(["numpy", "torch"]))
    def load_recently_stored(self, i: int, kind: str) -> None:
        keys = self.recent[i % len(self.recent)]
        found = self.engine.lookup(keys)
        bufs = empty_buffers(self.layout, len(keys), kind)
        result = self.engine.load_sync(keys, bufs)
        assert result.loaded_blocks == found.num_blocks
        assert mismatches(self.layout, keys, bufs, result.loaded_blocks) == []
        # Not asserted: that the latest store is fully restorable. Blocks it found present may
        # be evicted by the same store (test_engine.py::test_store_never_evicts_its_own_present_blocks).

    @rule(c=st.integers(0, N_CHAINS - 1), layer=st.integers(0, 1))
    def load_one_layer(self, c: int, layer: int) -> None:
        keys = self.chains[c]
        found = self.engine.lookup(keys, layers=[layer])
        bufs = empty_buffers(self.layout, len(keys), layers=[layer])
        result = self.engine.load_sync(keys, bufs)
        assert result.loaded_blocks == found.num_blocks
        assert mismatches(self.layout, keys, bufs, result.loaded_blocks) == []

    @invariant()
    def within_capacity(self) -> None:
        used, live, capacity = tier_usage(self.engine, self.kind)
        assert capacity == self.capacity
        assert live <= self.capacity, f"live bytes {live} > capacity {self.capacity}"
        assert used <= self.capacity, f"used bytes {used} > capacity {self.capacity}"

    @invariant()
    def nothing_pending(self) -> None:
        stats = self.engine.stats()
        assert stats["tiers"][self.kind]["pinned_blocks"] == 0
        assert stats["dropped_stores"] == 0

    def teardown(self) -> None:
        self.engine.close()
