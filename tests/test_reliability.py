"""Faults on real files: kill -9 while storing, flipped bytes in segments, verify and repair."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents

pytestmark = pytest.mark.slow


def nvme_config(path: Path, capacity: str = "256MiB") -> dict[str, object]:
    return {"tiers": [{"name": "nvme", "capacity": capacity, "path": str(path), "direct_io": "auto"}]}


WRITER = r"""
import sys, numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
path = sys.argv[1]
layout = get_layout("tiny")
cfg = {"tiers": [{"name": "nvme", "capacity": "256MiB", "path": path}]}
with Engine(cfg, layout=layout) as engine:
    rng = np.random.default_rng(int(sys.argv[2]))
    while True:
        toks = rng.integers(0, 32000, size=16 * 8, dtype=np.uint32)
        keys = engine.keys_for_tokens(toks)
        bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
        res = engine.store_sync(keys, bufs)
        if res.stored == len(keys):
            print(" ".join(k.hex() for k in keys), flush=True)
"""


def _check_all_present(path: Path, acked: list[bytes]) -> None:
    layout = get_layout("tiny")
    with Engine(nvme_config(path), layout=layout) as engine:
        found = engine.lookup(acked)
        assert found.num_blocks == len(acked), "an acknowledged block is missing after kill -9"
        bufs = {
            layer: np.zeros((len(acked), layout.layer_nbytes(layer)), np.uint8) for layer in range(layout.num_layers)
        }
        res = engine.load_sync(acked, bufs)
        assert res.loaded_blocks == len(acked)
        for layer, data in bufs.items():
            assert np.array_equal(data, block_contents(acked, layer, data.shape[1]))
        reports = engine.verify()
        assert reports and all(r["bad_checksums"] == 0 and r["missing_data"] == 0 for r in reports), reports


def test_kill_9_while_storing_loses_no_acknowledged_block(tmp_path: Path) -> None:
    rnd = random.Random(1234)
    acked: list[bytes] = []
    for trial in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / "nvme"), str(trial)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the engine is up and one batch is durable
        assert first, proc.stderr.read() if proc.stderr else ""
        time.sleep(rnd.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        with proc:  # read through the buffered reader: communicate() skips what readline() buffered
            rest = proc.stdout.read()
        for line in [first, *rest.splitlines()]:
            if line.strip() and len(line.split()) == 8:  # a torn last line was not acknowledged
                acked.extend(bytes.fromhex(h) for h in line.split())
        _check_all_present(tmp_path / "nvme", acked)
    assert len(acked) >= 80


def _store_chain(path: Path, n_blocks: int) -> list[bytes]:
    layout = get_layout("tiny")
    with Engine(nvme_config(path), layout=layout) as engine:
        keys = engine.keys_for_tokens(np.arange(16 * n_blocks, dtype=np.uint32))
        bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in range(layout.num_layers)}
        assert engine.store_sync(keys, bufs).stored == n_blocks
    return keys


def _flip_bytes(path: Path, count: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    segs = sorted((path).rglob("*.seg"))
    assert segs
    for _ in range(count):
        seg = rnd.choice(segs)
        size = seg.stat().st_size
        with open(seg, "r+b") as f:
            off = rnd.randrange(0, size)
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def _kvstrata(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_flipped_bytes_are_misses_and_verify_reports_them(tmp_path: Path) -> None:
    keys = _store_chain(tmp_path / "nvme", 64)
    _flip_bytes(tmp_path / "nvme", 200)
    cfg = tmp_path / "kv.toml"
    cfg.write_text(f'[[tiers]]\nname = "nvme"\ncapacity = "256MiB"\npath = "{tmp_path / "nvme"}"\n')
    bad = _kvstrata("verify", "--config", str(cfg), "--json", str(tmp_path / "v.json"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert not report["ok"] and report["namespaces"][0]["bad_checksums"] >= 1
    layout = get_layout("tiny")
    with Engine(nvme_config(tmp_path / "nvme"), layout=layout) as engine:
        bufs = {layer: np.zeros((len(keys), layout.layer_nbytes(layer)), np.uint8) for layer in range(4)}
        res = engine.load_sync(keys, bufs)
        n = res.loaded_blocks
        assert n < len(keys), "flipped bytes went unnoticed"
        for layer, data in bufs.items():  # whatever was reported loaded is byte-exact
            assert np.array_equal(data[:n], block_contents(keys[:n], layer, data.shape[1]))
        assert engine.stats()["tiers"]["nvme"]["checksum_failures"] >= 1
        assert engine.lookup(keys).num_blocks == n  # the corrupt block is forgotten
    fixed = _kvstrata("verify", "--config", str(cfg), "--repair", "--json", str(tmp_path / "r.json"))
    assert fixed.returncode == 0, fixed.stderr
    again = _kvstrata("verify", "--config", str(cfg), "--json", str(tmp_path / "v2.json"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "v2.json").read_text())["ok"]


BAD_CONFIGS = {
    "malformed": ('[[tiers]\nname = "dram"\n', "malformed TOML"),
    "unknown tier": ('[[tiers]]\nname = "tape"\n', "unknown tier 'tape'"),
    "unknown eviction": ('[[tiers]]\nname = "dram"\neviction = "mru"\n', "unknown eviction 'mru'"),
    "unknown admission": ('[[tiers]]\nname = "dram"\nadmission = "never"\n', "unknown admission 'never'"),
    "negative size": ('[[tiers]]\nname = "dram"\ncapacity = -5\n', "-5"),
    "non-numeric size": ('[[tiers]]\nname = "dram"\ncapacity = "lots"\n', "'lots'"),
    "bad unit": ('[[tiers]]\nname = "dram"\ncapacity = "5XB"\n', "'5XB'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_a_clear_error_with_status_2(tmp_path: Path, case: str) -> None:
    text, needle = BAD_CONFIGS[case]
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    trace = tmp_path / "t.jsonl"
    assert _kvstrata("trace", "synth", "--out", str(trace), "--sessions", "1", "--turns", "1").returncode == 0
    res = _kvstrata("replay", "--trace", str(trace), "--config", str(cfg))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert needle in res.stderr.replace("\n", " "), res.stderr


def test_nvme_path_that_is_a_file_or_unwritable(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    trace = tmp_path / "t.jsonl"
    _kvstrata("trace", "synth", "--out", str(trace), "--sessions", "1", "--turns", "1")
    for path in (afile, afile / "sub", Path("/proc/kvstrata-cannot-write")):
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[[tiers]]\nname = "nvme"\ncapacity = "64MiB"\npath = "{path}"\n')
        res = _kvstrata("replay", "--trace", str(trace), "--config", str(cfg))
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stderr
        assert "path" in res.stderr


def test_other_layout_gets_a_separate_namespace(tmp_path: Path) -> None:
    keys = _store_chain(tmp_path / "nvme", 8)
    other = get_layout("tiny", block_size=32)
    with Engine(nvme_config(tmp_path / "nvme"), layout=other) as engine:
        assert engine.stats()["tiers"]["nvme"]["blocks"] == 0
        assert engine.lookup(keys).num_blocks == 0
    dirs = [p for p in (tmp_path / "nvme").iterdir() if p.is_dir()]
    assert len(dirs) == 2
    assert len({json.loads((d / "meta.json").read_text())["layout"]["block_size"] for d in dirs}) == 2


def test_env_override_reaches_the_engine(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    _kvstrata("trace", "synth", "--out", str(trace), "--sessions", "1", "--turns", "2")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), KVSTRATA__TIERS__DRAM__CAPACITY="-1")
    res = _kvstrata("replay", "--trace", str(trace), env=env)
    assert res.returncode == 2 and "capacity" in res.stderr, res.stderr
