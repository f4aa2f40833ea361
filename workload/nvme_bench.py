"""NVMe tier write and read against raw ``O_DIRECT`` sequential I/O of the same bytes, same directory.

The bytes: ``keys`` blocks x 32 layers of 64 KiB (the Llama-3-8B-like layout), one
``[keys, 64 KiB]`` array per layer on the caller's side.

The raw baseline (:class:`RawDirect`) gets the queue depth the tier gets: ``depth``
(:data:`~kvstrata.tiers.nvme.options.IO_DEPTH`) threads, each ``pwrite``-ing (``preadv``-ing)
every ``depth``-th chunk of :data:`~kvstrata.tiers.nvme.options.CHUNK_BYTES` of one file with
``O_DIRECT`` from (into) page-aligned buffers, so ``depth`` chunks are in flight at any time, as
in the tier; a write goes to a new file (its blocks allocated as the tier's new segments are) and
ends with one ``fdatasync``, as the tier's does. Its buffers are the tier's own staging buffers,
borrowed for each write or read (see :class:`RawDirect`: on a VM the speed of ``O_DIRECT`` I/O
depends on the memory it moves). They hold the bytes already: the baseline does no copy, where
the tier copies the caller's arrays into (out of) its staging buffers and checksums every record.

Against it: :class:`~kvstrata.tiers.nvme.NVMeTier` ``write``/``read`` of the batch (fresh keys
each write, the keys of the previous write deleted between rounds, not timed); the same write from
page-aligned copies of the arrays, which the tier (opened with ``KVSTRATA_NVME_ZERO_COPY=1``)
writes with no staging copy; the same read into page-aligned arrays, which that tier reads
straight into (no staging copy), against the raw read into those very arrays
(:meth:`RawDirect.read_into`); and :class:`Engine` ``store``/``load`` with an nvme tier of the
default settings (room for every round: no eviction). Reads bypass the page cache on both sides
(``O_DIRECT``); where the filesystem refuses ``O_DIRECT`` both sides run buffered and the page
cache is dropped (``posix_fadvise(DONTNEED)``) before every read. Every candidate runs once per
round in a rotating order (:func:`~kvstrata.workload.benchkit.interleaved`); figures are medians
with their range, and ratios are per round. The rounds run with the heap before them frozen, as
vLLM's workers and the daemon run (a full collection walks only what the rounds keep alive, not
what importing torch left), and ``collector_ms`` says how long the collector ran in each call.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine
from kvstrata.tiers import TierContext
from kvstrata.tiers.fileio import AlignedBufferPool, aligned_buffer, pread_into, pwrite_all
from kvstrata.tiers.nvme import NVMeOptions, NVMeTier
from kvstrata.tiers.nvme.lanes import cpu_workers
from kvstrata.tiers.nvme.options import CHUNK_BYTES, IO_DEPTH
from kvstrata.tiers.nvme.state import ZERO_COPY_ENV
from kvstrata.workload.benchkit import batch, collector_ms, gbps, interleaved, llama8b_layout, loadavg, placed, ratio

__all__ = ["RawDirect", "bench_nvme"]

Arrays = dict[int, np.ndarray]
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class RawDirect:
    """Sequential ``O_DIRECT`` write (+ one ``fdatasync``) and read of ``total`` bytes in one file
    of ``directory``, ``depth`` chunks of ``chunk`` bytes in flight (see the module docstring).

    ``pool``: take the I/O buffers from this pool for each write or read (the tier's own staging
    pool), so that both sides move the bytes through the same memory. On this project's VMs the
    speed of ``O_DIRECT`` I/O depends on which buffer it uses: the same file, written and read by
    the same code, ran at 78-89 ms a 256 MiB write with one pair of fresh buffers and 154 ms with
    another (reads 90-98 against 198-259 ms), stable for each pair. With buffers of its own the
    baseline drew a different lot from the tier's in every run, and the ratio came out at 0.7x in
    one run and 1.7x in the next for the same code."""

    def __init__(
        self,
        directory: str,
        total: int,
        chunk: int = CHUNK_BYTES,
        depth: int = IO_DEPTH,
        pool: AlignedBufferPool | None = None,
    ) -> None:
        self.path = os.path.join(directory, "raw-baseline.bin")
        self.total, self.chunk, self.depth = total, chunk, depth
        self.direct = _O_DIRECT != 0 and _accepts_direct(directory)
        self._pool = pool
        # as many buffers as the tier's pipeline borrows for a call of this size, taken in rotation
        self._count = min(-(-total // chunk), depth + cpu_workers(depth) + 1) if pool else depth
        rng = np.random.default_rng(1)
        self._bufs = [] if pool else [aligned_buffer(chunk) for _ in range(depth)]
        for buf in self._bufs:
            buf[:] = rng.integers(0, 256, size=len(buf), dtype=np.uint8)
        self._threads = ThreadPoolExecutor(depth, thread_name_prefix="kvstrata-raw")

    def close(self) -> None:
        self._threads.shutdown()
        self.remove()

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _lanes(self, fn: Callable[[np.ndarray, int], None]) -> None:
        offsets = range(0, self.total, self.chunk)
        with contextlib.ExitStack() as stack:
            bufs = self._bufs or [stack.enter_context(self._pool.borrow(self.chunk)) for _ in range(self._count)]  # type: ignore[union-attr]

            def lane(t: int) -> None:
                for i in range(t, len(offsets), self.depth):
                    fn(bufs[i % len(bufs)], offsets[i])

            for f in [self._threads.submit(lane, t) for t in range(self.depth)]:
                f.result()

    def write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if self.direct else 0), 0o600)
        try:
            self._lanes(lambda buf, off: pwrite_all(fd, buf[: min(self.chunk, self.total - off)], off))
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | (_O_DIRECT if self.direct else 0))
        try:
            self._lanes(lambda buf, off: _read_exactly(fd, buf[: min(self.chunk, self.total - off)], off))
        finally:
            os.close(fd)

    def read_into(self, arrays: list[np.ndarray]) -> None:
        """The same read into the caller's memory: the file, in order, into ``arrays`` (page-aligned,
        whole pages, ``total`` bytes together), one ``pread`` per array, ``depth`` in flight. The
        baseline of a zero-copy read, which lands its bytes in that memory: the speed of
        ``O_DIRECT`` I/O on a VM depends on the memory it moves (see the class docstring)."""
        flat = [a.reshape(-1).view(np.uint8) for a in arrays]
        offsets = list(itertools.accumulate((a.nbytes for a in flat), initial=0))
        if offsets[-1] != self.total:
            raise ValueError(f"raw baseline: {offsets[-1]} bytes of arrays for a file of {self.total}")
        fd = os.open(self.path, os.O_RDONLY | (_O_DIRECT if self.direct else 0))
        try:

            def lane(t: int) -> None:
                for i in range(t, len(flat), self.depth):
                    _read_exactly(fd, flat[i], offsets[i])

            for f in [self._threads.submit(lane, t) for t in range(self.depth)]:
                f.result()
        finally:
            os.close(fd)

    def drop_cache(self) -> None:
        """Drop the file's pages from the page cache (what a buffered read would find there)."""
        drop_cache(self.path)


