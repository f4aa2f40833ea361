"""The scheduler's light prober answers exactly what ``Engine.probe`` (the scheduler's old path:
a full engine over the persistent tiers, per rank) answers, on the same stored data."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_vllm_plan import FullAttentionSpec, Group, SlidingWindowSpec  # the same stand-ins for vLLM's specs

from kvstrata.config import KVStrataConfig, load_config
from kvstrata.core.keys import Key, Namespace
from kvstrata.engine.engine import Engine
from kvstrata.integrations.vllm.plan import (
    ModelPlan,
    build_plan,
    layer_policies,
    make_namespace,
    rank_keys,
)
from kvstrata.integrations.vllm.prober import TierProber, is_persistent, persistent_tiers
from kvstrata.tiers.nvme import NVMeTier
from kvstrata.workload.content import block_contents

TP = 2


def make_plan(hybrid: bool) -> ModelPlan:
    groups = [Group(["a0", "a1"], FullAttentionSpec(16, 256))]
    if hybrid:  # a sliding-window group: stores keep only its window, so layers differ per block
        groups.append(Group(["s0", "s1"], SlidingWindowSpec(16, 128, sliding_window=32)))
    return build_plan("prober-model", groups, scheduler_block_size=16, hash_block_size=16)


def namespaces(plan: ModelPlan) -> list[Namespace]:
    return [make_namespace(plan, "prober-model", "float16", r, TP, "") for r in range(TP)]


def tiers_for(kind: str, root: Path) -> list[dict[str, Any]]:
    nvme: dict[str, Any] = {"name": "nvme", "capacity": "64MiB", "path": str(root / "nvme"), "direct_io": "off"}
    fs: dict[str, Any] = {
        "name": "fs",
        "kind": "fs",
        "capacity": "64MiB",
        "url": f"file://{root / 'fs'}",
        "refresh_s": 0,
    }
    fs.update(fsync=False, gc_interval_s=0)
    dram: dict[str, Any] = {"name": "dram", "capacity": "16MiB"}
    choices: dict[str, list[dict[str, Any]]] = {"nvme": [dram, nvme], "fs": [dram, fs], "both": [dram, nvme, fs]}
    return choices[kind]


def store(config: KVStrataConfig, plan: ModelPlan, ns: Namespace, keys: list[Key], parent: Key | None = None) -> None:
    """Store ``keys`` (one chain, every layer) through a worker-like engine, then close it."""
    with Engine(config, layout=plan.layout, namespace=ns, layer_policies=layer_policies(plan, config)) as engine:
        bufs = {i: block_contents(keys, i, plan.layout.layer_nbytes(i)) for i in range(plan.layout.num_layers)}
        engine.store_sync(keys, bufs, parent=parent)
        engine.flush()


def old_probes(config: KVStrataConfig, plan: ModelPlan) -> list[Engine]:
    """What the scheduler built before: one engine per rank over the persistent tiers only."""
    cfg = config.with_tiers(persistent_tiers(config))
    policies = layer_policies(plan, cfg)
    return [Engine(cfg, layout=plan.layout, namespace=ns, layer_policies=policies) for ns in namespaces(plan)]


def request_keys(n: int, seed: int = 0) -> list[Key]:
    return [bytes(np.random.default_rng(seed * 100_000 + i).integers(0, 256, 16, dtype=np.uint8)) for i in range(n)]


def layer_sets(plan: ModelPlan) -> list[list[int]]:
    every = list(range(plan.layout.num_layers))
    return [every, *([*g.layers[:1]] for g in plan.groups), *(list(g.layers) for g in plan.groups), every[-1:]]


def assert_same_answers(probers: TierProber, engines: list[Engine], plan: ModelPlan, keys: list[Key]) -> int:
    """Every prefix length and layer set the scheduler may ask, on every rank; returns hits seen."""
    hits = 0
    for rank, engine in enumerate(engines):
        rkeys = rank_keys(keys, rank)
        for layers in layer_sets(plan):
            for n in (0, 1, 2, 5, 6, 21, 22, 40, 85, len(rkeys)):
                want = engine.probe(rkeys[:n], layers)
                got = probers.probe(rank, rkeys[:n], layers)
                assert got == want.tier_positions, (rank, layers, n)
                assert len(got) == want.num_blocks
                hits += len(got)
    return hits


@pytest.mark.parametrize("hybrid", [False, True], ids=["uniform", "hybrid"])
@pytest.mark.parametrize("kind", ["nvme", "fs", "both"])
def test_prober_answers_what_engine_probe_answers(kind: str, hybrid: bool, tmp_path: Path) -> None:
    plan = make_plan(hybrid)
    config = load_config({"tiers": tiers_for(kind, tmp_path)})
    keys = request_keys(100)
    ns = namespaces(plan)
    # rank 0: blocks 0..29 and 31..59 (a hole at 30); rank 1: only 0..9
    store(config, plan, ns[0], rank_keys(keys[:30], 0))
    store(config, plan, ns[0], rank_keys(keys[31:60], 0), parent=keys[30])
    store(config, plan, ns[1], rank_keys(keys[:10], 1))
    if kind == "both":  # the slower tier holds more than the faster one: positions differ per block
        store(load_config({"tiers": tiers_for("fs", tmp_path)}), plan, ns[0], rank_keys(keys[:45], 0))
    prober = TierProber(config, plan.layout, ns)
    engines = old_probes(config, plan)
    try:
        assert prober.tier_names == tuple(engines[0].config.tiers[i].name for i in range(len(prober.tier_names)))
        assert assert_same_answers(prober, engines, plan, keys) > 0
        # blocks stored after both opened: neither caches an answer
        store(config, plan, ns[1], rank_keys(keys[10:50], 1), parent=rank_keys(keys[9:10], 1)[0])
        assert assert_same_answers(prober, engines, plan, keys) > 0
        assert len(prober.probe(1, rank_keys(keys, 1), plan.groups[0].layers[:1])) == 50
    finally:
        prober.close()
        for engine in engines:
            engine.close()


def test_prober_opens_only_persistent_tiers(tmp_path: Path) -> None:
    config = load_config({"tiers": tiers_for("both", tmp_path)})
    assert [t.name for t in persistent_tiers(config)] == ["nvme", "fs"]
    assert is_persistent("nvme") and is_persistent("fs")
    assert not is_persistent("dram") and not is_persistent("no-such-tier")
    plan = make_plan(False)
    prober = TierProber(config, plan.layout, namespaces(plan))
    try:
        assert prober.ranks == TP and prober.tier_names == ("nvme", "fs")
        assert prober.probe(0, request_keys(8), [0]) == []
    finally:
        prober.close()
        prober.close()  # idempotent


def test_prober_starts_no_thread_and_loads_no_mirror(tmp_path: Path) -> None:
    """The scheduler's prober over many stored NVMe blocks: opening it and probing starts no
    thread (nor loads the NVMe tier's mirror of its whole index), and its answers are right."""
    plan = make_plan(False)
    config = load_config({"tiers": tiers_for("nvme", tmp_path)})
    keys = request_keys(400, seed=3)
    ns = namespaces(plan)
    store(config, plan, ns[0], rank_keys(keys[:300], 0))
    threads, count = set(threading.enumerate()), threading.active_count()
    prober = TierProber(config, plan.layout, ns)
    try:
        layers = plan.groups[0].layers[:1]
        assert len(prober.probe(0, rank_keys(keys, 0), layers)) == 300
        assert prober.probe(1, rank_keys(keys, 1), layers) == []
        assert prober.probe(0, rank_keys(keys[300:], 0), list(plan.groups[0].layers)) == []
        assert set(threading.enumerate()) - threads == set()
        assert threading.active_count() <= count
        nvme = [t for t in prober._tiers[0] if isinstance(t, NVMeTier)]
        assert nvme
        assert len(nvme[0]._mirror) < 2 * 300  # only the layer-0 records contains() asked, not the index
    finally:
        prober.close()
