"""The nvme tier under races and short reads: close() beside writes in flight, reads cut short
(NFS, FUSE, signals), a sweep beside new segments, verify beside live compaction, and a plain
verify that leaves the directory as it was."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# The oracle (layouts and block contents, also run by the child processes) and helpers of the nvme tier's tests.
from test_nvme_tier import NB, ORACLE, SEG16, block_bytes, ids_of, items_of, new_keys, open_tier

from kvstrata.engine.verify import verify_config
from kvstrata.errors import TierError
from kvstrata.tiers import BlockId, ReadStatus
from kvstrata.tiers.nvme import NVMeTier
from kvstrata.tiers.nvme import state as nvme_state
from kvstrata.tiers.nvme import writer as writer_module
from kvstrata.tiers.segments import SegmentIndex, block_key

GiB = 1 << 30


def exact(tier: NVMeTier, ids: list[BlockId]) -> list[bool]:
    """Per block: read back OK and byte-exact."""
    bufs = [np.zeros(NB, dtype=np.uint8) for _ in ids]
    status = tier.read(list(zip(ids, bufs, strict=True)))
    return [
        st is ReadStatus.OK and np.array_equal(buf, block_bytes(*bid))
        for bid, st, buf in zip(ids, status, bufs, strict=True)
    ]


def child_env() -> dict[str, str]:
    """A child process imports kvstrata from where this one does."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def segment_files(root: str, tier: NVMeTier | None = None) -> list[Path]:
    """The segment files under ``root``, less ``tier``'s spare (made ahead, empty)."""
    spare = tier._spare.name if tier is not None and tier._spare is not None else None
    return sorted(p for p in Path(root, "segments").glob("*.seg") if p.name != spare)


# -- close() beside writes in flight ----------------------------------------------------------------


