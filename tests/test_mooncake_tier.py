"""The ``mooncake`` tier against a real ``mooncake_master`` on loopback.

The conformance suite, options, object packing, namespaces, corrupted objects, two engine
processes sharing a master, and faults (the master killed, hung, down at open, gone for
long). Everything is skipped when ``mooncake.store`` does not import.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conformance import (
    TierConformance,
    assert_read_back,
    chain_keys,
    default_namespace,
    empty_buffers,
    engine_layout,
    mismatches,
    raw_block_keys,
    read_back,
    source_buffers,
    to_bytes,
    write_items,
)
from servers_mooncake import MooncakeMaster, master_binary, mooncake_import_error, tier_options

from kvstrata.config import load_config
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers import TIERS, ReadStatus, Tier, TierContext

MiB = 1024**2


IMPORT_ERROR = mooncake_import_error()
needs_mooncake = pytest.mark.skipif(IMPORT_ERROR is not None, reason=f"mooncake.store does not import: {IMPORT_ERROR}")


def _start_master(workdir: Path) -> MooncakeMaster:
    if IMPORT_ERROR is not None:
        pytest.skip(f"mooncake.store does not import: {IMPORT_ERROR}")
    binary = master_binary()
    if binary is None:
        pytest.skip("mooncake_master binary not found")
    master = MooncakeMaster(workdir, binary)
    master.start()
    return master


def open_tier(
    address: str, layout: KVLayout, tag: str, capacity: int = 8 * MiB, namespace: Namespace | None = None, **kw: Any
) -> Tier:
    cls = TIERS.get("mooncake")
    options = cls.Options.model_validate(tier_options(address, tag, **kw))
    return cls("pool", capacity, options, TierContext(layout, namespace or default_namespace(layout)))


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for the module, plus one tier kept open so that the process's shared client
    stays up between tests (closing a Mooncake client stalls the interpreter for 1-2 s)."""
    m = _start_master(tmp_path_factory.mktemp("mooncake"))
    keeper = open_tier(m.address, engine_layout(), "keeper")
    try:
        yield m
    finally:
        keeper.close()
        m.stop()


