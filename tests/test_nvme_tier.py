"""The nvme tier: round trips, persistence, sharing, space reclamation, checksums, faults, crashes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec, uniform_layout
from kvstrata.errors import ConfigError, LayoutMismatchError, TierError
from kvstrata.tiers import TIERS, BlockId, ReadStatus, TierContext
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.nvme import state as nvme_state
from kvstrata.tiers.segments import (
    ALIGN,
    FORMAT_VERSION,
    RECORD_HEADER,
    SegmentIndex,
    align_up,
    block_key,
    probe_direct_io,
)

# Shared with the crash-test child process, which runs it from source.
ORACLE = textwrap.dedent(
    """
    import numpy as np
    from kvstrata.core.keys import Namespace
    from kvstrata.core.layout import uniform_layout
    from kvstrata.tiers import TierContext

    LAYOUT = uniform_layout("test", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
    NS = Namespace(model="test", kv_dtype="bfloat16", layout_fingerprint=LAYOUT.fingerprint(), block_size=16)
    CTX = TierContext(LAYOUT, NS)
    NB = LAYOUT.layer_nbytes(0)
    # 400-byte layer-blocks: many records per page, none a multiple of 64 (packed geometry)
    SMALL = uniform_layout("test-small", num_layers=4, num_kv_heads=1, head_dim=20, block_size=5)
    SMALL_NS = Namespace(model="test-small", kv_dtype="bfloat16", layout_fingerprint=SMALL.fingerprint(), block_size=5)
    CTXS = {"8k": CTX, "400b": TierContext(SMALL, SMALL_NS)}

    def block_bytes(key, layer, nb=NB):
        return np.random.default_rng([*key, layer]).integers(0, 256, nb, dtype=np.uint8)
    """
)
_oracle: dict[str, Any] = {}
exec(ORACLE, _oracle)
LAYOUT = _oracle["LAYOUT"]
NS: Namespace = _oracle["NS"]
CTX: TierContext = _oracle["CTX"]
NB: int = _oracle["NB"]
CTXS: dict[str, TierContext] = _oracle["CTXS"]
block_bytes: Callable[..., np.ndarray] = _oracle["block_bytes"]
LAYERS = range(LAYOUT.num_layers)
GiB = 1 << 30
REC = NB + RECORD_HEADER  # what one 8 KiB layer-block takes in a segment: its header and its bytes
SEG16 = align_up(16 * REC)  # a segment that one batch of 4 keys x 4 layers fills


def new_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def ids_of(keys: list[bytes]) -> list[BlockId]:
    return [(k, layer) for k in keys for layer in LAYERS]


def items_of(keys: list[bytes]) -> list[tuple[BlockId, np.ndarray]]:
    return [(bid, block_bytes(*bid)) for bid in ids_of(keys)]


def read_back(tier: NVMeTier, ids: list[BlockId]) -> tuple[list[ReadStatus], list[np.ndarray]]:
    bufs = [np.zeros(NB, dtype=np.uint8) for _ in ids]
    return tier.read(list(zip(ids, bufs, strict=True))), bufs


def assert_exact(tier: NVMeTier, keys: list[bytes]) -> None:
    ids = ids_of(keys)
    status, bufs = read_back(tier, ids)
    assert status == [ReadStatus.OK] * len(ids)
    for bid, buf in zip(ids, bufs, strict=True):
        np.testing.assert_array_equal(buf, block_bytes(*bid))


def open_tier(path: Path, capacity: int = GiB, ctx: TierContext = CTX, **options: object) -> NVMeTier:
    return NVMeTier("nvme", capacity, NVMeOptions(path=str(path), **options), ctx)  # type: ignore[arg-type]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[NVMeTier]:
    t = open_tier(tmp_path)
    yield t
    t.close()


def segment_files(tier: NVMeTier) -> list[Path]:
    """The tier's segment files, less its spare (made ahead, empty: see ``Appender._next_segment``)."""
    spare = tier._spare.name if tier._spare is not None else None
    return sorted(p for p in Path(tier.root, "segments").glob("*.seg") if p.name != spare)


def flip_byte_of(tier: NVMeTier, data: np.ndarray, at: int = 100) -> None:
    """Corrupt the stored copy of ``data`` in place (found by content, not through the index)."""
    needle = data.tobytes()
    for path in segment_files(tier):
        pos = path.read_bytes().find(needle)
        if pos >= 0:
            with open(path, "r+b") as f:
                f.seek(pos + at)
                old = f.read(1)
                f.seek(pos + at)
                f.write(bytes([old[0] ^ 0xFF]))
                os.fsync(f.fileno())
            return
    raise AssertionError("block bytes not found in any segment")


# -- round trips and persistence --------------------------------------------------------------


def test_registry_and_capabilities() -> None:
    assert TIERS.get("nvme") is NVMeTier
    caps = NVMeTier.capabilities
    assert caps.persistent and caps.checksums and caps.alignment == 4096
    assert not caps.gpu_direct  # no kvikio / CUDA here


def test_round_trip_numpy(tier: NVMeTier) -> None:
    keys = new_keys(16)
    assert tier.write(items_of(keys)) == [True] * 64
    assert_exact(tier, keys)
    assert sorted(tier.scan()) == sorted((bid, NB) for bid in ids_of(keys))
    assert tier.used_bytes >= 64 * NB


def test_round_trip_torch_bf16(tier: NVMeTier) -> None:
    shape = LAYOUT.layers[0].block_shape
    keys = new_keys(4, seed=1)
    src = {bid: torch.randn(shape, dtype=torch.bfloat16) for bid in ids_of(keys)}
    assert all(tier.write(list(src.items())))
    dst = {bid: torch.empty(shape, dtype=torch.bfloat16) for bid in src}
    assert set(tier.read(list(dst.items()))) == {ReadStatus.OK}
    assert all(torch.equal(src[bid], dst[bid]) for bid in src)
    status, bufs = read_back(tier, list(src))  # torch in, numpy out: same bytes
    assert set(status) == {ReadStatus.OK}
    assert np.array_equal(bufs[0], src[next(iter(src))].view(torch.uint8).reshape(-1).numpy())


def test_rejects_malformed_items_and_reports_misses(tier: NVMeTier) -> None:
    key = new_keys(1)[0]
    wrong = [
        ((key, 0), np.zeros(NB - 1, dtype=np.uint8)),  # wrong size
        ((key[:8], 0), block_bytes(key, 0)),  # short key
        ((key, 9), np.zeros(NB, dtype=np.uint8)),  # no such layer
        ((key, 1), block_bytes(key, 1)),
    ]
    assert tier.write(wrong) == [False, False, False, True]
    status = tier.read(
        [((key, 1), np.zeros(NB - 8, dtype=np.uint8)), ((key, 2), np.zeros(NB, np.uint8)), ((b"x", 0), None)]
    )
    assert status == [ReadStatus.ERROR, ReadStatus.MISSING, ReadStatus.MISSING]
    tier.delete([(key, 3), (b"bad", 0)])  # missing and malformed ids are ignored


def test_reopen_finds_everything(tmp_path: Path) -> None:
    keys = new_keys(12)
    first = open_tier(tmp_path, segment_size=64 * 1024)
    for i in range(0, 12, 3):
        assert all(first.write(items_of(keys[i : i + 3])))
    first.close()
    first.close()  # idempotent
    with pytest.raises(TierError):
        first.write(items_of(keys[:1]))
    again = open_tier(tmp_path, segment_size=64 * 1024)
    assert sorted(again.scan()) == sorted((bid, NB) for bid in ids_of(keys))
    assert_exact(again, keys)
    assert again.verify().ok
    again.close()


def test_one_write_over_several_segments_and_chunks_lands_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call whose records fill several segments, each in several staging chunks: the chunks
    of every segment go out in one set of lanes, and each record lands where the index says."""
    from kvstrata.tiers.nvme import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", align_up(3 * REC))  # 3 records a chunk
    keys = new_keys(10, seed=11)  # 40 records: 3 segments of 16 and the rest in a 4th
    tier = open_tier(tmp_path, segment_size=SEG16)
    assert all(tier.write(items_of(keys)))
    assert len(segment_files(tier)) >= 3
    assert_exact(tier, keys)
    tier.close()
    again = open_tier(tmp_path, segment_size=SEG16)
    assert_exact(again, keys)
    assert again.verify().ok
    again.close()


def _read_with_spied_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_reads: bool, keys: list[bytes]
) -> list[list[list[int]]]:
    """Write ``keys``, read them back exactly through the extension's threads (``native_reads``)
    or the pipeline, and return the runs each feed handed them: per feed, per run, the items."""
    from kvstrata.tiers.nvme import native_reads as nr
    from kvstrata.tiers.nvme import reader

    tier = open_tier(tmp_path)
    if tier._native_reads != native_reads:
        if native_reads:
            tier.close()
            pytest.skip("native reads need kvstrata._native")
        tier._native_reads = False
    try:
        assert all(tier.write(items_of(keys)))
        handed: list[list[list[int]]] = []
        runs_class: Any = nr.NativeRuns if native_reads else reader._Runs
        plain = runs_class.feed

        def spy(self: Any, work: Any) -> None:
            handed.append([[i for i, _ in run] for _, run in work])
            plain(self, work)

        monkeypatch.setattr(runs_class, "feed", spy)
        assert_exact(tier, keys)
        return handed
    finally:
        tier.close()


@pytest.mark.parametrize("native_reads", [True, False])
def test_the_last_runs_of_a_read_are_cut_into_halving_runs_of_whole_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_reads: bool
) -> None:
    """A read's last runs are checked and copied out after every other read is done: they are cut
    so that little work is left when the disk is idle. Every record is still read once, whole, by
    the extension's threads or the pipeline."""
    from kvstrata.tiers.nvme import reader

    monkeypatch.setattr(reader, "MIN_RUN", NB)  # at the tier's real sizes: 16 MiB -> 8, 4, 2, 1, 1 MiB
    monkeypatch.setattr(reader, "run_bytes", lambda total: 1 << 30)  # the whole read planned as one run
    keys = new_keys(8)  # 32 records of 8 KiB, all in one segment: one run
    (runs,) = _read_with_spied_runs(tmp_path, monkeypatch, native_reads, keys)
    assert sorted(i for run in runs for i in run) == list(range(32))  # each record in exactly one run
    assert [len(run) for run in runs] == [16, 8, 4, 2, 2]  # halving, down to MIN_RUN
    assert all(run == sorted(run) for run in runs)  # in file order


@pytest.mark.parametrize("native_reads", [True, False])
def test_the_first_parts_of_a_large_read_are_not_read_in_a_small_calls_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_reads: bool
) -> None:
    """A large read is looked up in parts of doubling size, the first one small (``HEAD_ITEMS``), so
    that its first reads start at once. Its runs are sized for the whole call, at most half a part:
    the first part of a 512 MiB read went to the disk in 1 MiB runs (a small call's), ~0.7 GB/s a
    stream here against ~1.5 for 16 MiB ones. At scale here: records of 8 KiB, ``MIN_RUN`` one
    record, parts of 8, 8, 16, ... records."""
    from kvstrata.tiers.nvme import reader
    from kvstrata.tiers.nvme import tier as tier_module
    from kvstrata.tiers.nvme.options import IO_DEPTH

    monkeypatch.setattr(reader, "MIN_RUN", NB)
    monkeypatch.setattr(tier_module, "HEAD_ITEMS", 8)
    keys = new_keys(64)  # 256 records of 8 KiB, in one segment
    handed = _read_with_spied_runs(tmp_path, monkeypatch, native_reads, keys)
    assert sorted(i for part in handed for run in part for i in run) == list(range(256))  # each record once
    assert len(handed) > 3  # the read was cut into parts
    first = handed[0]
    assert sum(map(len, first)) == 8
    assert len(first) <= IO_DEPTH  # before: 8 runs of one record each
    assert max(len(run) for part in handed[:-1] for run in part) > 1  # runs of several records from the start


