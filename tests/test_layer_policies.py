"""Per-layer-group policies for hybrid layouts: config rules, retention, placement, snapshot
admission, priorities, broken chains, and (property tests) that every restored prefix is
consistent across groups and byte-exact."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conformance import block_bytes, chain_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.config import load_config
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec
from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError
from kvstrata.policies.layers import LayerPolicies, Retention, parse_match
from kvstrata.tiers.wrappers import FaultInjectingTier
from kvstrata.workload.layer_bytes import agentic_context, compare_policies, count_stored_bytes
from kvstrata.workload.replay import replay_trace
from kvstrata.workload.traces import Trace, synth_agentic

EngineFactory = Callable[..., Engine]


def hybrid_layout(window: int = 16) -> KVLayout:
    """Block size 4: a sliding layer (window ``window`` tokens), a full layer, a state layer."""
    return KVLayout(
        model="test-hybrid",
        block_size=4,
        layers=(
            LayerSpec("layers.0.swa", LayerKind.SLIDING, (2, 4, 1, 8), "float16", window),
            LayerSpec("layers.1.attn", LayerKind.FULL, (2, 4, 1, 8), "float16"),
            LayerSpec("layers.2.linear_attn", LayerKind.LINEAR, (96,), "float16"),
        ),
    )


def stored_buffers(engine: Engine, keys: list[Key], first: int) -> dict[int, Any]:
    """What an inference engine hands ``store``: every layer of every block, state snapshots
    only at the engine's restore points (as the Replayer does)."""
    layout = engine.layout
    points = engine.restore_points(keys, first_block=first)
    bufs: dict[int, Any] = {}
    for layer, spec in enumerate(layout.layers):
        rows = {i: block_bytes(k, layer, spec.nbytes) for i, k in enumerate(keys)}
        if spec.kind is LayerKind.LINEAR:
            rows = {r - 1: rows[r - 1] for r in points}
        bufs[layer] = rows
    return bufs


def turn(engine: Engine, keys: list[Key]) -> tuple[int, int]:
    """One request: look up, restore (checking every byte read), store the rest. Returns the
    lookup's and the load's block counts."""
    n = engine.lookup(keys).num_blocks
    loaded = restore(engine, keys[:n]) if n else 0
    if n < len(keys):
        part = keys[n:]
        engine.store_sync(part, stored_buffers(engine, part, n), parent=keys[n - 1] if n else None, first_block=n)
    engine.flush()
    return n, loaded


def restore(engine: Engine, keys: list[Key]) -> int:
    layout = engine.layout
    needs = engine.restore_needs(len(keys))
    bufs = {layer: {i: np.zeros(layout.layer_nbytes(layer), np.uint8) for i in needs[layer]} for layer in needs}
    res = engine.load_sync(keys, bufs)
    assert res.layer_blocks == engine.restore_needs(res.loaded_blocks)
    for layer, blocks in res.layer_blocks.items():
        for i in blocks:
            assert np.array_equal(bufs[layer][i], block_bytes(keys[i], layer, layout.layer_nbytes(layer))), (i, layer)
    return res.loaded_blocks


def oracle_restorable(engine: Engine, keys: list[Key]) -> int:
    """The longest consistent prefix, from what the tiers report holding (independent of the policy code)."""
    layout = engine.layout
    held = [0] * len(keys)
    for i, key in enumerate(keys):
        for mask in engine.contains(key).values():
            held[i] |= mask
    for n in range(len(keys), 0, -1):
        ok = True
        for layer, spec in enumerate(layout.layers):
            if spec.kind is LayerKind.SLIDING:
                need = range(max(0, n - math.ceil(spec.window / layout.block_size)), n)  # type: ignore[operator]
            elif spec.kind is LayerKind.LINEAR:
                need = range(n - 1, n)
            else:
                need = range(n)
            if any(not held[i] >> layer & 1 for i in need):
                ok = False
                break
        if ok:
            return n
    return 0


# --------------------------------------------------------------------------- config