@pytest.fixture
def own_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master for one test that kills or pauses it."""
    m = _start_master(tmp_path)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def raw(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client on the module's master (back-door access to objects)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 4 * MiB, "tcp", "", master.address) == 0
    yield store
    store.close()


@pytest.fixture
def layout4() -> KVLayout:
    """Four identical layers: one object per key holds all four (4 KiB each)."""
    return uniform_layout("mc-four", num_layers=4, num_kv_heads=2, head_dim=64, block_size=4, dtype="float32")


# --------------------------------------------------------------------------- the conformance suite


class TestMooncake(TierConformance):
    kind = "mooncake"
    requires = "mooncake.store"
    concurrent_rounds = 100  # every round is a network round trip per batch

    @pytest.fixture(autouse=True)
    def _pool(self, master: MooncakeMaster) -> None:
        self.master_address = master.address

    def tier_options(self, root: Path) -> dict[str, Any]:
        return tier_options(self.master_address, str(root))  # object names private to the test


# --------------------------------------------------------------------------- options and registry


@needs_mooncake
def test_options_parse_sizes_and_defaults() -> None:
    from kvstrata.tiers.mooncake import MooncakeOptions

    cls = TIERS.get("mooncake")
    opts = cls.Options.model_validate(
        {"master_address": "10.0.0.1:50051", "global_segment_size": "256MiB", "local_buffer_size": "64MiB"}
    )
    assert isinstance(opts, MooncakeOptions)
    assert opts.global_segment_size == 256 * MiB and opts.local_buffer_size == 64 * MiB
    assert (opts.protocol, opts.metadata_server, opts.device_names, opts.local_hostname) == (
        "tcp",
        "P2PHANDSHAKE",
        "",
        "127.0.0.1",
    )
    caps = cls.capabilities
    assert (caps.persistent, caps.shared, caps.checksums) == (False, True, True)
    config = load_config(
        {"tiers": [{"name": "pool", "kind": "mooncake", "metadata_server": "http://127.0.0.1:8080/metadata"}]}
    )
    assert config.tiers[0].options.metadata_server == "http://127.0.0.1:8080/metadata"


@needs_mooncake
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_address", "no-port"),
        ("master_address", "host:99999"),
        ("metadata_server", "ftp://somewhere/metadata"),
        ("protocol", "udp"),
        ("global_segment_size", "lots"),
        ("staging_size", "-1MiB"),
        ("timeout_s", 0),
        ("prefix", "a/b"),
        ("local_hostname", ""),
    ],
)
def test_bad_options_are_config_errors_naming_the_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"tiers": [{"name": "pool", "kind": "mooncake", field: value}]})
    assert field in str(exc.value) and repr(value) in str(exc.value)


def test_kvstrata_works_without_mooncake() -> None:
    """With ``mooncake`` unimportable, kvstrata and the other tiers work and the tier names its install hint."""
    script = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from kvstrata.errors import ConfigError\n"
        "from kvstrata.tiers import TIERS\n"
        "TIERS.get('dram'); TIERS.get('nvme')\n"
        "try:\n    TIERS.get('mooncake')\nexcept ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "needs an optional dependency" in out.stdout and "kvstrata[mooncake]" in out.stdout


@needs_mooncake
def test_spans_pack_consecutive_layers_of_one_group(mixed_layout: KVLayout) -> None:
    from kvstrata.tiers.mooncake import plan_spans

    big = uniform_layout("mc-big", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert big.layer_nbytes(0) == 64 * 1024
    assert [c.layers for c in plan_spans(big, 4 * MiB)] == [tuple(range(32))]  # one 2 MiB object per block
    small = plan_spans(big, MiB)
    assert [len(c.layers) for c in small] == [15, 15, 2] and all(c.size <= MiB for c in small)
    for layout in (big, mixed_layout):
        spans = plan_spans(layout, MiB)
        assert sorted(layer for c in spans for layer in c.layers) == list(range(layout.num_layers))
        groups = {layer: g.index for g in layout.groups for layer in g.layers}
        assert all(len({groups[layer] for layer in c.layers}) == 1 for c in spans)
    assert len(plan_spans(mixed_layout, MiB)) == 3  # three kinds of layers never share an object


# --------------------------------------------------------------------------- packing, namespaces


def test_one_object_per_key_and_layer_reads_of_subsets(master: MooncakeMaster, layout4: KVLayout, raw: Any) -> None:
    tier = open_tier(master.address, layout4, "subsets")
    try:
        keys = raw_block_keys(3, seed=11)
        ids = [(k, layer) for k in keys for layer in range(4)]
        assert tier.write(write_items(layout4, ids)) == [True] * len(ids)
        names = {tier.object_key(bid) for bid in ids}  # type: ignore[attr-defined]
        assert len(names) == 3  # four layer-blocks per object
        sizes = {raw.get_size(name) for name in names}
        assert len(sizes) == 1 and tier.used_bytes == 3 * sizes.pop() > 3 * layout4.block_nbytes
        assert_read_back(tier, layout4, [(keys[1], 2)])  # one layer out of an object
        assert_read_back(tier, layout4, [(keys[2], 3), (keys[0], 1), (keys[2], 0)], kind="torch")
        assert tier.contains([(keys[0], 0), (raw_block_keys(1, seed=12)[0], 0)]) == [True, False]
    finally:
        tier.close()


def test_partial_writes_and_deletes_merge_into_the_object(master: MooncakeMaster, layout4: KVLayout) -> None:
    tier = open_tier(master.address, layout4, "partial")
    try:
        key = raw_block_keys(1, seed=21)[0]
        assert tier.write(write_items(layout4, [(key, 1)])) == [True]
        assert tier.write(write_items(layout4, [(key, 3), (key, 0)])) == [True, True]
        statuses, _ = read_back(tier, layout4, [(key, layer) for layer in range(4)])
        assert statuses == [ReadStatus.OK, ReadStatus.OK, ReadStatus.MISSING, ReadStatus.OK]
        assert_read_back(tier, layout4, [(key, 0), (key, 1), (key, 3)])
        used = tier.used_bytes
        tier.delete([(key, 1)])
        statuses, _ = read_back(tier, layout4, [(key, layer) for layer in range(4)])
        assert statuses == [ReadStatus.OK, ReadStatus.MISSING, ReadStatus.MISSING, ReadStatus.OK]
        assert tier.used_bytes == used
        tier.delete([(key, 0), (key, 3)])  # the last layers: the object goes
        assert tier.used_bytes == 0 and tier.contains([(key, 0)]) == [False]
    finally:
        tier.close()


def test_namespaces_never_collide(master: MooncakeMaster, layout4: KVLayout) -> None:
    """Two tenants (namespaces) in one master, same keys, same prefix: each sees only its own bytes."""
    base = default_namespace(layout4)
    a = open_tier(master.address, layout4, "tenants", namespace=base.with_salt("tenant-a"))
    b = open_tier(master.address, layout4, "tenants", namespace=base.with_salt("tenant-b"))
    try:
        keys = raw_block_keys(2, seed=31)
        ids = [(k, layer) for k in keys for layer in range(4)]
        assert all(a.write(write_items(layout4, ids, version=1)))
        assert b.contains(ids) == [False] * len(ids)
        assert read_back(b, layout4, ids)[0] == [ReadStatus.MISSING] * len(ids)
        assert all(b.write(write_items(layout4, ids, version=2)))
        assert_read_back(a, layout4, ids, version=1)
        assert_read_back(b, layout4, ids, version=2)
        assert a.object_key(ids[0]) != b.object_key(ids[0])  # type: ignore[attr-defined]
    finally:
        a.close()
        b.close()


def test_rewrites_racing_reads_never_mix_versions(master: MooncakeMaster, layout4: KVLayout) -> None:
    """Two writers rewrite objects with alternating contents while readers read: an OK layer is
    exactly one version, never a mix; everything else is a miss (Mooncake hides an object while
    it is upserted; a read torn by a rewrite is re-read)."""
    tier = open_tier(master.address, layout4, "rewrites")
    ids = [(k, layer) for k in raw_block_keys(6, seed=61) for layer in range(4)]
    versions = {v: write_items(layout4, ids, version=v) for v in (1, 2)}
    expected = {
        v: {bid: to_bytes(buf) for bid, buf in items} for v, items in versions.items()
    }  # the oracle, per version
    errors: list[str] = []
    seen: dict[ReadStatus, int] = {}
    stop = threading.Event()

    def writer(first: int) -> None:
        v = first
        while not stop.is_set():
            tier.write(versions[v])
            v = 3 - v

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            pick = rng.sample(ids, 6)
            statuses, bufs = read_back(tier, layout4, pick)
            for bid, status, buf in zip(pick, statuses, bufs, strict=True):
                seen[status] = seen.get(status, 0) + 1
                data = to_bytes(buf)
                if status is ReadStatus.OK and not any(np.array_equal(data, expected[v][bid]) for v in (1, 2)):
                    errors.append(f"layer {bid[1]} of {bid[0].hex()}: bytes of no version")
                elif status is not ReadStatus.OK and data.any():
                    errors.append(f"{status} wrote into the destination")

    try:
        assert all(tier.write(versions[1]))
        threads = [threading.Thread(target=writer, args=(v,)) for v in (1, 2)]
        threads += [threading.Thread(target=reader, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert errors == []
        assert set(seen) <= {ReadStatus.OK, ReadStatus.MISSING, ReadStatus.CORRUPT}
        assert all(tier.write(versions[2]))
        assert_read_back(tier, layout4, ids, version=2)
    finally:
        stop.set()
        tier.close()


# --------------------------------------------------------------------------- corrupted objects


def test_corrupted_objects_are_misses_never_wrong_bytes(master: MooncakeMaster, layout4: KVLayout, raw: Any) -> None:
    tier = open_tier(master.address, layout4, "corrupt")
    try:
        keys = raw_block_keys(5, seed=41)
        ids = [(k, layer) for k in keys for layer in range(4)]
        assert all(tier.write(write_items(layout4, ids)))
        name = [tier.object_key((k, 0)) for k in keys]  # type: ignore[attr-defined]
        good = raw.get(name[4])
        rng = np.random.default_rng(0)
        flipped = bytearray(raw.get(name[3]))
        flipped[-100] ^= 0x01  # a bit in the bytes of its last layer
        garbage = {
            name[0]: rng.integers(0, 256, len(good), dtype=np.uint8).tobytes(),  # noise of the right size
            name[1]: b"not a kvstrata object",  # too short for the ranges a read asks for
            name[2]: good,  # another key's intact object under this key's name
            name[3]: bytes(flipped),
        }
        for key_name, data in garbage.items():
            assert raw.upsert(key_name, data) == 0
        statuses, bufs = read_back(tier, layout4, ids[:16])
        bad = statuses[:12] + statuses[15:16]
        assert bad == [ReadStatus.CORRUPT] * 13
        assert statuses[12:15] == [ReadStatus.OK] * 3  # other layers of the flipped object are intact
        for status, buf in zip(statuses, bufs, strict=True):
            if status is not ReadStatus.OK:
                assert not to_bytes(buf).any(), "a corrupt read wrote into the caller's buffer"
        assert_read_back(tier, layout4, ids[12:15] + ids[16:])
        assert tier.checksum_failures == 13  # type: ignore[attr-defined]
    finally:
        tier.close()


def test_a_read_that_fails_twice_beside_a_write_of_this_tier_is_a_miss_not_corrupt(
    master: MooncakeMaster, layout4: KVLayout, raw: Any
) -> None:
    """An object that fails its checks on both tries while a write or delete of this process runs
    may be one being rewritten (the conformance race ``test_concurrent_readers_and_writers`` once
    got CORRUPT twice in a loaded CI): MISSING, not counted; once nothing runs, the same object is
    CORRUPT and counted."""
    tier = open_tier(master.address, layout4, "corrupt-beside")
    try:
        keys = raw_block_keys(2, seed=43)
        ids = [(k, layer) for k in keys for layer in range(4)]
        assert all(tier.write(write_items(layout4, ids)))
        name = tier.object_key((keys[0], 0))  # type: ignore[attr-defined]
        assert raw.upsert(name, b"\0" * len(raw.get(name))) == 0  # zeros: what a torn rewrite can show
        with tier._mutation():  # type: ignore[attr-defined]  # a write of this tier is running
            statuses, _ = read_back(tier, layout4, ids[:4])
        assert statuses == [ReadStatus.MISSING] * 4
        assert tier.checksum_failures == 0  # type: ignore[attr-defined]
        statuses, _ = read_back(tier, layout4, ids[:4])
        assert statuses == [ReadStatus.CORRUPT] * 4
        assert tier.checksum_failures == 4  # type: ignore[attr-defined]
        assert_read_back(tier, layout4, ids[4:])
    finally:
        tier.close()


def test_engine_turns_a_corrupted_object_into_a_miss(master: MooncakeMaster, raw: Any, tmp_path: Path) -> None:
    layout = engine_layout()
    config = {"tiers": [{"name": "pool", "kind": "mooncake", "capacity": "4MiB", **tier_options(master.address, "ec")}]}
    with Engine(config, layout=layout) as engine:
        keys = chain_keys(layout, 5, 4)
        assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 4
        victim = engine.tiers[0].tier.object_key((keys[2], 0))  # type: ignore[attr-defined]
        assert raw.upsert(victim, bytes(raw.get_size(victim))) == 0  # zeros: no header, no data
        bufs = empty_buffers(layout, 4)
        result = engine.load_sync(keys, bufs)
        assert result.loaded_blocks == 2 and mismatches(layout, keys, bufs, 2) == []
        assert engine.stats()["tiers"]["pool"]["checksum_failures"] >= 1


# --------------------------------------------------------------------------- two processes

WRITER = r"""
import json, sys
import numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
config, n = json.loads(sys.argv[1]), int(sys.argv[2])
layout = get_layout("tiny")
with Engine(config, layout=layout) as engine:
    keys = engine.keys_for_tokens(np.arange(layout.block_size * n, dtype=np.uint32))
    bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
    result = engine.store_sync(keys, bufs)
    print(json.dumps({"stored": result.stored}), flush=True)
    sys.stdin.readline()  # stay alive (the pool keeps a node's objects only while it runs) until told
