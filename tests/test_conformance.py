"""Every tier runs the same conformance suite (see ``conformance.py``).

A new tier (Mooncake pool, fsspec local-dir or S3, ...) joins with one subclass
naming its registry kind and, if it needs them, its options and required module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conformance import TierConformance, TierFactory, assert_read_back, raw_block_keys, read_back, write_items

from kvstrata.core.layout import KVLayout
from kvstrata.errors import TierError
from kvstrata.tiers import ReadStatus, Tier
from kvstrata.tiers.wrappers import FaultInjectingTier, GateTier, LatencyTier, WrapperTier


class TestDRAM(TierConformance):
    kind = "dram"


class TestHBM(TierConformance):
    kind = "hbm"  # a host stand-in without CUDA; device memory with it


class TestNVMe(TierConformance):
    kind = "nvme"
    requires = "kvstrata.tiers.nvme"
    concurrent_rounds = 100  # every write is fdatasync-ed

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {"path": str(root), "direct_io": "off"}


class TestWrappedDRAM(TestDRAM):
    """Wrappers are tiers too: with no fault or delay configured they must be transparent."""

    def wrap(self, tier: Tier) -> Tier:
        return LatencyTier(FaultInjectingTier(tier))


class TestWrappedNVMe(TestNVMe):
    def wrap(self, tier: Tier) -> Tier:
        return GateTier(FaultInjectingTier(tier))


@pytest.mark.parametrize("kind", ["dram", "nvme"])
def test_wrappers_forward_capabilities_and_peek(kind: str, tmp_path: Path, mixed_layout: KVLayout) -> None:
    if kind == "nvme":
        pytest.importorskip("kvstrata.tiers.nvme", reason="nvme tier not available")
    options = {"path": str(tmp_path), "direct_io": "off"} if kind == "nvme" else {}
    factory = TierFactory(kind, options, mixed_layout)
    try:
        inner = factory.make(1024**2)
        for wrapper in (FaultInjectingTier(inner), LatencyTier(inner), GateTier(inner), WrapperTier(inner)):
            assert wrapper.capabilities == inner.capabilities
            assert (wrapper.name, wrapper.capacity) == (inner.name, inner.capacity)
            assert hasattr(wrapper, "peek") == hasattr(inner, "peek")  # the engine probes with getattr
    finally:
        factory.close_all()


def test_fault_injection_is_seeded_and_validated(mixed_layout: KVLayout) -> None:
    factory = TierFactory("dram", {}, mixed_layout)
    ids = [(k, 0) for k in raw_block_keys(40)]
    try:
        outcomes = []
        for _ in range(2):
            faulty = FaultInjectingTier(factory.make(1024**2), fail_writes=0.5, seed=3)
            outcomes.append(faulty.write(write_items(mixed_layout, ids)))
            assert faulty.injected["write"] == outcomes[-1].count(False)
            statuses, _ = read_back(faulty, mixed_layout, ids)
            assert [s is ReadStatus.OK for s in statuses] == outcomes[-1]  # a failed write stored nothing
        assert outcomes[0] == outcomes[1] and 5 < outcomes[0].count(False) < 35
    finally:
        factory.close_all()
    with pytest.raises(ValueError, match="fail_reads"):
        FaultInjectingTier(factory.make(1024), fail_reads=1.5)
    with pytest.raises(ValueError, match="negative"):
        LatencyTier(factory.make(1024), read_s=-1)


def test_a_down_tier_raises_tier_errors(mixed_layout: KVLayout) -> None:
    factory = TierFactory("dram", {}, mixed_layout, FaultInjectingTier)
    tier = factory.make(1024**2)
    assert isinstance(tier, FaultInjectingTier)
    tier.down = True
    for call in (
        lambda: tier.write(write_items(mixed_layout, [(b"k" * 16, 0)])),
        lambda: tier.read([((b"k" * 16, 0), np.zeros(256, np.uint8))]),
        lambda: tier.delete([(b"k" * 16, 0)]),
        lambda: tier.used_bytes,
        lambda: tier.has_room([256], 0),
    ):
        with pytest.raises(TierError, match="down"):
            call()
    tier.close()
    assert tier.closed


def test_nvme_direct_io_auto_round_trip(tmp_path: Path, mixed_layout: KVLayout) -> None:
    """``direct_io = "auto"`` uses O_DIRECT where the filesystem allows it and buffered I/O elsewhere."""
    pytest.importorskip("kvstrata.tiers.nvme", reason="nvme tier not available")
    factory = TierFactory("nvme", {"path": str(tmp_path), "direct_io": "auto"}, mixed_layout)
    try:
        tier = factory.make(1024**2)
        ids = [(k, layer) for k in raw_block_keys(5) for layer in range(mixed_layout.num_layers)]
        assert tier.write(write_items(mixed_layout, ids)) == [True] * len(ids)
        assert_read_back(tier, mixed_layout, ids)
        assert_read_back(tier, mixed_layout, ids, kind="torch")
        tier = factory.reopen(tier)
        assert_read_back(tier, mixed_layout, ids)
    finally:
        factory.close_all()
