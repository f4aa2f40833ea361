"""Two processes on one NVMe directory: what one stores after the other opened is found and loaded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.tiers.nvme.options import RESCAN_S
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


FILLER = r"""
import sys, numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
layout = get_layout("tiny")
cfg = {"tiers": [{"name": "nvme", "capacity": "1MiB", "path": sys.argv[1], "write": "write-back", "promote": False},
                 {"name": "fs", "kind": "fs", "capacity": "64MiB", "url": "file://" + sys.argv[2], "promote": False}]}
with Engine(cfg, layout=layout) as engine:
    keys = engine.keys_for_tokens(np.arange(16 * int(sys.argv[3]), dtype=np.uint32) + 7)
    bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
    assert engine.store_sync(keys, bufs).stored == len(keys)
    print(engine.stats()["tiers"]["nvme"]["used_bytes"])
"""


def test_a_writer_makes_room_in_a_tier_another_process_filled_after_it_opened(tmp_path: Path) -> None:
    """The first engine knows no block of the tier when it must make room: it takes in what the
    other process stored (a scan of the shared index) and demotes those, instead of failing
    every write until a lookup happens to adopt them. Nothing of the other's is lost."""
    layout = get_layout("tiny")
    nvme, fs = tmp_path / "nvme", tmp_path / "fs"
    cfg = {
        "tiers": [
            {"name": "nvme", "capacity": "1MiB", "path": str(nvme), "write": "write-back", "promote": False},
            {"name": "fs", "kind": "fs", "capacity": "64MiB", "url": f"file://{fs}", "promote": False},
        ]
    }
    with Engine(cfg, layout=layout) as late:  # opened while the directory was empty
        theirs = 240  # 240 blocks x 4 layers x 1 KiB: the other fills the 1 MiB tier
        out = subprocess.run(
            [sys.executable, "-c", FILLER, str(nvme), str(fs), str(theirs)],
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        assert int(out.stdout.split()[-1]) > 900 * 1024, out.stdout
        time.sleep(RESCAN_S + 0.1)  # past the tier's cached view of the segment files' sizes
        keys = late.keys_for_tokens(np.arange(16 * 64, dtype=np.uint32))
        bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in range(4)}
        assert late.store_sync(keys, bufs).stored == 64
        nvme_stats = late.stats()["tiers"]["nvme"]
        assert nvme_stats["rescans"] >= 1 and nvme_stats["demotions"] > 0, nvme_stats
    with Engine(cfg, layout=layout) as check:
        other = check.keys_for_tokens(np.arange(16 * theirs, dtype=np.uint32) + 7)
        for chain in (keys, other):
            hit = check.lookup(chain)
            assert hit.num_blocks == len(chain), set(hit.tiers)
            got = {layer: np.zeros((len(chain), layout.layer_nbytes(layer)), np.uint8) for layer in range(4)}
            assert check.load_sync(chain, got).loaded_blocks == len(chain)
            for layer, data in got.items():
                assert np.array_equal(data, block_contents(chain, layer, data.shape[1]))
