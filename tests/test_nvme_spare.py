"""The nvme tier's spare segment: made ahead by a write that rolls over, taken by the next
rollover (no new file, fsync and index transaction before that write's first ``pwrite``), removed
when unused at close, and swept by the next open after a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import uniform_layout
from kvstrata.tiers import ReadStatus, TierContext
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.nvme import writer as nvme_writer
from kvstrata.tiers.segments import RECORD_HEADER, align_up

LAYOUT = uniform_layout("spare", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
NS = Namespace(model="spare", kv_dtype="bfloat16", layout_fingerprint=LAYOUT.fingerprint(), block_size=16)
CTX = TierContext(LAYOUT, NS)
NB = LAYOUT.layer_nbytes(0)
SEG16 = align_up(16 * (NB + RECORD_HEADER))  # one batch of 4 keys x 4 layers fills a segment


def open_tier(path: Path) -> NVMeTier:
    return NVMeTier("nvme", 1 << 30, NVMeOptions(path=str(path), segment_size=SEG16), CTX)


def batch(i: int) -> list[tuple[tuple[bytes, int], np.ndarray]]:
    rng = np.random.default_rng(i)
    return [
        ((bytes([i, k]) * 8, layer), rng.integers(0, 256, NB, dtype=np.uint8)) for k in range(4) for layer in range(4)
    ]


def files(tier: NVMeTier) -> set[str]:
    return {p.name for p in Path(tier.segment_dir).glob("*.seg")}


def test_a_rollover_takes_the_spare_and_the_write_makes_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tmp_path)
    try:
        assert all(tier.write(batch(0)))  # the first segment: no spare yet (nothing was filled)
        assert tier._spare is None
        assert all(tier.write(batch(1)))  # fills the first, rolls over: the spare is made after
        spare = tier._spare
        assert spare is not None
        assert os.path.getsize(os.path.join(tier.segment_dir, spare.name)) == 0
        assert tier._index.segments()[spare.seg].live_count == 0  # registered, empty

        made_for_spare: list[bool] = []  # each segment made: for the spare (True) or for a reservation
        new_segment = nvme_writer.Appender._new_segment

        def spy(self: NVMeTier) -> object:
            made_for_spare.append(self._spare_wanted)
            return new_segment(self)

        monkeypatch.setattr(nvme_writer.Appender, "_new_segment", spy)
        items = batch(2)
        assert all(tier.write(items))  # rolls over into the spare
        assert {tier._mirror[key + layer.to_bytes(2, "big")][0] for (key, layer), _ in items} == {spare.seg}
        assert made_for_spare == [True]  # the reservation made none: one segment made, the next spare
        assert tier._spare is not None and tier._spare.seg != spare.seg
        out = [np.zeros(NB, dtype=np.uint8) for _ in items]
        assert tier.read([(bid, buf) for (bid, _), buf in zip(items, out, strict=True)]) == [ReadStatus.OK] * 16
        for (_, want), got in zip(items, out, strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        tier.close()


def test_the_spare_is_made_after_the_write_is_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the spare (a new file, a directory fsync, a synced index transaction) while the
    write's last chunks were on the disk waited ~15-20 ms for them in its fsyncs, and the write's
    index entries waited behind it: ~6% of a 512 MiB write (issue 16). The spare now comes after
    the write's commit, where it costs ~1 ms."""
    tier = open_tier(tmp_path)
    try:
        steps: list[str] = []
        putting = type(tier._index).putting
        make_spare = nvme_writer.Appender._make_spare

        def spy_putting(index: object, *a: object, **kw: object) -> object:
            steps.append("entries")
            return putting(index, *a, **kw)  # type: ignore[arg-type]

        def spy_spare(self: NVMeTier) -> None:
            steps.append("spare wanted" if self._spare_wanted else "no spare")
            make_spare(self)

        monkeypatch.setattr(type(tier._index), "putting", spy_putting)
        monkeypatch.setattr(nvme_writer.Appender, "_make_spare", spy_spare)
        monkeypatch.setattr(nvme_writer.os, "fdatasync", lambda fd: steps.append("sync"))
        assert all(tier.write(batch(0)))
        assert all(tier.write(batch(1)))  # fills the first segment, rolls over: a spare is wanted
        assert tier._spare is not None
        assert steps[-3:] == ["entries", "sync", "spare wanted"]
    finally:
        tier.close()


def test_close_removes_an_unused_spare(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    for i in range(3):
        assert all(tier.write(batch(i)))
    spare = tier._spare
    assert spare is not None and spare.name in files(tier)
    before = files(tier)
    tier.close()
    assert files(tier) == before - {spare.name}
    again = open_tier(tmp_path)
    try:
        assert spare.seg not in again._index.segments()
        assert sorted(bid for bid, _ in again.scan()) == sorted(bid for i in range(3) for bid, _ in batch(i))
    finally:
        again.close()


def test_a_spare_left_by_a_crash_is_swept_at_the_next_open(tmp_path: Path) -> None:
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_nvme_spare import batch, open_tier
        from pathlib import Path
        tier = open_tier(Path(sys.argv[1]))
        for i in range(3):
            assert all(tier.write(batch(i)))
        print(tier._spare.seg, tier._spare.name, flush=True)
        os._exit(0)  # no close: the spare stays registered, its flock goes with the process
        """
    )
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seg, name = out.stdout.split()
    tier = open_tier(tmp_path)
    try:
        assert name not in files(tier)
        assert int(seg) not in tier._index.segments()
        assert sorted(bid for bid, _ in tier.scan()) == sorted(bid for i in range(3) for bid, _ in batch(i))
    finally:
        tier.close()
