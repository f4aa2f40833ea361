"""Benchmarks that print ratios against a baseline measured in the same run (``kvstrata bench``).

Layout: Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, bf16, 16-token
blocks: 64 KiB per layer-block), batches of 256 keys x 32 layers (512 MiB).
The DRAM figures (:mod:`~kvstrata.workload.copy_bench`) are medians of interleaved rounds
against the best plain copies of the same bytes; the lookup figures come from
:mod:`~kvstrata.workload.lookup_bench`; the NVMe figures (:mod:`~kvstrata.workload.nvme_bench`) are
medians of interleaved rounds against raw ``O_DIRECT`` I/O of the same bytes in the same directory,
at the tier's queue depth. The scaling curves of
``kvstrata bench --scaling`` are :mod:`~kvstrata.workload.scaling`.
"""

from __future__ import annotations

from typing import Any

from kvstrata.core.hostcopy import copy_threads
from kvstrata.core.native import native_path, native_reason
from kvstrata.workload.benchkit import GB, KiB, MiB, llama8b_layout
from kvstrata.workload.copy_bench import bench_dram
from kvstrata.workload.lookup_bench import bench_lookup, vllm_default_hash
from kvstrata.workload.nvme_bench import bench_nvme

__all__ = ["GB", "bench_dram", "bench_lookup", "bench_nvme", "llama8b_layout", "run_all", "vllm_default_hash"]


def run_all(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    """Every figure of ``kvstrata bench``: DRAM store/load at 1 KiB, 64 KiB and 1 MiB layer-blocks
    against the best plain copies (and at 2 copy threads where the default is one), NVMe
    write/read against raw O_DIRECT I/O, hash + lookup."""
    keys = 64 if quick else 256
    rounds = 3 if quick else 7
    sizes = ((KiB, keys), (64 * KiB, keys), (MiB, max(4, keys // 16)))  # (layer-block bytes, keys)
    dram = {size: bench_dram(keys=n, layer_bytes=size, rounds=rounds) for size, n in sizes}
    dram2 = {}  # the engine's own choice here is one thread (half the CPUs); the 2-thread limit needs 2
    if copy_threads() < 2:
        dram2 = {size: bench_dram(keys=n, layer_bytes=size, rounds=rounds, copy_threads=2) for size, n in sizes[1:]}
    nvme = bench_nvme(keys=keys // 2, rounds=rounds, directory=directory)
    look = bench_lookup(repeats=5 if quick else 20)
    return {
        "code_path": native_path(),  # the hot loops in C (kvstrata._native) or in Python
        "code_path_reason": native_reason(),
        "layout": "llama-3-8b-like: 32 layers x 64 KiB layer-blocks, 16-token blocks",
        "batch": f"{keys} keys x 32 layers",
        "dram": dram[64 * KiB],
        "dram_by_layer_bytes": {str(size): figures for size, figures in dram.items()},
        # only where the default copies with one thread: the same figures at 2 copy threads
        "dram_2threads_by_layer_bytes": {str(size): figures for size, figures in dram2.items()},
        "nvme": nvme,
        "lookup_128k_ms": look["lookup_128k_ms"],
        "per_layer_lookup_128k_ms": look["per_layer_lookup_128k_ms"],
        "hash_speedup_vs_sha256": look["hash_speedup_vs_sha256"],
        "lookup": look,
    }
