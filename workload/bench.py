"""Benchmarks that print ratios against a baseline measured in the same run (``kvstrata bench``).

Layout: Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, bf16, 16-token
blocks: 64 KiB per layer-block), batches of 256 keys x 32 layers (512 MiB).
The DRAM figures (:mod:`~kvstrata.workload.copy_bench`) are medians of interleaved rounds
against the best plain copies of the same bytes; the lookup figures come from
:mod:`~kvstrata.workload.lookup_bench`; the NVMe figures are the best of ``repeats`` runs
against raw file I/O of the same bytes in the same directory. The scaling curves of
``kvstrata bench --scaling`` are :mod:`~kvstrata.workload.scaling`.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import numpy as np

from kvstrata.engine.engine import Engine
from kvstrata.workload.benchkit import GB, KiB, MiB, llama8b_layout
from kvstrata.workload.benchkit import batch as _batch
from kvstrata.workload.benchkit import best as _best
from kvstrata.workload.benchkit import timed as _timed
from kvstrata.workload.copy_bench import bench_dram
from kvstrata.workload.lookup_bench import bench_lookup, vllm_default_hash

__all__ = ["GB", "bench_dram", "bench_lookup", "bench_nvme", "llama8b_layout", "run_all", "vllm_default_hash"]


def _keys(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = np.arange(n * engine.layout.block_size, dtype=np.uint32) + np.uint32(salt * 7919)
    return engine.keys_for_tokens(tokens)


def _raw_file_io(directory: str, data: list[np.ndarray], total: int) -> tuple[float, float, bool]:
    """Sequential write+fsync and read of the same bytes in one file (O_DIRECT if possible)."""
    import mmap

    path = os.path.join(directory, "raw-baseline.bin")
    chunk = 8 * 1024 * 1024
    region = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    staging = np.frombuffer(region, dtype=np.uint8)
    flat = np.concatenate([d.reshape(-1) for d in data]) if data else np.zeros(0, np.uint8)
    direct = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    try:
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            staging[:n] = flat[off : off + n]
            os.pwrite(fd, memoryview(region)[: max(n, 4096) if direct else n], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t0
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    out = np.empty(total, dtype=np.uint8)
    t0 = time.perf_counter()
    try:
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            os.preadv(fd, [memoryview(region)[:n]], off)
            out[off : off + n] = staging[:n]
    finally:
        os.close(fd)
    read_s = time.perf_counter() - t0
    os.unlink(path)
    return write_s, read_s, direct


def bench_nvme(keys: int = 256, repeats: int = 2, directory: str | None = None) -> dict[str, Any]:
    """Engine store/load with one NVMe tier vs raw sequential file I/O of the same bytes, same directory."""
    layout = llama8b_layout()
    src = _batch(layout, keys, 1)
    dst = {layer: np.empty_like(a) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-", dir=directory) as tmp:
        raw = [_raw_file_io(tmp, [src[layer] for layer in src], total) for _ in range(repeats)]
        raw_w, raw_r = min(r[0] for r in raw), min(r[1] for r in raw)
        cfg = {
            "engine": {"max_pending_bytes": 4 * total},
            "tiers": [{"name": "nvme", "capacity": 4 * total, "path": tmp, "eviction": "lru"}],
        }
        with Engine(cfg, layout=layout) as engine:
            rounds = [_keys(engine, keys, r) for r in range(repeats)]
            write_s = min(_timed(functools.partial(engine.store_sync, k, src)) for k in rounds)
            read_s = _best(lambda: engine.load_sync(rounds[-1], dst), repeats)
            ok = all(np.array_equal(dst[layer], src[layer]) for layer in src)
            direct = engine.tiers[0].tier.capabilities.direct_io
    return {
        "bytes": total,
        "raw_write_gbps": total / raw_w / GB,
        "raw_read_gbps": total / raw_r / GB,
        "raw_o_direct": raw[0][2],
        "write_gbps": total / write_s / GB,
        "read_gbps": total / read_s / GB,
        "write_ratio": raw_w / write_s,
        "read_ratio": raw_r / read_s,
        "tier_o_direct": direct,
        "bytes_ok": float(ok),
        "note": "raw and tier both fsync writes; reads right after writes may be served partly "
        "from the page cache when O_DIRECT is unavailable",
    }


def run_all(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    """Every figure of ``kvstrata bench``: DRAM store/load at 1 KiB, 64 KiB and 1 MiB layer-blocks
    against the best plain copies, NVMe write/read against raw file I/O, hash + lookup."""
    keys = 64 if quick else 256
    rounds = 3 if quick else 7
    dram = {
        size: bench_dram(keys=n, layer_bytes=size, rounds=rounds)
        for size, n in ((KiB, keys), (64 * KiB, keys), (MiB, max(4, keys // 16)))
    }
    nvme = bench_nvme(keys=keys, repeats=3, directory=directory)
    look = bench_lookup(repeats=5 if quick else 20)
    return {
        "layout": "llama-3-8b-like: 32 layers x 64 KiB layer-blocks, 16-token blocks",
        "batch": f"{keys} keys x 32 layers",
        "dram": dram[64 * KiB],
        "dram_by_layer_bytes": {str(size): figures for size, figures in dram.items()},
        "nvme": nvme,
        "lookup_128k_ms": look["lookup_128k_ms"],
        "per_layer_lookup_128k_ms": look["per_layer_lookup_128k_ms"],
        "hash_speedup_vs_sha256": look["hash_speedup_vs_sha256"],
        "lookup": look,
    }
