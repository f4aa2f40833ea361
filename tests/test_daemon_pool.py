"""The daemon holds the node's Mooncake pool segment, so pool objects outlive the inference
process that put them (a real ``mooncake_master`` on loopback; skipped without ``mooncake.store``).

An inference process that contributes no memory of its own (``global_segment_size = 0``) puts
blocks into the pool, and exits; they live in the daemon's segment, and another process reads
them back byte-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from servers_mooncake import MooncakeMaster, master_binary, mooncake_import_error, tier_options
from test_daemon_support import DaemonProcess

from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents

IMPORT_ERROR = mooncake_import_error()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(IMPORT_ERROR is not None or master_binary() is None, reason=f"no mooncake: {IMPORT_ERROR}"),
]

WRITER = r"""
import json, sys, numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
layout = get_layout("tiny")
config, n = json.loads(sys.argv[1]), int(sys.argv[2])
with Engine(config, layout=layout) as engine:
    keys = engine.keys_for_tokens(np.arange(layout.block_size * n, dtype=np.uint32))
    bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
    print(json.dumps({"stored": engine.store_sync(keys, bufs).stored}), flush=True)
"""


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster(tmp_path / "master")
    m.start()
    try:
        yield m
    finally:
        m.stop()


def test_pool_objects_outlive_the_process_that_put_them(tmp_path: Path, master: MooncakeMaster) -> None:
    layout = get_layout("tiny")
    held = {"name": "pool", "kind": "mooncake", "capacity": "16MiB", **tier_options(master.address, "daemon-pool")}
    nvme = f'[[tiers]]\nname = "nvme"\ncapacity = "64MiB"\npath = "{tmp_path / "nvme"}"\n'
    pool = "[[tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in held.items())
    cfg_path = tmp_path / "kv.toml"
    cfg_path.write_text(nvme + pool + "[daemon]\nmetrics_port = 0\nscrub_bytes_per_s = 0\n")
    client = {"tiers": [{**held, "global_segment_size": 0}]}  # contributes nothing to the pool
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        assert d.status()["pool"] == [{"tier": "pool", "connected": True}]
        assert d.metric("kvstrata_daemon_pool_connected", tier="pool") == 1
        n = 24
        out = subprocess.run(
            [sys.executable, "-c", WRITER, json.dumps(client), str(n)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1]) == {"stored": n}, out.stderr[-2000:]
        with Engine(client, layout=layout) as reader:  # the writer is gone; its blocks are not
            keys = reader.keys_for_tokens(np.arange(layout.block_size * n, dtype=np.uint32))
            found = reader.lookup(keys)
            assert found.num_blocks == n and set(found.tiers) == {"pool"}
            bufs = {i: np.zeros((n, layout.layer_nbytes(i)), np.uint8) for i in range(layout.num_layers)}
            assert reader.load_sync(keys, bufs).loaded_blocks == n
            for layer, data in bufs.items():
                assert np.array_equal(data, block_contents(keys, layer, data.shape[1]))
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()
