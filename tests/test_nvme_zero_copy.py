"""The nvme tier's zero-copy writes: records in memory that ``O_DIRECT`` takes as it is go to the
disk from there (one gathered write per chunk, the headers from a staging buffer), and land the
very bytes a staged write lands. Real files with ``O_DIRECT``, a real catalog layout (70B-class,
64 KiB layer-blocks, 80 layers: several 16 MiB chunks a batch)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.core import native
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.errors import ConfigError
from kvstrata.tiers import BlockId, ReadStatus, TierContext, fileio
from kvstrata.tiers.fileio import ALIGN, aligned_buffer, probe_direct_io, probe_memory_alignment
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.nvme import writer as nvme_writer

BIG = get_layout("llama-3.1-70b")  # 80 layers of 64 KiB layer-blocks
CTX = TierContext(BIG, Namespace(BIG.model, "bfloat16", BIG.fingerprint(), BIG.block_size))
NB = BIG.layer_nbytes(0)
GiB = 1 << 30

pytestmark = pytest.mark.skipif(native.NATIVE is None, reason="zero copy needs kvstrata._native")


def needs_direct_io(path: Path) -> None:
    if not probe_direct_io(str(path)):
        pytest.skip(f"{path} refuses O_DIRECT (tmpfs?): every write is staged there")


def keys_of(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def layer_arrays(keys: list[bytes], shift: int | None) -> dict[int, np.ndarray]:
    """Per layer a ``[keys, NB]`` array of each block's bytes; page-aligned rows (``shift`` None)
    or rows starting ``shift`` bytes past a page (malloc-like, not aligned for O_DIRECT)."""
    out = {}
    for layer in range(BIG.num_layers):
        raw = aligned_buffer(len(keys) * NB + ALIGN)
        arr = raw[shift or 0 : (shift or 0) + len(keys) * NB].reshape(len(keys), NB)
        for i, k in enumerate(keys):
            arr[i] = np.random.default_rng([*k, layer]).integers(0, 256, NB, dtype=np.uint8)
        out[layer] = arr
    return out


def items(keys: list[bytes], arrays: dict[int, np.ndarray]) -> list[tuple[BlockId, np.ndarray]]:
    return [((k, layer), arr[i]) for layer, arr in arrays.items() for i, k in enumerate(keys)]


def segment_bytes(tier: NVMeTier) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(tier.root, "segments").glob("*.seg")))


@pytest.fixture(autouse=True)
def zero_copy_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", "1")


def open_tier(path: Path) -> NVMeTier:
    return NVMeTier("nvme", GiB, NVMeOptions(path=str(path), direct_io="on"), CTX)


def read_all(tier: NVMeTier, keys: list[bytes]) -> tuple[list[ReadStatus], dict[int, np.ndarray]]:
    dst = {layer: np.zeros((len(keys), NB), np.uint8) for layer in range(BIG.num_layers)}
    return tier.read(items(keys, dst)), dst


def test_aligned_memory_is_written_without_staging_and_lands_the_bytes_a_staged_write_lands(tmp_path: Path) -> None:
    needs_direct_io(tmp_path)
    keys = keys_of(4, seed=1)  # 320 records of 64 KiB: 20 MiB, two chunks
    aligned, shifted = layer_arrays(keys, None), layer_arrays(keys, 4)
    direct, staged = open_tier(tmp_path / "a"), open_tier(tmp_path / "b")
    try:
        assert direct._mem_align in (8, 16, 64, 512, ALIGN)
        assert all(direct.write(items(keys, aligned)))
        assert all(staged.write(items(keys, shifted)))
        assert direct.stats()["zero_copy_records"] == 4 * BIG.num_layers
        assert staged.stats()["zero_copy_records"] == 0  # 4 bytes past a page: no device takes that
        assert segment_bytes(direct) == segment_bytes(staged)  # headers, payloads, padding: the same file
        for tier in (direct, staged):
            status, dst = read_all(tier, keys)
            assert status == [ReadStatus.OK] * len(status)
            assert all(np.array_equal(dst[layer], aligned[layer]) for layer in dst)
    finally:
        direct.close()
        staged.close()
    again = open_tier(tmp_path / "a")  # what was acknowledged is there for the next process
    try:
        status, dst = read_all(again, keys)
        assert status == [ReadStatus.OK] * len(status)
        assert all(np.array_equal(dst[layer], aligned[layer]) for layer in dst)
    finally:
        again.close()


def test_one_unaligned_record_stages_its_chunk_and_the_switch_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_direct_io(tmp_path)
    keys = keys_of(2, seed=2)
    arrays = layer_arrays(keys, None)
    odd = np.zeros(NB + 4, np.uint8)[4:]  # one record 4 bytes past its allocation
    odd[:] = arrays[3][1]
    batch = items(keys, arrays)
    batch = [(bid, odd if bid == (keys[1], 3) else buf) for bid, buf in batch]
    tier = open_tier(tmp_path / "a")
    try:
        assert all(tier.write(batch))  # 160 records, one chunk: staged whole
        assert tier.stats()["zero_copy_records"] == 0
        status, dst = read_all(tier, keys)
        assert status == [ReadStatus.OK] * len(status) and all(np.array_equal(dst[i], arrays[i]) for i in dst)
    finally:
        tier.close()
    for value in ("0", None):  # off, and off by default
        if value is None:
            monkeypatch.delenv("KVSTRATA_NVME_ZERO_COPY")
        else:
            monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", value)
        off = open_tier(tmp_path / f"b{value}")
        try:
            assert off._mem_align == 0
            assert all(off.write(items(keys, arrays)))
            assert off.stats()["zero_copy_records"] == 0
        finally:
            off.close()
    monkeypatch.setenv("KVSTRATA_NVME_ZERO_COPY", "yes")
    with pytest.raises(ConfigError, match="KVSTRATA_NVME_ZERO_COPY='yes'"):
        open_tier(tmp_path / "c")


def test_bytes_changed_during_a_zero_copy_write_read_back_corrupt_never_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum is taken from the caller's memory before the write: a caller that changes a
    record meanwhile leaves one that fails its check (a miss, counted), never one served wrong."""
    needs_direct_io(tmp_path)
    keys = keys_of(2, seed=3)
    arrays = layer_arrays(keys, None)
    plain = nvme_writer.pwritev_all

    def meddling(fd: int, addrs: np.ndarray, lengths: np.ndarray, offset: int) -> None:
        arrays[0][0, 100] ^= 0xFF  # the first record of the chunk, after its checksum was taken
        plain(fd, addrs, lengths, offset)

    monkeypatch.setattr(nvme_writer, "pwritev_all", meddling)
    tier = open_tier(tmp_path)
    try:
        assert all(tier.write(items(keys, arrays)))
        status, dst = read_all(tier, keys)
        bad = [i for i, st in enumerate(status) if st is not ReadStatus.OK]
        assert bad == [0] and status[0] is ReadStatus.CORRUPT  # (keys[0], layer 0)
        assert tier.stats()["checksum_failures"] == 1
        assert not dst[0][0].any()  # nothing delivered for it
    finally:
        tier.close()