"""


@pytest.mark.slow
def test_blocks_stored_by_another_engine_process_are_found_and_loaded(master: MooncakeMaster) -> None:
    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.content import block_contents

    layout = get_layout("tiny")
    tier = {"name": "pool", "kind": "mooncake", "capacity": "16MiB", **tier_options(master.address, "two-procs")}
    config = {"tiers": [tier]}
    n = 24
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(config), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()
        assert json.loads(line) == {"stored": n}, f"writer said {line!r}"
        with Engine(config, layout=layout) as reader:
            keys = reader.keys_for_tokens(np.arange(layout.block_size * (n + 4), dtype=np.uint32))
            pool = reader.tiers[0].tier
            ids = [(k, layer) for k in keys for layer in range(layout.num_layers)]
            per_key = layout.num_layers
            assert pool.contains(ids) == [True] * (n * per_key) + [False] * (4 * per_key)  # asked the master
            for layer in range(layout.num_layers):  # the other process's bytes, exactly
                bufs = [np.zeros(layout.layer_nbytes(layer), np.uint8) for _ in range(n)]
                assert pool.read([((k, layer), b) for k, b in zip(keys[:n], bufs, strict=True)]) == [ReadStatus.OK] * n
                assert np.array_equal(np.stack(bufs), block_contents(keys[:n], layer, layout.layer_nbytes(layer)))
            found = reader.lookup(keys)  # the engine asks shared tiers on a miss
            assert found.num_blocks == n and set(found.tiers) == {"pool"}
            bufs2 = {i: np.zeros((n, layout.layer_nbytes(i)), np.uint8) for i in range(layout.num_layers)}
            assert reader.load_sync(keys[:n], bufs2).loaded_blocks == n
            for layer, data in bufs2.items():
                assert np.array_equal(data, block_contents(keys[:n], layer, data.shape[1]))
    finally:
        if writer.stdin is not None:
            writer.stdin.close()
        writer.wait(60)
    assert writer.returncode == 0


# --------------------------------------------------------------------------- faults


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _recovers(engine: Engine, layout: KVLayout, seed: int, within: float = 30.0) -> bool:
    """Poll: store a fresh chain and load it back exactly."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        keys = chain_keys(layout, seed, 2)
        seed += 1
        if engine.store_sync(keys, source_buffers(layout, keys)).stored == 2:
            bufs = empty_buffers(layout, 2)
            if engine.load_sync(keys, bufs).loaded_blocks == 2 and mismatches(layout, keys, bufs, 2) == []:
                return True
        time.sleep(0.2)
    return False


