"""The nvme tier's self-describing records: a damaged or lost index is a clear error, and
``kvstrata verify --repair`` rebuilds it from the segment files; format-2 directories stay
readable; LMDB reader slots of killed processes do not run out. Real files, real LMDB, real
processes killed with SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from kvstrata.cli import main
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.engine.verify import verify_config
from kvstrata.errors import CorruptIndexError, TierError
from kvstrata.tiers import BlockId, ReadStatus, TierContext
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.records import RECORD_HEADER, meta_document, pack_header, parse_header
from kvstrata.tiers.segments import MAX_READERS, Loc, SegmentIndex, lock_namespace

GiB = 1 << 30
BIG = get_layout("llama-3.1-70b")  # 80 layers of 64 KiB layer-blocks (16 tokens, bf16)
SMALL = uniform_layout("test-small", num_layers=4, num_kv_heads=1, head_dim=20, block_size=5)  # 400 bytes
SECRET = "a deployment secret of more than sixteen bytes"


def ctx_of(layout: KVLayout) -> TierContext:
    ns = Namespace(layout.model, "bfloat16", layout.fingerprint(), layout.block_size)
    return TierContext(layout, ns)


def block_bytes(bid: BlockId, nbytes: int) -> np.ndarray:
    return np.random.default_rng([*bid[0], bid[1]]).integers(0, 256, nbytes, dtype=np.uint8)


def items_of(layout: KVLayout, keys: list[bytes]) -> list[tuple[BlockId, np.ndarray]]:
    ids = [(k, layer) for layer in range(layout.num_layers) for k in keys]  # layer-major, as the engine writes
    return [(bid, block_bytes(bid, layout.layer_nbytes(bid[1]))) for bid in ids]


def new_keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def options(path: Path, **extra: Any) -> NVMeOptions:
    return NVMeOptions(path=str(path), **extra)


def open_tier(path: Path, layout: KVLayout, **extra: Any) -> NVMeTier:
    return NVMeTier("nvme", GiB, options(path, **extra), ctx_of(layout))


def read_all(tier: NVMeTier, items: list[tuple[BlockId, np.ndarray]]) -> list[ReadStatus]:
    bufs = [np.zeros_like(data) for _, data in items]
    status = tier.read([(bid, buf) for (bid, _), buf in zip(items, bufs, strict=True)])
    for st, buf, (bid, data) in zip(status, bufs, items, strict=True):
        if st is ReadStatus.OK:
            assert np.array_equal(buf, data), f"{bid} read back other bytes"
    return status


def assert_exact(tier: NVMeTier, items: list[tuple[BlockId, np.ndarray]]) -> None:
    assert read_all(tier, items) == [ReadStatus.OK] * len(items)


def damage_index(root: str, how: str = "garbage") -> None:
    data = Path(root, "index.lmdb", "data.mdb")
    if how == "garbage":
        data.write_bytes(os.urandom(65536))
    else:  # truncated: LMDB would read pages past the end of the file (SIGBUS before this change)
        os.truncate(data, data.stat().st_size // 2)


def config_for(path: Path, **extra: Any) -> dict[str, Any]:
    return {"tiers": [{"name": "nvme", "capacity": "1GiB", "path": str(path), **extra}]}


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))


def locate(tier: NVMeTier, data: np.ndarray) -> tuple[Path, int]:
    """The segment file and offset of a record's payload, found by its bytes."""
    needle = data.tobytes()
    for seg in sorted(Path(tier.root, "segments").glob("*.seg")):
        pos = seg.read_bytes().find(needle)
        if pos >= 0:
            return seg, pos
    raise AssertionError("payload not found in any segment")


def header_of(seg: Path, payload: int) -> int:
    """Where the header of the record whose payload is at ``payload`` lies in ``seg``."""
    raw = seg.read_bytes()
    for at in range(payload, len(raw) - RECORD_HEADER + 1, RECORD_HEADER):
        head = parse_header(raw, at)
        if head is not None and at - head.back == payload:
            return at
    raise AssertionError("header not found")