@pytest.mark.parametrize("records", [1900, 2200], ids=["one-chunk-15MiB", "two-chunks-17MiB"])
def test_close_beside_a_write_in_flight_never_writes_into_another_file(tmp_path: Path, records: int) -> None:
    """close() lets the write finish (or fail): its pwrite never reaches a reused fd number, and
    a batch of two 16 MiB chunks never meets a shut-down thread pool (RuntimeError)."""
    marker = np.full(NB, 0xAB, np.uint8)  # KV bytes: unmistakable in an unrelated file
    for trial in range(8):
        path = tmp_path / f"t{trial}"
        tier = open_tier(path, direct_io="off")
        ids = [(key, 0) for key in new_keys(records, seed=trial)]
        outcome: list[object] = []

        def write(tier: NVMeTier = tier, ids: list[BlockId] = ids, outcome: list[object] = outcome) -> None:
            try:
                outcome.append(tier.write([(bid, marker) for bid in ids]))
            except Exception as exc:  # asserted below: only TierError is allowed
                outcome.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        while not segment_files(tier.root):  # the write has reserved its segment: it is in flight
            time.sleep(0)
        tier.close()
        unrelated = [os.open(tmp_path / f"unrelated-{trial}-{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(8)]
        writer.join()
        sizes = [os.fstat(fd).st_size for fd in unrelated]
        for fd in unrelated:
            os.close(fd)
        assert sizes == [0] * 8, f"trial {trial}: KV bytes landed in files opened after close()"
        (result,) = outcome
        assert isinstance(result, (list, TierError)), f"trial {trial}: {result!r}"
        with pytest.raises(TierError, match="closed"):
            tier.write([(ids[0], marker)])
        reopened = open_tier(path, direct_io="off")
        sample = ids[:: records // 16]
        bufs = [np.zeros(NB, np.uint8) for _ in sample]
        status = reopened.read(list(zip(sample, bufs, strict=True)))
        if isinstance(result, list) and all(result):  # acknowledged: durable and exact
            assert status == [ReadStatus.OK] * len(sample) and all(np.array_equal(b, marker) for b in bufs)
        assert reopened.verify().ok
        reopened.close()


def test_a_close_that_stops_waiting_leaves_the_release_to_the_last_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits only so long (here not at all); the write still running keeps its segment
    fd, and when it finishes it releases the files (the segment's flock with them)."""
    monkeypatch.setattr(nvme_state, "CLOSE_WAIT_S", 0.0, raising=False)  # (main had no such wait)
    tier = open_tier(tmp_path, direct_io="off")
    ids = [(key, 0) for key in new_keys(1900)]
    marker = np.full(NB, 0xCD, np.uint8)
    outcome: list[object] = []
    writer = threading.Thread(target=lambda: outcome.append(tier.write([(bid, marker) for bid in ids])))
    writer.start()
    while not segment_files(tier.root):
        time.sleep(0)
    tier.close()  # returns at once: the write is still in flight
    unrelated = os.open(tmp_path / "unrelated", os.O_RDWR | os.O_CREAT, 0o600)
    writer.join()
    assert os.fstat(unrelated).st_size == 0
    os.close(unrelated)
    assert outcome == [[True] * len(ids)]  # it finished normally: acknowledged
    (seg,) = segment_files(tier.root)
    fd = os.open(seg, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the last call (BlockingIOError if not)
    finally:
        os.close(fd)
    monkeypatch.undo()
    reopened = open_tier(tmp_path, direct_io="off")
    assert reopened.verify().ok and len(list(reopened.scan())) == len(ids)
    reopened.close()


# -- short reads ------------------------------------------------------------------------------------


def cut_reads(monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    """Every ``preadv`` moves at most ``cap`` bytes, as reads over NFS or FUSE, or interrupted by
    a signal, may (a real short read of a local file cannot be provoked); 0: reads return nothing."""
    real = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        (view,) = buffers
        return real(fd, [memoryview(view)[:cap]], offset) if cap else 0

    monkeypatch.setattr(os, "preadv", preadv)


def test_compaction_under_short_reads_keeps_every_intact_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tmp_path, direct_io="off", segment_size=SEG16, compact_threshold=0.5)
    keys = new_keys(40)
    for i in range(0, 40, 4):  # 4 keys x 4 layers = one full segment per batch
        assert all(tier.write(items_of(keys[i : i + 4])))
    sealed = set(segment_files(tier.root, tier))
    cut_reads(monkeypatch, 12345)  # not a multiple of 4 KiB: each read stops inside a record
    tier.delete(ids_of([k for i, k in enumerate(keys) if i % 4]))  # each segment 25% live: compacted
    survivors = ids_of(keys[::4])
    assert not sealed & set(segment_files(tier.root, tier))  # every sparse segment was compacted away
    assert exact(tier, survivors) == [True] * 40  # through short reads too
    monkeypatch.undo()
    assert exact(tier, survivors) == [True] * 40
    assert tier.verify().ok
    tier.close()


def test_verify_repair_under_short_reads_keeps_intact_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier(tmp_path, direct_io="off")
    keys = new_keys(8)
    assert all(tier.write(items_of(keys)))  # 32 layer-blocks, 256 KiB in one segment
    cut_reads(monkeypatch, 12345)
    report = tier.verify(repair=True)
    assert (report.missing_data, report.bad_checksums, report.blocks_checked) == (0, 0, 32), report.problems
    cut_reads(monkeypatch, 0)  # reads that return nothing while fstat says the file holds more
    stuck = tier.verify(repair=True)
    assert not stuck.ok and any("read failed" in p for p in stuck.problems)
    assert not any("truncated" in p for p in stuck.problems)
    monkeypatch.undo()
    assert exact(tier, ids_of(keys)) == [True] * 32  # repair dropped nothing it could not read
    assert tier.verify().ok
    tier.close()


def test_a_truly_truncated_segment_is_still_found_under_short_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tmp_path, direct_io="off")
    keys = new_keys(4)
    assert all(tier.write(items_of(keys)))  # 16 records in order
    os.truncate(segment_files(tier.root)[0], 16 * NB - NB - 100)  # the last record gone, one more cut
    cut_reads(monkeypatch, 12345)
    report = tier.verify(repair=True)
    assert report.missing_data == 2 and sum("truncated" in p for p in report.problems) == 2
    monkeypatch.undo()
    assert exact(tier, ids_of(keys)[:14]) == [True] * 14
    assert tier.verify().ok
    tier.close()


# -- a sweep (grace_s=0) beside new segments --------------------------------------------------------


SWEEPER = ORACLE + textwrap.dedent(
    """
    import sys
    from kvstrata.tiers.nvme import NVMeOptions, NVMeTier

    tier = NVMeTier("nvme", 1 << 30, NVMeOptions(path=sys.argv[1], direct_io="off"), CTX)
    print("ready", flush=True)
    while True:
        tier.verify(repair=True, grace_s=0)
    """
)


def test_a_sweep_with_no_grace_never_takes_a_new_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new segment is created, then locked, then registered. A sweep of unregistered files
    (``verify --repair`` with ``grace_s=0``) that runs in between finds it unregistered and
    unlocked and unlinks it: the writer must notice and make another, not append acknowledged
    records to an unlinked inode.

    First the sweep is placed in that window (by another tier on the directory, right after
    the create); then the race is left to the scheduler: a sweeping process in a loop while
    every write here starts a new segment (on main this part alone rarely hits the window)."""
    writer = open_tier(tmp_path, direct_io="off", segment_size=4 * NB)  # every batch: a new segment
    sweeper = open_tier(tmp_path, direct_io="off")
    real_open_new = writer_module.open_new
    swept: list[str] = []

    def open_new_then_sweep(path: str, flags: int, mode: int) -> int:
        fd = real_open_new(path, flags, mode)
        if path.endswith(".seg") and not swept:  # one sweep lands in the window, at the first new segment
            sweeper.verify(repair=True, grace_s=0)
            swept.append(path)
        return fd

    monkeypatch.setattr(writer_module, "open_new", open_new_then_sweep)
    keys = new_keys(1)
    assert all(writer.write(items_of(keys)))
    assert swept and not os.path.exists(swept[0])  # the sweep did unlink that file
    monkeypatch.undo()
    assert exact(writer, ids_of(keys)) == [True] * 4
    assert exact(sweeper, ids_of(keys)) == [True] * 4
    sweeper.close()

    child = subprocess.Popen(
        [sys.executable, "-c", SWEEPER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    acked = keys
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for step in range(60):
            batch = new_keys(1, seed=step + 1)
            assert all(writer.write(items_of(batch))), f"write {step}"
            acked += batch
            if len(acked) > 4:  # keep the index small: old segments die and are reclaimed
                writer.delete(ids_of(acked[:-4]))
                del acked[:-4]
            assert exact(writer, ids_of(acked)) == [True] * 4 * len(acked), f"write {step}"
        assert child.poll() is None, "the sweeper died"
    finally:
        child.kill()
        child.wait()
    assert writer.verify().ok
    writer.close()


# -- verify beside a live writer that compacts ------------------------------------------------------

CHURN = ORACLE + textwrap.dedent(
    """
    import random, sys
    from kvstrata.tiers.nvme import NVMeOptions, NVMeTier

    tier = NVMeTier("nvme", 1 << 30, NVMeOptions(path=sys.argv[1], segment_size=16 * NB, compact_threshold=0.6), CTX)
    rng = random.Random(int(sys.argv[2]))
    live = []
    step = 0
    while True:
        step += 1
        if step == 20:
            print("ready", flush=True)  # compaction has begun
        keys = [rng.randbytes(16) for _ in range(4)]
        assert all(tier.write([((k, l), block_bytes(k, l)) for k in keys for l in range(4)]))
        live += keys
        if len(live) > 64:  # delete a spread of old keys: sealed segments fall below 60% live and are compacted
            gone = [live.pop(rng.randrange(len(live))) for _ in range(8)]
            tier.delete([(k, l) for k in gone for l in range(4)])
    """
)


def test_verify_beside_live_compaction_reports_no_false_loss(tmp_path: Path) -> None:
    """``kvstrata verify`` (no repair) while another process writes, deletes and so compacts:
    records compaction moved after the check's snapshot are not reported lost."""
    open_tier(tmp_path, capacity=GiB).close()  # the namespace directory exists before the check lists it
    child = subprocess.Popen(
        [sys.executable, "-c", CHURN, str(tmp_path), "7"], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    config = {"tiers": [{"name": "nvme", "capacity": "1GiB", "path": str(tmp_path)}]}
    false_reports: list[str] = []
    checked = 0
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range(40):
            (report,) = verify_config(config)
            checked += report["blocks_checked"]
            if report["missing_data"] or report["bad_checksums"]:
                false_reports += report["problems"]
        assert child.poll() is None, "the writer died"
    finally:
        child.kill()
        child.wait()
    assert false_reports == [], f"{len(false_reports)} false reports, e.g. {false_reports[:3]}"
    assert checked > 0


# -- a plain verify changes nothing on disk ---------------------------------------------------------


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` and its content hash; LMDB's lock file (reader slots) excepted."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    } | {str(p.relative_to(root)) + "/": "dir" for p in root.rglob("*") if p.is_dir()}


def test_plain_verify_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, segment_size=SEG16)  # a batch of 4 keys fills a segment
    keys = new_keys(12)
    for i in range(0, 12, 4):
        assert all(tier.write(items_of(keys[i : i + 4])))
    root = tier.root
    tier.close()
    index = SegmentIndex(os.path.join(root, "index.lmdb"), GiB)  # another process empties the first segment
    index.drop([block_key(bid) for bid in ids_of(keys[:4])])
    index.close()
    old = time.time() - 3600  # well past the sweep's grace period
    stray = Path(root, "segments", "999-dead-000001.seg")  # a crashed writer's unregistered file
    stray.write_bytes(b"\0" * 8192)
    os.utime(stray, (old, old))
    config = {"tiers": [{"name": "nvme", "capacity": "1GiB", "path": str(tmp_path)}]}
    before = tree_digest(tmp_path)
    (report,) = verify_config(config, repair=False)
    assert tree_digest(tmp_path) == before
    assert report["ok"] and report["blocks_checked"] == 32 and report["orphan_bytes"] >= 8192 + 16 * NB
    (fixed,) = verify_config(config, repair=True)  # --repair does sweep
    assert fixed["repaired"] and not stray.exists() and len(segment_files(root)) == 2
