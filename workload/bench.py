"""Benchmarks that print ratios against a baseline measured in the same run.

Layout: Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, bf16, 16-token
blocks: 64 KiB per layer-block), batches of 256 keys x 32 layers (512 MiB).
Each figure is the best of ``repeats`` runs, so cold page faults and noise from
this shared machine count less; both sides of every ratio get the same treatment.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.engine.engine import Engine

GB = 1e9


def llama8b_layout() -> KVLayout:
    return uniform_layout("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _batch(layout: KVLayout, keys: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        layer: rng.integers(0, 256, size=(keys, layout.layer_nbytes(layer)), dtype=np.uint8)
        for layer in range(layout.num_layers)
    }


def _keys(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = np.arange(n * engine.layout.block_size, dtype=np.uint32) + np.uint32(salt * 7919)
    return engine.keys_for_tokens(tokens)


def bench_dram(keys: int = 256, repeats: int = 3) -> dict[str, float]:
    """Engine store/load with one DRAM tier vs numpy copies of the same blocks."""
    layout = llama8b_layout()
    src = _batch(layout, keys, 0)
    dst = {layer: np.empty_like(a) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    blocks = [(dst[layer][i], src[layer][i]) for layer in src for i in range(keys)]

    def numpy_blocks() -> None:
        for d, s in blocks:
            np.copyto(d, s)

    numpy_s = _best(numpy_blocks, repeats)

    def numpy_contiguous() -> None:
        for layer in src:
            np.copyto(dst[layer], src[layer])

    numpy_contig_s = _best(numpy_contiguous, repeats)
    cfg = {
        "engine": {"max_pending_bytes": 4 * total},
        "tiers": [{"name": "dram", "capacity": total, "eviction": "lru"}],
    }
    with Engine(cfg, layout=layout) as engine:
        rounds = [_keys(engine, keys, r) for r in range(repeats + 1)]
        engine.store_sync(rounds[-1], src)  # touch every page of the pool once
        store_s = min(_timed(functools.partial(engine.store_sync, k, src)) for k in rounds[:repeats])
        load_s = _best(lambda: engine.load_sync(rounds[repeats - 1], dst), repeats)
        ok = all(np.array_equal(dst[layer], src[layer]) for layer in src)
    return {
        "bytes": total,
        "numpy_copy_gbps": total / numpy_s / GB,
        "numpy_contiguous_gbps": total / numpy_contig_s / GB,
        "store_gbps": total / store_s / GB,
        "load_gbps": total / load_s / GB,
        "store_ratio": numpy_s / store_s,
        "load_ratio": numpy_s / load_s,
        "bytes_ok": float(ok),
    }


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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


def vllm_default_hash(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's default prefix hash: sha256 over a pickled (parent, tokens, extra) tuple, chained."""
    out: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def bench_lookup(tokens: int = 131072, repeats: int = 20) -> dict[str, float]:
    """Hash + lookup of a 128K-token prompt that is fully cached (the worst case: no early exit)."""
    layout = llama8b_layout()
    ns = Namespace("llama-3-8b", "bfloat16", layout.fingerprint(), 16)
    hasher = BlockHasher(ns)
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 128000, size=tokens, dtype=np.uint32)
    cfg = {"tiers": [{"name": "dram", "capacity": "64MiB"}]}
    with Engine(cfg, layout=layout, namespace=ns) as engine:
        keys = hasher.keys_for_tokens(toks)
        _populate_index(engine, keys)

        def hash_and_lookup() -> int:
            return engine.lookup(hasher.keys_for_tokens(toks)).num_blocks

        found = hash_and_lookup()
        kv_s = _best(hash_and_lookup, repeats)
        hash_only_s = _best(lambda: hasher.keys_for_tokens(toks), repeats)
    as_list = toks.tolist()
    sha_s = _best(lambda: vllm_default_hash(as_list, 16), max(3, repeats // 5))
    return {
        "tokens": tokens,
        "blocks_found": found,
        "lookup_128k_ms": kv_s * 1e3,
        "hash_128k_ms": hash_only_s * 1e3,
        "vllm_sha256_hash_128k_ms": sha_s * 1e3,
        "hash_speedup_vs_sha256": sha_s / hash_only_s,
    }


def _populate_index(engine: Engine, keys: list[bytes]) -> None:
    """Mark keys present in the top tier's index without moving bytes (lookup cost only)."""
    idx = engine.tiers[0]
    with engine._lock:
        for k in keys:
            idx.add(k, engine.layout.all_layers_mask, 0, None)
            engine._best[k] = 0


def run_all(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    keys = 64 if quick else 256
    dram = bench_dram(keys=keys, repeats=2 if quick else 3)
    nvme = bench_nvme(keys=keys, repeats=3, directory=directory)
    look = bench_lookup(repeats=5 if quick else 20)
    return {
        "layout": "llama-3-8b-like: 32 layers x 64 KiB layer-blocks, 16-token blocks",
        "batch": f"{keys} keys x 32 layers",
        "dram": dram,
        "nvme": nvme,
        "lookup_128k_ms": look["lookup_128k_ms"],
        "hash_speedup_vs_sha256": look["hash_speedup_vs_sha256"],
        "lookup": look,
    }
