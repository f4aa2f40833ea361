"""pytest-benchmark wrappers around kvstrata's benchmark functions.

Run with ``make bench`` (or ``pytest benchmarks --benchmark-only``). Each test records the
engine's figure and stores the same-run baseline ratios in ``benchmark.extra_info``; the ratios
are the numbers to compare, not the seconds.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvstrata.core import hostcopy
from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.engine.engine import Engine
from kvstrata.workload import bench as kb
from kvstrata.workload.benchkit import KiB, MiB, batch, layout_for, placed


@pytest.mark.parametrize("threads", [None, 2], ids=["default-threads", "2-threads"])
@pytest.mark.parametrize(("layer_bytes", "keys"), [(KiB, 256), (64 * KiB, 128), (MiB, 8)])
def test_dram_store_load(benchmark, layer_bytes: int, keys: int, threads: int | None) -> None:  # type: ignore[no-untyped-def]
    """Engine and tier store/load against the best 1- and 2-thread copies of the same bytes
    (``extra_info``: ``engine_load_vs_2thread`` and the rest), with the default copy threads and
    with 2; the timed part is a load."""
    with hostcopy.using_copy_threads(threads) if threads else contextlib.nullcontext():
        _dram_store_load(benchmark, layer_bytes, keys)


def _dram_store_load(benchmark, layer_bytes: int, keys: int) -> None:  # type: ignore[no-untyped-def]
    figures = kb.bench_dram(keys=keys, layer_bytes=layer_bytes, rounds=3)
    benchmark.extra_info.update(figures)
    assert figures["bytes_ok"] == 1.0
    layout = layout_for(layer_bytes)
    src = batch(layout, keys, 0)
    dst = {layer: placed(a.shape) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    cfg = {"engine": {"max_pending_bytes": 4 * total}, "tiers": [{"name": "dram", "capacity": 2 * total}]}
    with Engine(cfg, layout=layout) as engine:
        keys_ = engine.keys_for_tokens(np.arange(keys * layout.block_size, dtype=np.uint32))
        engine.store_sync(keys_, src)
        benchmark(lambda: engine.load_sync(keys_, dst))
    assert all(np.array_equal(dst[layer], src[layer]) for layer in src)


def test_nvme_write_read(benchmark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """NVMe tier and engine write/read against raw O_DIRECT I/O of the same bytes at the same queue
    depth, in interleaved rounds (``extra_info``: ``write_vs_raw``, ``read_vs_raw``, medians and range)."""
    figures = benchmark.pedantic(
        kb.bench_nvme, kwargs={"keys": 64, "rounds": 3, "directory": str(tmp_path)}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(figures)
    assert figures["bytes_ok"] == 1.0
    assert set(figures["write_vs_raw"]) == {"median", "min", "max"}


def test_hash_and_lookup_128k(benchmark) -> None:  # type: ignore[no-untyped-def]
    """Hash + lookup of a 128K-token prompt, uniform and per-layer paths (``extra_info``); the
    timed part is hashing alone."""
    figures = kb.bench_lookup(repeats=5)
    benchmark.extra_info.update(figures)
    assert figures["blocks_found"] == 131072 // 16
    assert figures["per_layer"]["blocks_found"] == 131072 // 16
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 128000, size=131072, dtype=np.uint32)
    hasher = BlockHasher(Namespace("m", "bfloat16", "f", 16))
    benchmark(lambda: hasher.keys_for_tokens(toks))
