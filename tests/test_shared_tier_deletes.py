"""In a shared tier a delete by block id removes every copy the tier knows of it, another
process's too. So an engine deletes there only what it means to: a demotion that could read only
some layers of a block (another process moved the rest) leaves its partial write in the tier
below, and a load that finds a block gone from where it looked drops it from its index without
deleting the copy another process wrote since.

Found by ``test_daemon_stress.py::test_kill_9_daemon_at_random_moments`` in CI: a writer's
demotion NVMe -> fs wrote the layers it could still read (the daemon had demoted the chain and
was deleting it from NVMe), then cleaned up that incomplete block by id, and the fs tier's delete
removed those layer-blocks from the daemon's complete object too: an acknowledged chain lost."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.tiers.fs.tier import FSTier
from kvstrata.workload.content import block_contents

BLOCKS = 32


def fs_tier(root: Path, **extra: Any) -> dict[str, Any]:
    return {"name": "fs", "kind": "fs", "capacity": "64MiB", "url": f"file://{root / 'fs'}", "promote": False, **extra}


def refresh_before_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fs delete lists the store first: the deleter's catalog has seen the other copy by then
    (a refresh that, unforced, happens whenever ``refresh_s`` has passed)."""
    real_delete = FSTier.delete

    def delete_after_refresh(self: FSTier, ids: Sequence[Any]) -> None:
        self._refresh(full=True)
        real_delete(self, ids)

    monkeypatch.setattr(FSTier, "delete", delete_after_refresh)


def check_loads(fs: dict[str, Any], keys: list[Any], bufs: dict[int, np.ndarray]) -> None:
    """A fresh engine finds every block of ``keys`` in ``fs`` and loads it byte-exact."""
    layout = get_layout("tiny")
    with Engine({"tiers": [fs]}, layout=layout) as fresh:
        assert fresh.lookup(keys).num_blocks == BLOCKS
        out = {layer: np.zeros_like(data) for layer, data in bufs.items()}
        assert fresh.load_sync(keys, out).loaded_blocks == BLOCKS
        for layer, data in out.items():
            assert np.array_equal(data, bufs[layer])


def test_a_partial_demotion_keeps_another_writers_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = get_layout("tiny")
    layers = range(layout.num_layers)
    fs = fs_tier(tmp_path, refresh_s=3600)  # the writer learns of the other copy only where the test says so
    chain = BLOCKS * sum(layout.layer_nbytes(layer) for layer in layers)
    dram = {"name": "dram", "capacity": chain + chain // 2, "promote": False, "write": "write-back"}
    tokens = np.arange(16 * BLOCKS, dtype=np.uint32) + 5
    with Engine({"tiers": [dram, fs]}, layout=layout) as writer:
        keys = writer.keys_for_tokens(tokens)
        bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in layers}
        assert writer.store_sync(keys, bufs).stored == BLOCKS
        with Engine({"tiers": [fs]}, layout=layout) as other:  # another process's complete copy
            assert other.store_sync(keys, bufs).stored == BLOCKS
            other.flush()
        refresh_before_delete(monkeypatch)
        writer._state.tiers[0].tier.delete([(k, 0) for k in keys])  # layer 0 gone from DRAM: partial reads
        more = writer.keys_for_tokens(tokens + 100_000)
        more_bufs = {layer: block_contents(more, layer, layout.layer_nbytes(layer)) for layer in layers}
        assert writer.store_sync(more, more_bufs).stored == BLOCKS  # evicts the first chain: its demotion
        writer.flush()
        assert writer.stats()["tiers"]["dram"]["evictions"] > 0
    monkeypatch.undo()
    check_loads(fs, keys, bufs)


def test_a_block_missing_where_a_reader_looked_keeps_its_new_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that finds a block gone from where its lookup saw it (another process moved it)
    drops it from its index but deletes nothing: the block's new copy stays."""
    layout = get_layout("tiny")
    layers = range(layout.num_layers)
    fs = fs_tier(tmp_path, gc_grace_s=0)  # a deleted object's file goes at once
    tokens = np.arange(16 * BLOCKS, dtype=np.uint32) + 9
    with Engine({"tiers": [fs]}, layout=layout) as first:
        keys = first.keys_for_tokens(tokens)
        ids = [(k, layer) for k in keys for layer in layers]
        bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in layers}
        assert first.store_sync(keys, bufs).stored == BLOCKS
        first.flush()
        with Engine({"tiers": [{**fs, "refresh_s": 3600}]}, layout=layout) as reader:
            assert reader.lookup(keys).num_blocks == BLOCKS  # seen in the first copy's object
            first._state.tiers[0].tier.delete(ids)  # that copy goes (its file too) ...
            with Engine({"tiers": [fs]}, layout=layout) as second:  # ... and another process writes it again
                assert second.store_sync(keys, bufs).stored == BLOCKS
                second.flush()
            refresh_before_delete(monkeypatch)
            out = {layer: np.zeros((BLOCKS, layout.layer_nbytes(layer)), np.uint8) for layer in layers}
            assert reader.load_sync(keys, out).loaded_blocks == 0  # missing where it looked
            reader.flush()
            monkeypatch.undo()
    check_loads(fs, keys, bufs)