def test_rules_parse_and_apply_in_order() -> None:
    cfg = load_config(
        {
            "tiers": [{"name": "dram", "capacity": "1MiB"}, {"name": "l2", "kind": "dram", "capacity": "1MiB"}],
            "policies": {
                "checkpoint_every": 8,
                "layers": [
                    {"match": "sliding_window", "tiers": ["dram"]},
                    {"match": "layers.2.*", "tiers": ["dram", "l2"], "priority": -1},
                    {"match": "mamba", "tiers": ["dram"]},
                ],
            },
        }
    )
    pol = LayerPolicies.resolve(hybrid_layout(), cfg.policies, tier_names=["dram", "l2"])
    swa, full, lin = (pol.group_of(i) for i in range(3))
    assert swa.retention is Retention.WINDOW and swa.tiers == {"dram"} and swa.window_blocks == 4
    assert full.retention is Retention.ALL and full.tiers is None
    assert lin.retention is Retention.SNAPSHOT and lin.tiers == {"dram"} and lin.priority == -1  # later rule wins
    assert pol.checkpoint_every == 8
    assert pol.tier_mask("l2") == 0b010 and pol.tier_mask("dram") == 0b111
    assert pol.tier_mask("gpu", "hbm") == 0b111  # the inference engine's cache holds every layer
    assert parse_match("kind:full") == ("kind", LayerKind.FULL)
    assert parse_match("name:attn") == ("name", "attn")


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"match": "slidng_window", "tiers": ["dram"]}, ["unknown layer kind", "sliding_window"]),
        ({"match": "sliding", "tiers": ["nvme"]}, ["'nvme' is not configured", "dram"]),
        ({"match": "", "tiers": ["dram"]}, ["empty match"]),
        ({"match": "   "}, ["empty match"]),
        ({"match": "sliding", "tiers": []}, ["empty tier list"]),
        ({"match": "sliding", "retention": "some"}, ["retention"]),
    ],
)
def test_a_bad_rule_is_a_clear_error(rule: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"name": "dram", "capacity": "1MiB"}], "policies": {"layers": [rule]}})
    for word in words:
        assert word in str(info.value)
    assert "policies" in str(info.value)


def test_toml_rules_and_env_override(tmp_path: Path) -> None:
    path = tmp_path / "kv.toml"
    path.write_text(
        '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\n\n'
        '[[policies.layers]]\nmatch = "sliding_window"\ntiers = ["dram"]\n'
    )
    cfg = load_config(str(path), environ={})
    assert cfg.policies.layer_policy == "per-layer" and cfg.policies.layers[0].tiers == ("dram",)
    cfg = load_config(str(path), environ={"KVSTRATA__POLICIES__LAYER_POLICY": "uniform"})
    assert cfg.policies.layer_policy == "uniform"
    with pytest.raises(ConfigError, match="layer_policy"):
        load_config(str(path), environ={"KVSTRATA__POLICIES__LAYER_POLICY": "sometimes"})


def test_uniform_layouts_take_the_plain_path(make_engine: EngineFactory) -> None:
    for name in ("tiny", "llama-3-8b"):
        eng = make_engine({"name": "dram", "capacity": "1MiB"}, layout=get_layout(name))
        assert not eng.hybrid and eng.policies.trivial
    eng = make_engine({"name": "dram", "capacity": "1MiB"}, layout=get_layout("gpt-oss-20b"))
    assert eng.hybrid and eng.policies.mode == "per-layer"
    uniform = LayerPolicies.uniform(get_layout("gpt-oss-20b"))
    eng = make_engine({"name": "dram", "capacity": "1MiB"}, layout=get_layout("gpt-oss-20b"), layer_policies=uniform)
    assert not eng.hybrid and eng.stats()["layer_policy"] == "uniform"
    assert LayerPolicies.uniform(get_layout("gpt-oss-20b")).trivial
    assert LayerPolicies.resolve(get_layout("deepseek-v3")).rank_independent
    assert not LayerPolicies.uniform(get_layout("deepseek-v3")).rank_independent


# --------------------------------------------------------------------------- retention


