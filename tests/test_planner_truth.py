"""The planner against reality: its token hit rate is within 2 points of ``kvstrata replay``
through the real engine, for the same trace, tiers and policies (each replay runs here, in the
same test run).

1. The Mooncake conversation trace through both command lines (``plan --tiers`` and
   ``replay --tiers`` with the same shorthand): DRAM (LRU) over a small NVMe tier, so the
   NVMe tier's segment files fill, compact and evict.
2. A synthetic agentic trace on three tiers: an LRU hbm stand-in, write-back DRAM, and NVMe
   with second-touch admission (demotion, promotion and admission all matter).
3. Two instances, round-robin, private DRAM and NVMe each, through the real multi-instance
   replay (``kvstrata.workload.multi.replay_multi``, one engine process per instance).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.config import load_config
from kvstrata.engine.catalog import get_layout
from kvstrata.planner import EngineLimits, Simulator, block_trace, tiers_from_config
from kvstrata.workload.multi import replay_multi
from kvstrata.workload.replay import replay_trace
from kvstrata.workload.traces import Trace, read_trace, synth_agentic

pytestmark = pytest.mark.slow

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
TOLERANCE = 0.02  # 2 percentage points


def kvstrata(*args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr


def _compare(name: str, planned: dict[str, float], real: dict[str, float]) -> None:
    print(f"\n{name}: planner vs replay: " + ", ".join(f"{k} {planned[k]:.4f}/{real[k]:.4f}" for k in real))
    assert real["total"] > 0.03, "the configuration must produce hits to be a meaningful check"
    for key, value in real.items():
        assert abs(planned[key] - value) <= TOLERANCE, (key, planned[key], value)


def test_plan_matches_replay_on_the_mooncake_conversation_trace(tmp_path: Path) -> None:
    nvme = f"nvme=512MiB:path={tmp_path / 'nvme'}:direct_io=off:fsync=false"
    tiers = f"dram=128MiB:lru,{nvme}"
    common = ["--trace", str(CONVERSATION), "--limit", "1500", "--model", "tiny", "--tiers", tiers]
    kvstrata("plan", *common, "--json", str(tmp_path / "plan.json"))
    kvstrata("replay", *common, "--json", str(tmp_path / "replay.json"))
    plan = json.loads((tmp_path / "plan.json").read_text())
    real = json.loads((tmp_path / "replay.json").read_text())
    assert plan["trace"]["prompt_tokens"] == real["prompt_tokens"]
    _compare(
        "mooncake conversation, dram lru + nvme",
        {"total": plan["token_hit_rate"], **{k: v["hit_rate"] for k, v in plan["per_tier"].items()}},
        {"total": real["token_hit_rate"], **real["per_tier_hit_rate"]},
    )
    assert real["stats"]["tiers"]["nvme"]["evictions"] > 0  # the NVMe tier was full


def _simulate(trace: Trace, config: dict[str, Any], instances: int = 1) -> dict[str, float]:
    layout = get_layout("tiny", block_size=trace.block_size)
    cfg = load_config(config)
    sim = Simulator(
        tiers_from_config(cfg),
        [s.nbytes for s in layout.layers],
        limits=EngineLimits.from_config(cfg),
        instances=instances,
        routing="round-robin",
    ).run(block_trace(trace.requests, layout.block_size))
    return {"total": sim.token_hit_rate, **{t.name: sim.tier_hit_rate(t.name) for t in sim.tiers}}


def test_plan_matches_replay_with_write_back_and_second_touch(tmp_path: Path) -> None:
    trace = Trace(synth_agentic(sessions=6, turns=8))
    config = {
        "tiers": [
            {"name": "hbm", "capacity": "4MiB", "eviction": "lru", "promote": False},
            {"name": "dram", "capacity": "12MiB", "write": "write-back"},
            {"name": "nvme", "capacity": "40MiB", "admission": "second-touch", "path": str(tmp_path / "nvme")},
        ]
    }
    config["tiers"][2].update(direct_io="off", fsync=False)
    planned = _simulate(trace, config)
    rep = replay_trace(trace, get_layout("tiny"), config, verify=False)
    real = {"total": rep.token_hit_rate, **{k: rep.per_tier.get(k, 0) / rep.prompt_tokens for k in rep.tiers}}
    _compare("synthetic agentic, hbm + write-back dram + second-touch nvme", planned, real)
    assert rep.engine_stats["tiers"]["nvme"]["not_admitted"] > 0 and rep.engine_stats["tiers"]["dram"]["promotions"]


def test_plan_matches_the_multi_instance_replay_round_robin(tmp_path: Path) -> None:
    trace = read_trace(CONVERSATION, limit=1200)
    config = {
        "tiers": [
            {"name": "dram", "capacity": "64MiB"},
            {"name": "nvme", "capacity": "256MiB", "path": str(tmp_path / "nvme"), "direct_io": "off", "fsync": False},
        ]
    }
    planned = _simulate(trace, config, instances=2)
    rep = replay_multi(trace, "tiny", config, instances=2, routing="round-robin", verify=False)
    real = {"total": rep.token_hit_rate, **{k: rep.per_tier.get(k, 0) / rep.prompt_tokens for k in rep.tiers}}
    _compare("mooncake conversation, 2 instances round-robin, private dram + nvme", planned, real)
