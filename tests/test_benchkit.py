"""The benchmarks' shared timing (:mod:`kvstrata.workload.benchkit`): interleaved rounds run in a
frozen heap, as vLLM's workers and the daemon do, and say how long the collector ran in each."""

from __future__ import annotations

import gc

import numpy as np

from kvstrata.workload.benchkit import KiB, batch, frozen_heap, interleaved, layout_for, placed


def _cycles(n: int) -> None:
    """``n`` reference cycles: only the collector frees them (it runs as they pile up)."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_rounds_run_frozen_and_the_collector_time_is_charged_to_the_candidate_that_caused_it() -> None:
    heap = [[i] for i in range(50_000)]  # what a bench sets up: walked by a full pass unless frozen
    seen: dict[str, int] = {}

    def churn() -> None:
        seen["frozen"] = gc.get_freeze_count()
        _cycles(20_000)

    def idle() -> None:
        pass

    collector: dict[str, list[float]] = {}
    gc.collect()
    assert gc.get_freeze_count() == 0
    times = interleaved({"churn": churn, "idle": idle}, 3, collector=collector)
    assert set(times) == set(collector) == {"churn", "idle"}
    assert all(len(v) == 3 for v in (*times.values(), *collector.values()))
    assert seen["frozen"] >= len(heap)  # the set-up heap was out of the walk during the rounds
    assert gc.get_freeze_count() == 0  # and back in it afterwards
    assert sum(collector["churn"]) > 0  # 20,000 cycles a round set the collector off
    assert all(c <= t for c, t in zip(collector["churn"], times["churn"], strict=True))  # part of the time
    assert sum(collector["idle"]) == 0.0


def test_a_heap_frozen_before_stays_frozen() -> None:
    """A caller that froze its own heap (vLLM does) keeps it frozen: unfreezing would hand its
    start-up objects back to the collector."""
    gc.collect()
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() >= before
    finally:
        gc.unfreeze()


def test_caller_arrays_start_16_bytes_into_a_page_whatever_their_size() -> None:
    """The benchmarks' caller arrays start where malloc puts a large numpy array, at every size,
    so no run meets (or misses) glibc's slow copy between alignments by where the heap put it."""
    for shape in [(1, 1024), (256, 1024), (4, 64 * KiB)]:
        arr = placed(shape)
        assert arr.shape == shape and arr.ctypes.data % 4096 == 16 and not arr.any()
    assert placed((3, 5), into_page=0).ctypes.data % 4096 == 0
    one, again = batch(layout_for(KiB, num_layers=2), 8, seed=3), batch(layout_for(KiB, num_layers=2), 8, seed=3)
    assert all(a.ctypes.data % 4096 == 16 and a.shape == (8, KiB) for a in one.values())
    assert all(np.array_equal(one[layer], again[layer]) for layer in one) and one[0].any()