def test_sliding_window_stores_are_bounded_by_the_window(make_engine: EngineFactory) -> None:
    layout = hybrid_layout(window=16)  # 4 blocks
    eng = make_engine({"name": "dram", "capacity": "4MiB"}, layout=layout)
    keys = chain_keys(layout, 1, 40)
    turn(eng, keys[:30])  # one store: restore point at its end only
    swa = [i for i, k in enumerate(keys[:30]) if eng.contains(k).get("dram", 0) & 0b001]
    assert swa == list(range(26, 30))
    state = [i for i, k in enumerate(keys[:30]) if eng.contains(k).get("dram", 0) & 0b100]
    assert state == [29]
    assert all(eng.contains(k)["dram"] & 0b010 for k in keys[:30])  # full attention: every block
    turn(eng, keys)  # the next turn restores at 30 and stores 30..40
    swa = [i for i, k in enumerate(keys) if eng.contains(k).get("dram", 0) & 0b001]
    assert swa == [*range(26, 30), *range(36, 40)]
    assert len(swa) <= 2 * 4  # two restore points x the window
    assert eng.lookup(keys).num_blocks == 40


def test_checkpoint_every_adds_restore_points() -> None:
    layout = hybrid_layout(window=8)
    with Engine(
        {"tiers": [{"name": "dram", "capacity": "4MiB"}], "policies": {"checkpoint_every": 10}}, layout=layout
    ) as eng:
        keys = chain_keys(layout, 2, 35)
        assert eng.restore_points(keys, first_block=0) == [10, 20, 30, 35]
        assert eng.restore_points(keys[5:], first_block=5) == [5, 15, 25, 30]
        turn(eng, keys)
        other = chain_keys(layout, 3, 5, shared=[])  # unrelated
        assert eng.lookup(other).num_blocks == 0
        state = [i + 1 for i, k in enumerate(keys) if eng.contains(k)["dram"] & 0b100]
        assert state == [10, 20, 30, 35]
        assert eng.lookup(keys[:27]).num_blocks == 20  # the last checkpoint before 27


def test_a_branch_point_becomes_a_restore_point(make_engine: EngineFactory) -> None:
    """Two prompts share 12 blocks and diverge: the first re-send misses (no restore point at the
    divergence), the engine remembers the branch point, and the next one restores 12 blocks."""
    layout = hybrid_layout(window=8)
    eng = make_engine({"name": "dram", "capacity": "4MiB"}, layout=layout)
    shared = list(range(12 * layout.block_size))
    a = chain_keys(layout, 10, 20, shared=shared)
    b = chain_keys(layout, 11, 20, shared=shared)
    c = chain_keys(layout, 12, 20, shared=shared)
    assert turn(eng, a) == (0, 0)
    assert turn(eng, b) == (0, 0)  # full attention reaches 12, but nothing restores there yet
    assert turn(eng, c) == (12, 12)


# --------------------------------------------------------------------------- placement, budget, priority


def test_placement_rules_keep_groups_in_their_tiers(tmp_path: Path) -> None:
    layout = hybrid_layout(window=8)
    cfg = {
        "tiers": [
            {"name": "dram", "capacity": 60 * 256, "write": "write-through"},
            {"name": "l2", "kind": "dram", "capacity": "4MiB"},
        ],
        "policies": {"layers": [{"match": "sliding", "tiers": ["dram"]}, {"match": "linear", "tiers": ["dram"]}]},
    }
    with Engine(cfg, layout=layout) as eng:
        keys = chain_keys(layout, 4, 12)
        turn(eng, keys)
        for k in keys:
            assert eng.contains(k).get("l2", 0) == 0b010  # only full attention below DRAM
        assert eng.lookup(keys).tiers[-1] == "dram"
        for seed in range(5, 30):  # push the chain out of DRAM
            turn(eng, chain_keys(layout, seed, 12))
        assert all(eng.contains(k).get("dram", 0) == 0 for k in keys)
        assert eng.lookup(keys).num_blocks == 0  # the window and the snapshot were DRAM-only
        assert eng.stats()["tiers"]["l2"]["live_bytes"] > 0