def _read_exactly(fd: int, out: np.ndarray, offset: int) -> None:
    if pread_into(fd, out, offset) != len(out):
        raise OSError(f"raw baseline: short read at {offset}")


def _accepts_direct(directory: str) -> bool:
    from kvstrata.tiers.fileio import probe_direct_io

    return probe_direct_io(directory)


def drop_cache(path: str) -> None:
    """``posix_fadvise(DONTNEED)`` of every file under ``path`` (a file or a directory tree)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _items(keys: list[Key], arrays: Arrays) -> list[tuple[tuple[Key, int], np.ndarray]]:
    """The batch as the engine hands it to a records tier: by layer, then by key."""
    return [((k, layer), arr[i]) for layer, arr in arrays.items() for i, k in enumerate(keys)]


def bench_nvme(keys: int = 256, rounds: int = 5, directory: str | None = None, engine: bool = True) -> dict[str, Any]:
    """NVMe tier (and engine) write/read of ``keys`` x 32 layers of 64 KiB against raw ``O_DIRECT``
    sequential I/O of the same bytes in the same directory (see the module docstring)."""
    layout = llama8b_layout()
    src = batch(layout, keys, 0)
    dst = {layer: placed(a.shape) for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-", dir=directory) as tmp:
        cfg = {
            "engine": {"max_pending_bytes": 4 * total},
            "tiers": [{"name": "nvme", "capacity": (rounds + 3) * total * 2, "path": tmp, "eviction": "lru"}],
        }
        with Engine(cfg, layout=layout) as eng:
            opts = NVMeOptions(path=os.path.join(tmp, "tier"))
            with _env(ZERO_COPY_ENV, "1"):  # the tier alone also writes page-aligned memory with no copy
                tier = NVMeTier("bench-nvme", 4 * total, opts, TierContext(layout, eng.namespace))
            raw = RawDirect(tmp, total, pool=tier.staging_pool)
            try:
                times, gc_s, ok, direct = _rounds(raw, tier, eng if engine else None, src, dst, keys, rounds, tmp)
            finally:
                tier.close()
                raw.close()
    return _figures(times, gc_s, total, keys, rounds, ok, direct, raw.direct, (load_before, loadavg()))


def _rounds(
    raw: RawDirect,
    tier: NVMeTier,
    eng: Engine | None,
    src: Arrays,
    dst: Arrays,
    keys: int,
    rounds: int,
    tmp: str,
) -> tuple[dict[str, list[float]], dict[str, list[float]], bool, bool]:
    stored: list[list[Key]] = []
    engine_stored: list[list[Key]] = []
    fresh_tier = _salted(src, keys, 1)
    fresh_engine = _salted(src, keys, 10_000)
    direct = tier.direct_io and raw.direct

    batches: dict[str, list[tuple[tuple[Key, int], np.ndarray]]] = {}  # built untimed, as the engine hands them over

    def tier_write() -> None:
        tier.write(batches["write"])

    def tier_read() -> None:
        tier.read(batches["read"])

    def before_tier_write() -> None:
        if len(stored) > 1:  # the keys before the last write's go: the disk holds two batches at most
            tier.delete([(k, layer) for k in stored.pop(0) for layer in src])
        stored.append(next(fresh_tier))
        batches["write"] = _items(stored[-1], src)

    def before_tier_read() -> None:
        batches["read"] = _items(stored[-1], dst)

    aligned = _page_aligned(src)  # the same bytes in page-aligned memory (the dram arena's, pinned buffers')
    aligned_dst = _page_aligned(dst)

    def tier_read_aligned() -> None:
        tier.read(batches["read_aligned"])

    def before_tier_read_aligned() -> None:
        batches["read_aligned"] = _items(stored[-1], aligned_dst)

    def tier_write_aligned() -> None:
        tier.write(batches["write_aligned"])

    def before_tier_write_aligned() -> None:
        before_tier_write()
        batches["write_aligned"] = _items(stored[-1], aligned)

    candidates: dict[str, Callable[[], object]] = {
        "raw_write": raw.write,
        "tier_write": tier_write,
        "tier_write_aligned": tier_write_aligned,
        "raw_read": raw.read,
        "raw_read_aligned": lambda: raw.read_into(list(aligned_dst.values())),
        "tier_read": tier_read,
        "tier_read_aligned": tier_read_aligned,
    }
    setup: dict[str, Callable[[], object]] = {
        "raw_write": raw.remove,
        "tier_write": before_tier_write,
        "tier_write_aligned": before_tier_write_aligned,
        "tier_read": before_tier_read,
        "tier_read_aligned": before_tier_read_aligned,
    }
    if not direct:
        setup["raw_read"] = setup["raw_read_aligned"] = raw.drop_cache

        def buffered(before: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                before()
                drop_cache(tier.segment_dir)

            return run

        setup["tier_read"] = buffered(before_tier_read)
        setup["tier_read_aligned"] = buffered(before_tier_read_aligned)
    if eng is not None:
        engine = eng

        def engine_store() -> None:
            engine_stored.append(next(fresh_engine))
            engine.store_sync(engine_stored[-1], src)

        def engine_load() -> None:  # waited for whole: every layer in one tier call
            engine.load_sync(engine_stored[-1], dst)

        def engine_load_layerwise() -> None:  # the connector's load: one tier call a layer
            engine.load(engine_stored[-1], dst).result()

        candidates.update(
            engine_store=engine_store, engine_load=engine_load, engine_load_layerwise=engine_load_layerwise
        )
        if not direct:
            setup["engine_load"] = setup["engine_load_layerwise"] = lambda: drop_cache(tmp)
    for name, warm in candidates.items():  # threads started, files and pages of both sides in place
        setup.get(name, lambda: None)()
        warm()
    collector: dict[str, list[float]] = {}
    times = interleaved(candidates, rounds, setup, collector)
    ok = _check(tier, stored[-1], src, dst) and _check(tier, stored[-1], src, aligned_dst)
    if eng is not None:
        for arr in dst.values():
            arr.fill(0)
        ok = ok and eng.load_sync(engine_stored[-1], dst).loaded_blocks == keys
        ok = ok and all(np.array_equal(dst[layer], src[layer]) for layer in src)
    return times, collector, ok, direct


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _page_aligned(src: Arrays) -> Arrays:
    """Copies of ``src`` whose rows start on page boundaries (each layer's array in an anonymous
    mapping), as the dram tier's arena and pinned host buffers hand them over."""
    out: Arrays = {}
    for layer, arr in src.items():
        out[layer] = aligned_buffer(arr.nbytes)[: arr.nbytes].view(arr.dtype).reshape(arr.shape)
        out[layer][...] = arr
    return out


