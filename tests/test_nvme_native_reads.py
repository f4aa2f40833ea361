"""The nvme tier's staged reads through the extension's threads (``RunReader``, no GIL taken):
bytes, damage, truncation, destinations it cannot take, its switch, and the reader itself. Real
files, a real catalog layout (70B-class: 80 layers of 64 KiB layer-blocks)."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstrata.core import native
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.errors import ConfigError
from kvstrata.tiers import BlockId, ReadStatus, TierContext
from kvstrata.tiers.fileio import ALIGN, aligned_buffer
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.nvme import native_reads as nr
from kvstrata.tiers.nvme.options import HEAD_ITEMS, IO_DEPTH
from kvstrata.tiers.nvme.tier import read_cuts

BIG = get_layout("llama-3.1-70b")
CTX = TierContext(BIG, Namespace(BIG.model, "bfloat16", BIG.fingerprint(), BIG.block_size))
NB = BIG.layer_nbytes(0)
GiB = 1 << 30
KEYS = [bytes([i + 1]) * 16 for i in range(6)]  # 480 records of 64 KiB: 30 MiB

pytestmark = pytest.mark.skipif(native.NATIVE is None, reason="native reads need kvstrata._native")


def open_tier(path: Path, **extra: Any) -> NVMeTier:
    return NVMeTier("nvme", GiB, NVMeOptions(path=str(path), **extra), CTX)


def arrays(keys: int, seed: int) -> dict[int, np.ndarray]:
    """Per layer a ``[keys, NB]`` array of numpy's own (16 bytes into a page: no zero copy)."""
    rng = np.random.default_rng(max(seed, 0))
    return {
        layer: rng.integers(0, 256, (keys, NB), dtype=np.uint8) if seed >= 0 else np.zeros((keys, NB), np.uint8)
        for layer in range(BIG.num_layers)
    }


def items(keys: list[bytes], arrs: dict[int, np.ndarray]) -> list[tuple[BlockId, Any]]:
    return [((k, layer), arr[i]) for layer, arr in arrs.items() for i, k in enumerate(keys)]


