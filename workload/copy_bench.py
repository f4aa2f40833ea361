"""DRAM store and load against the best plain copy of the same bytes, in the same run.

The bytes: ``keys`` blocks x 32 layers of ``layer_bytes`` each, one ``[keys, layer_bytes]`` array
per layer on the caller's side (as vLLM hands over a layer's pages). The baselines copy exactly
those bytes, caller array to caller array:

* ``numpy_blocks``: one thread, ``np.copyto`` block by block (a view each);
* ``numpy_layers``: one thread, ``np.copyto`` of each layer's array (the same bytes, 32 copies);
* ``threads2_layers``: two threads, each copying every other layer's array;
* ``threads2_halves``: two threads, each copying one half of every layer's array;
* ``stream_layers`` / ``threads2_stream``: each layer's array copied with non-temporal stores, by
  one thread / by two threads taking every other layer (the copy loop of ``kvstrata._native``,
  which the tier's own copies use from 32 KiB up; numpy's copy reads every destination line before
  writing it, which is most of the time of a copy into memory no cache holds). Only with the
  extension built.

The best single-thread copy is the fastest of the 1-thread copies in each round, the best
2-thread copy the fastest of the 2-thread ones (the real limit: the tier copies with up to
:data:`~kvstrata.core.hostcopy.COPY_THREADS` threads, half the CPUs by default, so 1 on a 2-core
machine: ``kvstrata bench`` then measures the tier at 2 copy threads too). Against them: the DRAM tier alone
(``write``/``read`` of the batch as the engine hands it over), and :class:`Engine` ``store``/
``load`` with that tier (index, queue, eviction: each store goes to fresh keys of a full tier, so
it evicts as many blocks as it writes). Every candidate runs once per round, in a rotating order
(:func:`~kvstrata.workload.benchkit.interleaved`); figures are medians with their range.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstrata.core import hostcopy, native
from kvstrata.core.buffers import row_addresses
from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine
from kvstrata.tiers import SpanBatch, SpanGroup, TierContext
from kvstrata.tiers.memory import DRAMTier, MemoryOptions
from kvstrata.workload.benchkit import (
    KiB,
    batch,
    collector_ms,
    fastest,
    gbps,
    interleaved,
    layout_for,
    loadavg,
    placed,
    ratio,
    salted_keys,
    spread,
)

__all__ = ["ONE_THREAD", "TWO_THREADS", "bench_dram", "plain_copies"]

Arrays = dict[int, np.ndarray]


def plain_copies(src: Arrays, dst: Arrays, helper: ThreadPoolExecutor) -> dict[str, Callable[[], None]]:
    """The baseline copies of ``src`` into ``dst`` (see the module docstring); ``helper``: one
    thread that is the second thread of the 2-thread copies."""
    layers = list(src)
    blocks = [(dst[layer][i], src[layer][i]) for layer in layers for i in range(len(src[layer]))]
    halves = [len(src[layer]) // 2 for layer in layers]

    def numpy_blocks() -> None:
        for d, s in blocks:
            np.copyto(d, s)

    def numpy_layers() -> None:
        for layer in layers:
            np.copyto(dst[layer], src[layer])

    def some_layers(which: list[int]) -> None:
        for layer in which:
            np.copyto(dst[layer], src[layer])

    def threads2_layers() -> None:
        other = helper.submit(some_layers, layers[0::2])
        some_layers(layers[1::2])
        other.result()

    def half(first: bool) -> None:
        for layer, h in zip(layers, halves, strict=True):
            part = slice(0, h) if first else slice(h, None)
            np.copyto(dst[layer][part], src[layer][part])

    def threads2_halves() -> None:
        other = helper.submit(half, True)
        half(False)
        other.result()

    out = {
        "numpy_blocks": numpy_blocks,
        "numpy_layers": numpy_layers,
        "threads2_layers": threads2_layers,
        "threads2_halves": threads2_halves,
    }
    ext = native.NATIVE
    if ext is not None:
        runs = [(int(dst[layer].ctypes.data), int(src[layer].ctypes.data), int(src[layer].nbytes)) for layer in layers]
        move = ext.memmove_runs

        def stream_layers() -> None:
            move(runs)

        def threads2_stream() -> None:
            other = helper.submit(move, runs[0::2])
            move(runs[1::2])
            other.result()

        out.update(stream_layers=stream_layers, threads2_stream=threads2_stream)
    return out


ONE_THREAD = ("numpy_blocks", "numpy_layers", "stream_layers")
TWO_THREADS = ("threads2_layers", "threads2_halves", "threads2_stream")


def span_batch(arrays: Arrays, keys: list[Key], write: bool) -> SpanBatch:
    """The batch the engine hands a ``host_spans`` tier for these arrays (rows by address)."""
    positions = list(range(len(keys)))
    groups = []
    for layer, arr in arrays.items():
        size = int(arr.shape[1])
        addresses = row_addresses(arr, positions, size, write)
        if addresses is None:  # pragma: no cover - the arrays are host memory
            raise ValueError("benchmark arrays must be C-contiguous host memory")
        groups.append(SpanGroup(layer, keys, addresses, size))
    return SpanBatch(groups)


def bench_dram(
    keys: int = 256, layer_bytes: int = 64 * KiB, rounds: int = 5, copy_threads: int | None = None
) -> dict[str, Any]:
    """DRAM tier and engine store/load of ``keys`` x 32 layers of ``layer_bytes`` against the
    best plain copies of the same bytes (see the module docstring); ``copy_threads``: the
    threads the tier copies with (:func:`~kvstrata.core.hostcopy.set_copy_threads`; None: as set)."""
    with contextlib.nullcontext() if copy_threads is None else hostcopy.using_copy_threads(copy_threads):
        out = _bench_dram(keys, layer_bytes, rounds)
        out["copy_threads"] = hostcopy.copy_threads()
    return out


def _bench_dram(keys: int, layer_bytes: int, rounds: int) -> dict[str, Any]:
    layout = layout_for(layer_bytes)
    src = batch(layout, keys, 0)
    dst = {layer: placed(a.shape) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    blocks = keys * layout.num_layers
    load_before = loadavg()
    cfg = {
        "engine": {"max_pending_bytes": 4 * total},
        "tiers": [{"name": "dram", "capacity": 2 * total, "eviction": "lru"}],
    }
    with ThreadPoolExecutor(1, thread_name_prefix="kvstrata-bench") as helper, Engine(cfg, layout=layout) as engine:
        room = total + total // 4  # a rewrite frees its old slots first
        tier = DRAMTier("bench-dram", room, MemoryOptions(pin_memory="off"), TierContext(layout, engine.namespace))
        try:
            ids = engine.keys_for_tokens(np.arange(keys * layout.block_size, dtype=np.uint32) + np.uint32(7))
            wbatch, rbatch = span_batch(src, ids, write=False), span_batch(dst, ids, write=True)
            fresh = _fresh_keys(engine, keys)
            stored: list[list[Key]] = []

            def engine_store() -> None:
                stored.append(next(fresh))
                engine.store_sync(stored[-1], src)

            def engine_load() -> None:
                engine.load_sync(stored[-1], dst)

            candidates = {
                **plain_copies(src, dst, helper),
                "tier_store": lambda: tier.write(wbatch),
                "tier_load": lambda: tier.read(rbatch),
                "engine_store": engine_store,
                "engine_load": engine_load,
            }
            for warm in candidates.values():  # every page on both sides faulted in; the engine's tier full
                warm()
            engine_store()
            gc_s: dict[str, list[float]] = {}
            times = interleaved(candidates, rounds, collector=gc_s)
            ok = _check(engine, tier, stored[-1], ids, src, dst, rbatch)
        finally:
            tier.close()
    return _figures(times, gc_s, total, blocks, keys, layer_bytes, rounds, ok, (load_before, loadavg()))


def _fresh_keys(engine: Engine, keys: int) -> Iterator[list[Key]]:
    """Key sets no store used yet (each store of one evicts the oldest blocks of a full tier)."""
    for salt in itertools.count(1000):
        yield salted_keys(engine, keys, salt)


def _check(
    engine: Engine, tier: DRAMTier, last: list[Key], ids: list[Key], src: Arrays, dst: Arrays, rbatch: SpanBatch
) -> bool:
    """Every byte the engine and the tier read back equals the byte written."""
    for arr in dst.values():
        arr.fill(0)
    engine_ok = engine.load_sync(last, dst).loaded_blocks == len(last)
    engine_ok = engine_ok and all(np.array_equal(dst[layer], src[layer]) for layer in src)
    for arr in dst.values():
        arr.fill(0)
    tier_ok = all(st.value == "ok" for st in tier.read(rbatch))
    return engine_ok and tier_ok and all(np.array_equal(dst[layer], src[layer]) for layer in src)


def _figures(
    times: dict[str, list[float]],
    gc_s: dict[str, list[float]],
    total: int,
    blocks: int,
    keys: int,
    layer_bytes: int,
    rounds: int,
    ok: bool,
    load: tuple[float, float],
) -> dict[str, Any]:
    one = fastest(*(times[name] for name in ONE_THREAD if name in times))
    two = fastest(*(times[name] for name in TWO_THREADS if name in times))
    numpy_one = fastest(times["numpy_blocks"], times["numpy_layers"])
    numpy_two = fastest(times["threads2_layers"], times["threads2_halves"])
    out: dict[str, Any] = {
        "bytes": total,
        "keys": keys,
        "layer_bytes": layer_bytes,
        "layer_blocks": blocks,
        "rounds": rounds,
        "loadavg": list(load),
        "bytes_ok": float(ok),
        "gbps": {name: gbps(total, t) for name, t in times.items()},
        "collector_ms": collector_ms(gc_s),
        "best_1thread_gbps": gbps(total, one),
        "best_2thread_gbps": gbps(total, two),
        "streaming_copies": "stream_layers" in times,  # the best copies include non-temporal ones
        "numpy_1thread_gbps": gbps(total, numpy_one),  # the best copies through numpy alone
        "numpy_2thread_gbps": gbps(total, numpy_two),
    }
    for who in ("tier", "engine"):
        for op in ("store", "load"):
            t = times[f"{who}_{op}"]
            out[f"{who}_{op}_vs_1thread"] = ratio(one, t)
            out[f"{who}_{op}_vs_2thread"] = ratio(two, t)
            out[f"{who}_{op}_vs_numpy_1thread"] = ratio(numpy_one, t)
            out[f"{who}_{op}_vs_numpy_2thread"] = ratio(numpy_two, t)
            # time above the best 2-thread copy, per layer-block (what the bookkeeping costs)
            out[f"{who}_{op}_overhead_us"] = spread([(c - b) / blocks for b, c in zip(two, t, strict=True)], 1e6)
    e = out["gbps"]
    out.update(  # the figures ``kvstrata bench`` has always printed
        numpy_copy_gbps=e["numpy_blocks"]["median"],
        store_gbps=e["engine_store"]["median"],
        load_gbps=e["engine_load"]["median"],
        store_ratio=out["engine_store_vs_1thread"]["median"],
        load_ratio=out["engine_load_vs_1thread"]["median"],
    )
    return out