def test_a_cut_never_splits_a_run_of_one_record_or_a_short_one() -> None:
    from kvstrata.tiers.nvme.options import IO_DEPTH
    from kvstrata.tiers.nvme.reader import MIN_RUN, _tapered
    from kvstrata.tiers.segments import Loc

    big = [(0, Loc(1, 0, 64 << 20, 0, b"", True))]  # one record larger than any run
    assert _tapered([(3, big)]) == [(3, big)]
    short = [(i, Loc(1, i * 65600, 65536, 0, b"", True)) for i in range(16)]  # 1 MiB
    assert 2 * MIN_RUN >= 16 * 65600 and _tapered([(3, short)]) == [(3, short)]
    first = [(99, Loc(2, 0, 4096, 0, b"", True))]
    long = [(i, Loc(1, i * 65600, 65536, 0, b"", True)) for i in range(256)]  # 16 MiB
    cut = _tapered([(4, first), (3, long)])
    assert cut[-1] == (4, first)  # one record: not cut, and the smallest run goes last
    assert [len(run) for _, run in cut[:-1]] == [128, 64, 32, 16, 16]
    assert [item for _, run in cut[:-1] for item in run] == long and {fd for fd, _ in cut[:-1]} == {3}
    # the last runs holding IO_DEPTH full runs' bytes are cut (their reads end together), largest
    # part first; the runs before them are not, and a short remainder after them goes last
    again = [(i + 300, loc) for i, loc in long]
    rest = [(999, Loc(7, 0, 65536, 0, b"", True))]
    more = _tapered([(5, long), *([(6, again)] * IO_DEPTH), (8, rest)])
    assert more[0] == (5, long)
    assert [len(run) for _, run in more[1:-1]] == [n for n in (128, 64, 32, 16, 16) for _ in range(IO_DEPTH)]
    assert more[-1] == (8, rest)
    assert sorted(item for _, run in more for item in run) == sorted([*long, *again * IO_DEPTH, *rest])