# -- a damaged index: one clear error, then verify --repair ---------------------------------------------


def _kvstrata(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=300, env=env
    )


def _one_clear_line(res: subprocess.CompletedProcess[str], index: Path) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert str(index) in lines[0] and "kvstrata verify --repair" in lines[0], lines[0]


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_a_damaged_index_is_one_clear_error_and_verify_repair_rebuilds_it(tmp_path: Path, how: str) -> None:
    """Engine(), ``kvstrata replay`` and ``kvstrata verify`` name the index and the way out;
    ``kvstrata verify --repair`` rebuilds it and the engine then loads every block it stored."""
    layout = get_layout("tiny")
    cfg_path = tmp_path / "kv.toml"
    cfg_path.write_text(f'[[tiers]]\nname = "nvme"\ncapacity = "64MiB"\npath = "{tmp_path / "nvme"}"\n')
    with Engine(str(cfg_path), layout=layout) as engine:
        keys = engine.keys_for_tokens(np.arange(16 * 24, dtype=np.uint32))
        rng = np.random.default_rng(12)
        bufs = {layer: rng.integers(0, 256, (len(keys), 1024), dtype=np.uint8) for layer in range(4)}
        assert engine.store_sync(keys, bufs).stored == len(keys)
    (root,) = [p for p in (tmp_path / "nvme").iterdir() if (p / "meta.json").exists()]
    index = root / "index.lmdb"
    damage_index(str(root), how)
    trace = tmp_path / "t.jsonl"
    assert (
        CliRunner().invoke(main, ["trace", "synth", "--out", str(trace), "--sessions", "1", "--turns", "1"]).exit_code
        == 0
    )

    _one_clear_line(_kvstrata("verify", "--config", str(cfg_path)), index)
    _one_clear_line(_kvstrata("replay", "--trace", str(trace), "--config", str(cfg_path), "--model", "tiny"), index)
    with pytest.raises(CorruptIndexError, match="kvstrata verify --repair") as err:
        Engine(str(cfg_path), layout=layout)
    assert str(index) in str(err.value) and isinstance(err.value, TierError)

    fixed = _kvstrata("verify", "--config", str(cfg_path), "--repair", "--json", str(tmp_path / "r.json"))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    (report,) = json.loads((tmp_path / "r.json").read_text())["namespaces"]
    assert report["ok"] and report["rebuilt"]["blocks_checked"] == 4 * len(keys), report
    assert any("index rebuilt" in p for p in report["problems"]) and list(root.glob("index.lmdb.broken-*"))
    with Engine(str(cfg_path), layout=layout) as engine:
        out = {layer: np.zeros((len(keys), 1024), np.uint8) for layer in range(4)}
        assert engine.load_sync(keys, out).loaded_blocks == len(keys)
        for layer in range(4):
            assert np.array_equal(out[layer], bufs[layer])
    again = _kvstrata("verify", "--config", str(cfg_path))
    assert again.returncode == 0, again.stdout + again.stderr