class Spy:
    """Counts the runs the extension's threads read and the pipeline's runs (the fallback)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stats: list[tuple[int, int, int]] = []
        self.fallback: list[int] = []
        finish, init = nr.NativeRuns.finish, nr.NativeRuns.__init__
        spy = self

        def finished(runs: nr.NativeRuns) -> None:
            finish(runs)
            if runs.reader is not None:
                spy.stats.append(runs.reader.stats())

        def made(runs: nr.NativeRuns, *args: Any) -> None:
            init(runs, *args)
            plain = runs.fallback.feed

            def fed(work: Any) -> None:
                spy.fallback.append(sum(len(run) for _, run in work))
                plain(work)

            runs.fallback.feed = fed  # type: ignore[method-assign]

        monkeypatch.setattr(nr.NativeRuns, "finish", finished)
        monkeypatch.setattr(nr.NativeRuns, "__init__", made)

    @property
    def runs(self) -> int:
        return sum(s[0] for s in self.stats)


@pytest.fixture
def written(tmp_path: Path):  # type: ignore[no-untyped-def]
    src = arrays(len(KEYS), seed=1)
    tier = open_tier(tmp_path / "t")
    assert tier._native_reads
    assert all(tier.write(items(KEYS, src)))
    yield tier, src
    tier.close()


def test_the_extensions_threads_read_every_byte_with_reads_overlapped(written, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    spy = Spy(monkeypatch)
    dst = arrays(len(KEYS), seed=-1)
    status = tier.read(items(KEYS, dst))
    assert status == [ReadStatus.OK] * len(status)
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
    assert tier.stats()["native_reads"] == len(status) and not spy.fallback
    (done, most, threads), *_ = spy.stats
    assert done >= 3 and 2 <= most <= IO_DEPTH and threads >= 2  # several runs, reads in flight together


def test_a_damaged_record_is_corrupt_and_quarantined_the_others_are_served(written) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    (victim, loc), *_ = [(bid, loc) for bid, loc in tier.records() if bid == (KEYS[2], 7)]
    path = tier._segment_path(loc.seg)
    assert path is not None
    with open(path, "r+b") as f:  # one byte of its payload, flipped
        f.seek(loc.offset + 1000)
        byte = f.read(1)
        f.seek(loc.offset + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    dst = arrays(len(KEYS), seed=-1)
    status = tier.read(items(KEYS, dst))
    where = {bid: st for (bid, _), st in zip(items(KEYS, dst), status, strict=True)}
    assert where.pop(victim) is ReadStatus.CORRUPT
    assert set(where.values()) == {ReadStatus.OK}
    assert not dst[7][2].any()  # a corrupt record is never copied out
    assert np.array_equal(dst[8], src[8])
    assert tier.stats()["checksum_failures"] >= 1
    assert tier.read([(victim, np.zeros(NB, np.uint8))]) == [ReadStatus.MISSING]  # quarantined


def test_a_truncated_segment_reads_as_the_pipeline_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records past the end of a cut segment file come back short from the extension and are read
    again by the pipeline: the statuses are those the pipeline alone gives."""
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(nr.NATIVE_READS_ENV, switch)
        src = arrays(len(KEYS), seed=2)
        tier = open_tier(tmp_path / switch)
        assert tier._native_reads is (switch == "1")
        assert all(tier.write(items(KEYS, src)))
        locs = sorted(loc for _, loc in tier.records())
        last = locs[-1]
        path = tier._segment_path(last.seg)
        assert path is not None
        os.truncate(path, last.offset + NB // 2)  # the last record cut in half
        spy = Spy(monkeypatch)
        dst = arrays(len(KEYS), seed=-1)
        results[switch] = tier.read(items(KEYS, dst))
        assert (spy.fallback != []) is (switch == "1")  # the extension's short run went to the pipeline
        good = [i for i, st in enumerate(results[switch]) if st is ReadStatus.OK]
        assert len(good) >= len(results[switch]) - 64
        tier.close()
    assert results["1"] == results["0"]
    assert set(results["1"]) == {ReadStatus.OK, ReadStatus.ERROR}


def test_a_destination_it_cannot_take_goes_through_the_pipeline(written, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A strided view (not one span of host memory: an error on either path) sends its run to the
    pipeline, whose status it gets; the other runs are the extension's; every other byte arrives."""
    tier, src = written
    spy = Spy(monkeypatch)
    dst = arrays(len(KEYS), seed=-1)
    wide = np.zeros((NB, 2), np.uint8)
    batch = items(KEYS, dst)
    at = next(i for i, (bid, _) in enumerate(batch) if bid == (KEYS[0], 0))
    batch[at] = (batch[at][0], wide[:, 0])  # every other byte of a wider array
    status = tier.read(batch)
    assert status[at] is ReadStatus.ERROR and not wide.any()
    assert status[:at] + status[at + 1 :] == [ReadStatus.OK] * (len(batch) - 1)
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src if layer)
    assert np.array_equal(dst[0][1:], src[0][1:])
    assert 1 <= sum(spy.fallback) < len(batch) and spy.runs >= 1
    monkeypatch.setenv(nr.NATIVE_READS_ENV, "0")
    pipeline = open_tier(Path(tier.opts.path))
    assert pipeline.read([batch[at]]) == [ReadStatus.ERROR]
    pipeline.close()


def test_runs_larger_than_a_staging_buffer_go_through_the_pipeline(written, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvstrata.tiers.nvme import reader
    from kvstrata.tiers.nvme import tier as tier_module

    tier, src = written
    monkeypatch.setattr(reader, "run_bytes", lambda total: 1 << 30)  # a segment's records in one run,
    monkeypatch.setattr(reader, "_tapered", lambda work: work)  # not cut at its end,
    monkeypatch.setattr(tier_module, "HEAD_ITEMS", 1 << 20)  # in one part
    spy = Spy(monkeypatch)
    dst = arrays(len(KEYS), seed=-1)
    status = tier.read(items(KEYS, dst))
    assert status == [ReadStatus.OK] * len(status)
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
    assert sum(spy.fallback) > 0 and tier.stats()["native_reads"] + sum(spy.fallback) == len(status)


def test_the_switch_and_a_keyed_tier_keep_the_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nr.NATIVE_READS_ENV, "yes")
    with pytest.raises(ConfigError, match="KVSTRATA_NVME_NATIVE_READS='yes'"):
        open_tier(tmp_path / "bad")
    monkeypatch.setenv(nr.NATIVE_READS_ENV, "1")
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    keyed = open_tier(tmp_path / "keyed", secret_file=str(secret))
    assert not keyed._native_reads  # a keyed tag is checked in Python
    src = arrays(2, seed=3)
    assert all(keyed.write(items(KEYS[:2], src)))
    dst = arrays(2, seed=-1)
    assert set(keyed.read(items(KEYS[:2], dst))) == {ReadStatus.OK}
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
    assert keyed.stats()["native_reads"] == 0
    keyed.close()


def test_a_large_read_is_cut_into_doubling_parts() -> None:
    assert read_cuts(1) == [0, 1]
    assert read_cuts(2 * HEAD_ITEMS - 1) == [0, 2 * HEAD_ITEMS - 1]
    cuts = read_cuts(4096 + 100)
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    assert cuts[0] == 0 and cuts[-1] == 4196 and sizes[0] == HEAD_ITEMS
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes[1:-1]))  # doubling
    assert sizes[-1] < 2 * cuts[-2]