def test_the_mirror_is_a_bounded_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mirror of the index holds at most ``MIRROR_MAX`` entries however much one process
    writes and reads; what it forgot is asked of the index, so every answer stays exact, also
    after another process deleted blocks."""
    monkeypatch.setattr(nvme_state, "MIRROR_MAX", 64)
    keys = new_keys(120, seed=17)  # 480 layer-blocks
    tier = open_tier(tmp_path)
    other = open_tier(tmp_path)
    try:
        for i in range(0, len(keys), 10):
            assert all(tier.write(items_of(keys[i : i + 10])))
            assert len(tier._mirror) <= 64
        assert_exact(tier, keys)
        assert len(tier._mirror) <= 64
        other.delete(ids_of(keys[:5]))  # another process deletes blocks cached here
        assert tier.contains(ids_of(keys[:6])) == [False] * 20 + [True] * 4
        assert sorted(tier.scan()) == sorted((bid, NB) for bid in ids_of(keys[5:]))
        assert tier.stats()["mirror_blocks"] <= 64
    finally:
        tier.close()
        other.close()


def assert_mirror_consistent(tier: NVMeTier) -> None:
    """Each mirrored key is a member of its entry's segment and of no other one."""
    members = {key: seg for seg, keys in tier._by_seg.items() for key in keys}
    assert sum(len(keys) for keys in tier._by_seg.values()) == len(members)  # in one segment each
    assert members == {key: fields[0] for key, fields in tier._mirror.items()}


def test_a_write_mirrors_its_entries_by_segment(tmp_path: Path) -> None:
    """A write's entries go into the mirror in bulk: a batch that spans segments, rewrites keys
    written before (in another segment) and names a key twice leaves every mirrored key in its
    own segment's members only, the last of a repeated key winning, as reads find on disk."""
    tier = open_tier(tmp_path, segment_size=SEG16)
    try:
        keys = new_keys(10, seed=31)
        assert all(tier.write(items_of(keys[:4])))
        assert_mirror_consistent(tier)
        items = items_of(keys[2:10])  # keys 2-3 rewritten, 8 keys x 4 layers over several segments
        twice = items[0][0]
        items.append((twice, block_bytes(b"\x07" * 16, 0)))  # the same block again, other bytes
        assert all(tier.write(items))
        assert len({tier._mirror[key][0] for key in tier._mirror}) >= 2
        assert_mirror_consistent(tier)
        status, bufs = read_back(tier, [twice])
        assert status == [ReadStatus.OK]
        np.testing.assert_array_equal(bufs[0], block_bytes(b"\x07" * 16, 0))
        assert_exact(tier, [k for k in keys if k != twice[0]][:1] + keys[3:10])
    finally:
        tier.close()


def test_the_mirror_leaves_the_garbage_collector_alone(tier: NVMeTier) -> None:
    """The collector does not track the mirror's entries: up to a million of them would otherwise
    be walked by every full collection (188 ms for 1M Locs, on whichever thread allocated, holding
    the GIL). With the extension they are untracked as they go in (a write's are its Locs, a
    read's plain tuples); without it they are plain tuples, which the collector's first pass
    untracks."""
    import gc

    from kvstrata.core import native

    keys = new_keys(8, seed=23)
    assert all(tier.write(items_of(keys)))
    if native.NATIVE is not None:
        assert len(tier._mirror) == 8 * len(LAYERS)
        assert not any(gc.is_tracked(v) for v in tier._mirror.values())
    assert_exact(tier, keys)  # a read refreshes the mirror too
    assert len(tier._mirror) == 8 * len(LAYERS)
    gc.collect()
    assert not any(gc.is_tracked(v) for v in tier._mirror.values())
    assert all(isinstance(v, tuple) for v in tier._mirror.values())


