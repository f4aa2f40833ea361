"""The engine with CUDA tensors as store sources and load destinations, layer by layer, over the
memory and nvme tiers, and the per-layer policies of a hybrid layout on CUDA buffers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conformance import block_bytes, chain_keys

from gpu.helpers import device_bytes, engine_buffers, on_device
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec, uniform_layout
from kvstrata.engine.engine import Engine

LAYOUT = uniform_layout("gpu-engine", num_layers=3, num_kv_heads=2, head_dim=64, block_size=4, dtype="bfloat16")


def tiers_for(name: str, device: str, root: Path) -> list[dict[str, Any]]:
    block = LAYOUT.block_nbytes
    dram: dict[str, Any] = {"name": "dram", "capacity": 12 * block, "pin_memory": "on" if device == "cuda" else "off"}
    nvme: dict[str, Any] = {"name": "nvme", "capacity": "64MiB", "path": str(root / "nvme"), "direct_io": "auto"}
    choices: dict[str, list[dict[str, Any]]] = {
        "hbm": [{"name": "hbm", "capacity": 64 * block}],
        "dram-pinned": [dram | {"capacity": 64 * block}],
        "dram+nvme": [dram | {"write": "write-through"}, nvme],  # DRAM holds 12 of 24 blocks: loads read NVMe too
    }
    return choices[name]


@pytest.mark.parametrize("tiers", ["hbm", "dram-pinned", "dram+nvme"])
def test_store_and_load_device_tensors_layer_by_layer(tmp_path: Path, device: str, tiers: str) -> None:
    with Engine({"tiers": tiers_for(tiers, device, tmp_path)}, layout=LAYOUT) as engine:
        chains = [chain_keys(LAYOUT, seed, 4) for seed in range(6)]
        for keys in chains:
            result = engine.store_sync(keys, engine_buffers(LAYOUT, keys, device))
            assert result.stored == len(keys) and not result.failed
        engine.flush()
        for keys in chains:
            bufs = engine_buffers(LAYOUT, keys, device, fill=False)
            handle = engine.load(keys, bufs)
            for layer in range(LAYOUT.num_layers):  # as a model consumes them: layer 0 first
                assert handle.wait_layer(layer, timeout=30)
                for i, key in enumerate(keys):
                    buf = bufs[layer][i]
                    assert buf.device.type == device
                    assert (device_bytes(buf) == block_bytes(key, layer, LAYOUT.layer_nbytes(layer))).all(), (
                        tiers,
                        layer,
                        i,
                    )
            loaded = handle.result(timeout=30)
            assert loaded.ok and loaded.loaded_blocks == len(keys)
        if tiers == "dram+nvme":
            assert engine.stats()["tiers"]["dram"]["evictions"] > 0
            assert engine.stats()["tiers"]["nvme"]["live_bytes"] >= 24 * LAYOUT.block_nbytes


def hybrid_layout() -> KVLayout:
    """A sliding layer (window 8 tokens = 2 blocks), a full layer, a state layer."""
    return KVLayout(
        model="gpu-hybrid",
        block_size=4,
        layers=(
            LayerSpec("layers.0.swa", LayerKind.SLIDING, (2, 4, 1, 8), "float16", 8),
            LayerSpec("layers.1.attn", LayerKind.FULL, (2, 4, 1, 8), "float16"),
            LayerSpec("layers.2.linear_attn", LayerKind.LINEAR, (96,), "float16"),
        ),
    )


def test_per_layer_policies_on_device_buffers(tmp_path: Path, device: str) -> None:
    """Sliding-window retention, state snapshots at restore points and a sparse restore, all with
    buffers on ``device``: what is kept is what the policy says, and every byte restored is exact."""
    layout = hybrid_layout()
    tiers = [
        {"name": "dram", "capacity": "1MiB", "pin_memory": "on" if device == "cuda" else "off"},
        {"name": "nvme", "capacity": "64MiB", "path": str(tmp_path / "nvme"), "direct_io": "auto"},
    ]
    with Engine({"tiers": tiers}, layout=layout) as engine:
        assert engine.hybrid
        keys = chain_keys(layout, 5, 12)
        points = engine.restore_points(keys, first_block=0)
        assert points == [12]
        bufs: dict[int, dict[int, torch.Tensor]] = {}
        for layer, spec in enumerate(layout.layers):
            rows = range(len(keys)) if spec.kind is not LayerKind.LINEAR else [p - 1 for p in points]
            bufs[layer] = {i: on_device(layout, layer, device, block_bytes(keys[i], layer, spec.nbytes)) for i in rows}
        engine.store_sync(keys, bufs, first_block=0)
        engine.flush()
        held = [engine.contains(k).get("dram", 0) for k in keys]
        assert [i for i, m in enumerate(held) if m & 0b001] == [10, 11]  # the window before the restore point
        assert [i for i, m in enumerate(held) if m & 0b100] == [11]  # one state snapshot
        assert all(m & 0b010 for m in held)
        needs = engine.restore_needs(len(keys))
        dst = {layer: {i: on_device(layout, layer, device) for i in needs[layer]} for layer in needs}
        result = engine.load_sync(keys, dst)
        assert result.loaded_blocks == 12 and result.layer_blocks == needs
        for layer, blocks in dst.items():
            for i, buf in blocks.items():
                assert buf.device.type == device
                assert (device_bytes(buf) == block_bytes(keys[i], layer, layout.layer_nbytes(layer))).all(), (layer, i)
