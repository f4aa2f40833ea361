"""Multi-instance replay: routing, per-instance configs, and real engine processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.config import load_config
from kvstrata.errors import ConfigError
from kvstrata.workload.multi import instance_config, replay_multi, route
from kvstrata.workload.traces import Trace, synth_agentic


def _trace(sessions: int = 3, turns: int = 4) -> Trace:
    reqs = synth_agentic(
        sessions=sessions, turns=turns, shared_tokens=512, first_turn_tokens=256, turn_tokens=128, output_tokens=64
    )
    return Trace(reqs)


def test_round_robin_spreads_requests_and_sticky_keeps_sessions() -> None:
    reqs = _trace().requests
    rr = route(reqs, 2, "round-robin")
    assert rr == [i % 2 for i in range(len(reqs))]
    sticky = route(reqs, 2, "sticky")
    by_session: dict[str, set[int]] = {}
    for req, inst in zip(reqs, sticky, strict=True):
        by_session.setdefault(str(req.session), set()).add(inst)
    assert all(len(v) == 1 for v in by_session.values())
    assert set(sticky) == {0, 1}


@pytest.mark.parametrize(("instances", "routing"), [(0, "round-robin"), (2, "random")])
def test_bad_routing_inputs_name_the_value(instances: int, routing: str) -> None:
    with pytest.raises(ConfigError, match=str(routing if instances else instances)):
        route(_trace().requests, instances, routing)


def test_private_paths_are_per_instance(tmp_path: Path) -> None:
    cfg = load_config(
        {
            "tiers": [
                {"name": "dram", "capacity": "1MiB"},
                {"name": "nvme", "capacity": "8MiB", "path": str(tmp_path), "direct_io": "off"},
            ]
        }
    )
    a, b = (instance_config(cfg, i, hbm_capacity=1 << 20) for i in (0, 1))
    assert [t.name for t in a.tiers] == ["hbm", "dram", "nvme"]
    assert a.tiers[2].options.path == str(tmp_path / "instance-0")
    assert b.tiers[2].options.path == str(tmp_path / "instance-1")


@pytest.mark.slow
def test_two_instances_replay_real_bytes_and_routing_matters(tmp_path: Path) -> None:
    """Small private DRAM, no cluster tier: round-robin loses what sticky routing keeps."""
    trace = _trace(sessions=3, turns=5)  # 3 sessions on 2 instances: round-robin moves every session
    cfg = {"tiers": [{"name": "dram", "capacity": "384KiB"}]}
    rr = replay_multi(trace, "tiny", cfg, instances=2, routing="round-robin")
    sticky = replay_multi(trace, "tiny", cfg, instances=2, routing="sticky")
    for rep in (rr, sticky):
        assert rep.requests == len(trace)
        assert rep.mismatched_loads == 0
        assert rep.prompt_tokens == sum(r.input_length for r in trace.requests)
        assert sum(p["requests"] for p in rep.per_instance) == len(trace)
        assert rep.throughput_tokens_per_s > 0
    assert sticky.token_hit_rate > rr.token_hit_rate + 0.1