def _engine(address: str, tag: str, **kw: Any) -> Engine:
    tier = {"name": "pool", "kind": "mooncake", "capacity": "4MiB", **tier_options(address, tag, **kw)}
    return Engine({"tiers": [tier]}, layout=engine_layout())


def _every_op_fails_soft(engine: Engine, layout: KVLayout, stored: list[bytes], bound: float) -> None:
    """Loads, stores, lookups and probes with the master gone: misses within ``bound`` seconds, no exception."""
    pool = engine.tiers[0].tier
    for round_ in range(3):
        bufs = empty_buffers(layout, len(stored))
        result, took = _timed(engine.load_sync, stored, bufs)
        assert took < bound and result.loaded_blocks == 0, (round_, took, result)
        fresh = chain_keys(layout, 900 + round_, 2)
        outcome, took = _timed(engine.store_sync, fresh, source_buffers(layout, fresh))
        assert took < bound and outcome.stored == 0
        present, took = _timed(pool.contains, [(k, 0) for k in stored])
        assert took < bound and present == [False] * len(stored)
        assert engine.lookup(fresh).num_blocks == 0
    stats = engine.stats()["tiers"]["pool"]
    assert stats["io_errors"] > 0 or stats["write_failures"] > 0
    assert pool.faults > 0  # type: ignore[attr-defined]