def test_snapshot_admission_respects_its_budget() -> None:
    layout = hybrid_layout(window=8)
    capacity = 256 * 1024
    cfg = {"tiers": [{"name": "dram", "capacity": capacity}], "policies": {"checkpoint_budget": 0.025}}
    with Engine(cfg, layout=layout) as eng:
        budget = 0.025 * capacity  # 34 snapshots of 192 bytes
        snap = layout.layer_nbytes(2)
        offered = []
        for seed in range(40):
            keys = chain_keys(layout, 100 + seed, 4 + seed % 9)
            turn(eng, keys)
            offered.append(len(keys))  # one snapshot per turn end, valued by the prefix it restores
            d = eng.stats()["tiers"]["dram"]
            assert d["snapshot_bytes"] <= budget
            assert d["live_bytes"] <= capacity
        d = eng.stats()["tiers"]["dram"]
        assert d["evictions"] == d["snapshots_dropped"]  # only the budget evicted anything
        assert d["snapshot_bytes"] > budget - snap  # the budget is used
        assert d["snapshots_dropped"] > 0 and d["snapshots_not_admitted"] > 0
        kept = sorted(eng.tiers[0].snapshots.values())  # the most valuable: the longest prefixes
        assert kept == sorted(offered)[-len(kept) :]


def test_priorities_shed_the_lowest_priority_layers_first() -> None:
    layout = hybrid_layout(window=64)  # every block keeps its sliding layer
    per_block = layout.layer_nbytes(0) + layout.layer_nbytes(1)
    cfg = {
        "tiers": [{"name": "dram", "capacity": 10 * per_block + 2 * layout.layer_nbytes(2), "eviction": "lru"}],
        "policies": {"layers": [{"match": "sliding", "priority": -1}]},
    }
    with Engine(cfg, layout=layout) as eng:
        old = chain_keys(layout, 1, 8)
        turn(eng, old)
        turn(eng, chain_keys(layout, 2, 4))
        stats = eng.stats()["tiers"]["dram"]
        assert stats["evictions"] > 0
        # the old chain lost sliding layers before losing any full-attention block
        masks = [eng.contains(k).get("dram", 0) for k in old]
        assert any(m == 0b010 for m in masks), masks
        assert all(m & 0b010 for m in masks[:4]), masks


def test_a_broken_chain_is_evicted_first() -> None:
    layout = hybrid_layout(window=8)
    # b: 3 full + 2 sliding layer-blocks + a snapshot (832 bytes); a: 6 + 2 + a snapshot (1216)
    cfg = {"tiers": [{"name": "dram", "capacity": 832 + 1216 + 200, "eviction": "lru"}]}
    with Engine.with_tiers(cfg, layout=layout, wrap={0: FaultInjectingTier}) as eng:
        faulty = eng.tiers[0].tier
        assert isinstance(faulty, FaultInjectingTier)
        b = chain_keys(layout, 21, 3)
        a = chain_keys(layout, 20, 6)
        turn(eng, b)
        turn(eng, a)
        assert turn(eng, a) == (6, 6)  # touches a: LRU order is b (oldest), then a
        faulty.corrupt_reads, faulty.targets = 1.0, {a[1]}
        assert restore(eng, a) == 0  # a[1] is corrupt: forgotten, which breaks a[2:] (no snapshot before it)
        faulty.targets = set()
        turn(eng, chain_keys(layout, 22, 3))  # needs room: the useless a[2:] go before b
        assert all(eng.contains(k) for k in b)
        assert any(not eng.contains(k) for k in a[2:])


def test_a_fresh_engine_restores_a_hybrid_prefix_from_nvme(make_engine: EngineFactory) -> None:
    layout = hybrid_layout(window=8)
    first = make_engine({"name": "dram", "capacity": "1MiB"}, {"name": "nvme", "capacity": "64MiB"}, layout=layout)
    keys = chain_keys(layout, 7, 12)
    turn(first, keys)
    first.close()
    again = make_engine({"name": "dram", "capacity": "1MiB"}, {"name": "nvme", "capacity": "64MiB"}, layout=layout)
    found = again.lookup(keys)
    assert found.num_blocks == 12 and set(found.tiers) == {"nvme"}
    assert restore(again, keys) == 12
    assert again.stats()["tiers"]["nvme"]["snapshot_bytes"] == layout.layer_nbytes(2)
    again.flush()  # the restore promoted what it read into DRAM
    assert again.lookup(keys).tiers[-1] == "dram"


# --------------------------------------------------------------------------- property tests