def test_repair_rebuilds_both_namespaces_and_every_acknowledged_block_reads_back(tmp_path: Path) -> None:
    """64 KiB layer-blocks (llama-3.1-70b) and 400-byte ones: rewritten, deleted and compacted
    blocks, a torn tail; after the rebuild every acknowledged block reads back byte-exact."""
    big_keys, small_keys = new_keys(6, seed=1), new_keys(120, seed=2)
    big, small = items_of(BIG, big_keys), items_of(SMALL, small_keys)
    bt = open_tier(tmp_path, BIG)
    for i in range(0, 6, 2):
        assert all(bt.write(big[i * 80 : (i + 2) * 80]))  # 2 keys x 80 layers per batch (not layer-major here)
    assert all(bt.write(big[:80]))  # rewritten: a dead copy stays in the segment
    bt.close()
    st = open_tier(tmp_path, SMALL, segment_size="64KiB", compact_threshold=0.5)
    for i in range(0, 120, 10):
        assert all(st.write(items_of(SMALL, small_keys[i : i + 10])))
    doomed = [bid for bid, _ in small if bid[0] in small_keys[::3]]
    st.delete(doomed)  # some segments fall below half live: compacted
    st.close()
    survivors = [it for it in small if it[0][0] not in small_keys[::3]]
    for tier_root in {bt.root, st.root}:
        damage_index(tier_root)
        with open(next(Path(tier_root, "segments").glob("*.seg")), "ab") as f:
            f.write(os.urandom(5000))  # a torn tail: garbage after the last record

    reports = verify_config(config_for(tmp_path), repair=True)
    assert len(reports) == 2 and all(r["ok"] and r["rebuilt"] for r in reports), reports
    by_model = {r["model"]: r for r in reports}
    assert by_model[BIG.model]["rebuilt"]["blocks_checked"] == len(big)
    assert any("duplicate copies left out" in p for p in by_model[BIG.model]["problems"])
    bt, st = open_tier(tmp_path, BIG), open_tier(tmp_path, SMALL, segment_size="64KiB")
    assert_exact(bt, big)
    # the headers of a chunk follow its payloads: 64 KiB layer-blocks stay page-aligned (O_DIRECT, GPUDirect)
    assert all(loc.offset % 4096 == 0 for _, loc in bt.records())
    assert_exact(st, survivors)
    # a deleted block whose bytes were not reclaimed yet comes back: still the right KV for its key
    assert set(read_all(st, [it for it in small if it[0] in doomed])) <= {ReadStatus.OK, ReadStatus.MISSING}
    assert bt.verify().ok and st.verify().ok
    bt.close()
    st.close()


def test_a_flipped_byte_in_a_header_or_payload_drops_just_that_record(tmp_path: Path) -> None:
    keys = new_keys(40, seed=3)
    items = items_of(SMALL, keys)  # 160 records of 400 bytes in one chunk
    tier = open_tier(tmp_path, SMALL)
    assert all(tier.write(items))
    tier.close()
    hurt = {7: 30, 50: None, 90: 1}  # a byte of the header's payload position, of the payload, of the magic
    for i, at in hurt.items():
        seg, pos = locate(tier, items[i][1])
        flip(seg, pos + 123 if at is None else header_of(seg, pos) + at)
    damage_index(tier.root)
    rebuilt = NVMeTier.rebuild_index("nvme", options(tmp_path), ctx_of(SMALL))
    assert rebuilt is not None and rebuilt.blocks_checked == len(items) - 3
    assert rebuilt.bad_checksums == 2  # the damaged header and the damaged payload (a lost magic is not seen)
    tier = open_tier(tmp_path, SMALL)
    status = read_all(tier, items)
    assert [i for i, st in enumerate(status) if st is not ReadStatus.OK] == sorted(hurt)
    assert all(status[i] is ReadStatus.MISSING for i in hurt)
    tier.close()


def test_a_keyed_tier_rebuilds_with_its_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    other = tmp_path / "other"
    other.write_text(SECRET[::-1])
    os.chmod(other, 0o600)
    keys = new_keys(30, seed=4)
    items = items_of(SMALL, keys)
    tier = open_tier(tmp_path / "nvme", SMALL, secret_file=str(secret))
    assert all(tier.write(items))
    tier.close()
    seg, pos = locate(tier, items[11][1])
    flip(seg, pos + 5)  # a payload byte: its keyed tag fails
    damage_index(tier.root)
    # another secret rebuilds it: the records are kept, unchecked and never served by that tier
    report = NVMeTier.rebuild_index("nvme", options(tmp_path / "nvme", secret_file=str(other)), ctx_of(SMALL))
    assert report is not None and report.blocks_checked == len(items)
    assert any("written with another secret" in p for p in report.problems)
    stranger = open_tier(tmp_path / "nvme", SMALL, secret_file=str(other))
    assert set(read_all(stranger, items)) == {ReadStatus.MISSING}
    stranger.close()
    # with its own secret: the forged-or-damaged record is left out, the others read back
    reports = verify_config(config_for(tmp_path / "nvme", secret_file=str(secret)), rebuild=True)
    assert reports[0]["rebuilt"]["blocks_checked"] == len(items) - 1 and reports[0]["rebuilt"]["bad_checksums"] == 1
    tier = open_tier(tmp_path / "nvme", SMALL, secret_file=str(secret))
    status = read_all(tier, items)
    assert status[11] is ReadStatus.MISSING and status.count(ReadStatus.OK) == len(items) - 1
    assert tier.auth_failures == 0 and tier.verify().ok
    tier.close()


