"""The capacity planner: shorthand, stack distances, hit curves, Belady, space rules, cost model, CLI.

Fast tests. The planner-against-the-real-engine comparisons on the shipped traces are in
``test_planner_truth.py``; here a few small ones check the same thing in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.config import load_config, parse_tiers_shorthand, tiers_from_shorthand
from kvstrata.core.catalog import get_layout
from kvstrata.errors import ConfigError, UnknownNameError
from kvstrata.planner import (
    EngineLimits,
    PlanOptions,
    Simulator,
    block_trace,
    make_plan,
    simulate,
    tiers_from_config,
    tiers_from_text,
)
from kvstrata.planner.command import PlanRequest, run_plan
from kvstrata.planner.costmodel import GPUS, CostModel, ModelCompute, model_compute, parse_bandwidth
from kvstrata.planner.costmodel import AttentionGroup as Attn
from kvstrata.planner.mrc import belady_hit_tokens, hit_curve, stack_distances
from kvstrata.planner.report import plan_tables, plan_to_dict, render_markdown
from kvstrata.planner.space import (
    MaskSizes,
    MemoryRecordSpace,
    SegmentRecordSpace,
    SegmentSpace,
    arena_max_blocks,
    capacity_for_blocks,
    runs_layout,
)
from kvstrata.planner.workload import BlockTrace
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers.memory import SlotArena
from kvstrata.workload.replay import replay_trace
from kvstrata.workload.traces import Request, Trace, synth_agentic, write_jsonl


def kvstrata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=600)


# ------------------------------------------------------------------------------------------------ shorthand


def test_tiers_shorthand_parses_sizes_policies_and_inf() -> None:
    tiers = parse_tiers_shorthand("hbm=40GiB, dram=256GiB:lru:second-touch, nvme=4TiB:write-back:path=/mnt/x,fs=inf")
    assert [t["name"] for t in tiers] == ["hbm", "dram", "nvme", "fs"]
    assert tiers[0] == {"name": "hbm", "capacity": 40 * 1024**3, "eviction": "lru", "promote": False}
    assert tiers[1]["eviction"] == "lru" and tiers[1]["admission"] == "second-touch"
    assert tiers[2]["write"] == "write-back" and tiers[2]["path"] == "/mnt/x"
    assert tiers[3]["capacity"] is None


def test_tiers_from_shorthand_is_a_validated_config(tmp_path: Path) -> None:
    cfg = tiers_from_shorthand(f"dram=1GiB,nvme=2GiB:second-touch:path={tmp_path}")
    assert [t.name for t in cfg.tiers] == ["dram", "nvme"]
    assert cfg.tiers[1].capacity == 2 * 1024**3 and cfg.tiers[1].admission == "second-touch"
    assert cfg.tiers[1].options.path == str(tmp_path)
    assert tiers_from_shorthand("nvme=1GiB").tiers[0].options.path.endswith("nvme")  # the cache dir default


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("dram=12XB", "unknown size unit"),
        ("dram", "expected NAME=SIZE"),
        ("dram=1GiB:fifo", "unknown option"),
        ("fs=inf", "planning only"),
        ("", "expected"),
        ("dram=1GiB,dram=2GiB", "duplicate"),
        ("tape=1TiB", "unknown tier"),
    ],
)
def test_tiers_shorthand_errors_name_the_problem(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        tiers_from_shorthand(text)


def test_plan_tiers_accept_kinds_the_engine_may_lack_and_mark_shared_ones() -> None:
    tiers = tiers_from_text("hbm=1GiB,dram=2GiB,nvme=3GiB:shared,mooncake=1TiB,fs=inf")
    assert [t.shared for t in tiers] == [False, False, True, True, True]
    assert tiers[-1].capacity is None
    with pytest.raises(UnknownNameError, match="unknown tier"):
        tiers_from_text("tape=1TiB")


# ------------------------------------------------------------------------------------------------ stack distances


def _lru_depths(keys: list[int], starts: list[int] | None) -> list[int]:
    """Brute force: LRU depth of each reference (at the reference, or at its request's start)."""
    n = len(keys)
    stack: list[int] = []
    out = []
    snap: list[int] = []
    for t, k in enumerate(keys):
        if starts is not None and starts[t] == t:
            snap = list(stack)
        view = snap if starts is not None else stack
        earlier = [u for u in range(t) if keys[u] == k]
        if not earlier:
            out.append(n)
        elif starts is not None and earlier[-1] >= starts[t]:
            out.append(0)
        else:
            out.append(len(view) - 1 - view.index(k))
        if k in stack:
            stack.remove(k)
        stack.append(k)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_stack_distances_match_a_brute_force_lru_stack(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, size=25)
    keys = rng.integers(0, 30, size=int(lengths.sum()))
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    assert stack_distances(keys).tolist() == _lru_depths(keys.tolist(), None)
    assert stack_distances(keys, starts).tolist() == _lru_depths(keys.tolist(), starts.tolist())


def _toy_trace(prompts: list[list[int]], outputs: list[int], block_size: int = 4) -> BlockTrace:
    keys: list[int] = []
    starts = [0]
    fresh = 10_000
    for p, o in zip(prompts, outputs, strict=True):
        keys += p + list(range(fresh, fresh + o))
        fresh += o
        starts.append(len(keys))
    n = len(prompts)
    return BlockTrace(
        block_size=block_size,
        keys=np.asarray(keys, dtype=np.int64),
        starts=np.asarray(starts, dtype=np.int64),
        n_prompt=np.asarray([len(p) for p in prompts], dtype=np.int64),
        input_tokens=np.asarray([len(p) * block_size for p in prompts], dtype=np.int64),
        timestamps_ms=np.arange(n, dtype=np.float64),
        sessions=(None,) * n,
        num_ids=fresh,
    )


def _random_chains(seed: int, n: int = 60) -> BlockTrace:
    """Requests that extend one of a few growing conversations (shared first blocks)."""
    rng = np.random.default_rng(seed)
    convs: list[list[int]] = [[0, 1]]
    prompts, outputs = [], []
    nxt = 2
    for _ in range(n):
        c = int(rng.integers(0, len(convs) + 1))
        if c == len(convs):
            convs.append([0, nxt])
            nxt += 1
        grow = int(rng.integers(0, 4))
        convs[c] = convs[c] + list(range(nxt, nxt + grow))
        nxt += grow
        prompts.append(list(convs[c]))
        outputs.append(int(rng.integers(0, 2)))
    return _toy_trace(prompts, outputs)


def _lru_prefix_hits(trace: BlockTrace, capacity: int) -> int:
    """Brute force: one LRU cache of ``capacity`` blocks, prefix rule, whole requests referenced in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i in range(len(trace)):
        keys = trace.request_keys(i)
        for k in keys[: trace.n_prompt[i]]:
            if k not in cache:
                break
            hits += 1
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits * trace.block_size


@pytest.mark.parametrize("seed", range(4))
def test_lru_hit_curve_equals_an_lru_cache_at_every_capacity(seed: int) -> None:
    trace = _random_chains(seed)
    curve = hit_curve(trace, "lru")
    for capacity in range(0, 40):
        assert curve.hit_tokens(capacity) == _lru_prefix_hits(trace, capacity), capacity
    for huge in (10**9, float("inf")):  # larger than the whole trace: only first references miss
        assert curve.hit_tokens(huge) == _lru_prefix_hits(trace, 10**9)


def test_hit_curve_per_instance_sums_the_instances() -> None:
    trace = _random_chains(7)
    groups = [np.arange(0, len(trace), 2), np.arange(1, len(trace), 2)]
    curve = hit_curve(trace, "lru", groups)
    for capacity in (3, 8, 20):
        expected = sum(_lru_prefix_hits(_subtrace(trace, g.tolist()), capacity) for g in groups)
        assert curve.hit_tokens(capacity) == expected


def test_blocks_for_target_is_the_smallest_capacity_reaching_it() -> None:
    trace = _random_chains(3)
    curve = hit_curve(trace, "lru")
    target = 0.5 * curve.max_hit_rate
    need = curve.blocks_for(target)
    assert need is not None
    assert curve.hit_rate(need) >= target > curve.hit_rate(need - 1)
    assert curve.blocks_for(min(1.0, curve.max_hit_rate + 0.01)) is None


# ------------------------------------------------------------------------------------------------ Belady


def _min_opt_hits(trace: BlockTrace, capacity: int) -> int:
    """Brute-force Belady (bypassing MIN): a quadratic scan for the farthest next use."""
    keys = trace.keys.tolist()
    n = len(keys)

    def next_use(t: int, k: int) -> int:
        return next((u for u in range(t + 1, n) if keys[u] == k), n)

    cache: set[int] = set()
    hit = [False] * n
    for t, k in enumerate(keys):
        if k in cache:
            hit[t] = True
            if next_use(t, k) == n:
                cache.discard(k)
            continue
        nu = next_use(t, k)
        if nu == n or capacity == 0:
            continue
        if len(cache) >= capacity:
            far = max(cache, key=lambda c: next_use(t, c))
            if next_use(t, far) <= nu:
                continue
            cache.discard(far)
        cache.add(k)
    total = 0
    for i in range(len(trace)):
        s = int(trace.starts[i])
        for j in range(int(trace.n_prompt[i])):
            if not hit[s + j]:
                break
            total += 1
    return total * trace.block_size


@pytest.mark.parametrize("seed", range(3))
def test_belady_matches_brute_force_and_bounds_lru(seed: int) -> None:
    trace = _random_chains(seed, n=40)
    lru = hit_curve(trace, "lru")
    prev = -1
    for capacity in (1, 2, 4, 8, 16, 32):
        opt = belady_hit_tokens(trace, capacity)
        assert opt == _min_opt_hits(trace, capacity)
        assert opt >= lru.hit_tokens(capacity)
        assert opt >= prev
        prev = opt
    assert belady_hit_tokens(trace, float("inf")) == lru.hit_tokens(float("inf"))


# ------------------------------------------------------------------------------------------------ space rules


@pytest.mark.parametrize("sizes", [[1024] * 4, [256, 400, 288], [65536] * 3])
@pytest.mark.parametrize("capacity", [10_000, 1 << 20, 5 * (1 << 20) + 123])
def test_memory_space_holds_as_many_blocks_as_the_real_arena(sizes: list[int], capacity: int) -> None:
    arena = SlotArena(capacity)
    blocks = 0
    while arena.can_allocate(sizes):
        for s in sizes:
            arena.allocate(s)
        blocks += 1
    blocks = min(blocks, capacity // sum(sizes))
    assert arena_max_blocks(capacity, sizes) == blocks
    if blocks:
        cap = capacity_for_blocks(blocks, sizes, "dram")
        assert arena_max_blocks(cap, sizes) >= blocks and arena_max_blocks(cap - 1, sizes) < blocks


def test_segment_space_lays_batches_out_like_plan_batch() -> None:
    from kvstrata.planner.space import CHUNK_BYTES
    from kvstrata.tiers.nvme import CHUNK_BYTES as TIER_CHUNK
    from kvstrata.tiers.segments import plan_batch

    assert CHUNK_BYTES == TIER_CHUNK

    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.choice([1024, 32768, 1000, 4 << 20, 20 << 20]))
        space = SegmentSpace(1 << 40, [size] * 4, 256 << 20, 0.5)
        n, room = int(rng.integers(1, 300)), int(rng.integers(0, 300 << 20))
        lo = int(rng.integers(0, n))
        want = plan_batch([size] * n, 16 << 20, room, start=lo).count
        assert space._fit(None, lo, n, room) == want


# ------------------------------------------------------------------------------------------------ the simulator


def _synth(**kw: Any) -> Trace:
    return Trace(
        synth_agentic(
            **{
                "sessions": 3,
                "turns": 4,
                "shared_tokens": 2000,
                "first_turn_tokens": 1000,
                "turn_tokens": 300,
                "output_tokens": 100,
                **kw,
            }
        )
    )


def _both(trace: Trace, config: dict[str, Any], tmp_path: Path) -> tuple[Any, Any]:
    layout = get_layout("tiny", block_size=trace.block_size)
    for t in config["tiers"]:
        if t["name"] == "nvme":
            t.update(path=str(tmp_path / "nvme"), direct_io="off", fsync=False)
    cfg = load_config(config)
    sim = simulate(
        block_trace(trace.requests, layout.block_size),
        tiers_from_config(cfg),
        [s.nbytes for s in layout.layers],
        limits=EngineLimits.from_config(cfg),
    )
    real = replay_trace(trace, layout, cfg, verify=False)
    return sim, real


def test_simulator_agrees_with_the_engine_on_a_small_three_tier_run(tmp_path: Path) -> None:
    config = {
        "tiers": [
            {"name": "hbm", "capacity": "96KiB", "eviction": "lru", "promote": False},
            {"name": "dram", "capacity": "256KiB"},
            {"name": "nvme", "capacity": "1MiB", "admission": "second-touch"},
        ]
    }
    sim, real = _both(_synth(), config, tmp_path)
    assert real.token_hit_rate > 0.2  # the run exercises hits
    assert sim.prompt_tokens == real.prompt_tokens
    for t in sim.tiers:
        assert abs(sim.tier_hit_rate(t.name) - real.per_tier[t.name] / real.prompt_tokens) < 0.01, t.name
        stats = real.engine_stats["tiers"][t.name]
        assert t.evictions == pytest.approx(stats["evictions"], rel=0.05, abs=5), t.name
        assert t.not_admitted == pytest.approx(stats["not_admitted"], rel=0.05, abs=5), t.name


def test_simulator_splits_large_store_batches_like_the_engine(tmp_path: Path) -> None:
    """A 16 KiB queue budget is four 4 KiB blocks: every request's store is split into parts, and
    plan and replay still agree block for block (nothing is dropped on either side)."""
    config = {"engine": {"max_pending_bytes": "16KiB"}, "tiers": [{"name": "dram", "capacity": "1MiB"}]}
    sim, real = _both(_synth(), config, tmp_path)
    assert sim.dropped_stores == real.engine_stats["dropped_stores"] == 0
    assert sim.stored_blocks == real.blocks_stored > 0
    assert sim.token_hit_rate == pytest.approx(real.token_hit_rate, abs=0.005)
    assert real.token_hit_rate > 0.2


def test_simulator_drops_blocks_larger_than_the_budget_like_the_engine(tmp_path: Path) -> None:
    config = {"engine": {"max_pending_bytes": "2KiB"}, "tiers": [{"name": "dram", "capacity": "1MiB"}]}
    sim, real = _both(_synth(), config, tmp_path)
    assert sim.dropped_stores > 0 and sim.dropped_blocks > 0
    assert sim.dropped_stores == real.engine_stats["dropped_stores"]
    assert sim.dropped_blocks == real.engine_stats["dropped_blocks"]
    assert sim.token_hit_rate == real.token_hit_rate == 0


def _subtrace(trace: BlockTrace, idx: list[int]) -> BlockTrace:
    """The requests ``idx`` of ``trace``, alone."""
    lengths = [int(trace.starts[i + 1] - trace.starts[i]) for i in idx]
    return BlockTrace(
        trace.block_size,
        np.concatenate([trace.keys[trace.starts[i] : trace.starts[i + 1]] for i in idx]),
        np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        trace.n_prompt[idx],
        trace.input_tokens[idx],
        trace.timestamps_ms[idx],
        tuple(trace.sessions[i] for i in idx),
        trace.num_ids,
    )


def test_round_robin_instances_with_private_tiers_are_independent_engines() -> None:
    trace = block_trace(_synth(sessions=4).requests, 16)
    tiers = tiers_from_text("dram=128KiB,nvme=512KiB")
    sizes = [s.nbytes for s in get_layout("tiny").layers]
    multi = Simulator(tiers, sizes, instances=2, routing="round-robin").run(trace)
    assert multi.instance_of.tolist() == [i % 2 for i in range(len(trace))]
    hits = 0
    for inst in range(2):
        hits += simulate(_subtrace(trace, list(range(inst, len(trace), 2))), tiers, sizes).hit_tokens
    assert multi.hit_tokens == hits


def test_a_shared_tier_serves_what_another_instance_stored() -> None:
    trace = block_trace(_synth(sessions=1, turns=4).requests, 16)
    sizes = [s.nbytes for s in get_layout("tiny").layers]
    private = Simulator(tiers_from_text("dram=1MiB"), sizes, instances=2).run(trace)
    shared = Simulator(tiers_from_text("dram=1MiB,fs=inf"), sizes, instances=2).run(trace)
    assert private.token_hit_rate < shared.token_hit_rate
    assert shared.tier_hit_rate("fs") > 0  # turn t+1 lands on the other instance and finds turn t in fs
    sticky = Simulator(tiers_from_text("dram=1MiB"), sizes, instances=2, routing="sticky").run(trace)
    assert sticky.token_hit_rate > private.token_hit_rate  # one session stays on one instance


def test_cache_aware_routing_follows_the_cached_prefix() -> None:
    trace = block_trace(_synth(sessions=3, turns=4).requests, 16)  # 3 sessions: round-robin moves them
    sizes = [s.nbytes for s in get_layout("tiny").layers]
    tiers = tiers_from_text("dram=4MiB")
    rr = Simulator(tiers, sizes, instances=2, routing="round-robin").run(trace)
    aware = Simulator(tiers, sizes, instances=2, routing="cache-aware").run(trace)
    assert aware.token_hit_rate > rr.token_hit_rate
    assert set(aware.instance_of.tolist()) == {0, 1}  # the balance guard spreads the load


# ------------------------------------------------------------------------------------------------ cost model


def test_prefill_flops_count_attention_pairs_and_windows() -> None:
    mc = ModelCompute(10.0, (Attn(2, 3.0), Attn(1, 5.0, window=7)))
    for new, cached in [(5, 0), (10, 3), (3, 10), (0, 4), (20, 20)]:
        full = sum(c for c in range(cached + 1, cached + new + 1))
        window = sum(min(c, 7) for c in range(cached + 1, cached + new + 1))
        want = 2 * 10.0 * new + 3.0 * 2 * full + 5.0 * window
        assert mc.prefill_flops(np.array([new]), np.array([cached]))[0] == pytest.approx(want)


def test_cost_model_speedups() -> None:
    cm = CostModel(model_compute("llama-3-8b"), GPUS["h100"])
    tokens = np.array([8192, 16384])
    none = cm.evaluate(tokens, np.zeros((2, 2), dtype=np.int32), [("hbm", "hbm"), ("nvme", "nvme")], 512, 64 << 20)
    assert none.ttft_speedup == pytest.approx(1.0) and none.prefill_throughput_speedup == pytest.approx(1.0)
    hits = np.array([[15, 0], [0, 31]], dtype=np.int32)  # hbm hits are free, nvme hits cost bytes
    some = cm.evaluate(tokens, hits, [("hbm", "hbm"), ("nvme", "nvme")], 512, 64 << 20)
    assert some.ttft_speedup > 1.0 and some.load_time_s["hbm"] == 0 and some.load_time_s["nvme"] > 0
    slow = CostModel(model_compute("llama-3-8b"), GPUS["h100"], overrides={"nvme": 1e8})
    assert slow.evaluate(tokens, hits, [("hbm", "hbm"), ("nvme", "nvme")], 512, 64 << 20).bottleneck == "nvme link"


def test_bandwidths_parse() -> None:
    assert parse_bandwidth("50GB/s") == 50e9
    assert parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("1GiB/s") == 1024**3
    with pytest.raises(ConfigError):
        parse_bandwidth("fast")


def test_kimi_k25_fp8_kv_per_100k_tokens() -> None:
    """The study's "~3.8 GB per 100K tokens in FP8" against the published geometry: 3.51 GB."""
    layout = get_layout("kimi-k2.5", kv_dtype="fp8")
    assert layout.bytes_per_token == 61 * (512 + 64)
    assert 100_000 * layout.bytes_per_token / 1e9 == pytest.approx(3.51, abs=0.01)


# ------------------------------------------------------------------------------------------------ plans


def test_plan_figures_and_calibrated_curves() -> None:
    trace = block_trace(_synth(sessions=4, turns=6).requests, 16)
    layout = get_layout("tiny")
    tiers = tiers_from_text("hbm=64KiB,dram=256KiB,nvme=2MiB")
    plan = make_plan(
        trace,
        layout,
        tiers,
        CostModel(model_compute("tiny"), GPUS["h100"]),
        options=PlanOptions(target_hit_rate=0.5, verify_target=True),
    )
    d = plan.to_dict()
    for key in ("token_hit_rate", "per_tier", "belady_token_hit_rate", "ssd_bytes_written_per_day", "ttft_speedup"):
        assert key in d
    assert d["token_hit_rate"] == pytest.approx(sum(t["hit_rate"] for t in d["per_tier"].values()))
    assert d["belady_token_hit_rate"] >= d["token_hit_rate"] - 1e-9
    for name, curve in plan.curves.items():
        assert len(curve.capacity_bytes) == 20
        assert curve.hit_rate == sorted(curve.hit_rate)  # more capacity never hurts on the curve
        if name != "hbm" and curve.calibration != 1.0:  # fitted to the simulation where it limits
            assert curve.at_configured == pytest.approx(d["per_tier"][name]["cumulative_hit_rate"], abs=0.01)
    nvme = d["per_tier"]["nvme"]["target"]
    assert nvme["capacity_bytes"] is not None
    assert nvme["simulated_hit_rate"] == pytest.approx(0.5, abs=0.05)


# ------------------------------------------------------------------------------------------------ CLI


def _plan_cli(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    trace = tmp_path / "t.jsonl"
    write_jsonl(trace, _synth().requests)
    tiers = "hbm=64KiB,dram=256KiB,nvme=1MiB,fs=inf"
    return kvstrata("plan", "--trace", str(trace), "--tiers", tiers, "--target-hit-rate", "0.6", *extra)


def test_cli_plan_writes_json_and_markdown(tmp_path: Path) -> None:
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    res = _plan_cli(tmp_path, "--json", str(out), "--markdown", str(md))
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert set(d["per_tier"]) == {"hbm", "dram", "nvme", "fs"}
    assert 0 < d["token_hit_rate"] <= d["belady_token_hit_rate"] + 1e-9
    assert d["per_tier"]["fs"]["capacity_bytes"] is None
    assert all(len(c["capacity_bytes"]) == 20 for c in d["mrc"]["curves"].values())
    assert "token hit rate" in res.stdout and "Belady" in res.stdout
    assert md.read_text().startswith("# kvstrata plan") and "## Cost model" in md.read_text()


def test_cli_plan_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    res = _plan_cli(tmp_path, "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_inline_synth_and_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\n[[tiers]]\nname = "nvme"\ncapacity = "4MiB"\n'
        f'path = "{tmp_path / "nvme"}"\n'
    )
    out = tmp_path / "p.json"
    res = kvstrata(
        "plan",
        "--synth",
        "sessions=2,turns=3,shared-tokens=500",
        "--config",
        str(cfg),
        "--instances",
        "2",
        "--routing",
        "sticky",
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert d["instances"] == 2 and d["per_tier"]["dram"]["copies"] == 2 and d["trace"]["requests"] == 6


def test_cli_replay_accepts_tiers(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_jsonl(trace, _synth(sessions=1, turns=2).requests)
    out = tmp_path / "r.json"
    res = kvstrata(
        "replay", "--trace", str(trace), "--tiers", f"dram=1MiB,nvme=4MiB:path={tmp_path / 'n'}", "--json", str(out)
    )
    assert res.returncode == 0, res.stderr
    assert set(json.loads(out.read_text())["per_tier"]) == {"dram", "nvme"}
    both = kvstrata("replay", "--trace", str(trace), "--tiers", "dram=1MiB", "--config", str(trace))
    assert both.returncode == 2 and "not both" in both.stderr


def _bad_trace(tmp_path: Path) -> str:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')  # no output_length
    return str(p)


def _bad_model(tmp_path: Path) -> str:
    p = tmp_path / "config.json"
    p.write_text('{"num_hidden_layers": 2, "hidden_size": ')
    return str(p)


@pytest.mark.parametrize(
    ("make_args", "words"),
    [
        (lambda tmp: ["--model", "no-such-model"], "unknown model"),
        (lambda tmp: ["--model", _bad_model(tmp)], "not valid JSON"),
        (lambda tmp: ["--trace", _bad_trace(tmp)], "output_length"),
        (lambda tmp: ["--tiers", "dram=12 parsecs"], "unknown size unit"),
        (lambda tmp: ["--target-hit-rate", "1.5"], "1.5"),
        (lambda tmp: ["--target-hit-rate", "-0.1"], "-0.1"),
        (lambda tmp: ["--gpu", "abacus"], "unknown gpu"),
        (lambda tmp: ["--bandwidth", "nowhere=1GB/s"], "--bandwidth"),
        (lambda tmp: ["--layer-policy", "every-other"], "--layer-policy"),
    ],
)
def test_cli_plan_bad_inputs_exit_2(tmp_path: Path, make_args: Any, words: str) -> None:
    args = make_args(tmp_path)
    if "--trace" not in args:
        good = tmp_path / "good.jsonl"  # a valid trace, so that only the bad argument is wrong
        write_jsonl(good, synth_agentic(sessions=1, turns=2))
        args = ["--trace", str(good), "--limit", "5", *args]
    if "--tiers" not in args:
        args += ["--tiers", "dram=1GiB"]
    res = kvstrata("plan", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert words in res.stderr


def test_requests_keys_for_mooncake_output_blocks_are_unique() -> None:
    reqs = [
        Request(0, 0.0, None, 1100, 600, hash_ids=[1, 2, 3]),
        Request(1, 1.0, None, 1100, 600, hash_ids=[1, 2, 3]),
    ]
    trace = block_trace(reqs, 512)
    a, b = trace.request_keys(0), trace.request_keys(1)
    assert trace.n_prompt.tolist() == [2, 2] and a[:2] == b[:2]
    assert len(a) == 2 + (1100 - 1024 + 600) // 512 and not set(a[2:]) & set(b[2:])


# ------------------------------------------------------------------------------------------------ per-layer policies


def test_runs_layout_is_plan_batch_over_runs_of_equal_records() -> None:
    from kvstrata.tiers.segments import plan_batch, record_extent

    rng = np.random.default_rng(3)
    for _ in range(3000):
        runs = [
            (int(rng.choice([64, 1000, 9728, 70_000, 5_000_000, 20_000_000])), int(rng.integers(1, 40)))
            for _ in range(int(rng.integers(1, 5)))
        ]
        lengths = [size for size, n in runs for _ in range(n)]
        start = int(rng.integers(0, len(lengths)))
        room = None if rng.random() < 0.3 else int(rng.integers(0, 2 * sum(lengths)))
        limit = int(rng.choice([16 << 20, 8192, 100_000]))
        want = plan_batch(lengths, limit, room, start=start)
        got = runs_layout([(record_extent(size), n) for size, n in runs], limit, room, start=start)
        assert got == (want.count, want.size)


def _records_fuzz(model: str, capacity: int, seed: int, tmp_path: Path, steps: int = 120) -> None:
    """Random writes and deletes of layer-records (any subset of a block's layers) into a real nvme
    tier and a real DRAM arena, and into their record-level models: the same answers, the same bytes."""
    import random

    from kvstrata.core.keys import Key, Namespace
    from kvstrata.tiers.base import TierContext
    from kvstrata.tiers.memory import DRAMTier, MemoryOptions
    from kvstrata.tiers.nvme import NVMeOptions, NVMeTier

    layout = get_layout(model)
    ctx = TierContext(layout, Namespace(layout.model, layout.layers[0].dtype, layout.fingerprint(), 16))
    sizes = [s.nbytes for s in layout.layers]
    n_layers = len(sizes)
    masks = MaskSizes(sizes)
    nvme = NVMeTier("nvme", capacity, NVMeOptions(path=str(tmp_path / f"n{seed}"), direct_io="off", fsync=False), ctx)
    dram = DRAMTier("dram", capacity // 4, MemoryOptions(pin_memory="off"), ctx)
    nvme_model = SegmentRecordSpace(capacity, masks, 256 * 1024**2, 0.5)
    dram_model = MemoryRecordSpace(capacity // 4, masks)
    rng = random.Random(seed)
    held: dict[int, int] = {}  # key -> layer mask (the same records in both tiers)
    live = 0  # dram bytes
    nxt = 0
    try:
        for _ in range(steps):
            if rng.random() < 0.55 or not held:
                items = [(nxt + i, rng.randint(1, (1 << n_layers) - 1)) for i in range(rng.randint(1, 40))]
                nxt += len(items)
                ids = [(k, layer) for layer in range(n_layers) for k, m in items if m >> layer & 1]  # layer-major
                lengths = [sizes[layer] for _, layer in ids]
                fits_nvme = nvme.has_room(lengths, 0)
                fits_dram = dram.has_room(lengths, live)
                assert fits_nvme == nvme_model.fits_records([m for _, m in items], 0)
                assert fits_dram == dram_model.fits_records([m for _, m in items], live)
                if fits_nvme and fits_dram:
                    bufs = [((Key(k.to_bytes(16, "big")), layer), np.zeros(sizes[layer], np.uint8)) for k, layer in ids]
                    assert all(nvme.write(bufs)) and all(dram.write(bufs))
                    nvme_model.add_records(items)
                    dram_model.add_records(items)
                    held.update(items)
                    live += sum(lengths)
                    continue
            gone = []
            for k in rng.sample(sorted(held), min(len(held), rng.randint(1, 30))):
                part = held[k] if rng.random() < 0.7 else held[k] & rng.randint(1, (1 << n_layers) - 1)
                if part:
                    gone.append((k, part))
                    held[k] &= ~part
                    if not held[k]:
                        del held[k]
            gone_ids = [
                (Key(k.to_bytes(16, "big")), layer) for k, m in gone for layer in range(n_layers) if m >> layer & 1
            ]
            nvme.delete(gone_ids)
            dram.delete(gone_ids)
            nvme_model.remove_records(gone)
            dram_model.remove_records(gone)
            live -= sum(sizes[layer] for _, layer in gone_ids)
            assert nvme.refresh_used() == nvme_model.physical_bytes
        assert nvme_model.compactions > 0
    finally:
        nvme.close()
        dram.close()


@pytest.mark.parametrize("model", ["tiny-swa", "tiny-linear"])
def test_record_spaces_match_the_real_tiers(model: str, tmp_path: Path) -> None:
    _records_fuzz(model, 2 * 1024**2 if model == "tiny-swa" else 8 * 1024**2, 0, tmp_path)


KiB = 1024
HYBRID_SMALL = {
    "tiny-swa": ("tiny-swa", {}),
    "tiny-swa, sliding layers shed first": ("tiny-swa", {"layers": [{"match": "sliding", "priority": -1}]}),
    "tiny-linear, checkpoint_every 8, snapshot budget 0.3": (
        "tiny-linear",
        {"checkpoint_every": 8, "checkpoint_budget": 0.3},
    ),
}


@pytest.mark.parametrize("case", list(HYBRID_SMALL))
def test_hybrid_simulator_matches_the_engine_on_a_small_run(case: str, tmp_path: Path) -> None:
    """DRAM over NVMe, both full, per-layer policies; DRAM does not promote (a promotion copy
    racing the next store on the engine's I/O threads makes a replay this tight vary between runs)."""
    model, policies = HYBRID_SMALL[case]
    nvme = {"name": "nvme", "capacity": "1MiB", "path": str(tmp_path / "nvme"), "direct_io": "off", "fsync": False}
    config = {"tiers": [{"name": "dram", "capacity": "256KiB", "promote": False}, nvme], "policies": policies}
    layout = get_layout(model)
    trace = _synth()
    cfg = load_config(config)
    pol = LayerPolicies.resolve(layout, cfg.policies, tier_names=["dram", "nvme"])
    sizes = [s.nbytes for s in layout.layers]
    sim = simulate(block_trace(trace.requests, 16), tiers_from_config(cfg), sizes, policies=pol)
    real = replay_trace(trace, layout, config, verify=False)
    stats = real.engine_stats["tiers"]
    assert sim.hybrid and real.token_hit_rate > 0.1
    assert sim.token_hit_rate == pytest.approx(real.token_hit_rate, abs=0.02)
    assert {t.name: t.bytes_stored for t in sim.tiers} == real.to_dict()["bytes_stored"]["per_tier"]
    assert {t.name: t.bytes_written for t in sim.tiers} == real.to_dict()["bytes_written"]["per_tier"]
    assert all(t.evictions == stats[t.name]["evictions"] > 0 for t in sim.tiers)
    if "budget" in case:
        assert sim.tiers[0].snapshots_dropped == stats["dram"]["snapshots_dropped"] > 0


def test_uniform_layer_policy_takes_the_block_path() -> None:
    trace = block_trace(_synth().requests, 16)
    layout = get_layout("tiny-swa")
    sizes = [s.nbytes for s in layout.layers]
    tiers = tiers_from_text("dram=256KiB,nvme=1MiB")
    plain = simulate(trace, tiers, sizes)
    uniform = simulate(trace, tiers, sizes, policies=LayerPolicies.uniform(layout))
    per_layer = simulate(trace, tiers, sizes, policies=LayerPolicies.resolve(layout))
    assert not uniform.hybrid and uniform.layer_policy == "uniform" and per_layer.hybrid
    assert uniform.hit_tokens == plain.hit_tokens and uniform.bytes_stored == plain.bytes_stored
    assert [t.bytes_stored for t in plain.tiers] == [t.resident_blocks * sum(sizes) for t in plain.tiers]
    tiny = simulate(trace, tiers, sizes, policies=LayerPolicies.resolve(get_layout("tiny")))
    assert not tiny.hybrid  # a uniform layout: per-layer policies keep every layer anyway


def _plan_synth(**kw: Any) -> Any:
    synth = "sessions=3,turns=6,shared-tokens=2000,first-turn-tokens=1000,turn-tokens=600,output-tokens=200"
    return run_plan(PlanRequest(synth=synth, model="tiny-swa", tiers="dram=512KiB,nvme=2MiB", **kw))


def test_plan_reports_bytes_stored_per_layer_policy() -> None:
    plans = {policy: plan_to_dict(_plan_synth(layer_policy=policy)) for policy in ("per-layer", "uniform")}
    for policy, d in plans.items():
        stored = d["bytes_stored"]
        assert d["layer_policy"] == policy and stored["total"] == sum(stored["per_tier"].values()) > 0
        assert stored["per_tier"] == {name: t["bytes_stored"] for name, t in d["per_tier"].items()}
    per, uni = plans["per-layer"], plans["uniform"]
    assert per["bytes_stored"]["total"] < uni["bytes_stored"]["total"]
    assert per["token_hit_rate"] > uni["token_hit_rate"]  # the same bytes hold more of the working set
    assert any("per-layer policies simulated" in n for n in per["notes"])
    assert any("layer policy uniform" in n for n in uni["notes"])
    assert per["layer_policies"]["groups"][0]["retention"] == "window"
    default = _plan_synth()
    assert default.layer_policy == "per-layer"  # the default
    assert "bytes stored" in str(plan_tables(default)) and "bytes stored" in render_markdown(default)


def test_plan_honours_the_config_policies_section(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text(
        '[policies]\nlayer_policy = "uniform"\n\n[[tiers]]\nname = "dram"\ncapacity = "1MiB"\n\n'
        f'[[tiers]]\nname = "nvme"\ncapacity = "4MiB"\npath = "{tmp_path / "n"}"\n'
    )
    req: dict[str, Any] = {"synth": "sessions=2,turns=3,shared-tokens=1000", "model": "tiny-linear", "config": str(cfg)}
    assert run_plan(PlanRequest(**req)).layer_policy == "uniform"
    assert run_plan(PlanRequest(**req, layer_policy="per-layer")).layer_policy == "per-layer"
    with pytest.raises(ConfigError, match="layer policy"):
        run_plan(PlanRequest(**req, layer_policy="sometimes"))


@pytest.mark.parametrize("policy", ["uniform", "per-layer"])
def test_plan_of_a_large_model_stores_long_prompts(policy: str) -> None:
    """Gemma 3 27B is ~496 KiB a token: one 8,192-token request is ~4 GiB, eight times the store
    queue budget of a 4 GiB top tier. It is stored in parts, so its continuation hits (the whole
    batch used to be dropped: 0% hits, 0 bytes stored)."""
    synth = "sessions=1,turns=2,shared-tokens=0,first-turn-tokens=8192,turn-tokens=256,output-tokens=16"
    plan = run_plan(PlanRequest(synth=synth, model="gemma-3-27b", tiers="hbm=4GiB,dram=64GiB", layer_policy=policy))
    d = plan_to_dict(plan)
    assert d["engine_limits"]["max_pending_bytes"] == 512 * 1024**2
    assert d["dropped_store_batches"] == 0 and d["stored_blocks"] > 0
    # the second request (8,464 tokens) re-reads the first one's 8,192 + 16 output tokens
    assert d["token_hit_rate"] == pytest.approx(8208 / (8192 + 8464), abs=0.002)