def test_open_and_contains_start_no_thread_and_load_no_mirror(tmp_path: Path) -> None:
    """A tier opened only to ask ``contains`` (vLLM's scheduler probing) stays light: no I/O
    thread starts and the in-memory mirror of the index is not loaded; the shared LMDB index
    answers. Reads and scans do not load it whole either: a read caches what it asked for, a
    scan reads the index."""
    keys = new_keys(300, seed=7)
    writer = open_tier(tmp_path)
    for i in range(0, len(keys), 50):
        assert all(writer.write(items_of(keys[i : i + 50])))
    writer.close()
    missing = new_keys(20, seed=8)
    threads, count = set(threading.enumerate()), threading.active_count()
    probe = open_tier(tmp_path)
    try:
        assert probe.contains(ids_of(keys[:40])) == [True] * 160
        assert probe.contains(ids_of(missing)) == [False] * 80
        assert probe.contains([(keys[299], 3), (missing[0], 0), (keys[0], 1)]) == [True, False, True]
        assert set(threading.enumerate()) - threads == set()
        assert threading.active_count() <= count
        assert len(probe._mirror) <= 41 * 4  # only what contains() asked the index, never all 1200 records
        assert_exact(probe, keys[100:300])  # a read (which may start the I/O threads)...
        assert len(probe._mirror) <= 41 * 4 + 200 * 4  # ...caches the entries it read, not all 1200
        assert sorted(probe.scan()) == sorted((bid, NB) for bid in ids_of(keys))
        assert len(probe._mirror) <= 41 * 4 + 200 * 4
    finally:
        probe.close()
    assert not any(t.name.startswith("kvstrata-nvme-") for t in set(threading.enumerate()) - threads)


def test_second_instance_shares_the_directory(tmp_path: Path) -> None:
    a = open_tier(tmp_path)
    b = open_tier(tmp_path)  # another "process": own writer id, own segments
    ka, kb = new_keys(4, seed=1), new_keys(4, seed=2)
    assert all(a.write(items_of(ka)))
    assert all(b.write(items_of(kb)))
    assert_exact(b, ka)  # found through the shared index although b opened before a wrote
    assert_exact(a, kb)
    names = {p.name.rsplit("-", 1)[0] for p in segment_files(a)}
    assert len(names) == 2  # one writer id each
    a.close()
    b.close()
    c = open_tier(tmp_path)
    assert {bid for bid, _ in c.scan()} == set(ids_of(ka + kb))
    assert_exact(c, ka + kb)
    c.close()


