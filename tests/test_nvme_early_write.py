"""The first chunk of an nvme write goes to the disk in two parts: its first half as soon as it is
staged, the rest (with every header) after (``early_cut``, ``Pipeline.early``). Real files, a real
catalog layout (70B-class: 80 layers of 64 KiB layer-blocks); the bytes, a failure of the early
part, a rest that is not host memory, and where the cut falls."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.core import native
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Namespace
from kvstrata.errors import TierError
from kvstrata.tiers import BlockId, ReadStatus, TierContext
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier, lanes
from kvstrata.tiers.nvme import writer as nvme_writer
from kvstrata.tiers.nvme.writer import EARLY_MIN, early_cut
from kvstrata.tiers.segments import ALIGN, plan_batch

BIG = get_layout("llama-3.1-70b")
CTX = TierContext(BIG, Namespace(BIG.model, "bfloat16", BIG.fingerprint(), BIG.block_size))
NB = BIG.layer_nbytes(0)
GiB = 1 << 30
KEYS = [bytes([i + 1]) * 16 for i in range(6)]  # 480 records of 64 KiB: 30 MiB, two chunks

pytestmark = pytest.mark.skipif(native.NATIVE is None, reason="staging in one call needs kvstrata._native")


def open_tier(path: Path) -> NVMeTier:
    return NVMeTier("nvme", GiB, NVMeOptions(path=str(path)), CTX)


def batch(keys: list[bytes], seed: int) -> list[tuple[BlockId, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [((k, layer), rng.integers(0, 256, NB, dtype=np.uint8)) for layer in range(BIG.num_layers) for k in keys]


def read_back(tier: NVMeTier, items: list[tuple[BlockId, np.ndarray]]) -> list[ReadStatus]:
    out = [np.zeros(NB, dtype=np.uint8) for _ in items]
    status = tier.read([(bid, buf) for (bid, _), buf in zip(items, out, strict=True)])
    for (_, want), got, st in zip(items, out, status, strict=True):
        if st is ReadStatus.OK:
            np.testing.assert_array_equal(got, want)
    return status


class EarlySpy:
    """The early parts the pipeline was handed, and the pwrites that ran (offset, bytes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.early: list[int] = []
        self.writes: list[tuple[int, int]] = []
        early, pwrite = lanes.Pipeline.early, nvme_writer.pwrite_all

        def spy_early(pipe: Any, k: int, fn: Any) -> None:
            self.early.append(k)
            early(pipe, k, fn)

        def spy_pwrite(fd: int, data: Any, offset: int) -> None:
            self.writes.append((offset, len(data)))
            pwrite(fd, data, offset)

        monkeypatch.setattr(lanes.Pipeline, "early", spy_early)
        monkeypatch.setattr(nvme_writer, "pwrite_all", spy_pwrite)


def test_the_first_chunk_goes_in_two_parts_and_every_byte_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = EarlySpy(monkeypatch)
    tier = open_tier(tmp_path)
    try:
        items = batch(KEYS, 1)
        assert all(tier.write(items))
        layout = plan_batch([NB] * len(items), nvme_writer.CHUNK_BYTES)
        (_, hi, _, first_size), *rest = layout.chunks
        cut = layout.offsets[hi // 2]
        assert spy.early == [0]
        assert sorted(spy.writes) == sorted(
            [(0, cut), (cut, first_size - cut), *((base, size) for _, _, base, size in rest)]
        )
        assert read_back(tier, items) == [ReadStatus.OK] * len(items)
    finally:
        tier.close()


def test_a_failed_early_part_fails_the_write_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tmp_path)
    try:
        pwrite = nvme_writer.pwrite_all
        calls: list[tuple[int, int]] = []

        def early_fails(fd: int, data: Any, offset: int) -> None:
            calls.append((offset, len(data)))
            if offset == 0:  # the early part: the first chunk's first half, at the new segment's start
                raise OSError(errno.ENOSPC, "No space left on device")
            pwrite(fd, data, offset)

        monkeypatch.setattr(nvme_writer, "pwrite_all", early_fails)
        items = batch(KEYS, 2)
        with pytest.raises(TierError, match="No space left"):
            tier.write(items)
        layout = plan_batch([NB] * len(items), nvme_writer.CHUNK_BYTES)
        assert (0, layout.offsets[layout.chunks[0][1] // 2]) in calls  # the first half, not the chunk
        assert tier.contains([bid for bid, _ in items]) == [False] * len(items)
        monkeypatch.undo()
        assert all(tier.write(items))
        assert read_back(tier, items) == [ReadStatus.OK] * len(items)
    finally:
        tier.close()


def test_a_rest_that_is_not_host_memory_is_staged_record_by_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension refuses the rest of the first chunk (as it refuses device tensors) after its
    first half went early: the rest is copied record by record and every record is sealed from
    the staged bytes; every record reads back intact."""
    stage_in = nvme_writer.stage_in
    calls: list[int] = []

    def rest_refused(stage: Any, positions: Any, bufs: Any, lengths: Any, checksums: bool) -> Any:
        calls.append(len(positions))
        return None if len(calls) == 2 else stage_in(stage, positions, bufs, lengths, checksums)

    monkeypatch.setattr(nvme_writer, "stage_in", rest_refused)
    spy = EarlySpy(monkeypatch)
    tier = open_tier(tmp_path)
    try:
        items = batch(KEYS, 3)
        assert all(tier.write(items))
        assert spy.early == [0] and len(calls) >= 2
        assert read_back(tier, items) == [ReadStatus.OK] * len(items)
        assert tier.stats()["checksum_failures"] == 0
    finally:
        tier.close()


def test_where_the_cut_falls() -> None:
    pages = [i * 16 * ALIGN for i in range(256)]  # 64 KiB records: the middle one
    assert early_cut(pages, 256 * 16 * ALIGN) == 128
    small = [i * 16 * ALIGN for i in range(8)]  # 512 KiB in all: not worth a write of its own
    assert 4 * 16 * ALIGN < EARLY_MIN and early_cut(small, 8 * 16 * ALIGN) == 0
    odd = [i * 3 * 1024 for i in range(2048)]  # 3 KiB records: every fourth starts on a page
    j = early_cut(odd, 2048 * 3 * 1024)
    assert j >= 1024 and odd[j] % ALIGN == 0 and odd[j] >= EARLY_MIN and j - 1024 < 4
    unaligned = [i * 4104 for i in range(2200)]  # on a page every 512th: none of the 64 from the middle
    assert all(p % ALIGN for p in unaligned[1100:1164]) and early_cut(unaligned, 2200 * 4104) == 0
    assert early_cut([], 0) == 0 and early_cut([0], ALIGN) == 0
