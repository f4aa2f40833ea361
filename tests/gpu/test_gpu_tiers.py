"""The memory tiers on CUDA: the conformance suite on an hbm tier whose arena is CUDA memory, and
dram with pinned host memory, written from and read into buffers on either device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conformance import MiB, TierConformance, TierFactory, raw_block_keys

from gpu.helpers import device_bytes, items_on, on_device, wrong_blocks
from kvstrata.testing.oracle import mixed_layout
from kvstrata.tiers import ReadStatus, Tier
from kvstrata.tiers.memory import SlotArena


@pytest.mark.gpu
class TestCudaHBM(TierConformance):
    """Every conformance test, with the hbm tier's arena in CUDA memory (host buffers in and out:
    each read and write is a host <-> device copy)."""

    kind = "hbm"

    def wrap(self, tier: Tier) -> Tier:
        storage = tier._arena._storage  # type: ignore[attr-defined]
        assert isinstance(storage, torch.Tensor) and storage.device.type == "cuda", "hbm arena is not CUDA memory"
        return tier


def memory_options(kind: str, device: str) -> dict[str, str]:
    """dram pinned where CUDA is under test (``pin_memory = "on"`` needs CUDA), plain otherwise."""
    if kind == "dram":
        return {"pin_memory": "on" if device == "cuda" else "off"}
    return {}


@pytest.mark.parametrize("kind", ["hbm", "dram"])
def test_memory_tier_round_trip_with_device_buffers(kind: str, device: str) -> None:
    """Blocks written from buffers on ``device`` read back byte-exact into buffers on ``device`` and
    on the host, and a missing or wrong-sized destination is a miss, not a copy."""
    layout = mixed_layout()
    factory = TierFactory(kind, memory_options(kind, device), layout)
    try:
        tier = factory.make(MiB)
        storage = tier._arena._storage  # type: ignore[attr-defined]
        if device == "cuda":
            if kind == "hbm":
                assert storage.device.type == "cuda"
            else:
                assert isinstance(storage, torch.Tensor) and storage.is_pinned()
        ids = [(k, layer) for k in raw_block_keys(6) for layer in range(layout.num_layers)]
        assert tier.write(items_on(layout, ids, device)) == [True] * len(ids)
        for where in dict.fromkeys([device, "cpu"]):
            bufs = [on_device(layout, layer, where) for _, layer in ids]
            assert tier.read(list(zip(ids, bufs, strict=True))) == [ReadStatus.OK] * len(ids)
            assert all(b.device.type == where for b in bufs)
            assert wrong_blocks(layout, ids, bufs) == []
        absent = raw_block_keys(1, seed=9)[0]
        small = torch.zeros(8, dtype=torch.uint8, device=device)
        assert tier.read([((absent, 0), on_device(layout, 0, device)), (ids[0], small)]) == [ReadStatus.MISSING] * 2
        assert not device_bytes(small).any()
    finally:
        factory.close_all()


def test_pinned_arena_copies_to_and_from_cuda(device: str) -> None:
    """The copy engine path: CUDA (or host) tensor -> pinned (or plain) host slot -> CUDA (or host)."""
    from kvstrata.core.buffers import copy_many

    pin = device == "cuda"
    arena = SlotArena(MiB, "cpu", pin=pin)
    try:
        src = torch.arange(4096, dtype=torch.int32, device=device).view(torch.uint8)  # 16 KiB
        off = arena.allocate(src.numel())
        assert off is not None
        copy_many([(arena.span(off, src.numel()), src)], background=True)
        dst = torch.zeros_like(src)
        copy_many([(dst, arena.span(off, src.numel()))])
        assert torch.equal(dst.cpu(), src.cpu())
        assert bytes(arena.view(off, src.numel()).numpy() if pin else arena.view(off, src.numel())) == bytes(
            device_bytes(src)
        )
    finally:
        arena.close()


def test_dram_pin_memory_on_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    """Only where CUDA is absent: ``pin_memory = "on"`` cannot pin, and says so at open."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pinning works here")
    from kvstrata.errors import TierError

    factory = TierFactory("dram", {"pin_memory": "on"}, mixed_layout())
    make: Callable[[int], Tier] = factory.make
    with pytest.raises((TierError, RuntimeError)):
        make(MiB)