_CHAINS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 24)),  # (branch, blocks)
    min_size=1,
    max_size=14,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=_CHAINS,
    window=st.sampled_from([4, 8, 16, 24]),
    capacity_blocks=st.integers(6, 60),
    every=st.sampled_from([0, 3, 8]),
    pin=st.booleans(),
    lru=st.booleans(),
    budget=st.sampled_from([0.05, 0.5]),
)
def test_every_restored_prefix_is_consistent_across_groups(
    ops: list[tuple[int, int]], window: int, capacity_blocks: int, every: int, pin: bool, lru: bool, budget: float
) -> None:
    layout = hybrid_layout(window=window)
    block = sum(s.nbytes for s in layout.layers)
    rules = [{"match": "sliding", "tiers": ["dram"]}, {"match": "linear", "tiers": ["dram"]}] if pin else []
    cfg = {
        "tiers": [
            {"name": "dram", "capacity": capacity_blocks * block, "eviction": "lru" if lru else "prefix-aware"},
            {"name": "l2", "kind": "dram", "capacity": 2 * capacity_blocks * block},
        ],
        "policies": {"checkpoint_every": every, "checkpoint_budget": budget, "layers": rules},
    }
    shared = list(range(6 * layout.block_size))
    branches = [chain_keys(layout, 50 + b, 24, shared=shared) for b in range(4)]
    with Engine(cfg, layout=layout) as eng:
        for branch, length in ops:
            keys = branches[branch][:length]
            assert eng.lookup(keys).num_blocks == oracle_restorable(eng, keys)
            n, loaded = turn(eng, keys)
            assert loaded == n  # no faults: everything the lookup promised arrives, byte for byte
            for idx in eng.tiers:
                stats = eng.stats()["tiers"][idx.name]
                assert stats["live_bytes"] <= stats["capacity_bytes"]
                assert stats["snapshot_bytes"] <= budget * stats["capacity_bytes"]


@settings(max_examples=200, deadline=None)
@given(
    avail=st.lists(st.integers(0, 7), max_size=30),
    window=st.sampled_from([4, 8, 12, 40]),
)
def test_restorable_is_the_longest_consistent_prefix(avail: list[int], window: int) -> None:
    pol = LayerPolicies.resolve(hybrid_layout(window=window))
    n = pol.restorable(avail)
    need = pol.needed_masks(n)
    assert all(avail[i] & m == m for i, m in enumerate(need))
    for longer in range(n + 1, len(avail) + 1):
        assert any(avail[i] & m != m for i, m in enumerate(pol.needed_masks(longer)))


# --------------------------------------------------------------------------- replay and byte counts


def test_counted_bytes_match_a_real_replay() -> None:
    reqs = synth_agentic(
        sessions=2, turns=4, shared_tokens=800, first_turn_tokens=400, turn_tokens=300, output_tokens=90
    )
    rules = {"layers": [{"match": "sliding", "tiers": ["dram"]}]}
    for model in ("tiny-swa", "tiny-linear"):
        layout = get_layout(model)
        for mode in ("uniform", "per-layer"):
            cfg = {
                "tiers": [{"name": "dram", "capacity": "64MiB"}, {"name": "l2", "kind": "dram", "capacity": "64MiB"}],
                "policies": rules,
            }
            rep = replay_trace(Trace(reqs), layout, cfg, layer_policy=mode).to_dict()
            pol = LayerPolicies.resolve(layout, load_config(cfg).policies, mode=mode, tier_names=["dram", "l2"])
            counted = count_stored_bytes(reqs, layout, pol, [("dram", "dram"), ("l2", "dram")])
            assert rep["mismatched_loads"] == 0 and rep["failed_loads"] == 0
            assert rep["bytes_written"]["per_tier"] == counted.per_tier, (model, mode)
            assert rep["bytes_stored"] == {"total": counted.total, "per_tier": counted.per_tier}
            assert rep["hit_tokens"] == counted.hit_tokens
            assert rep["layer_policy"] == mode


