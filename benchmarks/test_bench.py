"""pytest-benchmark wrappers around kvstrata's benchmark functions.

Run with ``make bench`` (or ``pytest benchmarks --benchmark-only``). Each test
records the engine's figure and stores the same-run baseline ratio in
``benchmark.extra_info``; the ratios are the numbers to compare, not the seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.engine.engine import Engine
from kvstrata.workload import bench as kb


@pytest.fixture(scope="module")
def layout():  # type: ignore[no-untyped-def]
    return kb.llama8b_layout()


def _batch(layout, keys):  # type: ignore[no-untyped-def]
    return kb._batch(layout, keys, 0)


def test_dram_store_load(benchmark, layout) -> None:  # type: ignore[no-untyped-def]
    figures = kb.bench_dram(keys=128, repeats=2)
    benchmark.extra_info.update(figures)
    src = _batch(layout, 128)
    dst = {layer: np.empty_like(a) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    cfg = {"engine": {"max_pending_bytes": 4 * total}, "tiers": [{"name": "dram", "capacity": 2 * total}]}
    with Engine(cfg, layout=layout) as engine:
        keys = kb._keys(engine, 128, 0)
        engine.store_sync(keys, src)
        benchmark(lambda: engine.load_sync(keys, dst))
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)


def test_nvme_write_read(benchmark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    figures = benchmark.pedantic(
        kb.bench_nvme, kwargs={"keys": 64, "repeats": 1, "directory": str(tmp_path)}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(figures)
    assert figures["bytes_ok"] == 1.0


def test_hash_and_lookup_128k(benchmark) -> None:  # type: ignore[no-untyped-def]
    figures = kb.bench_lookup(repeats=5)
    benchmark.extra_info.update(figures)
    assert figures["blocks_found"] == 131072 // 16
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 128000, size=131072, dtype=np.uint32)
    hasher = kb.BlockHasher(kb.Namespace("m", "bfloat16", "f", 16))
    benchmark(lambda: hasher.keys_for_tokens(toks))
