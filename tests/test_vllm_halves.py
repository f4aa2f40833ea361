"""The connector's two halves without a vLLM process. Scheduler: hits from the persistent tiers
when no worker answers (every rank, the shortest answer wins), loads the workers confirmed.
Worker: a confirmed load plans from the engine's index alone (the worker's socket lookup took
the blocks in), any other load looks up first and adopts what another process stored; each load
walks the index once, and no pinned plan outlives an aborted or failed load."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash

pytest.importorskip("vllm")

from test_vllm_plan import FullAttentionSpec, Group  # the same stand-ins for vLLM's specs

from kvstrata.config import load_config  # after the skip: the halves import vLLM
from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine
from kvstrata.errors import KVStrataError
from kvstrata.integrations.vllm.lookup import LookupClient, LookupServer
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, TransferSpec
from kvstrata.integrations.vllm.plan import build_plan, layer_policies, make_namespace, rank_keys
from kvstrata.integrations.vllm.scheduler import SchedulerSide
from kvstrata.integrations.vllm.settings import ConnectorSettings, ExtraConfig
from kvstrata.integrations.vllm.worker import WorkerSide
from kvstrata.workload.content import block_contents

BLOCK = 16
MODEL = "sched-model"


@dataclass
class Request:
    request_id: str
    num_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None


PLAN = build_plan(MODEL, [Group(["l0", "l1"], FullAttentionSpec(BLOCK, 256))], BLOCK, BLOCK)


def settings(tmp_path: Path, tp: int, load_mode: str = "auto") -> ConnectorSettings:
    tiers = [
        {"name": "dram", "capacity": "16MiB"},
        {"name": "nvme", "capacity": "64MiB", "path": str(tmp_path / "nvme"), "direct_io": "off"},
    ]
    extra = ExtraConfig(config=load_config({"tiers": tiers}), worker_lookup_timeout_s=0.5, load_mode=load_mode)
    instance = f"test-{os.getpid()}-{tmp_path.name}"
    return ConnectorSettings(extra, MODEL, "float16", tp, instance, 0, use_vllm_hashes=True)


def request(n_blocks: int) -> Request:
    hashes = [xxhash.xxh3_64_digest(i.to_bytes(4, "little")) for i in range(n_blocks)]
    return Request("r1", n_blocks * BLOCK + 1, hashes)


def keys_of(req: Request) -> list[Key]:
    seed = make_namespace(PLAN, MODEL, "float16", 0, 1, "").seed
    return [xxhash.xxh3_128_digest(seed + h) for h in req.block_hashes]


def store(s: ConnectorSettings, rank: int, keys: list[Key]) -> None:
    ns = make_namespace(PLAN, MODEL, "float16", rank, s.tp_size, "")
    config = s.config
    with Engine(config, layout=PLAN.layout, namespace=ns, layer_policies=layer_policies(PLAN, config)) as engine:
        rkeys = rank_keys(keys, rank)
        engine.store_sync(rkeys, {i: block_contents(rkeys, i, PLAN.layout.layer_nbytes(i)) for i in (0, 1)})
        engine.flush()


def blocks(n: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(range(1, n + 1)),))


def test_without_workers_the_persistent_tiers_answer_for_every_rank(tmp_path: Path) -> None:
    s = settings(tmp_path, tp=2)
    req = request(12)
    keys = keys_of(req)
    store(s, 0, keys[:10])
    store(s, 1, keys[:7])  # the shortest rank decides
    sched = SchedulerSide(s, PLAN)
    try:
        assert sched.prober is not None and sched.prober.ranks == 2
        assert sched.get_num_new_matched_tokens(req, 0) == (7 * BLOCK, True)  # from disk: async
        assert sched.get_num_new_matched_tokens(req, 2 * BLOCK) == (5 * BLOCK, True)
        sched.update_state_after_alloc(req, blocks(12), 5 * BLOCK)
        (spec,) = sched.pending_loads
        assert spec.keys == keys[2:7] and spec.block_ids == [3, 4, 5, 6, 7]
        assert not spec.confirmed and not spec.sync  # the workers must look up (and adopt) themselves
    finally:
        sched.close()


def test_a_load_every_worker_confirmed_is_marked(tmp_path: Path) -> None:
    s = settings(tmp_path, tp=1)
    req = request(6)
    asked: list[int] = []

    def answer(keys: list[Key], layers: list[int]) -> tuple[int, int]:
        asked.append(len(keys))
        return 4, 4  # four blocks, all in the worker's memory

    server = LookupServer(s.lookup_address(0), answer)
    sched = SchedulerSide(s, PLAN)
    try:
        assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, False)  # in memory: a sync load
        sched.update_state_after_alloc(req, blocks(6), 4 * BLOCK)
        (spec,) = sched.pending_loads
        assert spec.confirmed and spec.sync and spec.keys == keys_of(req)[:4]
        assert asked == [6]
    finally:
        sched.close()
        server.close()


def test_no_persistent_tier_means_no_prober(tmp_path: Path) -> None:
    s = settings(tmp_path, tp=1)
    dram_only = ExtraConfig(config=load_config({"tiers": [{"name": "dram", "capacity": "16MiB"}]}))
    s = ConnectorSettings(dram_only, s.model, s.kv_dtype, 1, s.instance_id, 0, True)
    sched = SchedulerSide(s, PLAN)
    try:
        assert sched.prober is None
        assert sched.get_num_new_matched_tokens(request(4), 0) == (0, False)
    finally:
        sched.close()


def load(worker: WorkerSide, spec: TransferSpec) -> bool:
    """Run one async load through the worker; True when vLLM would be told it finished intact."""
    worker.start_loads(KVStrataMetadata(loads=[spec]))
    for _ in range(1000):
        finished, failed = worker.poll_loads()
        if spec.req_id in finished:
            return spec.req_id not in failed
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def test_worker_loads_confirmed_hits_from_its_index_and_others_after_a_lookup(tmp_path: Path) -> None:
    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    worker = WorkerSide(s, PLAN, 0)
    try:
        caches = {name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")}
        worker.register_kv_caches(caches)
        store(s, 0, keys)  # another process stores after the worker opened: not in its index yet
        ids = [1, 2, 3, 4, 5, 6]
        # confirmed, but no lookup ever took the blocks in: load plans from the index alone and finds none
        assert not load(worker, TransferSpec("a", 0, keys, ids, confirmed=True))
        assert not caches["l0"][1:7].any()
        # not confirmed: the worker looks up first (adopting them), then loads
        assert load(worker, TransferSpec("b", 0, keys[:3], ids[:3]))
        want = block_contents(keys, 0, 256)
        assert torch.equal(caches["l0"][1:4], torch.from_numpy(want[:3]))
        # the scheduler's socket lookup adopts the rest; a confirmed load then needs no lookup
        client = LookupClient(s.lookup_address(0), timeout_s=5.0)
        answer = client.lookup(keys, list(PLAN.groups[0].layers))
        assert answer is not None and answer[0] == 6
        client.close()
        assert load(worker, TransferSpec("c", 0, keys, ids, confirmed=True))
        assert torch.equal(caches["l1"][1:7], torch.from_numpy(block_contents(keys, 1, 256)))
    finally:
        worker.close()


def test_a_request_finished_while_its_load_runs_is_counted_and_its_load_released(tmp_path: Path) -> None:
    """vLLM finishes (aborts) a request whose async load is still running: the worker counts it
    (``aborted_during_load``), once; the load still ends and is reported, and then nothing stays
    pinned or pending."""
    from kvstrata.tiers.wrappers import GateTier

    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    worker = WorkerSide(s, PLAN, 0)
    try:
        worker.register_kv_caches({name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")})
        store(s, 0, keys)  # on NVMe only, for this worker's engine
        client = LookupClient(s.lookup_address(0), timeout_s=5.0)  # the scheduler's lookup adopts them
        assert client.lookup(keys, list(PLAN.groups[0].layers)) == (6, 0)
        client.close()
        nvme = worker.engine._state.tiers[1]
        gate = GateTier(nvme.tier)
        nvme.tier = gate
        gate.reads.clear()  # every NVMe read waits for the gate
        worker.start_loads(KVStrataMetadata(loads=[TransferSpec("gone", 0, keys, [1, 2, 3, 4, 5, 6], confirmed=True)]))
        assert worker.poll_loads({"gone", "other"}) == (set(), set())  # still loading
        assert worker.poll_loads({"gone"}) == (set(), set())  # finished twice: vLLM says it once, counted per call
        counted = worker.take_stats()
        assert counted is not None and counted.data["aborted_during_load"] == 2
        gate.reads.set()
        for _ in range(1000):
            done, _failed = worker.poll_loads()
            if "gone" in done:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the load never ended")
        assert worker.live()["pending_loads"] == 0
        assert pins(worker.engine) == 0
        after = worker.take_stats()
        assert after is None or "aborted_during_load" not in after.data
    finally:
        worker.close()


def pins(engine: Engine) -> int:
    """Pins held once the engine's background work is done (a load's promotion pins its source
    blocks until the copy up has finished)."""
    assert engine.flush(timeout=30)
    return sum(e.pins for idx in engine.tiers for e in idx.entries.values())


def count_walks(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the engine's index walks: ``lookup`` (restorable prefix) and ``plan`` (what a load reads)."""
    walks = {"lookup": 0, "plan": 0}
    placement = engine._placement
    for name in walks:
        real = getattr(placement, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            walks[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(placement, name, counted)
    return walks


def test_each_load_looks_up_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    layers = list(PLAN.groups[0].layers)
    worker = WorkerSide(s, PLAN, 0)
    try:
        caches = {name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")}
        worker.register_kv_caches(caches)
        store(s, 0, keys)
        walks = count_walks(worker.engine, monkeypatch)
        client = LookupClient(s.lookup_address(0), timeout_s=5.0)
        assert client.lookup(keys, layers) == (6, 0)  # the socket lookup pins its plan
        assert walks == {"lookup": 1, "plan": 1} and pins(worker.engine) == 6 and len(worker.held) == 1
        # the load of exactly those keys reads the kept plan: no walk at all
        assert load(worker, TransferSpec("a", 0, keys, [1, 2, 3, 4, 5, 6], confirmed=True))
        assert walks == {"lookup": 1, "plan": 1} and pins(worker.engine) == 0 and len(worker.held) == 0
        assert torch.equal(caches["l1"][1:7], torch.from_numpy(block_contents(keys, 1, 256)))
        # a confirmed load of other keys plans from the index: one walk
        assert load(worker, TransferSpec("b", 0, keys[2:5], [1, 2, 3], confirmed=True))
        assert walks == {"lookup": 1, "plan": 2}
        # an unconfirmed load looks up pinned, once, and the load reads that plan
        assert load(worker, TransferSpec("c", 0, keys[:4], [1, 2, 3, 4]))
        assert walks == {"lookup": 2, "plan": 3} and pins(worker.engine) == 0
        # a partial hit keeps nothing pinned
        assert client.lookup([*keys, *keys_of(request(8))[6:]], layers) is not None
        assert pins(worker.engine) == 0 and len(worker.held) == 0
        client.close()
    finally:
        worker.close()


def test_no_plan_stays_pinned_when_a_load_never_comes_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    layers = list(PLAN.groups[0].layers)
    worker = WorkerSide(s, PLAN, 0)
    try:
        caches = {name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")}
        worker.register_kv_caches(caches)
        store(s, 0, keys)
        client = LookupClient(s.lookup_address(0), timeout_s=5.0)
        assert client.lookup(keys, layers) == (6, 0)
        assert pins(worker.engine) == 6
        # the request is aborted between the scheduler's lookup and its load: the plan expires
        now = time.monotonic()
        worker.held.clock = lambda: now + worker.held.hold_s + 1
        worker.poll_loads()  # every step sweeps
        assert pins(worker.engine) == 0 and len(worker.held) == 0 and worker.held.expired == 1
        assert worker.engine.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        worker.held.clock = time.monotonic
        # the load starts but fails between its pinned lookup and the transfer: the plan goes back
        real_load = worker.engine.load

        def failing_load(*args: Any, **kwargs: Any) -> Any:
            assert pins(worker.engine) > 0  # the lookup pinned it
            raise KVStrataError("injected")

        monkeypatch.setattr(worker.engine, "load", failing_load)
        assert client.lookup(keys, layers) == (6, 0)
        assert not load(worker, TransferSpec("a", 0, keys, [1, 2, 3, 4, 5, 6], confirmed=True))  # the kept plan
        assert pins(worker.engine) == 0 and len(worker.held) == 0
        assert not load(worker, TransferSpec("b", 0, keys[:3], [1, 2, 3]))  # a pinned lookup of its own
        assert pins(worker.engine) == 0
        monkeypatch.setattr(worker.engine, "load", real_load)
        # fewer blocks than the scheduler was told: the pinned lookup is given back, the load fails
        worker.engine.flush()
        assert not load(worker, TransferSpec("c", 0, keys_of(request(8)), list(range(1, 9))))
        assert pins(worker.engine) == 0
        # a kept plan whose load never comes is given back when the worker closes
        assert client.lookup(keys, layers) == (6, 0)
        client.close()
        assert pins(worker.engine) == 6
        engine = worker.engine
    finally:
        worker.close()
    assert pins(engine) == 0


def test_tier_misses_and_faults_are_reported_per_tier_as_deltas(tmp_path: Path) -> None:
    """A tier that fails (here: NVMe refuses every write, as a pool whose master is gone does) shows
    in the worker's stats as ``tier:<counter>:<tier>`` deltas, sent once each, and becomes
    ``vllm:kvstrata_tier_faults{tier,kind}`` / ``vllm:kvstrata_tier_misses{tier}`` in Prometheus."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvstrata.integrations.vllm.stats import KVStrataPromMetrics, split_tier_key, tier_key
    from kvstrata.tiers.wrappers import FaultInjectingTier

    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    worker = WorkerSide(s, PLAN, 0)
    try:
        worker.register_kv_caches({name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")})
        worker.take_stats()  # the first gauges
        nvme = worker.engine._state.tiers[1]  # the worker's own engine: its NVMe tier fails every write
        nvme.tier = FaultInjectingTier(nvme.tier, fail_writes=1.0)
        worker.engine.store_sync(keys, {i: block_contents(keys, i, PLAN.layout.layer_nbytes(i)) for i in (0, 1)})
        assert worker.engine.flush(timeout=30)
        other = keys_of(Request("r2", 0, [xxhash.xxh3_64_digest(b"other%d" % i) for i in range(3)]))
        assert worker.engine.lookup(other).num_blocks == 0  # 3 misses on each tier
        tiers = worker.engine.stats()["tiers"]
        assert tiers["nvme"]["write_failures"] > 0
        sent = worker.take_stats()
        assert sent is not None
        assert sent.data[tier_key("write_failures", "nvme")] == tiers["nvme"]["write_failures"]
        assert sent.data[tier_key("misses", "nvme")] == tiers["nvme"]["misses"] >= 3
        assert tier_key("write_failures", "dram") not in sent.data  # no fault there, nothing sent
        again = worker.take_stats()
        assert again is None or not any(split_tier_key(k) for k in again.data)  # deltas: sent once
    finally:
        worker.close()

    registry = CollectorRegistry()

    def bind(cls: Any) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    prom = KVStrataPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(sent.data)
    prom.observe({tier_key("write_failures", "pool:a"): 2, tier_key("io_errors", "pool:a"): 1})  # ':' in a name
    fault = registry.get_sample_value(
        "vllm:kvstrata_tier_faults_total", {"engine": "0", "tier": "nvme", "kind": "write_failures"}
    )
    assert fault == tiers["nvme"]["write_failures"]
    misses = registry.get_sample_value("vllm:kvstrata_tier_misses_total", {"engine": "0", "tier": "nvme"})
    assert misses is not None and misses == tiers["nvme"]["misses"] >= 3
    pool = {"engine": "0", "tier": "pool:a"}
    assert registry.get_sample_value("vllm:kvstrata_tier_faults_total", pool | {"kind": "write_failures"}) == 2
    assert registry.get_sample_value("vllm:kvstrata_tier_faults_total", pool | {"kind": "io_errors"}) == 1


def test_live_gauges_follow_what_the_worker_holds(tmp_path: Path) -> None:
    """``WorkerSide.live`` (the ``vllm:kvstrata_live_*`` gauges) shows a held lookup's pins and plan,
    and zero once it expired; the stats carry the gauges only when they changed, per source, and
    aggregating keeps the latest per source (vLLM sums workers and steps with ``aggregate``)."""
    from kvstrata.integrations.vllm.stats import LIVE, KVStrataConnectorStats

    s = settings(tmp_path, tp=1)
    keys = keys_of(request(6))
    worker = WorkerSide(s, PLAN, 0)
    try:
        worker.register_kv_caches({name: torch.zeros(8, 256, dtype=torch.uint8) for name in ("l0", "l1")})
        first = worker.take_stats()
        assert first is not None and first.data[LIVE]["worker0"]["pinned_blocks"] == 0
        assert worker.take_stats() is None  # nothing changed: nothing sent
        store(s, 0, keys)
        client = LookupClient(s.lookup_address(0), timeout_s=5.0)
        assert client.lookup(keys, list(PLAN.groups[0].layers)) == (6, 0)
        client.close()
        held = worker.take_stats()
        assert held is not None and held.data[LIVE]["worker0"]["pinned_blocks"] == 6
        assert held.data[LIVE]["worker0"]["held_plans"] == 1
        now = time.monotonic()
        worker.held.clock = lambda: now + worker.held.hold_s + 1
        worker.poll_loads()
        assert worker.engine.flush(timeout=30)
        assert worker.live() == dict.fromkeys(worker.live(), 0) | {"staging_idle_bytes": 0}
        gone = worker.take_stats()
        assert gone is not None and gone.data[LIVE]["worker0"]["pinned_blocks"] == 0
        total = KVStrataConnectorStats(data={"loaded_blocks": 2})
        total.aggregate(held).aggregate(gone)
        total.aggregate(KVStrataConnectorStats(data={LIVE: {"scheduler": {"tracked_requests": 4}}}))
        assert total.data[LIVE]["worker0"]["pinned_blocks"] == 0  # the latest, not a sum
        reduced = total.reduce()
        assert reduced["live_tracked_requests"] == 4 and reduced["live_pinned_blocks"] == 0
        assert reduced["loaded_blocks"] == 2
        assert KVStrataConnectorStats(data={LIVE: {}}).is_empty()
    finally:
        worker.close()


def test_the_time_vllm_spends_in_the_hooks_is_reported_once_per_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every hook's time goes to ``worker_hook_time_ms`` (``scheduler_hook_time_ms`` on the
    scheduler's side): what a step waits for in the connector, a miss's lookup and store too. A
    report carries the time since the last one; none with no hook called."""
    from kvstrata.integrations.vllm.connector import HOOK_KEYS, KVStrataConnector
    from kvstrata.integrations.vllm.stats import COUNTERS

    assert set(HOOK_KEYS.values()) <= set(COUNTERS)  # Prometheus counters, vllm:kvstrata_*
    s = settings(tmp_path, tp=1)
    worker = WorkerSide(s, PLAN, 0)
    try:
        conn = KVStrataConnector.__new__(KVStrataConnector)
        conn._impl, conn._hook_s = worker, 0.0
        plain = worker.take_load_errors

        def slow() -> set[int]:
            time.sleep(0.03)
            return plain()

        monkeypatch.setattr(worker, "take_load_errors", slow)
        assert conn.get_block_ids_with_load_errors() == set()
        assert conn.get_block_ids_with_load_errors() == set()
        stats = conn.get_kv_connector_stats()
        assert stats is not None and 60 <= stats.data[HOOK_KEYS["worker"]] < 60_000
        assert HOOK_KEYS["scheduler"] not in stats.data
        again = conn.get_kv_connector_stats()
        assert again is None or HOOK_KEYS["worker"] not in again.data  # reported once

        def broken() -> set[int]:
            time.sleep(0.02)
            raise OSError("down")

        monkeypatch.setattr(worker, "take_load_errors", broken)
        with pytest.raises(OSError):  # a hook that raises is timed too
            conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data[HOOK_KEYS["worker"]] >= 20
    finally:
        worker.close()