def test_a_lost_index_keeps_the_segments_and_repair_rebuilds_it(tmp_path: Path) -> None:
    """An index that is gone (deleted, or replaced by an empty one) must not make the tier delete
    the segment files that are all that is left of its data."""
    items = items_of(BIG, new_keys(2, seed=5))
    tier = open_tier(tmp_path, BIG)
    assert all(tier.write(items))
    tier.close()
    segs = list(Path(tier.root, "segments").glob("*.seg"))
    for seg in segs:  # older than the grace period young unknown files get
        os.utime(seg, (seg.stat().st_atime - 3600, seg.stat().st_mtime - 3600))
    for f in Path(tier.root, "index.lmdb").iterdir():
        f.unlink()
    reopened = open_tier(tmp_path, BIG)
    assert all(seg.exists() for seg in segs)
    report = reopened.verify(repair=True)
    assert all(seg.exists() for seg in segs) and not report.ok and report.unindexed_files == len(segs)
    reopened.close()
    reports = verify_config(config_for(tmp_path), repair=True)
    assert reports[0]["ok"] and "it was lost or replaced" in reports[0]["problems"][0]
    rebuilt = open_tier(tmp_path, BIG)
    assert_exact(rebuilt, items)
    rebuilt.close()


def test_a_rebuild_never_runs_beside_a_process_that_uses_the_index(tmp_path: Path) -> None:
    items = items_of(SMALL, new_keys(4, seed=6))
    tier = open_tier(tmp_path, SMALL)
    assert all(tier.write(items))
    with pytest.raises(TierError, match="a process has it open"):
        NVMeTier.rebuild_index("nvme", options(tmp_path), ctx_of(SMALL), force=True)
    (row,) = verify_config(config_for(tmp_path), rebuild=True)  # the namespace's problem, not the run's
    assert not row["ok"] and "a process has it open" in row["problems"][0] and "repaired" not in row
    assert NVMeTier.rebuild_index("nvme", options(tmp_path), ctx_of(SMALL)) is None  # it is fine: left alone
    assert_exact(tier, items)
    tier.close()
    held = lock_namespace(tier.root, exclusive=True)  # what a rebuild holds
    assert held is not None
    try:
        with pytest.raises(TierError, match="being rebuilt"):
            open_tier(tmp_path, SMALL)
    finally:
        os.close(held)
    tier = open_tier(tmp_path, SMALL)
    assert_exact(tier, items)
    tier.close()


# -- format 2 (records without headers) ---------------------------------------------------------------------


