"""``kvstrata bench --device cuda``: one clear line where there is no CUDA; its figures where
there is (the timings themselves are never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvstrata.cli import main


def test_bench_device_cuda_without_cuda_is_one_line_naming_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the bench runs (see the gpu test below)")
    result = CliRunner().invoke(main, ["bench", "--device", "cuda", "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0], lines
    assert "Traceback" not in result.output
    assert not (tmp_path / "b.json").exists()


@pytest.mark.gpu
def test_bench_device_cuda_reports_figures_and_exact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--device", "cuda", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert res["hbm_dram"]["bytes_ok"] == 1.0
    for figure in ("store_gbps", "load_gbps", "store_ratio", "load_ratio"):
        assert res["hbm_dram"][figure] > 0
    if "skipped" not in res["nvme_hbm"]:
        assert res["nvme_hbm"]["bytes_ok"] == 1.0 and res["nvme_hbm"]["load_ratio"] > 0
