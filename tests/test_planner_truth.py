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
4. Hybrid layouts (``tiny-swa``, ``tiny-linear``) under the per-layer and the uniform layer
   policy, DRAM over a real NVMe tier at the budgets of ``benchmarks/test_layer_policy.py``,
   plus a tight one with ``checkpoint_every`` and a snapshot budget; and both command lines with
   a ``[policies]`` section. Besides the hit rates, the bytes each tier holds at the end
   (``bytes_stored``) are compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from shared_files import MOONCAKE_CONVERSATION

from kvstrata.config import load_config
from kvstrata.core.catalog import get_layout
from kvstrata.planner import EngineLimits, Simulator, block_trace, tiers_from_config
from kvstrata.planner.simulate import SimResult
from kvstrata.policies.layers import LayerPolicies
from kvstrata.workload.multi import replay_multi
from kvstrata.workload.replay import ReplayReport, replay_trace
from kvstrata.workload.traces import Trace, read_trace, synth_agentic

pytestmark = pytest.mark.slow

CONVERSATION = MOONCAKE_CONVERSATION
TOLERANCE = 0.02  # 2 percentage points


def kvstrata(*args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr


def _compare(name: str, planned: dict[str, float], real: dict[str, float]) -> None:
    print(f"\n{name}: planner vs replay: " + ", ".join(f"{k} {planned[k]:.4f}/{real[k]:.4f}" for k in real))
    assert real["total"] > 0.03, "the configuration must produce hits to be a meaningful check"
    for key, value in real.items():
        assert abs(planned[key] - value) <= TOLERANCE, (key, planned[key], value)


@pytest.mark.needs_shared(CONVERSATION)
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
    config: dict[str, Any] = {
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


@pytest.mark.needs_shared(CONVERSATION)
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


# --------------------------------------------------------------------------- hybrid layouts

MiB = 1024**2
# the scaled-down agentic trace of benchmarks/test_layer_policy.py (4 sessions x 8 turns)
LAYER_BENCH = {
    "sessions": 4,
    "turns": 8,
    "shared_tokens": 4000,
    "first_turn_tokens": 2000,
    "turn_tokens": 1024,
    "output_tokens": 300,
}
HYBRID_CASES = {
    # the layer-policy benchmark's budgets: per-layer fits a third to a half of the working set
    "tiny-swa, dram 2 MiB + nvme 6 MiB": ("tiny-swa", 2 * MiB, 6 * MiB, {}, True),
    "tiny-linear, dram 16 MiB + nvme 48 MiB": ("tiny-linear", 16 * MiB, 48 * MiB, {}, True),
    # tight: snapshots at every 8th block, a fifth of each tier for them (budget drops and refusals).
    # DRAM does not promote: under this much pressure a promotion copy racing the next store on
    # the engine's I/O threads makes the replay itself vary between runs
    "tiny-linear, dram 2 MiB (no promotion) + nvme 4 MiB, checkpoint_every 8, budget 0.2": (
        "tiny-linear",
        2 * MiB,
        4 * MiB,
        {"checkpoint_every": 8, "checkpoint_budget": 0.2},
        False,
    ),
}


def _hybrid_config(dram: int, nvme: int, policies: dict[str, Any], promote: bool, path: Path) -> dict[str, Any]:
    nvme_tier = {"name": "nvme", "capacity": nvme, "path": str(path), "direct_io": "off", "fsync": False}
    return {"tiers": [{"name": "dram", "capacity": dram, "promote": promote}, nvme_tier], "policies": policies}


def _hybrid_pair(case: str, policy: str, tmp_path: Path) -> tuple[SimResult, ReplayReport]:
    model, dram, nvme, policies, promote = HYBRID_CASES[case]
    trace = Trace(synth_agentic(**LAYER_BENCH))
    layout = get_layout(model)
    config = _hybrid_config(dram, nvme, policies, promote, tmp_path / "nvme")
    cfg = load_config(config)
    resolved = LayerPolicies.resolve(layout, cfg.policies, mode=policy, tier_names=[t.name for t in cfg.tiers])
    sizes = [s.nbytes for s in layout.layers]
    sim = Simulator(tiers_from_config(cfg), sizes, limits=EngineLimits.from_config(cfg), policies=resolved).run(
        block_trace(trace.requests, layout.block_size)
    )
    real = replay_trace(trace, layout, config, layer_policy=policy, verify=False)
    stats = real.engine_stats["tiers"]
    stored = ", ".join(f"{t.name} {t.bytes_stored}/{stats[t.name]['live_bytes']}" for t in sim.tiers)
    evictions = ", ".join(f"{t.name} {t.evictions}/{stats[t.name]['evictions']}" for t in sim.tiers)
    print(f"\n{case}, {policy}: bytes stored planner/replay {stored}; evictions {evictions}")
    return sim, real


def _rates(sim: SimResult, real: ReplayReport) -> tuple[dict[str, float], dict[str, float]]:
    planned = {"total": sim.token_hit_rate, **{t.name: sim.tier_hit_rate(t.name) for t in sim.tiers}}
    got = {"total": real.token_hit_rate, **{k: real.per_tier.get(k, 0) / real.prompt_tokens for k in real.tiers}}
    return planned, got


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_plan_matches_replay_under_per_layer_policies(case: str, tmp_path: Path) -> None:
    """The simulator mirrors the engine's hybrid path decision by decision: hit rates within 2
    points (equal in practice) and the bytes each tier holds at the end exactly equal."""
    sim, real = _hybrid_pair(case, "per-layer", tmp_path)
    planned, got = _rates(sim, real)
    _compare(f"{case}, per-layer", planned, got)
    assert sim.layer_policy == "per-layer" and sim.hybrid
    assert {t.name: t.bytes_stored for t in sim.tiers} == real.to_dict()["bytes_stored"]["per_tier"]
    if "budget" in case:
        assert sum(t.snapshots_dropped + t.snapshots_not_admitted for t in sim.tiers) > 0
    if "tiny-swa" in case or "budget" in case:
        assert sim.tiers[0].evictions > 0 and sim.tiers[1].evictions > 0  # both tiers were full


@pytest.mark.parametrize("case", list(HYBRID_CASES)[:2])
def test_plan_matches_replay_under_the_uniform_layer_policy(case: str, tmp_path: Path) -> None:
    """Every layer of every block (the engine's plain path). The token hit rate is within 2
    points; DRAM (full at the end) holds about the same bytes. A hit's promotion into DRAM is
    made from the load's buffers before the load returns, and the planner promotes before the
    store looks at the top tier, as the engine now does (when it was a background copy racing
    the store, the replay's DRAM/NVMe split moved by up to 6 points between runs, and the
    planner, which promoted after that look, was 2.1 points off at 2 + 6 MiB). NVMe's bytes
    differ by 13-15%: with segments this small (768 KiB) the uniform path's block-granular NVMe
    model, which moves a compacted segment's blocks whole where the tier moves records in file
    order, drifts (the per-layer path models records and matches). So the bytes are checked
    within 30% (NVMe) and 5% (DRAM)."""
    sim, real = _hybrid_pair(case, "uniform", tmp_path)
    planned, got = _rates(sim, real)
    _compare(f"{case}, uniform", {"total": planned["total"]}, {"total": got["total"]})
    assert sim.layer_policy == "uniform" and not sim.hybrid
    stored = real.to_dict()["bytes_stored"]["per_tier"]
    mine = {t.name: t.bytes_stored for t in sim.tiers}
    assert mine["dram"] == pytest.approx(stored["dram"], rel=0.05)  # full (equal in practice)
    assert mine["nvme"] == pytest.approx(stored["nvme"], rel=0.3)


def test_plan_and_replay_command_lines_agree_on_a_policies_section(tmp_path: Path) -> None:
    """``plan --config`` honours ``[policies]`` (checkpoint_every, a placement rule keeping the
    sliding-window layers in DRAM) as ``replay`` does; ``--layer-policy uniform`` overrides it in both."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text(
        '[policies]\ncheckpoint_every = 16\n\n[[policies.layers]]\nmatch = "sliding"\ntiers = ["dram"]\n\n'
        '[[tiers]]\nname = "dram"\ncapacity = "2MiB"\n\n'
        f'[[tiers]]\nname = "nvme"\ncapacity = "6MiB"\npath = "{tmp_path / "nvme"}"\ndirect_io = "off"\nfsync = false\n'
    )
    trace = tmp_path / "agentic.jsonl"
    kvstrata("trace", "synth", "--out", str(trace), *(f"--{k.replace('_', '-')}={v}" for k, v in LAYER_BENCH.items()))
    synth = ",".join(f"{k.replace('_', '-')}={v}" for k, v in LAYER_BENCH.items())
    for policy in (None, "uniform"):
        common = ["--config", str(cfg), "--model", "tiny-swa", *(["--layer-policy", policy] if policy else [])]
        kvstrata("plan", "--synth", synth, *common, "--json", str(tmp_path / "plan.json"))
        salt = ["--salt", policy or "config"]
        kvstrata("replay", "--trace", str(trace), *common, *salt, "--json", str(tmp_path / "replay.json"))
        plan = json.loads((tmp_path / "plan.json").read_text())
        real = json.loads((tmp_path / "replay.json").read_text())
        assert plan["trace"]["prompt_tokens"] == real["prompt_tokens"]
        assert plan["layer_policy"] == real["layer_policy"] == (policy or "per-layer")
        _compare(
            f"command lines, tiny-swa, [policies] section, {plan['layer_policy']}",
            {"total": plan["token_hit_rate"]},
            {"total": real["token_hit_rate"]},
        )
        if policy is None:
            assert plan["bytes_stored"] == real["bytes_stored"]
            assert plan["layer_policies"]["checkpoint_every"] == 16
            assert plan["per_tier"]["nvme"]["hit_rate"] == 0.0  # nvme holds no window: it restores nothing alone
        else:
            dram = real["bytes_stored"]["per_tier"]["dram"]
            assert plan["bytes_stored"]["per_tier"]["dram"] == pytest.approx(dram, rel=0.05)  # see above