def test_a_stale_full_view_is_rechecked_before_it_says_no_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon (here: ``b``) frees segments; the writer ``a`` must see the room at once
    instead of evicting its own blocks for space its cached view still counts as used."""
    import kvstrata.tiers.nvme.state as nvme_state
    import kvstrata.tiers.nvme.tier as nvme_tier

    monkeypatch.setattr(nvme_state, "RESCAN_S", 3600.0)  # a's cached view never ages out by itself
    monkeypatch.setattr(nvme_tier, "FRESH_S", 0.0)  # however soon after a's last look b frees space
    cap = 40 * NB
    a = open_tier(tmp_path, capacity=cap, segment_size=8 * NB)
    b = open_tier(tmp_path, capacity=cap, segment_size=8 * NB)
    try:
        keys = new_keys(32 // len(LAYERS), seed=3)
        assert all(b.write(items_of(keys)))
        b.close()  # seals b's segments
        b = open_tier(tmp_path, capacity=cap, segment_size=8 * NB)
        a.refresh_used()  # a sees b's segments: the tier is nearly full
        sizes = [NB] * 16
        assert a.used_bytes + 16 * NB > cap
        assert all(b.delete_at(b.records()))
        b.compact()
        assert b.refresh_used() + 16 * NB <= cap  # the bytes really left the disk
        assert a.has_room(sizes, 0)
        assert a.used_bytes == b.refresh_used()
    finally:
        a.close()
        b.close()


def test_other_namespace_gets_its_own_directory(tmp_path: Path, tier: NVMeTier) -> None:
    assert all(tier.write(items_of(new_keys(2))))
    other_ns = Namespace(NS.model, NS.kv_dtype, NS.layout_fingerprint, NS.block_size, tp_rank=1, tp_size=2)
    other = open_tier(tmp_path, ctx=TierContext(LAYOUT, other_ns))
    assert other.root != tier.root
    assert list(other.scan()) == []
    other.close()


def test_meta_mismatch_is_refused(tmp_path: Path) -> None:
    t = open_tier(tmp_path)
    meta_path = Path(t.root, "meta.json")
    t.close()
    meta = json.loads(meta_path.read_text())
    assert meta["namespace"] == NS.canonical() and meta["layout"] == json.loads(json.dumps(LAYOUT.to_dict()))
    meta["layout"]["block_size"] = 32
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(LayoutMismatchError, match=r"meta\.json"):
        open_tier(tmp_path)


def test_other_format_version_is_refused(tmp_path: Path) -> None:
    """Format 1 put every record in its own 4096-byte slot; its data must not be read as packed."""
    t = open_tier(tmp_path)
    meta_path = Path(t.root, "meta.json")
    t.close()
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == FORMAT_VERSION == 3
    meta["format"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(LayoutMismatchError, match=r"on-disk format 1, this engine reads format 3 .*upgrades format 2"):
        open_tier(tmp_path)


# -- space: deletes, compaction, has_room ---------------------------------------------------------


def test_delete_and_compaction_reclaim_space(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, segment_size=SEG16, compact_threshold=0.5)
    keys = new_keys(40)
    for i in range(0, 40, 4):  # 4 keys x 4 layers = one full segment per batch
        assert all(tier.write(items_of(keys[i : i + 4])))
    assert len(segment_files(tier)) == 10
    full = tier.used_bytes
    assert full == 10 * SEG16
    doomed = [k for i, k in enumerate(keys) if i % 4]  # 3 of every 4 keys: each segment drops to 25% live
    tier.delete(ids_of(doomed))
    survivors = keys[::4]
    assert tier.used_bytes <= align_up(len(survivors) * 4 * REC) + SEG16  # live data plus at most one active segment
    assert_exact(tier, survivors)
    status, _ = read_back(tier, ids_of(doomed[:2]))
    assert set(status) == {ReadStatus.MISSING}
    assert tier.verify().ok
    tier.delete(ids_of(survivors))
    assert tier.used_bytes == 0
    assert segment_files(tier) == []
    tier.close()
    reopened = open_tier(tmp_path, segment_size=SEG16)
    assert list(reopened.scan()) == []
    reopened.close()


def test_has_room_loop_terminates(tmp_path: Path) -> None:
    capacity = 64 * NB
    tier = open_tier(tmp_path, capacity=capacity)  # segment size is capped at capacity // 8
    resident: list[bytes] = []
    for key in new_keys(100):
        sizes = [NB] * 4
        evictions = 0
        while not tier.has_room(sizes, 0):
            assert resident, "nothing left to evict but still no room"
            victim = resident.pop(0)
            tier.delete(ids_of([victim]))
            evictions += 1
        assert all(tier.write(items_of([key])))
        resident.append(key)
        assert tier.used_bytes <= capacity
    assert len(resident) >= 8
    assert_exact(tier, resident)
    tier.close()


# -- packing: small layer-blocks share pages ---------------------------------------------------------

KiB = 1024


def small_ctx(layout: KVLayout) -> TierContext:
    ns = Namespace(model=layout.model, kv_dtype="bfloat16", layout_fingerprint=layout.fingerprint(), block_size=16)
    return TierContext(layout, ns)


TINY = small_ctx(uniform_layout("tiny", num_layers=4, num_kv_heads=1, head_dim=16, block_size=16))  # 1 KiB blocks
ODD = small_ctx(  # layer-blocks of 400, 288 and 1000 bytes: not multiples of 64
    KVLayout(
        model="odd",
        block_size=4,
        layers=(
            LayerSpec("state", LayerKind.LINEAR, (100,), "float32"),
            LayerSpec("mla", LayerKind.MLA, (4, 36), "bfloat16"),
            LayerSpec("attn", LayerKind.FULL, (2, 4, 5, 25), "float8_e4m3fn"),
        ),
    )
)


def ctx_items(ctx: TierContext, keys: list[bytes]) -> list[tuple[BlockId, np.ndarray]]:
    n = ctx.layout.layer_nbytes
    return [
        ((k, layer), np.random.default_rng([*k, layer]).integers(0, 256, n(layer), dtype=np.uint8))
        for k in keys
        for layer in range(ctx.layout.num_layers)
    ]


def assert_ctx_exact(tier: NVMeTier, items: list[tuple[BlockId, np.ndarray]]) -> None:
    bufs = [np.zeros_like(data) for _, data in items]
    status = tier.read([(bid, buf) for (bid, _), buf in zip(items, bufs, strict=True)])
    assert status == [ReadStatus.OK] * len(items)
    for (_, data), buf in zip(items, bufs, strict=True):
        np.testing.assert_array_equal(buf, data)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_small_blocks_are_packed(tmp_path: Path, direct_io: str) -> None:
    """1 KiB layer-blocks (the ``tiny`` model) cost about their size on disk, not a 4 KiB page each."""
    assert TINY.layout.layer_nbytes(0) == KiB
    tier = open_tier(tmp_path, ctx=TINY, direct_io=direct_io)
    rng = random.Random(5)
    written: list[tuple[BlockId, np.ndarray]] = []
    batches = 0
    for i in range(60):
        batch = ctx_items(TINY, new_keys(rng.randint(1, 12), seed=100 + i))
        if i % 7 == 0:
            batch = batch[: rng.randint(1, 3)]  # a batch smaller than a page still takes one
        assert all(tier.write(batch))
        written += batch
        batches += 1
    data = len(written) * KiB
    assert tier.used_bytes <= 1.1 * data + 4096 * batches  # was 4x the data: one 4096-byte slot per record
    assert tier.used_bytes < 1.5 * data
    assert_ctx_exact(tier, written)
    assert_ctx_exact(tier, written[7::13])  # scattered single records, each in the middle of a page
    report = tier.verify()
    assert report.ok and report.blocks_checked == len(written) and report.orphan_bytes == 0
    tier.delete([bid for bid, _ in written[1::3]])
    survivors = [it for j, it in enumerate(written) if j % 3 != 1]
    assert_ctx_exact(tier, survivors)
    report = tier.verify()
    assert report.ok and 0 < report.orphan_bytes <= (len(written) - len(survivors)) * KiB
    tier.close()
    reopened = open_tier(tmp_path, ctx=TINY, direct_io=direct_io)
    assert_ctx_exact(reopened, survivors)
    reopened.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_odd_sized_records_round_trip_and_compact(tmp_path: Path, direct_io: str) -> None:
    """Records whose sizes are not multiples of 64 (or of each other) survive reads, compaction and reopening."""
    sizes = [ODD.layout.layer_nbytes(layer) for layer in range(3)]
    assert sizes == [400, 288, 1000]
    tier = open_tier(tmp_path, ctx=ODD, direct_io=direct_io, segment_size=8 * KiB, compact_threshold=0.6)
    keys = new_keys(40, seed=3)
    items = ctx_items(ODD, keys)
    for i in range(0, 40, 5):
        assert all(tier.write(items[3 * i : 3 * (i + 5)]))
    # records rounded up to 64 bytes; a pad at the end of every batch and every segment
    assert tier.used_bytes <= 1.2 * sum(sizes) * 40 + 2 * 4096 * 8
    assert_ctx_exact(tier, items)
    doomed = {k for j, k in enumerate(keys) if j % 4}
    tier.delete([bid for bid, _ in items if bid[0] in doomed])  # sealed segments fall below 60% live: compacted
    survivors = [it for it in items if it[0][0] not in doomed]
    assert_ctx_exact(tier, survivors)
    assert tier.used_bytes <= 2 * sum(sizes) * 10 + 3 * 8 * KiB
    assert tier.verify().ok
    tier.close()
    reopened = open_tier(tmp_path, ctx=ODD, direct_io=direct_io, segment_size=8 * KiB)
    assert sorted(reopened.scan()) == sorted((bid, data.size) for bid, data in survivors)
    assert_ctx_exact(reopened, survivors)
    assert reopened.verify().ok
    reopened.close()


def test_compaction_repacks_small_batches(tmp_path: Path) -> None:
    """One-record batches take a page each; compacting their segment packs the survivors densely."""
    tier = open_tier(tmp_path, ctx=TINY, segment_size=64 * KiB)
    items = ctx_items(TINY, new_keys(10, seed=6))  # 40 records of 1 KiB
    for item in items:
        assert tier.write([item]) == [True]
    assert tier.used_bytes == 40 * 4 * KiB  # 2 sealed segments of 16 pages, 8 pages in the active one
    tier.delete([items[0][0], items[16][0]])  # each sealed segment drops to 15 KiB live of 64: compacted
    assert tier.used_bytes == 8 * 4 * KiB + 2 * 16 * KiB  # 15 records of 1 KiB + 64 B -> one batch of 16 KiB
    assert len(segment_files(tier)) == 1
    assert_ctx_exact(tier, items[1:16] + items[17:])
    assert tier.verify().ok
    tier.close()


def test_has_room_counts_the_packed_layout(tmp_path: Path) -> None:
    """``has_room`` charges a batch what the append will cost: packed records, page pads, segment splits."""
    tier = open_tier(tmp_path, ctx=TINY, capacity=64 * KiB)  # segment size: capacity // 8 = 8 KiB
    assert tier.segment_size == 8 * KiB
    items = ctx_items(TINY, new_keys(16, seed=4))
    # a record takes 1 KiB and its 64-byte header: 7 fill a segment, 3 a page
    assert tier.has_room([KiB] * 56, 0)  # 8 segments of 7 records fill the capacity exactly
    assert not tier.has_room([KiB] * 57, 0)
    assert tier.write(items[:17]) == [True] * 17  # 7 + 7 + 3 records: 2 full segments and a padded page
    assert tier.used_bytes == 20 * KiB
    assert tier.has_room([KiB], 0)
    assert tier.has_room([KiB] * 3, 0)  # fills the active segment's 4 KiB
    assert tier.has_room([KiB] * 38, 0)  # 3 + 5 segments of 7: 44 KiB more, 64 in all
    assert not tier.has_room([KiB] * 39, 0)
    assert tier.write(items[17:21]) == [True] * 4  # 3 records close the segment, 1 opens a new one
    assert tier.used_bytes == 28 * KiB
    assert_ctx_exact(tier, items[:21])
    tier.close()


# -- checksums, verify, repair ---------------------------------------------------------------------


def test_flipped_byte_reads_corrupt_then_missing(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = new_keys(8)
    assert all(tier.write(items_of(keys)))
    tier.close()
    bad = (keys[3], 2)
    flip_byte_of(tier, block_bytes(*bad))
    tier = open_tier(tmp_path)
    ids = ids_of(keys)
    status, _ = read_back(tier, ids)
    assert status[ids.index(bad)] is ReadStatus.CORRUPT
    assert status.count(ReadStatus.OK) == len(ids) - 1
    assert tier.checksum_failures == 1
    assert read_back(tier, [bad])[0] == [ReadStatus.MISSING]  # quarantined
    assert bad not in dict(tier.scan())
    assert tier.verify().ok
    tier.close()


def test_verify_reports_and_repairs(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = new_keys(8)
    assert all(tier.write(items_of(keys)))
    bad = (keys[5], 0)
    flip_byte_of(tier, block_bytes(*bad))
    stray = Path(tier.root, "segments", "999-dead-000001.seg")
    stray.write_bytes(b"\0" * 8192)
    report = tier.verify()
    assert not report.ok
    assert (report.blocks_checked, report.bad_checksums, report.missing_data) == (32, 1, 0)
    assert report.orphan_bytes >= 8192
    assert any("checksum" in p for p in report.problems)
    assert stray.exists() and not report.repaired
    fixed = tier.verify(repair=True, grace_s=0)
    assert fixed.repaired and fixed.bad_checksums == 1
    assert not stray.exists()
    after = tier.verify()
    # the dropped record's bytes and header, less what the padding rule may give the record before it
    assert after.ok and after.blocks_checked == 31 and NB - ALIGN <= after.orphan_bytes <= REC
    assert read_back(tier, [bad])[0] == [ReadStatus.MISSING]
    assert_exact(tier, [k for k in keys if k != keys[5]][:3])
    tier.close()


def test_verify_repair_keeps_young_unknown_files(tmp_path: Path, tier: NVMeTier) -> None:
    young = Path(tier.root, "segments", "1-new-000001.seg")
    young.write_bytes(b"\0" * 4096)
    tier.verify(repair=True)  # default grace period: may belong to a writer starting up
    assert young.exists()


def test_missing_segment_file_is_missing_not_an_exception(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, segment_size=SEG16)
    keys = new_keys(8)
    for i in range(0, 8, 4):
        assert all(tier.write(items_of(keys[i : i + 4])))
    tier.close()
    segment_files(tier)[0].unlink()
    tier = open_tier(tmp_path, segment_size=SEG16)
    report = tier.verify()
    assert report.missing_data == 16 and not report.ok
    status, _ = read_back(tier, ids_of(keys))
    assert status.count(ReadStatus.MISSING) == 16 and status.count(ReadStatus.OK) == 16
    assert tier.verify().ok  # the lost entries were dropped on read
    tier.close()


def test_truncated_segment_reads_error_and_repair_drops(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = new_keys(4)
    assert all(tier.write(items_of(keys)))  # 16 records, packed in order into one segment
    tier.close()
    seg = segment_files(tier)[0]
    os.truncate(seg, 16 * NB - NB - 100)  # the last record is gone, the one before lost its tail
    tier = open_tier(tmp_path)
    ids = ids_of(keys)
    status, _ = read_back(tier, ids)
    assert status[-2:] == [ReadStatus.ERROR] * 2 and status[:-2] == [ReadStatus.OK] * 14
    report = tier.verify(repair=True)
    assert report.missing_data == 2 and report.bad_checksums == 0
    assert tier.verify().ok
    assert read_back(tier, ids[-2:])[0] == [ReadStatus.MISSING] * 2
    tier.close()


# -- configuration -------------------------------------------------------------------------------


def test_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    target = tmp_path / "plain-file"
    target.write_text("x")
    with pytest.raises(ConfigError, match="plain-file") as err:
        open_tier(target)
    assert err.value.field == "path"


def test_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    paths = [blocker / "sub", Path("/proc/kvstrata-test")]  # root ignores directory permissions
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        paths.append(locked)
    for path in paths:
        with pytest.raises(ConfigError) as err:
            open_tier(path)
        assert err.value.field == "path" and str(path) in str(err.value)


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_direct_io_modes(tmp_path: Path, mode: str) -> None:
    supported = probe_direct_io(str(tmp_path))
    if mode == "on" and not supported:
        with pytest.raises(ConfigError, match="O_DIRECT"):
            open_tier(tmp_path, direct_io=mode)
        return
    tier = open_tier(tmp_path, direct_io=mode)
    assert tier.direct_io == (supported and mode != "off")
    keys = new_keys(6)
    assert all(tier.write(items_of(keys)))
    assert_exact(tier, keys)
    tier.close()


def test_options_parse_sizes_and_expand_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KV_TEST_DIR", "cache")
    opts = NVMeOptions(path="~/$KV_TEST_DIR/nvme", segment_size="1MiB", lmdb_map_size=1 << 30)  # type: ignore[arg-type]
    assert opts.segment_size == 1 << 20 and opts.fsync and opts.direct_io == "auto"
    tier = NVMeTier("nvme", GiB, opts, CTX)
    assert tier.root.startswith(str(tmp_path / "cache" / "nvme"))
    tier.close()
    with pytest.raises(ValueError):
        NVMeOptions(path="x", compact_threshold=1.5)


# -- concurrency ----------------------------------------------------------------------------------


def test_threads_read_write_delete_concurrently(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, segment_size=24 * NB, compact_threshold=0.6)
    stable = new_keys(8, seed=99)
    assert all(tier.write(items_of(stable)))
    errors: list[str] = []

    def worker(w: int) -> None:
        rng = random.Random(w)
        mine: list[bytes] = []
        try:
            for step in range(25):
                batch = new_keys(3, seed=1000 * (w + 1) + step)
                if not all(tier.write(items_of(batch))):
                    errors.append(f"write failed in {w}")
                mine += batch
                if len(mine) > 6:
                    gone = [mine.pop(rng.randrange(len(mine))) for _ in range(3)]
                    tier.delete(ids_of(gone))
                for keys in (rng.sample(mine, min(4, len(mine))), rng.sample(stable, 3)):
                    status, bufs = read_back(tier, ids_of(keys))
                    for bid, st, buf in zip(ids_of(keys), status, bufs, strict=True):
                        if st is not ReadStatus.OK or not np.array_equal(buf, block_bytes(*bid)):
                            errors.append(f"{w}: {bid[0].hex()}/{bid[1]} {st}")
        except Exception as exc:  # surfaced below
            errors.append(f"{w}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.checksum_failures == 0
    assert tier.verify().ok
    tier.close()


def test_a_write_into_a_reclaimed_segment_is_not_acknowledged(tmp_path: Path) -> None:
    """The index never points into an unregistered segment (a sweep may delete its file):
    if the active segment is reclaimed under its writer, the write reports failure."""
    tier = open_tier(tmp_path)
    gone = new_keys(1, seed=1)
    assert all(tier.write(items_of(gone)))
    index = SegmentIndex(os.path.join(tier.root, "index.lmdb"), GiB)  # as another process would
    (seg,) = index.segments()
    index.drop([block_key(bid) for bid in ids_of(gone)])
    assert index.forget_segment(seg)  # empty now: reclaimed while the tier still appends to it
    later = new_keys(2, seed=2)
    assert tier.write(items_of(later)) == [False] * 8
    assert tier.contains(ids_of(later)) == [False] * 8
    assert tier.verify().ok
    index.close()
    tier.close()


# -- crash consistency ------------------------------------------------------------------------------

CHILD = ORACLE + textwrap.dedent(
    """
    import random, sys
    from kvstrata.tiers.nvme import NVMeOptions, NVMeTier

    ctx = CTXS[sys.argv[3]]
    nb = ctx.layout.layer_nbytes(0)
    tier = NVMeTier("nvme", 1 << 30, NVMeOptions(path=sys.argv[1], segment_size=40 * nb), ctx)
    rng = random.Random(int(sys.argv[2]))
    mine = []
    while True:
        keys = [rng.randbytes(16) for _ in range(rng.randint(1, 6))]
        ok = tier.write([((k, l), block_bytes(k, l, nb)) for k in keys for l in range(4)])
        assert all(ok)
        print("W", *(k.hex() for k in keys), flush=True)
        mine += keys
        if len(mine) > 12 and rng.random() < 0.4:
            gone = [mine.pop(rng.randrange(len(mine))) for _ in range(8)]
            print("d", *(k.hex() for k in gone), flush=True)
            tier.delete([(k, l) for k in gone for l in range(4)])
    """
)


def _acked(stdout: str) -> tuple[set[bytes], set[bytes]]:
    """Keys whose write returned, and keys that a delete was started for (complete lines only)."""
    written: set[bytes] = set()
    deleting: set[bytes] = set()
    for line in stdout.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        kind, *hexes = line.split()
        (written if kind == "W" else deleting).update(bytes.fromhex(h) for h in hexes)
    return written, deleting


def _spawn(path: Path, seed: int, geometry: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(seed), geometry],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()  # the first acknowledged write: the child is up


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The rest of a killed child's stdout, and its stderr.

    Read through the same buffered readers as the first line: ``communicate`` reads the raw
    pipes and would skip whatever ``readline`` had already buffered past the first line (a
    lost ``d`` line made deleted blocks look acknowledged, then MISSING)."""
    assert proc.stdout is not None and proc.stderr is not None
    with proc:  # closes the pipes and waits
        return proc.stdout.read(), proc.stderr.read()