def _format2_directory(base: Path, layout: KVLayout, keys: list[bytes]) -> tuple[str, list[tuple[BlockId, np.ndarray]]]:
    """A namespace directory as format 2 wrote it: records back to back at 64-byte offsets in one
    4096-padded chunk, no headers, index entries of 24 bytes (segment u32, offset u64, length u32,
    xxh3_64 u64, big-endian)."""
    import xxhash

    ctx = ctx_of(layout)
    root = base / ctx.namespace.fingerprint
    (root / "segments").mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta_document(2, ctx.layout, ctx.namespace), indent=1, sort_keys=True))
    items = items_of(layout, keys)
    name, blob, entries = "100-old-000001.seg", bytearray(), []
    for (key, layer), data in items:
        entries.append(
            (
                key + layer.to_bytes(2, "big"),
                struct.pack(">IQIQ", 1, len(blob), data.size, xxhash.xxh3_64_intdigest(data.tobytes())),
            )
        )
        blob += data.tobytes() + bytes(-data.size % 64)
    blob += bytes(-len(blob) % 4096)
    (root / "segments" / name).write_bytes(blob)
    env = lmdb.open(str(root / "index.lmdb"), max_dbs=4, map_size=1 << 26, subdir=True)
    blocks, segments, meta = (env.open_db(n) for n in (b"blocks", b"segments", b"meta"))
    with env.begin(write=True) as txn:
        for k, v in entries:
            txn.put(k, v, db=blocks)
        txn.put(struct.pack(">I", 1), struct.pack(">QQ", len(blob), len(items)) + name.encode(), db=segments)
        txn.put(b"next_segment", struct.pack(">I", 2), db=meta)
    env.close()
    return str(root), items


def test_a_format_2_directory_stays_readable_and_is_upgraded_in_place(tmp_path: Path) -> None:
    root, old = _format2_directory(tmp_path, SMALL, new_keys(8, seed=7))
    tier = open_tier(tmp_path, SMALL, compact_threshold=0.5)
    assert tier.root == root
    assert_exact(tier, old)
    meta = json.loads(Path(root, "meta.json").read_text())
    assert meta["format"] == 3 and meta["upgraded_from"] == 2
    new = items_of(SMALL, new_keys(8, seed=8))
    assert all(tier.write(new))
    report = tier.verify()
    assert report.ok and report.blocks_checked == 64 and report.orphan_bytes == 0
    tier.delete([bid for bid, _ in old if bid[0] != old[0][0][0]])  # one old key survives: compacted, with headers
    assert not Path(root, "segments", "100-old-000001.seg").exists()
    kept = [it for it in old if it[0][0] == old[0][0][0]]
    assert_exact(tier, kept + new)
    tier.close()
    reopened = open_tier(tmp_path, SMALL)  # the upgraded meta is accepted as it is
    assert_exact(reopened, kept + new)
    reopened.close()
    damage_index(root)
    reports = verify_config(config_for(tmp_path), repair=True)
    assert reports[0]["ok"] and reports[0]["rebuilt"]["blocks_checked"] == len(kept + new)
    assert_exact(open_tier(tmp_path, SMALL), kept + new)


def test_a_rebuild_counts_headerless_records_as_unrecovered(tmp_path: Path) -> None:
    root, old = _format2_directory(tmp_path, SMALL, new_keys(8, seed=9))
    tier = open_tier(tmp_path, SMALL)  # upgrades the meta
    new = items_of(SMALL, new_keys(2, seed=10))
    assert all(tier.write(new))
    tier.close()
    damage_index(root)
    report = NVMeTier.rebuild_index("nvme", options(tmp_path), ctx_of(SMALL))
    assert report is not None and report.blocks_checked == len(new)
    assert report.orphan_bytes >= sum(data.size for _, data in old)
    assert any("format 2" in p and "no header" in p for p in report.problems), report.problems
    tier = open_tier(tmp_path, SMALL)
    assert_exact(tier, new)
    assert set(read_all(tier, old)) == {ReadStatus.MISSING}
    tier.close()


