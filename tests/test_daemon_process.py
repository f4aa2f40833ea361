"""``kvstrata daemon`` as a real process: /metrics, /healthz, /status, ``kvstrata status``, JSON logs,
SIGHUP reloads (a bad config keeps the old one), SIGTERM within a bounded time, bad configs at
start, one daemon per state directory, and promotion hints through the hint file and HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_daemon_support import (
    DaemonProcess,
    config_dict,
    kvstrata,
    load_and_check,
    located,
    store_chains,
    wait_for,
    write_config,
)

from kvstrata.core.catalog import get_layout

pytestmark = pytest.mark.slow

MiB = 1024**2


def test_endpoints_logs_reload_and_sigterm(tmp_path: Path) -> None:
    layout = get_layout("tiny")
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path)
    chains = store_chains(config_dict(tmp_path), layout, chains=12, blocks=32, seed=1)  # 1.5 of 2 MiB
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        url = d.wait_ready()
        assert url.startswith("http://127.0.0.1:")
        assert d.get("/healthz") == (200, b'{"status": "ok"}\n')
        assert d.get("/nope")[0] == 404
        wait_for(lambda: d.metric("kvstrata_daemon_demoted_blocks_total") > 0, 10, "a demotion")
        high = d.metric("kvstrata_tier_high_watermark_bytes", tier="nvme")
        assert high == int(0.6 * 2 * MiB)
        wait_for(lambda: d.metric("kvstrata_tier_used_bytes", tier="nvme") <= high, 10, "nvme under its high mark")
        assert d.metric("kvstrata_daemon_ready") == 1
        assert d.metric("kvstrata_tier_capacity_bytes", tier="fs") == 1024**3
        wait_for(lambda: d.metric("kvstrata_daemon_scrubbed_bytes_total") > 0, 10, "scrubbing")

        status = d.status()
        assert status["state"] == "running" and status["pid"] == d.proc.pid  # type: ignore[union-attr]
        (ns,) = status["namespaces"]
        assert [t["tier"] for t in ns["tiers"]] == ["nvme", "fs"] and ns["model"] == "tiny"
        assert status["totals"]["demoted_blocks"] > 0
        frozen = status["gc"]["frozen_objects"]  # start-up's heap is out of the collector's walk
        assert frozen > 1000, status["gc"]
        cli = kvstrata("status", "--config", str(cfg_path), "--json", "-")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["state"] == "running"
        table = kvstrata("status", "--config", str(cfg_path))
        assert "running" in table.stdout and "nvme" in table.stdout

        second = DaemonProcess(cfg_path, tmp_path, "second.log").start()  # one daemon per state directory
        assert second.wait(60) == 2
        assert "another kvstrata daemon" in second.log_path.read_text()

        good = cfg_path.read_text()
        cfg_path.write_text(good + "bogus = 1\n")
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.metric("kvstrata_daemon_config_reloads_total", result="error") == 1, 10, "a failed reload")
        assert d.get("/healthz")[0] == 200
        assert d.status()["namespaces"][0]["tiers"][0]["high_bytes"] == high  # the old config runs on
        cfg_path.write_text(good.replace("high_watermark = 0.6", "high_watermark = 0.75"))
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.metric("kvstrata_daemon_config_reloads_total", result="ok") == 1, 10, "a reload")
        assert d.status()["namespaces"][0]["tiers"][0]["high_bytes"] == int(0.75 * 2 * MiB)
        assert d.status()["gc"]["frozen_objects"] > 1000  # frozen again after the namespaces reopened

        rc, seconds = d.stop()
        assert rc == 0 and seconds < 10, (rc, seconds, d.log())
    finally:
        d.kill()
    state = d.state()
    assert state is not None and state["state"] == "stopped" and state["clean"]
    events = d.events()  # every log line is a JSON object
    names = [e.get("event") for e in events]
    for needed in ("starting", "ready", "watermark", "reload_failed", "reloaded", "stopping", "stopped"):
        assert needed in names, needed
    failed = next(e for e in events if e.get("event") == "reload_failed")
    assert failed["level"] == "error" and "daemon.bogus" in failed["msg"]
    assert all(set(e) >= {"ts", "level", "logger", "msg"} for e in events)
    assert len(load_and_check(config_dict(tmp_path), layout, chains)) == 12 * 32  # nothing lost
    assert kvstrata("verify", "--config", str(cfg_path)).returncode == 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("bogus = 1\n", "daemon.bogus: Extra inputs are not permitted"),
        ("low_watermark = 0.9\n", "low_watermark (0.9) must be below high_watermark (0.6)"),
        ("metrics_host = 5\n", "daemon.metrics_host"),
    ],
)
def test_bad_config_at_start_is_a_clear_error(tmp_path: Path, extra: str, needle: str) -> None:
    cfg = write_config(tmp_path / "kv.toml", tmp_path)
    text = cfg.read_text()
    if extra.startswith("low_watermark"):
        text = text.replace("low_watermark = 0.4\n", "")
    cfg.write_text(text + extra)
    res = kvstrata("daemon", "--config", str(cfg))
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr.replace("\n", " ") and "Traceback" not in res.stderr


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "kv.toml", tmp_path)
    d = DaemonProcess(cfg, tmp_path).start()
    try:
        port = d.wait_ready().rsplit(":", 1)[1]
        other = write_config(tmp_path / "other.toml", tmp_path / "other")
        res = kvstrata("daemon", "--config", str(other), "--metrics-port", port)
        assert res.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr
    finally:
        d.stop()


def test_hinted_session_is_back_in_nvme_before_its_next_turn(tmp_path: Path) -> None:
    layout = get_layout("tiny")
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path)
    cfg = config_dict(tmp_path)
    chains = store_chains(cfg, layout, chains=12, blocks=32, seed=2)
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        wait_for(lambda: set(located(cfg, layout, chains[1])) == {"fs"}, 20, "the old sessions demoted")
        assert set(located(cfg, layout, chains[0])) == {"fs"}
        # turn N+1 of session 0 is coming: hint it through the hint file (works with the daemon down too)
        fp = d.status()["namespaces"][0]["namespace"]
        t0 = time.monotonic()
        res = kvstrata("prefetch", "--config", str(cfg_path), *[k.hex() for k in chains[0]])
        assert res.returncode == 0, res.stderr
        wait_for(lambda: set(located(cfg, layout, chains[0])) == {"nvme"}, 10, "session 0 back in nvme")
        file_latency = time.monotonic() - t0
        # and through HTTP
        t0 = time.monotonic()
        res = kvstrata("prefetch", "--config", str(cfg_path), "--namespace", fp, "--url", d.url, chains[1][0].hex())
        assert res.returncode == 0, res.stderr
        wait_for(lambda: located(cfg, layout, chains[1][:1]) == ["nvme"], 10, "the hinted key back in nvme")
        http_latency = time.monotonic() - t0
        time.sleep(0.5)  # a few watermark cycles: hinted blocks are protected from demotion
        assert set(located(cfg, layout, chains[0])) == {"nvme"}
        assert d.metric("kvstrata_daemon_promoted_blocks_total", tier="nvme") >= 33 * 4
        assert d.metric("kvstrata_daemon_promotion_latency_seconds_count") == 2
        last = d.status()["last_promotion"]
        assert last["promoted"] == 4
        inside = d.metric("kvstrata_daemon_promotion_latency_seconds_sum")
        print(
            f"promotion, seen from a client: hint file -> nvme {file_latency:.3f}s (32 blocks), http -> nvme "
            f"{http_latency:.3f}s; inside the daemon (hint written -> copied): both {inside:.3f}s"
        )
    finally:
        rc, _ = d.stop()
    assert rc == 0
    tiers = load_and_check(cfg, layout, [chains[0]])  # a fresh engine serves the next turn from nvme
    assert set(tiers) == {"nvme"}
    assert len(load_and_check(cfg, layout, chains)) == 12 * 32


def namespace_dirs(root: Path) -> set[str]:
    return {p.name for p in (root / "nvme").iterdir() if (p / "meta.json").exists()}


def test_a_broken_namespace_is_reported_and_the_others_are_served(tmp_path: Path) -> None:
    """One namespace's index.lmdb is overwritten: the daemon starts, reports it (log once, /status,
    metric), demotes and promotes the healthy namespace; a kill -9 leaves the state unclean and the
    next start runs its check; SIGTERM stops cleanly."""
    healthy, other = get_layout("tiny"), get_layout("tiny", block_size=32)
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path, rescan_interval_s=0.2)
    cfg = config_dict(tmp_path)
    chains = store_chains(cfg, healthy, chains=12, blocks=32, seed=3)  # 1.5 of 2 MiB: over the high mark
    (good,) = namespace_dirs(tmp_path)
    store_chains(cfg, other, chains=2, blocks=8, seed=4)
    (bad,) = namespace_dirs(tmp_path) - {good}
    data_mdb = tmp_path / "nvme" / bad / "index.lmdb" / "data.mdb"
    with open(data_mdb, "r+b") as f:  # both LMDB meta pages: not an LMDB file any more
        f.write(np.random.default_rng(5).integers(0, 256, 8192, dtype=np.uint8).tobytes())

    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        (broken,) = d.status()["broken"]
        assert broken["namespace"] == bad and broken["tier"] == "nvme" and broken["during"] == "open"
        assert broken["path"] == str(tmp_path / "nvme" / bad) and "index.lmdb" in broken["reason"]
        assert d.metric("kvstrata_daemon_broken_tiers", namespace=bad, tier="nvme") == 1
        assert d.metric("kvstrata_daemon_broken_tiers", namespace=good) == 0
        # the healthy namespace is evicted (demoted to fs) and promoted back on a hint
        wait_for(lambda: set(located(cfg, healthy, chains[0])) == {"fs"}, 20, "the oldest session demoted")
        high = d.metric("kvstrata_tier_high_watermark_bytes", namespace=good, tier="nvme")
        # the pass that moved session 0 may still be demoting the next one: its gauge settles after
        wait_for(
            lambda: d.metric("kvstrata_tier_used_bytes", namespace=good, tier="nvme") <= high,
            10,
            "the healthy namespace under its high mark",
        )
        res = kvstrata("prefetch", "--config", str(cfg_path), "--namespace", good, *[k.hex() for k in chains[0]])
        assert res.returncode == 0, res.stderr
        wait_for(lambda: set(located(cfg, healthy, chains[0])) == {"nvme"}, 20, "session 0 back in nvme")
        wait_for(lambda: d.metric("kvstrata_daemon_promoted_blocks_total", tier="nvme") >= 32 * 4, 10, "promotion")
        time.sleep(0.6)  # a few rescans (every 0.2 s): the broken namespace is not reopened nor logged again
        d.proc.kill()  # type: ignore[union-attr]
        d.wait()
    finally:
        d.kill()
    marked = [e for e in d.events() if e.get("event") == "namespace_broken"]
    assert len(marked) == 1 and marked[0]["level"] == "error" and marked[0]["path"] == str(tmp_path / "nvme" / bad)
    assert "kvstrata verify --repair" in marked[0]["msg"]
    state = d.state()
    assert state is not None and state["state"] == "running" and not state["clean"]

    again = DaemonProcess(cfg_path, tmp_path, "again.log").start()
    try:
        again.wait_ready()
        status = again.status()
        assert status["startup"]["checked"] and status["startup"]["unclean_stop"]  # kill -9: checked
        assert [b["namespace"] for b in status["broken"]] == [bad]
        rc, _ = again.stop()
    finally:
        again.kill()
    assert rc == 0
    state = again.state()
    assert state is not None and state["state"] == "stopped" and state["clean"]
    assert len(load_and_check(cfg, healthy, chains)) == 12 * 32  # nothing of the healthy namespace lost


FAILING_DAEMON = """
import sys
from kvstrata.daemon.service import Daemon

