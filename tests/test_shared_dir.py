"""Two processes on one NVMe directory: what one stores after the other opened is found and loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents

WRITER = r"""
import sys, numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
layout = get_layout("tiny")
cfg = {"tiers": [{"name": "dram", "capacity": "16MiB"}, {"name": "nvme", "capacity": "64MiB", "path": sys.argv[1]}]}
with Engine(cfg, layout=layout) as engine:
    keys = engine.keys_for_tokens(np.arange(16 * int(sys.argv[2]), dtype=np.uint32))
    bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
    assert engine.store_sync(keys, bufs).stored == len(keys)
    engine.flush()
"""


def test_blocks_stored_by_another_process_after_open_are_found(tmp_path: Path) -> None:
    layout = get_layout("tiny")
    cfg = {
        "tiers": [{"name": "dram", "capacity": "16MiB"}, {"name": "nvme", "capacity": "64MiB", "path": str(tmp_path)}]
    }
    with Engine(cfg, layout=layout) as reader:  # opened before anything was written
        keys = reader.keys_for_tokens(np.arange(16 * 40, dtype=np.uint32))
        assert reader.lookup(keys).num_blocks == 0
        subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "30"], check=True, timeout=120)
        found = reader.lookup(keys)
        assert found.num_blocks == 30 and set(found.tiers) == {"nvme"}
        bufs = {i: np.zeros((30, layout.layer_nbytes(i)), np.uint8) for i in range(layout.num_layers)}
        res = reader.load_sync(keys[:30], bufs)
        assert res.loaded_blocks == 30
        for layer, data in bufs.items():
            assert np.array_equal(data, block_contents(keys[:30], layer, data.shape[1]))
        reader.flush()
        assert reader.lookup(keys).tiers[:30] == ["dram"] * 30  # promoted after the hit