def test_headers_and_index_entries_round_trip() -> None:
    bkey = bytes(range(16)) + (300).to_bytes(2, "big")
    head = pack_header(bkey, 400, 1024, 0xDEADBEEF, b"")
    assert len(head) == RECORD_HEADER
    assert parse_header(b"x" * 64 + head, 64) == (bkey, 400, 1024, 0xDEADBEEF, b"")
    tag = bytes(range(24))
    head = pack_header(bkey, 65536, 65536, 0, tag)
    assert parse_header(head, 0) == (bkey, 65536, 65536, 0, tag)
    for bit in range(8 * RECORD_HEADER):  # any flipped bit: not a header
        hurt = bytearray(head)
        hurt[bit // 8] ^= 1 << bit % 8
        assert parse_header(hurt, 0) is None, bit
    old = struct.pack(">IQIQ", 3, 4096, 400, 77)
    assert Loc.unpack(old) == Loc(3, 4096, 400, 77) and not Loc.unpack(old).framed
    assert Loc.unpack(old + tag) == Loc(3, 4096, 400, 77, tag)
    for loc in (Loc(3, 4096, 400, 77, framed=True), Loc(3, 4096, 400, 0, tag, framed=True)):
        assert Loc.unpack(loc.pack()) == loc and loc.extent == 448 + RECORD_HEADER and loc.end == 4096 + 448


# -- LMDB reader slots ------------------------------------------------------------------------------------

_FILL_READERS = textwrap.dedent(
    """
    import sys, time, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 30, subdir=True, lock=True)
    txns = []
    while True:
        try:
            txns.append(env.begin())
        except lmdb.ReadersFullError:
            break
    print(len(txns), flush=True)
    time.sleep(600)
    """
)


def test_reader_slots_of_killed_processes_are_reclaimed(tmp_path: Path) -> None:
    """A process killed (kill -9) while it holds LMDB reader slots leaves them taken. Three times a
    process takes every free slot (far more than the 126 there were) and is killed; each time a
    new thread of the process that had the index open all along (it needs a slot of its own)
    still reads, and so the next process can open the index."""
    items = items_of(SMALL, new_keys(6, seed=11))
    tier = open_tier(tmp_path, SMALL)
    assert all(tier.write(items))
    tier.close()
    path = os.path.join(tier.root, "index.lmdb")
    index = SegmentIndex(path, GiB)  # the long-lived process

    def read_in_a_new_thread() -> list[Any]:
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(index.blocks()))
        reader.start()
        reader.join()
        return got

    try:
        for _ in range(3):
            child = subprocess.Popen([sys.executable, "-c", _FILL_READERS, path], stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None
            held = child.stdout.readline()
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            assert held and MAX_READERS - 8 <= int(held) <= MAX_READERS, held
            got = read_in_a_new_thread()  # the table is full of dead slots: cleared, then read
            assert got and len(got[0]) == len(items)
        tier = open_tier(tmp_path, SMALL)
        assert_exact(tier, items)
        tier.close()
    finally:
        index.close()


def test_an_index_whose_file_ends_before_its_free_pages_opens_and_a_cut_into_used_pages_does_not(
    tmp_path: Path,
) -> None:
    """LMDB counts pages it allocated and freed in one transaction without writing them: after a
    large delete data.mdb ends before its last page number, and nothing references what it lacks.
    Such an index opens and serves every block (before, it was refused as truncated, so the tier
    did not open after a big delete or a writer's kill -9). A file cut into pages in use is still
    a clear CorruptIndexError, never a SIGBUS."""
    layout = get_layout("tiny")
    tier = open_tier(tmp_path / "nvme", layout)
    keys = new_keys(3000, 5)
    for i in range(0, len(keys), 100):
        assert all(tier.write(items_of(layout, keys[i : i + 100])))
    tier.delete([(k, layer) for k in keys[:2900] for layer in range(4)])
    root = tier.root
    tier.close()
    data = Path(root, "index.lmdb", "data.mdb")
    env = lmdb.open(str(data.parent), max_dbs=4, readonly=True, lock=False)
    try:
        psize, last = env.stat()["psize"], env.info()["last_pgno"]
    finally:
        env.close()
    assert data.stat().st_size < (last + 1) * psize, "no page past the end: the case is not made"

    tier = open_tier(tmp_path / "nvme", layout)
    try:
        assert_exact(tier, items_of(layout, keys[2900:]))
        assert tier.contains([(k, 0) for k in keys[:2900]]) == [False] * 2900
    finally:
        tier.close()
    os.truncate(data, data.stat().st_size - psize)  # the last page written is in use
    with pytest.raises(CorruptIndexError, match="truncated"):
        open_tier(tmp_path / "nvme", layout)