class FailingDaemon(Daemon):
    steps = 0

    def step(self):
        super().step()
        FailingDaemon.steps += 1
        if FailingDaemon.steps == 3:
            raise RuntimeError("injected fault in the serve loop")

sys.exit(FailingDaemon(sys.argv[1]).run())
"""


def test_an_exception_in_the_serve_loop_leaves_the_state_unclean(tmp_path: Path) -> None:
    layout = get_layout("tiny")
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path, nvme="64MiB")
    cfg = config_dict(tmp_path, nvme="64MiB")
    chains = store_chains(cfg, layout, chains=2, blocks=8, seed=6)
    log_path = tmp_path / "failing.log"
    with open(log_path, "wb") as log:
        res = subprocess.run([sys.executable, "-c", FAILING_DAEMON, str(cfg_path)], stderr=log, timeout=120)
    text = log_path.read_text()
    assert res.returncode != 0 and "injected fault in the serve loop" in text
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    names = [e.get("event") for e in events]
    assert "ready" in names and "stopped_unclean" in names and "stopped" not in names
    state = json.loads((tmp_path / "nvme" / ".kvstrata-daemon" / "daemon.json").read_text())
    assert state["state"] == "stopped" and state["clean"] is False

    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        startup = d.status()["startup"]
        assert startup["checked"] and startup["unclean_stop"]  # the next start ran the check
        rc, _ = d.stop()
    finally:
        d.kill()
    assert rc == 0 and d.state()["clean"]  # type: ignore[index]
    assert len(load_and_check(cfg, layout, chains)) == 2 * 8
