"""Tier capabilities: every tier declares them, callers read them (not getattr or kind names)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conformance import TierFactory

from kvstrata.core.buffers import Buffer
from kvstrata.core.layout import KVLayout
from kvstrata.daemon.metrics import DaemonMetrics
from kvstrata.daemon.scrub import _items
from kvstrata.daemon.watermarks import Watermarks
from kvstrata.errors import ConfigError
from kvstrata.planner.space import ByteSpace, MemorySpace, SegmentSpace, make_space, space_model
from kvstrata.tiers import TIERS, BlockId, ReadStatus, Tier, TierCapabilities, indexed, peekable, shrinkable
from kvstrata.tiers.wrappers import FaultInjectingTier, GateTier, LatencyTier, WrapperTier

EXPECTED = {  # kind -> flags it must declare (the rest of the set is free)
    "hbm": {"peek": True, "records": False, "shared": False, "device_memory": True, "space": "slots"},
    "dram": {"peek": True, "records": False, "shared": False, "space": "slots"},
    "nvme": {"peek": False, "records": True, "persistent": True, "shared": False, "space": "segments"},
    "fs": {"peek": False, "records": False, "shrink": True, "persistent": True, "shared": True, "space": "bytes"},
    "mooncake": {"peek": False, "records": False, "connection": True, "shared": True, "space": "bytes"},
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_registered_kind_declares_its_capabilities(kind: str) -> None:
    try:
        cls = TIERS.get(kind)
    except ConfigError as exc:  # mooncake without its optional dependency
        pytest.skip(str(exc))
    caps = cls.capabilities
    assert isinstance(caps, TierCapabilities)
    assert "capabilities" in vars(cls), f"{kind} inherits its capabilities instead of declaring them"
    for flag, value in EXPECTED[kind].items():
        assert getattr(caps, flag) == value, (kind, flag)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.peek = not caps.peek  # type: ignore[misc]


def test_every_registered_kind_is_covered() -> None:
    assert set(EXPECTED) <= set(TIERS.names())


def test_optional_methods_exist_exactly_where_declared() -> None:
    for kind in EXPECTED:
        try:
            cls = TIERS.get(kind)
        except ConfigError:
            continue
        caps = cls.capabilities
        assert callable(getattr(cls, "peek", None)) == caps.peek, kind
        for name in ("records", "delete_at", "compact", "refresh_used"):
            assert callable(getattr(cls, name, None)) == caps.records, (kind, name)
        for name in ("shrink", "maintain"):
            assert callable(getattr(cls, name, None)) == caps.shrink, (kind, name)
        assert hasattr(cls, "connected") == caps.connection, kind


def test_planner_space_model_comes_from_the_class() -> None:
    assert [space_model(k) for k in ("hbm", "dram", "nvme", "fs")] == ["slots", "slots", "segments", "bytes"]
    assert space_model("no-such-kind") == "bytes"
    sizes = [4096, 4096]
    assert isinstance(make_space("dram", 1 << 20, sizes), MemorySpace)
    assert isinstance(make_space("nvme", 1 << 30, sizes), SegmentSpace)
    assert isinstance(make_space("fs", 1 << 20, sizes), ByteSpace)


# -- wrappers ----------------------------------------------------------------------------------


def test_wrappers_forward_capabilities_peek_and_the_index(tmp_path: Path, mixed_layout: KVLayout) -> None:
    dram = TierFactory("dram", {}, mixed_layout)
    nvme = TierFactory("nvme", {"path": str(tmp_path), "direct_io": "off"}, mixed_layout)
    try:
        mem, disk = dram.make(1 << 20), nvme.make(1 << 24)
        for wrap in (FaultInjectingTier, LatencyTier, GateTier, WrapperTier):
            over_mem, over_disk = wrap(mem), wrap(disk)
            assert not indexed(over_mem) and not shrinkable(over_mem)
            assert over_mem.capabilities == mem.capabilities and peekable(over_mem)
            assert callable(getattr(over_mem, "peek", None))
            assert over_disk.capabilities == disk.capabilities and not peekable(over_disk)
            assert not hasattr(over_disk, "peek")  # the engine may still probe the attribute
            assert indexed(over_disk) and over_disk.records() == [] and over_disk.compact() == 0
        nested = LatencyTier(FaultInjectingTier(mem))
        assert peekable(nested) and nested.peek([]) == []
    finally:
        dram.close_all()
        nvme.close_all()


def test_nvme_machine_abilities_are_set_on_the_instance(
    tmp_path: Path, mixed_layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvstrata.tiers.nvme.state as nvme_state
    from kvstrata.tiers.nvme import NVMeTier

    before = NVMeTier.capabilities
    monkeypatch.setattr(nvme_state, "gds_available", lambda: True)  # as on a machine with kvikio and CUDA
    factory = TierFactory("nvme", {"path": str(tmp_path / "a"), "direct_io": "off"}, mixed_layout)
    try:
        with_gds = factory.make(1 << 24)
        assert with_gds.capabilities.gpu_direct and not with_gds.capabilities.direct_io
        assert NVMeTier.capabilities is before and not NVMeTier.capabilities.gpu_direct
        assert TIERS.get("nvme").capabilities == before
        assert FaultInjectingTier(with_gds).capabilities.gpu_direct  # a wrapper reports the instance's set
        monkeypatch.setattr(nvme_state, "gds_available", lambda: False)
        without = TierFactory("nvme", {"path": str(tmp_path / "b"), "direct_io": "off"}, mixed_layout)
        try:
            assert not without.make(1 << 24).capabilities.gpu_direct
        finally:
            without.close_all()
        # Everything else is the class's set.
        assert dataclasses.replace(with_gds.capabilities, gpu_direct=False) == before
    finally:
        factory.close_all()


# -- the daemon decides by capability -------------------------------------------------------------


class _Trap(Tier):
    """A tier that HAS records()/refresh_used()/shrink() methods but does not declare them:
    the daemon must go by ``capabilities`` and never call them."""

    capabilities = TierCapabilities(persistent=True)

    def __init__(self, blocks: dict[BlockId, bytes]) -> None:
        self.blocks = blocks
        self.calls: list[str] = []
        self.name, self.capacity = "trap", 1 << 20

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        return [False] * len(items)

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        return [ReadStatus.MISSING] * len(items)

    def delete(self, ids: Sequence[BlockId]) -> None:
        self.calls.append("delete")

    @property
    def used_bytes(self) -> int:
        return 1 << 30  # far above any watermark

    def scan(self) -> Iterator[tuple[BlockId, int]]:
        return iter((bid, len(b)) for bid, b in self.blocks.items())

    def records(self) -> list[tuple[BlockId, Any]]:
        self.calls.append("records")
        raise AssertionError("records() of a tier that does not declare it")

    def delete_at(self, records: Sequence[tuple[BlockId, Any]]) -> list[bool]:
        self.calls.append("delete_at")
        raise AssertionError("delete_at() of a tier that does not declare it")

    def refresh_used(self) -> int:
        self.calls.append("refresh_used")
        raise AssertionError("refresh_used() of a tier that does not declare it")

    def shrink(self, target_bytes: int, why: str = "") -> int:
        self.calls.append("shrink")
        raise AssertionError("shrink() of a tier that does not declare it")


def _trap() -> _Trap:
    return _Trap({(b"k" * 16, 0): b"x" * 64, (b"k" * 16, 1): b"y" * 64})


def test_scrub_walks_an_undeclared_index_by_scan() -> None:
    tier = _trap()
    assert sorted(_items(tier)) == sorted((bid, 64) for bid in tier.blocks)
    assert tier.calls == []


def test_watermarks_skip_a_tier_that_declares_no_index() -> None:
    tier = _trap()
    ns = SimpleNamespace(tier=lambda plan, create=False: tier, label="ns", fingerprint="ns", chain=[])
    plan = SimpleNamespace(name="trap", high=1024, low=512, position=0)
    result = Watermarks(DaemonMetrics(), 1 << 20, threading.Event()).enforce(ns, plan, lambda fp, key: False)  # type: ignore[arg-type]
    assert (result.demoted, result.dropped, result.expired_objects) == (0, 0, 0)
    assert tier.calls == []


def test_watermarks_use_a_declared_index() -> None:
    class Declared(_Trap):
        capabilities = dataclasses.replace(_Trap.capabilities, records=True)

        def refresh_used(self) -> int:
            self.calls.append("refresh_used")
            return 0  # under the watermark: nothing to do

    tier = Declared({})
    ns = SimpleNamespace(tier=lambda plan, create=False: tier, label="ns", fingerprint="ns", chain=[])
    plan = SimpleNamespace(name="t", high=1024, low=512, position=0)
    Watermarks(DaemonMetrics(), 1 << 20, threading.Event()).enforce(ns, plan, lambda fp, key: False)  # type: ignore[arg-type]
    assert tier.calls == ["refresh_used"]


def test_memory_peek_views_the_stored_bytes(mixed_layout: KVLayout) -> None:
    factory = TierFactory("dram", {}, mixed_layout)
    try:
        tier = factory.make(1 << 20)
        n = mixed_layout.layer_nbytes(0)
        data = np.arange(n, dtype=np.uint8)
        bid = (b"p" * 16, 0)
        assert tier.write([(bid, data)]) == [True]
        assert peekable(tier)
        (view,) = tier.peek([bid])
        assert view is not None and np.array_equal(np.asarray(view).view(np.uint8).reshape(-1), data)
    finally:
        factory.close_all()


def test_planner_reads_capabilities_not_kind_names() -> None:
    """A kind the planner has never heard of is planned by what its class declares: device
    memory is free to load from and not promoted into, a slot arena in host memory loads over
    the host link, segment files count as SSD; an unloadable kind has no capability set."""
    from kvstrata.planner.costmodel import GPUS, CostModel, model_compute
    from kvstrata.planner.kinds import in_device_memory, kind_capabilities
    from kvstrata.planner.spec import tiers_from_text
    from kvstrata.tiers.memory import DRAMTier, HBMTier
    from kvstrata.tiers.nvme import NVMeTier

    assert kind_capabilities("no-such-kind") is None and not in_device_memory("no-such-kind")
    assert in_device_memory("hbm") and not in_device_memory("dram")
    fakes = {"test-gpu-pool": HBMTier, "test-host-pool": DRAMTier, "test-drive": NVMeTier}
    for name, cls in fakes.items():
        TIERS.register(name, type(name.title().replace("-", ""), (cls,), {}))
    try:
        gpu, host, drive = tiers_from_text(
            "gpu=1GiB:kind=test-gpu-pool,host=1GiB:kind=test-host-pool,disk=1TiB:kind=test-drive"
        )
        assert (gpu.kind, gpu.promote, host.promote) == ("test-gpu-pool", False, True)
        assert drive.is_ssd and not host.is_ssd
        cost = CostModel(model_compute("tiny"), GPUS["h100"])
        assert cost.tier_bandwidth("gpu", "test-gpu-pool") is None
        assert cost.tier_bandwidth("host", "test-host-pool") == GPUS["h100"].host_link_gbps * 1e9
    finally:
        for name in fakes:
            TIERS.unregister(name)