# ---- the extension's RunReader itself -----------------------------------------------------------


def reader(stages: list[np.ndarray], depth: int = 2) -> Any:
    assert native.NATIVE is not None
    return native.NATIVE.RunReader(np.array([s.ctypes.data for s in stages], np.uint64), len(stages[0]), depth)


def test_run_reader_statuses(tmp_path: Path) -> None:
    """Per record: copied (1), corrupt and never copied (2), past a short read (3), an I/O error (4)."""
    data = np.random.default_rng(4).integers(0, 256, 3 * ALIGN, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes()[: 2 * ALIGN + 100])  # the third page is cut short
    dst = np.zeros((4, ALIGN), np.uint8)
    sums = [xxhash.xxh3_64_intdigest(data[i * ALIGN : (i + 1) * ALIGN].tobytes()) for i in range(3)]
    stages = [aligned_buffer(4 * ALIGN) for _ in range(2)]
    fd = os.open(path, os.O_RDONLY)
    try:
        r = reader(stages)
        runs = np.array([[fd, 0, 3 * ALIGN, 3], [999_999, 0, ALIGN, 1]], np.int64)
        recs = np.array(
            [
                [0, ALIGN, sums[0], dst[0].ctypes.data],
                [ALIGN, ALIGN, sums[1] ^ 1, dst[1].ctypes.data],  # the wrong checksum: corrupt
                [2 * ALIGN, ALIGN, sums[2], dst[2].ctypes.data],  # past the end of the file
                [0, ALIGN, sums[0], dst[3].ctypes.data],  # a bad fd: an I/O error
            ],
            np.uint64,
        )
        r.feed(runs, recs)
        assert list(r.finish()) == [1, 2, 3, 4]
        assert r.stats()[0] == 2
    finally:
        os.close(fd)
    assert np.array_equal(dst[0], data[:ALIGN])
    assert not dst[1].any() and not dst[2].any() and not dst[3].any()


