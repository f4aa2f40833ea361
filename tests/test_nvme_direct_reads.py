"""The nvme tier's zero-copy reads (``KVSTRATA_NVME_ZERO_COPY=1``, with its zero-copy writes):
runs of records whose destinations are host memory that ``O_DIRECT`` takes as it is are read
straight there (one scattered read per run, the gaps between records into a staging buffer), and
each record's checksum is checked where it landed. Real files with ``O_DIRECT``, a real catalog
layout (70B-class: 80 layers of 64 KiB layer-blocks)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstrata.core import native
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.tiers import BlockId, ReadStatus, TierContext, fileio
from kvstrata.tiers.fileio import ALIGN, aligned_buffer, probe_direct_io
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier

BIG = get_layout("llama-3.1-70b")
CTX = TierContext(BIG, Namespace(BIG.model, "bfloat16", BIG.fingerprint(), BIG.block_size))
NB = BIG.layer_nbytes(0)
GiB = 1 << 30

pytestmark = pytest.mark.skipif(native.NATIVE is None, reason="zero-copy reads need kvstrata._native")


@pytest.fixture(autouse=True)
def zero_copy_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", "1")


def open_tier(path: Path, **extra: object) -> NVMeTier:
    if not probe_direct_io(str(path.parent)):
        pytest.skip(f"{path.parent} refuses O_DIRECT (tmpfs?): every read is staged there")
    return NVMeTier("nvme", GiB, NVMeOptions(path=str(path), direct_io="on", **extra), CTX)  # type: ignore[arg-type]


def arrays(keys: int, shift: int | None, seed: int) -> dict[int, np.ndarray]:
    """Per layer a ``[keys, NB]`` array: page-aligned rows (``shift`` None) or rows ``shift`` bytes
    past a page (as numpy's own allocations are)."""
    rng = np.random.default_rng(max(seed, 0))
    out = {}
    for layer in range(BIG.num_layers):
        raw = aligned_buffer(keys * NB + ALIGN)
        out[layer] = raw[shift or 0 : (shift or 0) + keys * NB].reshape(keys, NB)
        if seed >= 0:
            out[layer][:] = rng.integers(0, 256, (keys, NB), dtype=np.uint8)
    return out


def items(keys: list[bytes], arrs: dict[int, np.ndarray]) -> list[tuple[BlockId, np.ndarray]]:
    return [((k, layer), arr[i]) for layer, arr in arrs.items() for i, k in enumerate(keys)]


KEYS = [bytes([i]) * 16 for i in range(6)]  # 480 records of 64 KiB: 30 MiB, two segments' chunks


@pytest.fixture
def written(tmp_path: Path):  # type: ignore[no-untyped-def]
    src = arrays(len(KEYS), None, seed=1)
    tier = open_tier(tmp_path / "t")
    assert all(tier.write(items(KEYS, src)))
    yield tier, src
    tier.close()


def test_aligned_destinations_are_read_straight_into_and_get_the_bytes(written) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    assert tier._mem_align in (8, 16, 64, 512, ALIGN)
    dst = arrays(len(KEYS), None, seed=-1)
    status = tier.read(items(KEYS, dst))
    assert status == [ReadStatus.OK] * len(status)
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
    assert tier.stats()["zero_copy_reads"] == len(status)


def test_unaligned_destinations_are_staged_and_a_mixed_call_gets_every_record(written) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    shifted = arrays(len(KEYS), 4, seed=-1)  # 4 bytes past a page: no device takes that
    status = tier.read(items(KEYS, shifted))
    assert status == [ReadStatus.OK] * len(status)
    assert all(np.array_equal(shifted[layer], src[layer]) for layer in src)
    assert tier.stats()["zero_copy_reads"] == 0
    aligned = arrays(len(KEYS), None, seed=-1)
    half = BIG.num_layers // 2  # the first half of the layers aligned, the rest not
    mixed = [(bid, shifted[bid[1]][KEYS.index(bid[0])] if bid[1] >= half else buf) for bid, buf in items(KEYS, aligned)]
    for arr in shifted.values():
        arr[:] = 0
    status = tier.read(mixed)
    assert status == [ReadStatus.OK] * len(status)
    for layer in src:
        assert np.array_equal((shifted if layer >= half else aligned)[layer], src[layer])
    # the runs of aligned records alone (a run with one record of each kind is staged whole)
    assert len(status) // 4 < tier.stats()["zero_copy_reads"] <= len(status) // 2


def test_a_corrupt_record_read_straight_in_is_a_miss_and_the_rest_arrive(written) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    bad = next(iter(tier.records()))  # the first record written
    bid, loc = bad
    path = tier._segment_path(loc.seg)
    assert path is not None
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, loc.offset + 1000)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), loc.offset + 1000)
    finally:
        os.close(fd)
    dst = arrays(len(KEYS), None, seed=-1)
    batch = items(KEYS, dst)
    status = tier.read(batch)
    wrong = [i for i, st in enumerate(status) if st is not ReadStatus.OK]
    assert [batch[i][0] for i in wrong] == [bid] and status[wrong[0]] is ReadStatus.CORRUPT
    assert tier.stats()["checksum_failures"] == 1
    for i, (b, buf) in enumerate(batch):
        if i not in wrong:
            assert np.array_equal(buf, src[b[1]][KEYS.index(b[0])])
    assert tier.read([batch[wrong[0]]]) == [ReadStatus.MISSING]  # dropped from the index