def test_pwritev_all_writes_every_piece_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    pieces = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 5000, 200)]  # > 64 a call
    addrs = np.array([p.ctypes.data for p in pieces], np.uint64)
    lengths = np.array([p.nbytes for p in pieces], np.int64)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fileio.pwritev_all(fd, addrs, lengths, 123)
    finally:
        os.close(fd)
    assert path.read_bytes()[123:] == b"".join(p.tobytes() for p in pieces)
    with pytest.raises(OSError):
        fileio.pwritev_all(-1, addrs, lengths, 0)
    with pytest.raises(ValueError, match="200 addresses but 199 lengths"):
        fileio.pwritev_all(0, addrs, lengths[:-1], 0)


def test_hash_records_takes_arrays_spans_and_cpu_tensors() -> None:
    rng = np.random.default_rng(6)
    rows = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 64, 4096, 70001)]
    tensor = torch.arange(1000, dtype=torch.bfloat16)
    bufs: list[object] = [*rows, (rows[2].ctypes.data, rows[2].nbytes), tensor]
    lengths = [r.nbytes for r in rows] + [rows[2].nbytes, 2000]
    got = fileio.hash_records(bufs, lengths)  # type: ignore[arg-type]
    assert got is not None
    sums, addrs = got
    want = [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]
    want += [want[2], xxhash.xxh3_64_intdigest(tensor.view(torch.uint8).numpy().tobytes())]
    assert sums.tolist() == want
    assert addrs.tolist()[:5] == [r.ctypes.data for r in rows] + [rows[2].ctypes.data]
    assert fileio.hash_records(rows[:1], [2]) is None  # not a record of that size: staged, which reports it
    page = aligned_buffer(3 * ALIGN)
    assert fileio.hash_records([page[:ALIGN], page[ALIGN : 2 * ALIGN]], [ALIGN, ALIGN], ALIGN) is not None
    assert fileio.hash_records([page[:ALIGN], page[ALIGN + 64 : 2 * ALIGN + 64]], [ALIGN, ALIGN], ALIGN) is None
    with pytest.raises(ValueError, match="2 records but 1 lengths"):
        fileio.hash_records(rows[:2], [1])


def test_the_alignment_probe_finds_what_o_direct_takes(tmp_path: Path) -> None:
    needs_direct_io(tmp_path)
    align = probe_memory_alignment(str(tmp_path))
    assert align in (8, 16, 64, 512, ALIGN)
    page = aligned_buffer(2 * ALIGN)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        assert os.pwrite(fd, page[align : align + ALIGN].data, 0) == ALIGN
        if align > 8:
            with pytest.raises(OSError):
                os.pwrite(fd, page[align // 2 : align // 2 + ALIGN].data, 0)
    finally:
        os.close(fd)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".probe")]
