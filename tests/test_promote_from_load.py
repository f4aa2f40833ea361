"""A restore from a lower tier promotes its blocks from the load's own destination buffers.

Before, the promotion re-read every block from the tier it was just read from (a background copy
``nvme -> dram``), so a restore from NVMe read the disk twice. The load's bytes were checked by
the read that put them in place, so the copy up now comes from them, before the load's result
(the caller owns its buffers again once the load is done). Loads that do not put every layer of
a block in place still promote from the lower tier, in the background, as before.

Shapes: a 70B-class layout (80 layers, 16 KiB layer-blocks at tensor-parallel 4), a DRAM tier
over an NVMe tier, a fresh engine that finds the blocks only on NVMe (a restarted instance)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.core.buffers import Pages
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine
from kvstrata.tiers.wrappers import FaultInjectingTier
from kvstrata.workload.content import block_contents, count_mismatches

pytest.importorskip("kvstrata.tiers.nvme", reason="nvme tier not available")

EngineFactory = Callable[..., Engine]
BLOCKS = 12


@pytest.fixture
def big() -> KVLayout:
    return get_layout("llama-3.1-70b", tp_size=4)


def _tiers(layout: KVLayout, tmp_path: Path) -> list[dict[str, Any]]:
    block = layout.block_nbytes
    return [
        {"name": "dram", "capacity": 2 * BLOCKS * block},
        {"name": "nvme", "capacity": 4 * BLOCKS * block + (64 << 20), "path": str(tmp_path / "nvme")},
    ]


def _keys(engine: Engine, salt: int) -> list[Key]:
    tokens = np.arange(BLOCKS * engine.layout.block_size, dtype=np.uint32) + np.uint32(salt * 7919)
    return engine.keys_for_tokens(tokens)


def _contents(keys: list[Key], layout: KVLayout) -> dict[int, np.ndarray]:
    return {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in range(layout.num_layers)}


def _on_nvme_only(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path, dram: dict[str, Any] | None = None, **kw: Any
) -> tuple[Engine, list[Key]]:
    """A fresh engine whose blocks are all on NVMe (stored by an engine before it, then closed);
    ``dram``: settings of its DRAM tier besides the defaults."""
    first = make_engine(*_tiers(big, tmp_path), layout=big)
    keys = _keys(first, 1)
    assert first.store_sync(keys, _contents(keys, big)).stored == BLOCKS
    first.flush()
    first.close()
    top, nvme = _tiers(big, tmp_path)
    engine = make_engine({**top, **(dram or {})}, nvme, layout=big, **kw)
    assert engine.lookup(keys).tiers == ["nvme"] * BLOCKS
    return engine, keys


def _bad(keys: list[Key], layout: KVLayout, got: dict[int, np.ndarray]) -> int:
    return sum(count_mismatches(keys, layer, got[layer]) for layer in range(layout.num_layers))


def _assert_promoted_from_below(engine: Engine, keys: list[Key], big: KVLayout) -> None:
    """A whole load from NVMe arrives intact, and its promotion into DRAM read NVMe again."""
    dst = {layer: np.zeros((BLOCKS, big.layer_nbytes(layer)), np.uint8) for layer in range(big.num_layers)}
    assert engine.load_sync(keys, dst).tiers == ["nvme"] * BLOCKS
    assert _bad(keys, big, dst) == 0
    _assert_promoted_after(engine, keys, big)


def _assert_promoted_after(engine: Engine, keys: list[Key], big: KVLayout) -> None:
    """Once the background copies are done, every block is in DRAM, read from NVMe a second time."""
    engine.flush()
    stats = engine.stats()["tiers"]
    assert stats["dram"]["promotions"] == BLOCKS
    assert stats["nvme"]["bytes_read"] == 2 * BLOCKS * big.block_nbytes
    assert engine.lookup(keys).tiers == ["dram"] * BLOCKS


def test_a_restore_from_nvme_reads_each_block_once(make_engine: EngineFactory, big: KVLayout, tmp_path: Path) -> None:
    engine, keys = _on_nvme_only(make_engine, big, tmp_path)
    dst = {layer: np.zeros((BLOCKS, big.layer_nbytes(layer)), np.uint8) for layer in range(big.num_layers)}
    result = engine.load_sync(keys, dst)
    assert result.loaded_blocks == BLOCKS and result.tiers == ["nvme"] * BLOCKS
    assert _bad(keys, big, dst) == 0
    # promoted by the time the load returned, from the bytes it delivered
    assert engine.lookup(keys).tiers == ["dram"] * BLOCKS
    for arr in dst.values():  # the caller owns its buffers again: scribbling on them changes nothing
        arr[:] = 0xAB
    engine.flush()
    stats = engine.stats()["tiers"]
    assert stats["nvme"]["bytes_read"] == BLOCKS * big.block_nbytes  # each block read from the disk once
    assert stats["dram"]["promotions"] == BLOCKS
    again = {layer: np.zeros_like(arr) for layer, arr in dst.items()}
    assert engine.load_sync(keys, again).tiers == ["dram"] * BLOCKS
    assert _bad(keys, big, again) == 0


def test_a_layer_wise_restore_into_pages_promotes_before_its_result(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path
) -> None:
    """The connector's restore: pages of a torch cache, waited for layer by layer."""
    engine, keys = _on_nvme_only(make_engine, big, tmp_path)
    pages = BLOCKS + 5
    cache = {layer: torch.zeros((pages, big.layer_nbytes(layer)), dtype=torch.uint8) for layer in range(big.num_layers)}
    ids = [(3 + 7 * i) % pages for i in range(BLOCKS)]
    assert len(set(ids)) == BLOCKS
    handle = engine.load(keys, {layer: Pages(cache[layer], ids) for layer in cache})
    for layer in range(big.num_layers):
        handle.wait_layer(layer)
    assert handle.result().loaded_blocks == BLOCKS
    got = {layer: cache[layer][ids].numpy() for layer in cache}
    assert _bad(keys, big, got) == 0
    assert engine.lookup(keys).tiers == ["dram"] * BLOCKS
    for t in cache.values():  # vLLM reuses the pages once the request is done
        t.fill_(0x5A)
    engine.flush()
    assert engine.stats()["tiers"]["nvme"]["bytes_read"] == BLOCKS * big.block_nbytes
    again = _contents(keys, big)
    for arr in again.values():
        arr[:] = 0
    assert engine.load_sync(keys, again).tiers == ["dram"] * BLOCKS
    assert _bad(keys, big, again) == 0