def test_a_truncated_segment_reads_what_it_holds_and_the_rest_is_not_served(written) -> None:  # type: ignore[no-untyped-def]
    tier, src = written
    records = tier.records()
    seg = records[0][1].seg
    in_seg = [(bid, loc) for bid, loc in records if loc.seg == seg]
    cut = in_seg[len(in_seg) // 2][1].offset + 4096 + 100  # inside a record, not on a page
    path = tier._segment_path(seg)
    assert path is not None
    os.truncate(path, cut)
    dst = arrays(len(KEYS), None, seed=-1)
    batch = items(KEYS, dst)
    status = dict(zip([b for b, _ in batch], tier.read(batch), strict=True))
    for bid, loc in in_seg:
        whole = loc.offset + loc.length <= cut
        assert (status[bid] is ReadStatus.OK) == whole, (bid, loc, status[bid])
        if whole:
            assert np.array_equal(dst[bid[1]][KEYS.index(bid[0])], src[bid[1]][KEYS.index(bid[0])])
        else:
            assert status[bid] is ReadStatus.ERROR  # cut short: an I/O error, not damage to quarantine
    assert tier.stats()["checksum_failures"] == 0
    # the runs that came short were read again staged, and are not counted as read straight in
    assert tier.stats()["zero_copy_reads"] <= len(batch) - sum(1 for b, loc in in_seg if loc.offset >= cut)


def test_a_tier_with_a_secret_stages_its_reads(tmp_path: Path) -> None:
    src = arrays(2, None, seed=3)
    secret = tmp_path / "secret"
    secret.write_text("a deployment secret of enough bytes " * 2)
    os.chmod(secret, 0o600)
    tier = open_tier(tmp_path / "t", secret_file=str(secret))
    try:
        assert all(tier.write(items(KEYS[:2], src)))
        dst = arrays(2, None, seed=-1)
        status = tier.read(items(KEYS[:2], dst))
        assert status == [ReadStatus.OK] * len(status)
        assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
        assert tier.stats()["zero_copy_reads"] == 0  # its keyed tag is checked in staging
    finally:
        tier.close()


def test_reads_are_staged_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = arrays(2, None, seed=4)
    for value in ("0", None):  # off, and off by default
        if value is None:
            monkeypatch.delenv("KVSTRATA_NVME_ZERO_COPY")
        else:
            monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", value)
        tier = open_tier(tmp_path / f"t{value}")
        try:
            assert tier._mem_align == 0
            assert all(tier.write(items(KEYS[:2], src)))
            dst = arrays(2, None, seed=-1)
            assert tier.read(items(KEYS[:2], dst)) == [ReadStatus.OK] * 2 * BIG.num_layers
            assert all(np.array_equal(dst[layer], src[layer]) for layer in src)
            assert tier.stats()["zero_copy_reads"] == 0
        finally:
            tier.close()


def test_preadv_all_and_hash_at(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    sizes = rng.integers(1, 3000, 150)  # > 64 pieces a call
    pieces = [np.zeros(int(n), np.uint8) for n in sizes]
    addrs = np.array([p.ctypes.data for p in pieces], np.uint64)
    lengths = np.array([p.nbytes for p in pieces], np.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = fileio.preadv_all(fd, addrs, lengths, 77)
        assert got == int(lengths.sum())
        assert b"".join(p.tobytes() for p in pieces) == data.tobytes()[77 : 77 + got]
        assert fileio.preadv_all(fd, addrs, lengths, 300_000 - 1000) == 1000  # the file ends
        with pytest.raises(ValueError, match="150 addresses but 149 lengths"):
            fileio.preadv_all(fd, addrs, lengths[:-1], 0)
        nowhere = addrs.copy()
        nowhere[3] = 0
        with pytest.raises(ValueError, match=r"piece 3: length \d+ at address 0"):
            fileio.preadv_all(fd, nowhere, lengths, 0)
        with pytest.raises(ValueError, match=r"piece 3: length \d+ at address 0"):
            fileio.pwritev_all(fd, nowhere, lengths, 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        fileio.preadv_all(-1, addrs, lengths, 0)
    want = [xxhash.xxh3_64_intdigest(p.tobytes()) for p in pieces]
    assert fileio.hash_at(addrs, lengths).tolist() == want


def test_record_addresses_takes_writable_host_memory_of_its_length() -> None:
    page = aligned_buffer(3 * ALIGN)
    ro = np.frombuffer(bytes(ALIGN), np.uint8)
    bufs: list[object] = [page[:ALIGN], page[ALIGN + 512 : 2 * ALIGN + 512], page[:100], ro, (page.ctypes.data, ALIGN)]
    got = fileio.record_addresses(bufs, [ALIGN, ALIGN, ALIGN, ALIGN, ALIGN], 512)  # type: ignore[arg-type]
    assert got is not None
    base = page.ctypes.data
    assert got.tolist() == [base, base + ALIGN + 512, 0, 0, base]  # too short, read-only: not taken
    got = fileio.record_addresses(bufs[:2], [ALIGN, ALIGN], ALIGN)  # type: ignore[arg-type]
    assert got is not None and got.tolist() == [base, 0]