def test_run_reader_refuses_bad_runs_by_name(tmp_path: Path) -> None:
    stages = [aligned_buffer(ALIGN)]
    dst = np.zeros(ALIGN, np.uint8)
    r = reader(stages)
    rec = np.array([[0, ALIGN, 0, dst.ctypes.data]], np.uint64)
    with pytest.raises(
        ValueError, match=r"run 0 \(fd 3, offset 0, length 8192, 1 records\) is not a read of 1 to 4096"
    ):
        r.feed(np.array([[3, 0, 2 * ALIGN, 1]], np.int64), rec)
    with pytest.raises(ValueError, match=r"record 0 .* is not inside run 0"):
        r.feed(np.array([[3, ALIGN, ALIGN, 1]], np.int64), rec)
    with pytest.raises(ValueError, match="the runs hold 2 records, recs has 1"):
        r.feed(np.array([[3, 0, ALIGN, 2]], np.int64), rec)
    with pytest.raises(ValueError, match="staging buffer 1 has address 0"):
        native.NATIVE.RunReader(np.array([stages[0].ctypes.data, 0], np.uint64), ALIGN, 1)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"depth \(0\)"):
        reader(stages, depth=0)
    assert r.finish() == b""
    with pytest.raises(ValueError, match="has finished"):
        r.feed(np.zeros((0, 4), np.int64), np.zeros((0, 4), np.uint64))


def test_run_reader_keeps_to_its_depth_and_an_abandoned_one_stops(tmp_path: Path) -> None:
    size = 64 * ALIGN
    data = np.random.default_rng(5).integers(0, 256, 16 * size, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    dst = np.zeros((16, size), np.uint8)
    sums = [xxhash.xxh3_64_intdigest(data[i * size : (i + 1) * size].tobytes()) for i in range(16)]
    runs = np.array([[0, i * size, size, 1] for i in range(16)], np.int64)
    recs = np.array([[i * size, size, sums[i], dst[i].ctypes.data] for i in range(16)], np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        runs[:, 0] = fd
        stages = [aligned_buffer(size) for _ in range(4)]  # alive while the reader is
        r = reader(stages, depth=1)
        r.feed(runs[:8], recs[:8])
        r.feed(runs[8:], recs[8:])  # fed while the first ones are read
        assert set(r.finish()) == {1}
        done, most, threads = r.stats()
        assert done == 16 and most == 1 and 1 <= threads <= 4
        assert np.array_equal(dst.reshape(-1), data)
        stopped = threading.Event()

        def abandon() -> None:
            gone = reader(stages[:2])
            gone.feed(runs, recs)
            del gone  # dropped before finish(): its threads stop after the runs they hold, and are joined
            stopped.set()

        t = threading.Thread(target=abandon, daemon=True)
        t.start()
        t.join(10)
        assert stopped.is_set()
    finally:
        os.close(fd)


def test_zero_copy_reads_keep_their_runs_and_the_others_are_native(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With ``KVSTRATA_NVME_ZERO_COPY=1`` a run whose destinations are page-aligned memory is read
    straight into it (the pipeline's zero-copy read); the runs into numpy's own arrays are the
    extension's. Both land every byte."""
    from kvstrata.tiers.fileio import probe_direct_io

    if not probe_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): no zero-copy reads there")
    monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", "1")
    tier = open_tier(tmp_path / "zc", direct_io="on")
    assert tier._mem_align and tier._native_reads
    src = arrays(len(KEYS), seed=6)
    assert all(tier.write(items(KEYS, src)))
    aligned = {}
    for layer in range(BIG.num_layers // 2):  # the first half of the layers into page-aligned memory
        aligned[layer] = aligned_buffer(len(KEYS) * NB).reshape(len(KEYS), NB)
    dst = {**arrays(len(KEYS), seed=-1), **aligned}
    status = tier.read(items(KEYS, dst))
    assert status == [ReadStatus.OK] * len(status)
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
    stats = tier.stats()
    assert stats["zero_copy_reads"] > 0 and stats["native_reads"] > 0
    assert stats["zero_copy_reads"] + stats["native_reads"] == len(status)
    tier.close()