def test_per_layer_stores_less_at_an_equal_hit_rate() -> None:
    ctx = agentic_context(40_000)
    assert ctx[-1].input_length + ctx[-1].output_length == 40_000
    for model in ("gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b"):
        rows = {r["policy"]: r for r in compare_policies(model, context_tokens=40_000)}
        uni, per = rows["uniform"], rows["per-layer"]
        assert per["token_hit_rate"] == uni["token_hit_rate"] > 0.7  # the first 30K-token prompt misses
        assert per["bytes_stored"]["total"] < 0.6 * uni["bytes_stored"]["total"]
    rows = {r["policy"]: r for r in compare_policies("deepseek-v3", context_tokens=40_000, tp_size=8)}
    assert rows["uniform"]["bytes_stored"]["total"] == 8 * rows["per-layer"]["bytes_stored"]["total"]


# --------------------------------------------------------------------------- command line


def _kvstrata(*args: str, check: bool = True) -> Any:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def test_replay_cli_reports_bytes_stored_per_layer_policy(tmp_path: Path) -> None:
    import json

    trace = tmp_path / "agentic.jsonl"
    _kvstrata("trace", "synth", "--out", str(trace), "--sessions", "2", "--turns", "3", "--shared-tokens", "2000")
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[[tiers]]\nname = "dram"\ncapacity = "256MiB"\n')
    reports = {}
    for policy in ("uniform", "per-layer"):
        out = tmp_path / f"{policy}.json"
        args = ["replay", "--trace", str(trace), "--config", str(cfg), "--model", "tiny-swa"]
        _kvstrata(*args, "--layer-policy", policy, "--json", str(out))
        reports[policy] = json.loads(out.read_text())
    uni, per = reports["uniform"], reports["per-layer"]
    for r in (uni, per):
        assert r["mismatched_loads"] == 0 and r["bytes_stored"]["total"] == r["bytes_stored"]["per_tier"]["dram"] > 0
        assert set(r["bytes_written"]) == {"total", "per_tier"}
    assert uni["layer_policy"] == "uniform" and per["layer_policy"] == "per-layer"
    assert per["bytes_stored"]["total"] < 0.7 * uni["bytes_stored"]["total"]
    assert per["token_hit_rate"] >= 0.9 * uni["token_hit_rate"]


def test_layers_cli_compares_policies_and_rejects_bad_rules(tmp_path: Path) -> None:
    import json

    out = tmp_path / "rows.json"
    _kvstrata("layers", "--model", "gpt-oss-20b", "--context", "40000", "--rule", "sliding=dram", "--json", str(out))
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"uniform", "per-layer", "per-layer + rules"}
    pinned = rows["per-layer + rules"]["bytes_stored"]["per_tier"]
    assert pinned["nvme"] == pinned["fs"] < pinned["dram"] == rows["per-layer"]["bytes_stored"]["per_tier"]["dram"]
    bad = _kvstrata("layers", "--model", "gpt-oss-20b", "--rule", "slidng=dram", check=False)
    assert bad.returncode == 2 and "unknown layer kind" in bad.stderr
    bad = _kvstrata("layers", "--model", "gpt-oss-20b", "--rule", "sliding=ssd", check=False)
    assert bad.returncode == 2 and "'ssd' is not configured" in bad.stderr


HYBRID_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[2])
from test_layer_policies import Engine, chain_keys, hybrid_layout, turn
layout = hybrid_layout(window=8)
cfg = {"tiers": [{"name": "dram", "capacity": "1MiB"}, {"name": "nvme", "capacity": "64MiB", "path": sys.argv[1]}]}
with Engine(cfg, layout=layout) as engine:
    turn(engine, chain_keys(layout, 7, 12))
"""


def test_a_hybrid_prefix_another_process_stored_after_open_is_adopted(tmp_path: Path) -> None:
    import subprocess
    import sys

    layout = hybrid_layout(window=8)
    cfg = {
        "tiers": [{"name": "dram", "capacity": "1MiB"}, {"name": "nvme", "capacity": "64MiB", "path": str(tmp_path)}]
    }
    keys = chain_keys(layout, 7, 12)
    with Engine(cfg, layout=layout) as reader:  # opened before anything was written
        assert reader.lookup(keys).num_blocks == 0
        here = str(Path(__file__).resolve().parent)
        subprocess.run([sys.executable, "-c", HYBRID_WRITER, str(tmp_path), here], check=True, timeout=120)
        found = reader.lookup(keys)
        assert found.num_blocks == 12 and set(found.tiers) == {"nvme"}
        assert restore(reader, keys) == 12