@pytest.mark.slow
def test_master_killed_then_restarted(own_master: MooncakeMaster) -> None:
    layout = engine_layout()
    with _engine(own_master.address, "killed", timeout_s=1.0) as engine:
        keys = chain_keys(layout, 1, 3)
        assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 3
        own_master.kill()
        _every_op_fails_soft(engine, layout, keys, bound=3.0)
        own_master.start()  # same address: the client re-mounts its segment
        assert _recovers(engine, layout, seed=100)
        bufs = empty_buffers(layout, 3)
        assert engine.load_sync(keys, bufs).loaded_blocks == 0  # the new master knows none of the old objects


@pytest.mark.slow
def test_hung_master_calls_end_at_the_deadline(own_master: MooncakeMaster) -> None:
    layout = engine_layout()
    with _engine(own_master.address, "hung", timeout_s=1.0) as engine:
        keys = chain_keys(layout, 2, 3)
        assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 3
        own_master.pause()  # sockets stay open, nothing answers
        try:
            _every_op_fails_soft(engine, layout, keys, bound=3.0)
        finally:
            own_master.resume()
        assert _recovers(engine, layout, seed=200)


@pytest.mark.slow
def test_master_down_at_open_is_retried(tmp_path: Path, layout4: KVLayout) -> None:
    down = _start_master(tmp_path)
    down.kill()  # its ports stay reserved for this test; nothing listens now
    tier, took = _timed(lambda: open_tier(down.address, layout4, "late", setup_timeout_s=5.0))
    try:
        assert took < 5.0 and not tier.connected  # type: ignore[attr-defined]
        ids = [(k, layer) for k in raw_block_keys(2, seed=51) for layer in range(4)]
        assert tier.write(write_items(layout4, ids)) == [False] * len(ids)
        assert read_back(tier, layout4, ids)[0] == [ReadStatus.ERROR] * len(ids)
        assert tier.contains(ids) == [False] * len(ids)
        down.start()
        deadline = time.monotonic() + 30
        while not all(tier.write(write_items(layout4, ids))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tier.connected  # type: ignore[attr-defined]
        assert_read_back(tier, layout4, ids)
    finally:
        tier.close()
        down.stop()


@pytest.mark.slow
def test_long_outage_sets_up_a_new_client_and_recovers(
    own_master: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    layout = engine_layout()
    caplog.set_level(logging.WARNING, logger="kvstrata.tiers.mooncake")
    with _engine(own_master.address, "replaced", timeout_s=1.0, reconnect_after_s=0.5) as engine:
        keys = chain_keys(layout, 3, 2)
        assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 2
        own_master.kill()
        deadline = time.monotonic() + 20
        while "setting up a new client" not in caplog.text and time.monotonic() < deadline:
            engine.tiers[0].tier.contains([(keys[0], 0)])
            time.sleep(0.2)
        assert "setting up a new client" in caplog.text
        own_master.start()
        assert _recovers(engine, layout, seed=300)


@needs_mooncake
def test_closed_tier_raises_tier_error(master: MooncakeMaster, layout4: KVLayout) -> None:
    tier = open_tier(master.address, layout4, "closed")
    tier.close()
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.write(write_items(layout4, [(raw_block_keys(1)[0], 0)]))
