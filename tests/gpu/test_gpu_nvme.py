"""The nvme tier with CUDA buffers: written from device memory (staged through the host, where the
record is checksummed), read back into it through kvikio (GPUDirect Storage where the filesystem
and driver allow, kvikio's POSIX compatibility mode otherwise), byte-exact, a corrupt record a
miss. The CPU variant runs the same checks on host buffers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.nvme_worker import round_trip
from kvstrata.tiers.nvme import gds_available


def test_nvme_round_trip_with_device_buffers(tmp_path: Path, device: str) -> None:
    seen = round_trip(tmp_path, device)
    assert seen["gpu_direct"] == gds_available()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gds", "compat"])
def test_kvikio_mode_round_trip(tmp_path: Path, mode: str) -> None:
    """One process per kvikio mode: ``KVIKIO_COMPAT_MODE=OFF`` (cuFile; skipped where this machine
    cannot do it) and ``=ON`` (POSIX reads, then copies to the device)."""
    if importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio is not installed (carry kvikio-cu13: make gpu-wheels)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env["KVIKIO_COMPAT_MODE"] = "OFF" if mode == "gds" else "ON"
    env["KVIKIO_GDS_THRESHOLD"] = "4096"  # kvikio reads smaller than this by POSIX even under cuFile
    worker = Path(__file__).with_name("nvme_worker.py")
    try:
        proc = subprocess.run(
            [sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        if mode == "gds" and "probe-ok" not in out:
            pytest.skip("kvikio hung on a cuFile read (GDS not usable here)")
        raise
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 and mode == "gds" and "probe-ok" not in lines:
        pytest.skip(f"GDS not usable on this machine: {proc.stderr.strip().splitlines()[-1:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(lines[-1])
    assert seen["gpu_direct"] and seen["gds_reads"] > 0, seen
