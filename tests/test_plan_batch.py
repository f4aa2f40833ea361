"""``plan_batch``: records of one length are laid out in closed form, exactly as the record-by-record
loop lays them out (offsets, chunks, size), with and without room, from any start."""

from __future__ import annotations

import numpy as np

from kvstrata.tiers import segments
from kvstrata.tiers.segments import plan_batch


def test_one_length_is_laid_out_as_record_by_record() -> None:
    rng = np.random.default_rng(11)
    sizes = [64, 400, 1024, 4096, 65_536, 65_600, 1 << 20, 5_000_000, 20_000_000]
    fast = 0
    for _ in range(3000):
        size = int(rng.choice(sizes))
        n = int(rng.integers(2, 300))
        start = int(rng.integers(0, 3))
        lengths = [int(rng.choice(sizes))] * start + [size] * n
        limit = int(rng.choice([16 << 20, 8192, 100_000, 1 << 20]))
        room = None if rng.random() < 0.3 else int(rng.integers(0, 2 * n * (size + 4096)))
        got = plan_batch(lengths, limit, room, start=start)
        want = segments._plan_records(lengths, limit, room, start)
        assert got == want, (size, n, start, limit, room)
        fast += got.count > 0
    assert fast > 1000  # most cases lay out records, not only the empty prefix


def test_the_closed_form_is_what_plan_batch_takes_for_one_length(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    taken: list[int] = []
    real = segments._plan_uniform

    def spy(count: int, length: int, limit: int, room: int | None) -> segments.BatchLayout:
        taken.append(count)
        return real(count, length, limit, room)

    monkeypatch.setattr(segments, "_plan_uniform", spy)
    plan_batch([65_536] * 4096, 16 << 20)
    plan_batch([65_536] * 10 + [4096], 16 << 20)  # two lengths: record by record
    plan_batch([4096] + [65_536] * 10, 16 << 20, start=1)  # one length from start on
    assert taken == [4096, 10]