@pytest.mark.slow
@pytest.mark.parametrize("geometry", ["8k", "400b"])
def test_kill9_mid_write_loses_nothing_acknowledged(tmp_path: Path, geometry: str) -> None:
    """Two writer processes share the directory; each round both are killed at random moments.

    With 400-byte records, batches share no page but records inside one do, and the
    40-record segments split most batches: torn tails must never reach acknowledged data."""
    ctx = CTXS[geometry]
    nb = ctx.layout.layer_nbytes(0)
    rng = random.Random(7)
    expected: set[bytes] = set()
    for round_ in range(10):
        children = [_spawn(tmp_path, 2 * round_ + i, geometry) for i in range(2)]
        for proc, _ in children:
            time.sleep(rng.uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
        for proc, first in children:
            rest, err = _finish(proc)
            assert proc.returncode == -signal.SIGKILL, err
            written, deleting = _acked(first + rest)
            expected = (expected | written) - deleting
        tier = open_tier(tmp_path, segment_size=40 * nb, ctx=ctx)
        assert_ctx_exact(tier, [((k, layer), block_bytes(k, layer, nb)) for k in sorted(expected) for layer in LAYERS])
        report = tier.verify()
        assert report.bad_checksums == 0 and report.missing_data == 0, report.problems
        tier.close()
    assert len(expected) > 50


def test_finish_keeps_the_lines_readline_buffered() -> None:
    """Regression: the kill test lost ``d`` lines that arrived with the first ``W`` line, so
    blocks deleted before the kill were expected to be present and read back MISSING."""
    script = "import os, time; os.write(1, b'W 01\\nd 01\\nW 02\\n'); time.sleep(60)"  # one pipe write
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # reads all three lines, returns one
    proc.send_signal(signal.SIGKILL)
    rest, _ = _finish(proc)
    assert _acked(first + rest) == ({b"\x01", b"\x02"}, {b"\x01"})


def test_rewrites_reclaim_the_replaced_records(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, segment_size=16 * NB)
    keys = new_keys(4)
    for _ in range(20):  # each round fills a segment and empties the previous one
        assert all(tier.write(items_of(keys)))
    assert tier.used_bytes <= 2 * 16 * NB
    assert_exact(tier, keys)
    assert tier.verify().ok
    tier.close()


def test_a_one_call_read_of_a_few_mib_overlaps_its_reads(tier: NVMeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's layer-wise load is one tier call of a few MiB: it is read in several runs on
    more than one thread (one 8 MiB pread before), into destinations 16 bytes into a page (a
    ``malloc``-ed array's offset, the case ``copy_staged`` copies by a cast), every byte exact."""
    from kvstrata.tiers.nvme import reader

    keys = new_keys(256, seed=7)  # 256 keys x 4 layers x 8 KiB: 8 MiB
    assert tier.write(items_of(keys)) == [True] * (256 * 4)
    seen: list[tuple[int, int]] = []
    real = reader.pread_or_error

    def counted(fd: int, out: np.ndarray, offset: int) -> int:
        seen.append((offset, threading.get_ident()))
        return real(fd, out, offset)

    monkeypatch.setattr(reader, "pread_or_error", counted)
    tier._native_reads = False  # the pipeline's reads (the extension's: test_nvme_native_reads.py)
    ids = ids_of(keys)
    pages = np.zeros(len(ids) * NB + ALIGN + 16, dtype=np.uint8)
    start = (-pages.ctypes.data) % ALIGN + 16
    bufs = [pages[start + i * NB : start + (i + 1) * NB] for i in range(len(ids))]
    assert tier.read(list(zip(ids, bufs, strict=True))) == [ReadStatus.OK] * len(ids)
    for bid, buf in zip(ids, bufs, strict=True):
        np.testing.assert_array_equal(buf, block_bytes(*bid))
    assert len(seen) >= 3
    assert len({thread for _, thread in seen}) >= 2


@pytest.mark.parametrize("tag", [b"", bytes(range(24))])
@pytest.mark.parametrize("framed", [True, False])
def test_an_index_entry_decodes_to_what_was_encoded(tag: bytes, framed: bool) -> None:
    from kvstrata.tiers.segments import Loc

    loc = Loc(7, (1 << 40) + 64, 65536, (1 << 64) - 3, tag, framed)
    raw = loc.pack()
    assert len(raw) == 24 + (1 if framed else 0) + len(tag)
    back = Loc.unpack(raw)
    assert back == loc and type(back) is Loc and back.extent == loc.extent and back.framed is framed
