"""``kvstrata bench --scaling --quick``: the curves' tables, JSON and PNG, checked for shape, never speed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstrata.cli import main

QUICK_X = {  # curve name prefix -> the x points of the quick run
    "DRAM store bandwidth (4 KiB)": [1, 16, 256],
    "DRAM load bandwidth (4 KiB)": [1, 16, 256],
    "DRAM store bandwidth (by block size)": [1, 32, 1024],
    "DRAM load bandwidth (by block size)": [1, 32, 1024],
    "hash + lookup time": [1024, 8192, 65536],
    "NVMe lookup and read time": [2000, 20000],
    "planner time": [4, 8, 16],  # requests: 1, 2 and 4 sessions of 4 turns
}


def test_scaling_quick_prints_tables_and_writes_the_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    res = CliRunner().invoke(
        main, ["bench", "--scaling", "--quick", "--dir", str(tmp_path), "--json", str(out), "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(out.read_text())
    assert rep["quick"] is True and rep["plot"] == str(png)
    curves = {c["name"]: c for c in rep["curves"]}
    for prefix, xs in QUICK_X.items():
        (name,) = [n for n in curves if n.startswith(prefix)]
        c = curves[name]
        assert c["x"] == xs, name
        assert name in res.output  # its table was printed
        assert c["expect"] in ("flat", "linear") and len(c["points"]) == len(xs)
        for series, ys in c["series"].items():
            assert len(ys) == len(xs) and all(math.isfinite(y) and y > 0 for y in ys), (name, series)
            assert series in c["slopes"]
    dram = [p for name, c in curves.items() if name.startswith("DRAM") for p in c["points"]]
    assert dram and all(p["bytes_ok"] == 1.0 for p in dram)  # every byte read back equals the byte written
    nvme = curves[next(n for n in curves if n.startswith("NVMe"))]["points"]
    assert [p["index_blocks"] for p in nvme] == [2000, 20000]
    assert all(p["read_ok"] == p["batch"] for p in nvme)  # reads through the synthetic index verify real bytes
    assert all(p["lmdb_bytes_per_block"] > 0 for p in nvme)
    lookup = curves[next(n for n in curves if n.startswith("hash"))]["points"]
    assert [p["tokens"] for p in lookup] == [1024, 8192, 65536]
