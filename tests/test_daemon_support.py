"""Helpers for the daemon tests (no tests here): a ``kvstrata daemon`` subprocess, configs, stores, checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents

STATE = ".kvstrata-daemon"


def write_config(path: Path, root: Path, nvme: str = "2MiB", fs: str = "1GiB", **daemon: Any) -> Path:
    """A TOML config: write-back NVMe over a file:// fs tier, daemon on any free port."""
    settings: dict[str, Any] = {
        "high_watermark": 0.6,
        "low_watermark": 0.4,
        "metrics_port": 0,
        "interval_s": 0.2,
        "scrub_bytes_per_s": "4MiB",
        "scrub_pause_s": 1.0,
        "hint_poll_s": 0.05,
    }
    settings.update(daemon)
    lines = [
        "[[tiers]]",
        'name = "nvme"',
        f'capacity = "{nvme}"',
        f'path = "{root / "nvme"}"',
        'write = "write-back"',
        "[[tiers]]",
        'name = "fs"',
        'kind = "fs"',
        f'capacity = "{fs}"',
        f'url = "file://{root / "fs"}"',
        "[daemon]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def config_dict(root: Path, nvme: str = "2MiB", fs: str = "1GiB", promote: bool = True) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "nvme", "capacity": nvme, "path": str(root / "nvme"), "write": "write-back", "promote": promote},
            {"name": "fs", "kind": "fs", "capacity": fs, "url": f"file://{root / 'fs'}", "promote": promote},
        ]
    }


def store_chains(cfg: dict[str, Any], layout: KVLayout, chains: int, blocks: int, seed: int = 0) -> list[list[Key]]:
    """Store ``chains`` independent prefixes of ``blocks`` blocks each; returns their keys (oldest first)."""
    out = []
    rng = np.random.default_rng(seed)
    with Engine(cfg, layout=layout) as engine:
        for _ in range(chains):
            keys = engine.keys_for_tokens(rng.integers(0, 32000, size=layout.block_size * blocks, dtype=np.uint32))
            bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in range(4)}
            assert engine.store_sync(keys, bufs).stored == blocks
            out.append(keys)
    return out


def located(cfg: dict[str, Any], layout: KVLayout, keys: list[Key]) -> list[str]:
    """Tiers a fresh engine would serve ``keys`` from (lookup only: moves nothing)."""
    with Engine(cfg, layout=layout) as engine:
        return engine.lookup(keys).tiers


def load_and_check(cfg: dict[str, Any], layout: KVLayout, chains: list[list[Key]], attempts: int = 1) -> list[str]:
    """Load every chain with a fresh engine (no promotion); every block must arrive byte-exact.
    Returns the serving tier of every block. While other processes move blocks, a load may miss
    (the block moved after the lookup): ``attempts`` > 1 retries those chains with a fresh engine;
    wrong bytes are never retried."""
    cfg = {**cfg, "tiers": [{**t, "promote": False} for t in cfg["tiers"]]}
    tiers: list[str] = []
    todo = chains
    for attempt in range(attempts):
        missed: list[list[Key]] = []
        problems: list[str] = []
        with Engine(cfg, layout=layout) as engine:
            for keys in todo:
                hit = engine.lookup(keys)
                bufs = {layer: np.zeros((len(keys), layout.layer_nbytes(layer)), np.uint8) for layer in range(4)}
                res = engine.load_sync(keys[: hit.num_blocks], {k: v[: hit.num_blocks] for k, v in bufs.items()})
                n = res.loaded_blocks
                for layer, data in bufs.items():
                    assert np.array_equal(data[:n], block_contents(keys[:n], layer, data.shape[1])), "wrong bytes"
                if n == len(keys):
                    tiers += hit.tiers
                    continue
                missed.append(keys)
                problems.append(f"found {hit.num_blocks}, loaded {n} of {len(keys)} ({set(hit.tiers)})")
        if not missed:
            return tiers
        todo = missed
        if attempt + 1 < attempts:
            time.sleep(0.2)
    raise AssertionError(f"{len(todo)} chains lost or unreadable: {problems[:3]}")


class DaemonProcess:
    """``python -m kvstrata daemon`` as a subprocess; stderr (JSON logs) goes to a file."""

    def __init__(self, config: Path, root: Path, log_name: str = "daemon.log") -> None:
        self.config = config
        self.state_dir = root / "nvme" / STATE
        self.log_path = root / log_name
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, *args: str) -> DaemonProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", "daemon", "--config", str(self.config), *args],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        return self

    def wait_ready(self, timeout: float = 60.0) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            state = self.state()
            if state and state.get("pid") == self.proc.pid and state.get("state") == "running":
                self.url = state["url"]
                if self.get("/healthz")[0] == 200:
                    return self.url
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout}s: {self.log()}")

    def state(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.state_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200
        data = json.loads(body)
        assert isinstance(data, dict)
        return data

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        code, body = self.get("/metrics")
        assert code == 200
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        self._log.close()
        return rc

    def stop(self, timeout: float = 60.0) -> tuple[int, float]:
        """SIGTERM; (exit status, seconds until exit)."""
        t0 = time.monotonic()
        self.signal(signal.SIGTERM)
        rc = self.wait(timeout)
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]


def kvstrata(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or dict(os.environ),
    )


def wait_for(cond: Any, timeout: float, what: str) -> float:
    """Poll ``cond()`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