def _salted(src: Arrays, keys: int, start: int) -> Iterator[list[Key]]:
    """Key sets no write used yet (16-byte keys, as the engine's hashes are)."""
    for salt in itertools.count(start):
        yield [salt.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(keys)]


def _check(tier: NVMeTier, last: list[Key], src: Arrays, dst: Arrays) -> bool:
    for arr in dst.values():
        arr.fill(0)
    statuses = tier.read(_items(last, dst))
    return all(st.value == "ok" for st in statuses) and all(np.array_equal(dst[layer], src[layer]) for layer in src)


def _figures(
    times: dict[str, list[float]],
    gc_s: dict[str, list[float]],
    total: int,
    keys: int,
    rounds: int,
    ok: bool,
    direct: bool,
    raw_direct: bool,
    load: tuple[float, float],
) -> dict[str, Any]:
    g = {name: gbps(total, t) for name, t in times.items()}
    out: dict[str, Any] = {
        "bytes": total,
        "keys": keys,
        "rounds": rounds,
        "loadavg": list(load),
        "bytes_ok": float(ok),
        "raw_o_direct": raw_direct,
        "tier_o_direct": direct,
        "queue_depth": IO_DEPTH,
        "chunk_bytes": CHUNK_BYTES,
        "gbps": g,
        "collector_ms": collector_ms(gc_s),
        "write_vs_raw": ratio(times["raw_write"], times["tier_write"]),
        "write_aligned_vs_raw": ratio(times["raw_write"], times["tier_write_aligned"]),
        "read_vs_raw": ratio(times["raw_read"], times["tier_read"]),
        "read_aligned_vs_raw": ratio(times["raw_read_aligned"], times["tier_read_aligned"]),
    }
    if "engine_store" in times:
        out["engine_store_vs_raw"] = ratio(times["raw_write"], times["engine_store"])
        out["engine_load_vs_raw"] = ratio(times["raw_read"], times["engine_load"])
        out["engine_load_layerwise_vs_raw"] = ratio(times["raw_read"], times["engine_load_layerwise"])
    out.update(  # the figures ``kvstrata bench`` has always printed
        raw_write_gbps=g["raw_write"]["median"],
        raw_read_gbps=g["raw_read"]["median"],
        write_gbps=g["tier_write"]["median"],
        read_gbps=g["tier_read"]["median"],
        write_ratio=out["write_vs_raw"]["median"],
        read_ratio=out["read_vs_raw"]["median"],
        note="both sides O_DIRECT (page cache bypassed)"
        if direct
        else "O_DIRECT refused here: both sides buffered, page cache dropped before every read",
    )
    return out
