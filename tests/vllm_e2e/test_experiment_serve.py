"""``kvstrata experiment serve`` end to end: real ``vllm serve`` instances behind a real HAProxy,
driven by aiperf (in its own virtual environment), on the smallest sweep: N = 1..2, round-robin,
no connector vs kvstrata (DRAM over NVMe on local disk), 4 agentic sessions of 3 turns.

Checks that the JSON is complete and sane, not speed: every row present with every field, no
failed request, every request counted by vLLM, hit rates within [0, ideal + slack], and kvstrata's
token hit rate above no connector's at the same N (the instances' caches hold less than the
working set, so vLLM's own prefix cache loses what kvstrata keeps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstrata.cli import main
from kvstrata.workload import serve, serve_fleet, serve_procs

from .serve_sweep import CLIENT_VENV, SMALL_SESSIONS, haproxy

FIELDS = (
    "instances",
    "routing",
    "mode",
    "token_hit_rate",
    "ideal_token_hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "e2e_p50_s",
    "output_tokens_per_s",
    "failed_requests",
)


_haproxy = haproxy


@pytest.mark.timeout(1200)  # two fleets of two `vllm serve` starts each: minutes on a loaded 2-core machine
@pytest.mark.skipif(_haproxy() is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_experiment_serve_smallest_sweep(tmp_path: Path) -> None:
    if not (CLIENT_VENV / "bin" / "aiperf").is_file() and shutil.which("python3") is None:
        pytest.skip("no python3 to make aiperf's virtual environment")
    out = tmp_path / "serve.json"
    png = tmp_path / "serve.png"
    args = [
        "experiment",
        "serve",
        "--max-instances=2",
        "--routing=round-robin",
        "--modes=none,kvstrata",
        *SMALL_SESSIONS,
        f"--workdir={tmp_path / 'work'}",
        f"--client-venv={CLIENT_VENV}",
        f"--json={out}",
        f"--plot={png}",
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    rows = {(r["instances"], r["mode"]): r for r in data["results"]}
    assert sorted(rows) == [(1, "kvstrata"), (1, "none"), (2, "kvstrata"), (2, "none")]
    assert data["working_set_tokens"] > 2 * data["kv_cache_tokens_per_instance"]
    for key, r in rows.items():
        assert all(f in r for f in FIELDS), (key, r)
        assert r["routing"] == "round-robin"
        assert r["failed_requests"] == 0, (key, r)
        assert r["requests"] == 4 * 3, (key, r)
        assert r["prompt_tokens"] > 4 * 3 * 256, (key, r)
        assert 0.0 <= r["token_hit_rate"] <= r["ideal_token_hit_rate"] + 0.05, (key, r)
        assert 0.3 < r["ideal_token_hit_rate"] < 1.0, (key, r)
        for f in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "output_tokens_per_s"):
            assert r[f] is not None and r[f] > 0, (key, f, r)
        assert r["ttft_p50_s"] <= r["ttft_p90_s"]
    for n in (1, 2):
        kv, none = rows[(n, "kvstrata")], rows[(n, "none")]
        assert kv["prompt_tokens_by_source"].get("external_kv_transfer", 0) > 0, kv
        assert none["prompt_tokens_by_source"].get("external_kv_transfer", 0) == 0, none
        assert kv["token_hit_rate"] > none["token_hit_rate"], (kv, none)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(_haproxy() is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_experiment_serve_replays_the_mooncake_trace(tmp_path: Path) -> None:
    """``--trace``: the 4 longest conversations of the Mooncake conversation trace, scaled down, on
    one instance whose KV cache (1,024 tokens) holds less than they share; every request is served,
    nothing fails, and kvstrata restores more of what the trace shares than vLLM's own cache."""
    from shared_files import MOONCAKE_CONVERSATION, require_shared

    require_shared(MOONCAKE_CONVERSATION)
    if not (CLIENT_VENV / "bin" / "aiperf").is_file() and shutil.which("python3") is None:
        pytest.skip("no python3 to make aiperf's virtual environment")
    out = tmp_path / "trace.json"
    args = [
        "experiment",
        "serve",
        "--max-instances=1",
        "--modes=none,kvstrata",
        f"--trace={MOONCAKE_CONVERSATION}",
        "--trace-conversations=4",
        "--trace-duration=30",
        "--output-tokens=8",
        "--max-model-len=1024",
        "--kv-blocks=9",
        f"--workdir={tmp_path / 'work'}",
        f"--client-venv={CLIENT_VENV}",
        f"--json={out}",
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["workload"] == "mooncake trace" and data["setup"]["trace"]["conversations"] == 4
    rows = {r["mode"]: r for r in data["results"]}
    assert sorted(rows) == ["kvstrata", "none"]
    for mode, r in rows.items():
        assert r["failed_requests"] == 0, (mode, r)
        assert r["requests"] == rows["none"]["requests"] > 100, (mode, r)  # 117 selected, 2 too long
        assert 0.5 < r["ideal_token_hit_rate"] < 1.0, (mode, r)
        assert 0.0 <= r["token_hit_rate"] <= r["ideal_token_hit_rate"] + 0.05, (mode, r)
    kv, none = rows["kvstrata"], rows["none"]
    assert kv["prompt_tokens_by_source"].get("external_kv_transfer", 0) > 0, kv
    assert kv["token_hit_rate"] > none["token_hit_rate"], (kv, none)


def test_experiment_serve_bad_options() -> None:
    """Bad options are one clear line naming the bad value, before anything starts."""
    runner = CliRunner()
    r = runner.invoke(main, ["experiment", "serve", "--modes=none,fast"])
    assert r.exit_code == 2 and "'none,fast'" in r.output and "kvstrata+pool" in r.output
    r = runner.invoke(main, ["experiment", "serve", "--routing=random"])
    assert r.exit_code == 2 and "'random'" in r.output
    r = runner.invoke(main, ["experiment", "serve", "--routing=round-robin,kv-event"])
    assert r.exit_code == 2 and "'round-robin,kv-event'" in r.output and "kv-events" in r.output
    r = runner.invoke(main, ["experiment", "serve", "--turns=40"])
    assert r.exit_code == 2 and "max_model_len 2048" in r.output
    r = runner.invoke(main, ["experiment", "serve", "--kv-blocks=2"])
    assert r.exit_code == 2 and "kv_blocks 2" in r.output


def test_haproxy_config_is_valid(tmp_path: Path) -> None:
    """Both generated configs pass ``haproxy -c``; sticky hashes the session header."""
    exe = _haproxy()
    if exe is None:
        pytest.skip("haproxy is not installed")
    import subprocess

    for routing in serve_procs.BALANCER_ROUTINGS:
        cfg = tmp_path / f"{routing}.cfg"
        cfg.write_text(serve_procs.haproxy_config(18000, [18001, 18002], routing))
        check = subprocess.run([exe, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert f"hdr({serve.SESSION_HEADER})" in serve_procs.haproxy_config(1, [2], "sticky")
    assert "roundrobin" in serve_procs.haproxy_config(1, [2], "round-robin")
    with pytest.raises(ValueError, match="'random'"):
        serve_procs.haproxy_config(1, [2], "random")


@pytest.mark.parametrize("mode", serve.MODES[1:])
def test_generated_connector_configs_validate(tmp_path: Path, mode: str) -> None:
    """The kv_transfer_config each mode gives its instances is a valid kvstrata config (a '+' from
    the mode's name in the pool's key prefix once stopped every pool instance at start-up)."""
    from kvstrata.config import load_config

    master = "127.0.0.1:50051" if mode == "kvstrata+pool" else None
    tag = f"123-{mode.replace('+', '-')}"
    cfg = serve_fleet.kvstrata_transfer_config(tmp_path, serve.ServeSetup(), master, tag)
    tiers = load_config(cfg["kv_connector_extra_config"]["config"], environ={}).tiers
    assert [t.name for t in tiers] == (["dram", "pool", "nvme"] if master else ["dram", "nvme"])