def test_a_failing_upper_tier_loses_the_promotion_not_the_load(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path
) -> None:
    engine, keys = _on_nvme_only(make_engine, big, tmp_path, wrap={0: lambda t: FaultInjectingTier(t, fail_writes=1.0)})
    dst = _contents(keys, big)
    for arr in dst.values():
        arr[:] = 0
    result = engine.load_sync(keys, dst)
    assert result.loaded_blocks == BLOCKS and _bad(keys, big, dst) == 0
    engine.flush()
    stats = engine.stats()["tiers"]
    assert stats["dram"]["promotions"] == 0 and stats["dram"]["blocks"] == 0
    assert stats["dram"]["write_failures"] >= 1
    assert engine.lookup(keys).tiers == ["nvme"] * BLOCKS  # still served from below


def test_a_load_of_some_layers_promotes_whole_blocks_from_below(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path
) -> None:
    """Its buffers hold only the layers asked for: the promotion reads the rest from the lower
    tier (every layer of each block, in the background), as before."""
    engine, keys = _on_nvme_only(make_engine, big, tmp_path)
    some = [0, 1, big.num_layers - 1]
    dst = {layer: np.zeros((BLOCKS, big.layer_nbytes(layer)), np.uint8) for layer in some}
    assert engine.load_sync(keys, dst).loaded_blocks == BLOCKS
    assert all(count_mismatches(keys, layer, dst[layer]) == 0 for layer in some)
    engine.flush()
    stats = engine.stats()["tiers"]
    assert stats["dram"]["promotions"] == BLOCKS
    assert stats["nvme"]["bytes_read"] == BLOCKS * (big.block_nbytes + sum(big.layer_nbytes(la) for la in some))
    whole = _contents(keys, big)
    for arr in whole.values():
        arr[:] = 0
    assert engine.load_sync(keys, whole).tiers == ["dram"] * BLOCKS
    assert _bad(keys, big, whole) == 0


def test_a_write_back_upper_tier_promotes_from_below(make_engine: EngineFactory, big: KVLayout, tmp_path: Path) -> None:
    """Making room in a write-back tier copies its victims down first, which the load's result
    must not wait for: such a tier is promoted into from the lower tier, in the background."""
    engine, keys = _on_nvme_only(make_engine, big, tmp_path, dram={"write": "write-back"})
    _assert_promoted_from_below(engine, keys, big)


def test_buffers_not_copied_by_address_promote_from_below(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffers the engine cannot copy by address (device memory on a GPU host: the CUDA variant
    of ``tests/gpu/test_gpu_engine.py`` loads into such) would take a copy per layer-block on the
    load's critical path: their promotion still reads the lower tier, in the background. Here
    the mover is told the load's buffers have no host addresses, as it is for CUDA tensors."""
    from kvstrata.engine import mover

    monkeypatch.setattr(mover, "layers_row_addresses", lambda *a: None)
    engine, keys = _on_nvme_only(make_engine, big, tmp_path)
    _assert_promoted_from_below(engine, keys, big)


def test_a_load_does_not_wait_for_a_store_holding_the_upper_tier(
    make_engine: EngineFactory, big: KVLayout, tmp_path: Path
) -> None:
    """A store making room in DRAM holds its space for as long as its copy runs (seconds for a
    large batch behind demotions). A load that finds DRAM held returns without waiting, and its
    blocks are promoted from below in the background once the store is done."""
    engine, keys = _on_nvme_only(make_engine, big, tmp_path)
    top = engine._state.tiers[0]
    dst = {layer: np.zeros((BLOCKS, big.layer_nbytes(layer)), np.uint8) for layer in range(big.num_layers)}
    done = threading.Event()

    def load() -> None:
        engine.load_sync(keys, dst)
        done.set()

    with top.space_lock:  # what a store does while it writes
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        finished = done.wait(timeout=60)
        assert finished, "the load waited for the upper tier's writer"
        assert engine.stats()["tiers"]["dram"]["promotions_deferred"] == 1
    loader.join()
    assert _bad(keys, big, dst) == 0
    _assert_promoted_after(engine, keys, big)  # from below
