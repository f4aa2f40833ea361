"""The tier-migration daemon in-process, on real tiers: config, watermarks, per-layer policies,
compare-and-swap deletes, hints and promotion, scrubbing within a budget, start-up repair.

The daemon as a separate process (HTTP, signals, CLI) is in ``test_daemon_process.py``; live
writers and kill -9 in ``test_daemon_stress.py``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_daemon_support import store_chains

from kvstrata.config import load_config
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.daemon.hints import HINTS_FILE, HintReader, append_hint, hint_slow_hits
from kvstrata.daemon.service import Daemon
from kvstrata.daemon.state import QUARANTINE_FILE, state_dir_for
from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError
from kvstrata.tiers import ReadStatus
from kvstrata.tiers.wrappers import FaultInjectingTier
from kvstrata.workload.content import block_contents

MiB = 1024**2
NVME = 2 * MiB  # 12 chains of 32 blocks (4 KiB each, tiny layout) fill 75%


def config(tmp: Path, nvme: str = "2MiB", fs: str | None = "256MiB", **daemon: Any) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "nvme", "capacity": nvme, "path": str(tmp / "nvme"), "write": "write-back", "direct_io": "off"}
    ]
    if fs is not None:
        tiers.append({"name": "fs", "kind": "fs", "capacity": fs, "url": f"file://{tmp / 'fs'}", "fsync": False})
    settings = {"high_watermark": 0.6, "low_watermark": 0.4, "metrics_port": 0, "scrub_bytes_per_s": 0}
    settings.update(daemon)
    return {"tiers": tiers, "daemon": settings}


def where(cfg: dict[str, Any], layout: KVLayout, keys: list[Key]) -> list[str]:
    """Tiers a fresh engine serves ``keys`` from; checks every loaded byte (and promotes nothing)."""
    cfg = {**cfg, "tiers": [{**t, "promote": False} for t in cfg["tiers"]]}
    with Engine(cfg, layout=layout) as engine:
        hit = engine.lookup(keys)
        bufs = {layer: np.zeros((len(keys), layout.layer_nbytes(layer)), np.uint8) for layer in range(4)}
        res = engine.load_sync(keys[: hit.num_blocks], {k: v[: hit.num_blocks] for k, v in bufs.items()})
        assert res.loaded_blocks == hit.num_blocks
        for layer, data in bufs.items():
            n = hit.num_blocks
            assert np.array_equal(data[:n], block_contents(keys[:n], layer, data.shape[1])), "wrong bytes served"
        return hit.tiers


def nvme_used(tmp: Path) -> int:
    return sum(p.stat().st_size for p in (tmp / "nvme").rglob("*.seg"))


@pytest.fixture
def tiny() -> KVLayout:
    return get_layout("tiny")


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        d.close()


def start(daemons: list[Daemon], cfg: dict[str, Any], unclean: bool = False) -> Daemon:
    d = Daemon(cfg)
    daemons.append(d)
    d.open(unclean)
    return d


# --------------------------------------------------------------------------- config
def test_daemon_section_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))
    d = load_config({"tiers": cfg.model_dump()["tiers"][:1]}).daemon
    assert (d.high_watermark, d.low_watermark, d.metrics_host, d.metrics_port) == (0.85, 0.70, "127.0.0.1", 9477)
    raw = config(tmp_path, watermarks={"fs": {"high": 0.9, "low": 0.8}})
    marks = load_config(raw).daemon
    assert (marks.watermarks_of("fs").high, marks.watermarks_of("nvme").high) == (0.9, 0.6)
    env = {"KVSTRATA__DAEMON__METRICS_PORT": "9999", "KVSTRATA__DAEMON__SCRUB_BYTES_PER_S": "8MiB"}
    over = load_config(config(tmp_path), environ=env).daemon
    assert (over.metrics_port, over.scrub_bytes_per_s) == (9999, 8 * MiB)
    assert state_dir_for(load_config(config(tmp_path))) == tmp_path / "nvme" / ".kvstrata-daemon"


@pytest.mark.parametrize(
    ("daemon", "needle"),
    [
        ({"high_watermark": 0.5, "low_watermark": 0.5}, "low_watermark (0.5) must be below high_watermark (0.5)"),
        ({"hig_watermark": 0.5}, "daemon.hig_watermark: Extra inputs are not permitted"),
        ({"watermarks": {"tape": {}}}, "watermarks: tier 'tape' is not configured (tiers: nvme, fs)"),
        ({"watermarks": {"fs": {"high": 0.5}}}, "daemon.watermarks.fs: the low watermark (0.7) must be below"),
        ({"scrub_bytes_per_s": "fast"}, "daemon.scrub_bytes_per_s: not a size: 'fast'"),
        ({"metrics_port": 70000}, "daemon.metrics_port"),
        ({"startup_check": "sometimes"}, "daemon.startup_check"),
    ],
)
def test_bad_daemon_settings_are_named(tmp_path: Path, daemon: dict[str, Any], needle: str) -> None:
    raw = config(tmp_path)
    raw["daemon"] = daemon
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert needle in str(err.value)


# --------------------------------------------------------------------------- watermarks
def test_demotes_oldest_first_down_to_the_low_watermark(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)  # 12 x 32 blocks x 4 KiB = 1.5 MiB of 2 MiB
    assert nvme_used(tmp_path) > 0.6 * NVME
    d = start(daemons, cfg)
    result = d.enforce_watermarks()
    assert result.demoted > 0 and result.dropped == 0 and result.failed == 0
    used = nvme_used(tmp_path)
    assert 0.3 * NVME < used <= 0.4 * NVME, used
    d.close()
    tiers = [where(cfg, tiny, keys) for keys in chains]
    assert all(len(t) == 32 for t in tiers), "a block was lost"
    assert set(tiers[0]) == {"fs"} and set(tiers[-1]) == {"nvme"}, "the oldest go first"
    firsts = [t.count("fs") for t in tiers]
    assert firsts == sorted(firsts, reverse=True)
    assert d.metrics.total("kvstrata_daemon_demoted_blocks_total", tier="nvme", to="fs") == result.demoted


def test_protected_keys_stay_and_below_high_nothing_moves(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    fp = next(iter(d.namespaces))
    hot = set(map(bytes, chains[0]))
    d.watermarks.enforce(d.namespaces[fp], d.chain[0], lambda ns, key: key in hot)
    before = nvme_used(tmp_path)
    assert d.enforce_watermarks().demoted == 0  # below the high watermark now
    assert nvme_used(tmp_path) == before
    d.close()
    assert set(where(cfg, tiny, chains[0])) == {"nvme"}
    assert "fs" in where(cfg, tiny, chains[1])


def test_layers_not_allowed_below_are_dropped_not_demoted(tmp_path: Path, daemons: list) -> None:
    layout = get_layout("tiny-swa")  # layers 0 and 2 sliding window, 1 and 3 full attention
    cfg = config(tmp_path)
    cfg["policies"] = {"layer_policy": "per-layer", "layers": [{"match": "sliding", "tiers": ["nvme"]}]}
    store_chains(cfg, layout, chains=20, blocks=32)  # sliding layers keep 8 blocks per chain
    d = start(daemons, cfg)
    res = d.enforce_watermarks()
    assert res.demoted > 0 and res.dropped > 0 and res.failed == 0
    assert d.metrics.total("kvstrata_daemon_dropped_blocks_total", reason="policy") == res.dropped
    ns = next(iter(d.namespaces.values()))
    fs = ns.tier(d.chain[1])
    assert fs is not None
    layers = {bid[1] for bid, _ in fs.scan()}
    assert layers == {1, 3}, "a sliding-window layer reached a tier its group may not occupy"


def test_without_a_lower_tier_cold_blocks_are_dropped(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path, fs=None)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    res = d.enforce_watermarks()
    assert res.dropped > 0 and res.demoted == 0
    assert nvme_used(tmp_path) <= 0.4 * NVME
    assert d.metrics.total("kvstrata_daemon_dropped_blocks_total", reason="bottom") == res.dropped
    d.close()
    assert len(where(cfg, tiny, chains[0])) == 0 and len(where(cfg, tiny, chains[-1])) == 32


def test_fs_tier_is_shrunk_to_its_low_watermark(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path, fs="1MiB")  # the demoted 0.7 MiB pass the fs tier's 0.6 MiB high mark
    cfg["tiers"][1]["object_size"] = "64KiB"  # expiry takes whole objects
    store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    d.enforce_watermarks()
    d.enforce_watermarks()  # the fs tier is checked after the nvme tier filled it
    ns = next(iter(d.namespaces.values()))
    fs = ns.tier(d.chain[1])
    assert fs is not None and 0.3 * MiB < fs.used_bytes <= 0.4 * MiB
    assert d.metrics.total("kvstrata_daemon_expired_objects_total") > 0


def test_failed_copies_keep_their_blocks_in_nvme(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    (ns,) = d.namespaces.values()
    assert ns.tier(d.chain[1], create=True) is not None
    faulty = ns.wrap(d.chain[1], lambda t: FaultInjectingTier(t, fail_writes=0.3, seed=5))
    assert isinstance(faulty, FaultInjectingTier)
    res = d.enforce_watermarks()
    assert res.failed > 0 and res.demoted > 0  # a key with any failed layer stays whole in nvme
    assert d.metrics.total("kvstrata_daemon_move_failures_total") == res.failed
    faulty.down = True  # the shared store is gone: nothing is deleted, and the pass gives up early
    res = d.enforce_watermarks()
    assert res.demoted == 0 and res.dropped == 0 and res.failed > 0
    faulty.down = False
    faulty.fail_writes = 0.0
    d.enforce_watermarks()
    assert nvme_used(tmp_path) <= 0.4 * NVME
    d.close()
    assert all(len(where(cfg, tiny, keys)) == 32 for keys in chains)


def test_delete_at_keeps_a_block_rewritten_since_the_snapshot(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    (keys,) = store_chains(cfg, tiny, chains=1, blocks=4)
    d = start(daemons, cfg)
    nvme = next(iter(d.namespaces.values())).tier(d.chain[0])
    assert nvme is not None
    snapshot = nvme.records()  # type: ignore[attr-defined]
    bid = (keys[0], 0)
    data = block_contents(keys[:1], 0, tiny.layer_nbytes(0))[0]
    assert nvme.write([(bid, data)]) == [True]  # another writer stores it again: new location
    gone = nvme.delete_at(snapshot)  # type: ignore[attr-defined]
    assert gone.count(False) == 1 and sum(gone) == len(snapshot) - 1
    out = np.zeros(tiny.layer_nbytes(0), np.uint8)
    assert nvme.read([(bid, out)]) == [ReadStatus.OK] and np.array_equal(out, data)


def test_compaction_pass_reclaims_segments_of_writers_that_left(tmp_path: Path, tiny: KVLayout, daemons) -> None:
    cfg = config(tmp_path, nvme="64MiB")
    rng = np.random.default_rng(3)
    with Engine(cfg, layout=tiny) as engine:  # a writer deletes most of what it wrote, then exits:
        chains = []  # its segment was active (locked) then, so nobody compacted it
        for _ in range(16):
            keys = engine.keys_for_tokens(rng.integers(0, 32000, size=16 * 32, dtype=np.uint32))
            engine.store_sync(keys, {layer: block_contents(keys, layer, 1024) for layer in range(4)})
            chains.append(keys)
        nvme = engine.tiers[0].tier
        nvme.delete([(k, layer) for keys in chains[:12] for k in keys[:28] for layer in range(4)])
    before = nvme_used(tmp_path)
    d = start(daemons, cfg)
    assert d.compact() >= 1
    assert nvme_used(tmp_path) < before / 2
    d.close()
    for keys in chains[:12]:
        assert where(cfg, tiny, keys[28:]) == ["nvme"] * 4
    assert all(where(cfg, tiny, keys) == ["nvme"] * 32 for keys in chains[12:])


# --------------------------------------------------------------------------- hints and promotion
def test_hint_file_is_process_safe_and_skips_torn_lines(tmp_path: Path) -> None:
    keys = [bytes([i]) * 16 for i in range(8)]

    def writer(n: int) -> None:
        for _ in range(50):
            append_hint(tmp_path, f"ns{n}", keys)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    reader = HintReader(tmp_path, max_bytes=4096)
    got = []
    while any(t.is_alive() for t in threads):
        got += reader.poll()
    for t in threads:
        t.join()
    got += reader.poll()
    assert len(got) == 200 and all(h.keys == tuple(keys) for h in got)
    with open(tmp_path / HINTS_FILE, "ab") as f:
        f.write(b'{"ns": "x", "keys": ["00"')  # a writer died mid-line
    assert reader.poll() == [] and reader.bad_lines == 1
    append_hint(tmp_path, "ns9", keys[:1])
    (hint,) = reader.poll()
    assert hint.namespace == "ns9" and hint.keys == (keys[0],)


def test_hinted_blocks_are_promoted_back_to_nvme(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    d.enforce_watermarks()
    session = chains[0]
    assert set(where(cfg, tiny, session)) == {"fs"}
    with Engine(cfg, layout=tiny) as engine:  # the inference side: a lookup that hits the slow tier
        hit = engine.lookup(session)
        assert hint_slow_hits(engine, session, hit, state_dir_for(load_config(cfg)))
    t0 = time.monotonic()
    assert d.serve_hints() == 1
    latency = time.monotonic() - t0
    assert d.last_promotion["promoted"] == 32 * 4, d.last_promotion
    assert latency < 5.0
    d.enforce_watermarks()  # the promoted (hinted) blocks are protected from demotion
    assert set(where(cfg, tiny, session)) == {"nvme"}
    assert d.metrics.total("kvstrata_daemon_promoted_blocks_total", tier="nvme") == 128
    assert d.metrics.total("kvstrata_daemon_hints_total", result="promoted") == 1


def test_promotion_makes_room_by_demoting_unhinted_blocks(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    chains = store_chains(cfg, tiny, chains=12, blocks=32)
    d = start(daemons, cfg)
    d.enforce_watermarks()
    cold = [k for keys in chains[:5] for k in keys]
    fp = next(iter(d.namespaces))
    append_hint(d.state.path, fp, cold)
    d.serve_hints()
    assert d.last_promotion["promoted"] == len(cold) * 4
    assert nvme_used(tmp_path) <= NVME * 0.6 + 256 * 1024
    d.close()
    assert all(set(where(cfg, tiny, keys)) == {"nvme"} for keys in chains[:5])
    assert all(len(where(cfg, tiny, keys)) == 32 for keys in chains)


def test_stale_and_unknown_hints_are_counted(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path)
    store_chains(cfg, tiny, chains=1, blocks=2)
    d = start(daemons, cfg)
    d.state.path.mkdir(parents=True)
    (d.state.path / HINTS_FILE).write_text(
        json.dumps({"ns": "nope", "keys": ["00" * 16]}) + "\n" + json.dumps({"ns": "x", "keys": [], "t": 1.0}) + "\n"
    )
    assert d.serve_hints() == 2
    assert d.metrics.total("kvstrata_daemon_hints_total", result="unknown_namespace") == 1
    assert d.metrics.total("kvstrata_daemon_hints_total", result="stale") == 1


# --------------------------------------------------------------------------- scrubbing and repair
def flip_bytes(root: Path, count: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    segs = sorted(root.rglob("*.seg"))
    for _ in range(count):
        seg = rnd.choice(segs)
        with open(seg, "r+b") as f:
            off = rnd.randrange(0, seg.stat().st_size)
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def test_scrub_quarantines_bad_blocks_within_its_budget(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path, nvme="64MiB", scrub_bytes_per_s="512KiB")
    chains = store_chains(cfg, tiny, chains=12, blocks=32)  # 1,536 layer-blocks, 1.5 MiB
    flip_bytes(tmp_path / "nvme", 20)
    d = start(daemons, cfg)
    (ns,) = d.namespaces.values()
    plan = d.chain[0]
    tier = ns.tier(plan)
    assert tier is not None
    t0 = time.monotonic()
    assert d.scrubber.scrub_tier(ns, plan, tier)
    elapsed = time.monotonic() - t0
    scrubbed = d.scrubber.progress.bytes
    assert scrubbed == 1.5 * MiB
    assert scrubbed <= 512 * 1024 * (elapsed + 1), (scrubbed, elapsed)  # the budget, plus a second's burst
    assert elapsed >= 1.9  # 1.5 MiB at 0.5 MiB/s after a 0.5 MiB burst
    bad = d.metrics.total("kvstrata_daemon_scrub_bad_blocks_total")
    assert 1 <= bad <= 20
    lines = (d.state.path / QUARANTINE_FILE).read_text().splitlines()
    assert len(lines) == bad and json.loads(lines[0])["tier"] == "nvme"
    d.close()
    served = sum(len(where(cfg, tiny, keys)) for keys in chains)  # every byte served is checked
    assert served < 12 * 32


def test_startup_repair_after_an_unclean_stop(tmp_path: Path, tiny: KVLayout, daemons: list) -> None:
    cfg = config(tmp_path, nvme="64MiB")
    store_chains(cfg, tiny, chains=4, blocks=32)
    flip_bytes(tmp_path / "nvme", 5)
    clean = start(daemons, cfg)
    assert clean.startup == {"checked": False, "unclean_stop": False}
    clean.close()
    d = start(daemons, cfg, unclean=True)
    assert d.startup["checked"] and d.startup["unclean_stop"]
    (report,) = d.startup["reports"]
    assert report["repaired"] and report["bad_checksums"] >= 1
    assert d.metrics.total("kvstrata_daemon_startup_problems_total") >= 1
    nvme = next(iter(d.namespaces.values())).tier(d.chain[0])
    assert nvme is not None and nvme.verify().ok


def test_a_namespace_with_a_damaged_meta_json_is_reported_not_managed(
    tmp_path: Path, tiny: KVLayout, daemons: list
) -> None:
    cfg = config(tmp_path, nvme="64MiB", rescan_interval_s=0.05)
    chains = store_chains(cfg, tiny, chains=1, blocks=4)
    stray = tmp_path / "nvme" / ("cd" * 8)
    (stray / "segments").mkdir(parents=True)
    (stray / "meta.json").write_text('{"format": 2, "layout": ')  # damaged
    d = start(daemons, cfg)
    assert len(d.namespaces) == 1  # the healthy one is managed
    (broken,) = d.status()["broken"]
    assert broken["namespace"] == stray.name and broken["tier"] == "nvme" and broken["during"] == "discovery"
    assert broken["path"] == str(stray) and "meta.json" in broken["reason"]
    metric = 'kvstrata_daemon_broken_tiers{namespace="cdcdcdcdcdcdcdcd",tier="nvme"} 1.0'
    assert metric in d.metrics_text().decode()
    d.step()
    assert where(cfg, tiny, chains[0]) == ["nvme"] * 4
    (stray / "meta.json").unlink()  # removed: no longer reported after the next full rescan
    time.sleep(0.1)
    d.step()
    assert d.status()["broken"] == [] and "cdcdcdcdcdcdcdcd" not in d.metrics_text().decode()


def test_freezing_the_heap_again_lets_what_was_closed_be_collected() -> None:
    """After a reload reopens the namespaces, the old ones' objects (cycles among tier objects)
    must not stay frozen forever: ``refreeze`` hands the frozen heap back first. A heap never
    frozen (tests driving the daemon in their own process) is left as it is."""
    import gc
    import weakref

    from kvstrata.daemon.heap import FrozenHeap

    class Node:
        pass

    gc.collect()
    assert gc.get_freeze_count() == 0
    heap = FrozenHeap()
    heap.refreeze()
    assert gc.get_freeze_count() == 0 and heap.status()["frozen_objects"] == 0
    try:
        old = Node()
        old.me = old  # type: ignore[attr-defined]  # a cycle: only the collector frees it
        gone = weakref.ref(old)
        heap.freeze()
        assert gc.get_freeze_count() > 0 and heap.status()["frozen_objects"] == gc.get_freeze_count()
        del old
        gc.collect()
        assert gone() is not None  # frozen: a full collection does not walk it
        heap.refreeze()
        assert gone() is None and gc.get_freeze_count() > 0
        assert len(heap.status()["collections"]) == 3
    finally:
        gc.unfreeze()
