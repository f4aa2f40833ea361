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


def test_every_baseline_copy_lands_the_same_bytes() -> None:
    """The plain copies the DRAM figures are measured against (numpy, 2 threads, streaming) each
    copy every byte of the batch: a baseline that skipped some would flatter nothing but itself."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstrata.core import native
    from kvstrata.workload.copy_bench import ONE_THREAD, TWO_THREADS, plain_copies

    src = batch(layout_for(KiB, num_layers=3), 40, seed=5)
    dst = {layer: placed(a.shape) for layer, a in src.items()}
    with ThreadPoolExecutor(1) as helper:
        copies = plain_copies(src, dst, helper)
        want = set(ONE_THREAD + TWO_THREADS) - (set() if native.NATIVE else {"stream_layers", "threads2_stream"})
        assert set(copies) == want
        for name, copy in copies.items():
            for arr in dst.values():
                arr.fill(0)
            copy()
            assert all(np.array_equal(dst[layer], src[layer]) for layer in src), name
