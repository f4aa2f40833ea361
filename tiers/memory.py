"""Memory tiers: ``dram`` (host memory, pinned when CUDA is present) and ``hbm`` (device memory).

Both keep their blocks in a :class:`~kvstrata.tiers.arena.SlotArena`: fixed-size slots carved
out of one pre-reserved arena, reused once freed (page faults happen once per slot).

``prefault = true`` (dram) faults the whole arena in ahead of use, from a background thread at
idle priority (``SCHED_IDLE``: it runs only on otherwise idle CPU), with
``madvise(MADV_POPULATE_WRITE)``, which maps pages without touching their bytes and so is safe
beside stores already writing into the arena. Stores then never pay first-touch page faults
(on a VM, a guest page's first touch can run at ~0.4 GB/s), at the price of the tier's full
capacity in RSS from the start, as a pinned arena has anyway. It needs Linux 5.14 or later;
elsewhere the arena stays lazily faulted and a log line says so.

Copies are by address (:mod:`kvstrata.core.hostcopy`), outside the tier's lock. The engine hands
the dram tier a :class:`~kvstrata.tiers.base.SpanBatch` (``host_spans``): per layer, keys and host
addresses; deletes come as an :class:`~kvstrata.tiers.base.IdBatch`. The index is a
:class:`~kvstrata.tiers.slot_table.SlotTable` (a row per key, a column per layer, numpy arrays),
so a batch costs a dict lookup per key and a few numpy operations, not Python work per
layer-block; a store of every layer of the same keys is one keys x layers block of them. A write
takes slots ascending (its copies merge into long runs with the caller's rows), starts the copy,
publishes the slots while the copy threads run (reads see them as missing until it is done, by
the batch's generation), then copies its own share. A read that overlapped a release checks its
slots again after copying: a slot freed and filled again meanwhile is a miss, never another
block's bytes. Any other batch (a list of items, buffers of any kind) takes the general path,
item by item.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from kvstrata.core.buffers import Buffer, copy_many, nbytes
from kvstrata.core.hostcopy import Copy, Run, int64_array, merge_runs, square_runs
from kvstrata.core.keys import Key
from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers.arena import EXTENT_BYTES, PREFAULT_CHUNK, SlotArena, populate_write_supported
from kvstrata.tiers.base import (
    BlockId,
    IdBatch,
    KeyGroup,
    ReadStatus,
    SpanBatch,
    SpanGroup,
    Tier,
    TierCapabilities,
    TierContext,
    TierOptions,
)
from kvstrata.tiers.slot_table import NO_ROW, SlotTable
from kvstrata.units import format_size, total_size

__all__ = [
    "EXTENT_BYTES",
    "PREFAULT_CHUNK",
    "DRAMTier",
    "HBMTier",
    "MemoryOptions",
    "SlotArena",
    "available_memory",
    "populate_write_supported",
]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available())


class MemoryOptions(TierOptions):
    pin_memory: Literal["auto", "on", "off"] = "auto"
    prefault: bool = False  # dram: fault the arena in ahead of use, at idle priority (see the module docstring)


def available_memory() -> int | None:
    """Host memory available to a new allocation (``MemAvailable`` of ``/proc/meminfo``), in bytes;
    None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _MemoryTier(Tier):
    """Shared implementation of the memory tiers."""

    Options: ClassVar[type[TierOptions]] = MemoryOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        super().__init__(name, capacity, options, context)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one write batch at a time (the engine's writes are anyway)
        self._table = SlotTable(context.layout.num_layers)
        self._generation = itertools.count(1)  # one per write batch
        self._writing = -1  # generation of the batch being copied in: its slots read as missing
        self._issued = 0  # the latest generation handed out
        available, where = self._available_memory()
        if available is not None and capacity > available:
            raise ConfigError(
                f"tier {name!r}: capacity {format_size(capacity)} exceeds this machine's available {where} "
                f"({format_size(available)})",
                field=f"tiers.{name}.capacity",
                value=capacity,
            )
        try:
            self._arena = self._make_arena(capacity)
        except (MemoryError, ValueError, RuntimeError) as exc:  # RuntimeError: torch's out-of-memory error
            raise TierError(f"tier {name!r}: cannot reserve {format_size(capacity)} of memory: {exc}") from None

    def _available_memory(self) -> tuple[int | None, str]:
        """What the arena may take at most, and where it lives (refused at open beyond it)."""
        return available_memory(), "memory"

    def _make_arena(self, capacity: int) -> SlotArena:
        raise NotImplementedError

    def close(self) -> None:
        self._arena.close()

    # ------------------------------------------------------------------ index (lock held)
    def _release(self, freed: dict[int, np.ndarray]) -> None:
        for size, offsets in freed.items():
            self._arena.release_many(offsets, size)

    def _rows(self, groups: Sequence[SpanGroup | KeyGroup], create: bool) -> list[np.ndarray]:
        """The table rows of each group's keys (groups sharing one key list share the lookup)."""
        table = self._table
        find = table.make if create else table.find
        memo: dict[int, np.ndarray] = {}
        out = []
        for g in groups:
            rows = memo.get(id(g.keys))
            if rows is None:
                rows = memo[id(g.keys)] = find(g.keys)
            out.append(rows)
        return out

    # ------------------------------------------------------------------ write
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        if type(items) is SpanBatch and self._arena.base is not None:
            return self._write_spans(items.groups)
        return self._write_items(items)

    def _write_square(self, groups: list[SpanGroup]) -> list[bool] | None:
        """:meth:`_write_spans` of groups that share one key list and one size (every layer of the
        same keys: the engine's uniform store), as one keys x layers block: a few numpy operations
        for the whole batch, whatever its number of layers. None: not such a batch (or the arena
        lacks room for all of it), the general path does it."""
        keys, size = groups[0].keys, groups[0].size
        n, m = len(keys), len(groups)
        if m < 2 or any(g.keys is not keys or g.size != size for g in groups) or len(set(keys)) != n:
            return None
        arena, table = self._arena, self._table
        layers = np.fromiter((g.layer for g in groups), np.int64, m)
        with self._write_lock:
            with self._lock:
                table.layer(int(layers.max()))
                rows = table.make(keys)
                self._release(table.clear_square(rows, layers))  # a rewrite frees its old slots first
                offsets = arena.allocate_many(size, n * m)
                if len(offsets) < n * m:
                    arena.release_many(offsets, size)
                    return None
                epoch = table.epoch
                gen = self._writing = self._issued = next(self._generation)
            offs = int64_array(offsets)
            try:
                slots = offs.reshape(m, n) + (arena.base or 0)
                copy = Copy(square_runs([g.addresses for g in groups], slots, size, True), background=True)
                with self._lock:
                    if table.epoch != epoch:  # a delete gave up rows meanwhile
                        rows = table.make(keys)
                    table.set_square(rows, layers, offs.reshape(m, n), size, gen)
                copy.finish()  # a store: on the store threads, never ahead of a load
            except BaseException:
                with self._lock:
                    self._unpublish(groups, [offsets[j * n : (j + 1) * n] for j in range(m)], gen, set())
                raise
            finally:
                with self._lock:
                    self._writing = -1
        return [True] * (n * m)

    def _write_spans(self, groups: list[SpanGroup]) -> list[bool]:
        """Slots ascending per group, the copy started, the slots published while it runs, then
        the copy finished (this thread copies too)."""
        square = self._write_square(groups)
        if square is not None:
            return square
        arena, table = self._arena, self._table
        with self._write_lock:
            with self._lock:
                rows = self._rows(groups, create=True)
                for g, r in zip(groups, rows, strict=True):
                    self._release(table.clear(r, table.layer(g.layer)))  # a rewrite frees its old slot first
                offsets = [arena.allocate_many(g.size, len(g.keys)) for g in groups]
                epoch = table.epoch
                gen = self._writing = self._issued = next(self._generation)
            freed: set[int] = set()
            try:
                copy = Copy(merge_runs(*_copy_lists(groups, offsets, arena.base or 0)), background=True)
                with self._lock:
                    if table.epoch != epoch:  # a delete gave up rows meanwhile
                        rows = self._rows(groups, create=True)
                    self._publish(groups, rows, offsets, gen, freed)
                copy.finish()  # a store: on the store threads, never ahead of a load
            except BaseException:
                with self._lock:
                    self._unpublish(groups, offsets, gen, freed)
                raise
            finally:
                with self._lock:
                    self._writing = -1
        ok: list[bool] = []
        for g, offs in zip(groups, offsets, strict=True):
            ok += [True] * len(offs) + [False] * (len(g.keys) - len(offs))  # no room left for the rest
        return ok

    def _publish(
        self, groups: list[SpanGroup], rows: list[np.ndarray], offsets: list[np.ndarray], gen: int, freed: set[int]
    ) -> None:
        """Lock held: point the table at the new slots (reads miss them until ``_writing`` clears)."""
        distinct: dict[int, bool] = {}
        for g, r, offs in zip(groups, rows, offsets, strict=True):
            r = r[: len(offs)]
            offs_arr = int64_array(offs)
            once = distinct.get(id(r))
            if once is None:
                once = distinct[id(r)] = len(np.unique(r)) == len(r)
            if not once:  # a layer-block twice in the batch: the last one stays, the others' slots go
                _, last = np.unique(r[::-1], return_index=True)
                keep = np.zeros(len(r), bool)
                keep[len(r) - 1 - last] = True
                extra = offs_arr[~keep].tolist()
                self._arena.release_many(extra, g.size)
                freed.update(extra)
                r, offs_arr = r[keep], offs_arr[keep]
            self._table.set(r, g.layer, offs_arr, g.size, gen)

    def _unpublish(self, groups: list[SpanGroup], offsets: list[np.ndarray], gen: int, freed: set[int]) -> None:
        """Lock held: a write that failed midway takes its slots back."""
        table = self._table
        rows = self._rows(groups, create=False)
        for g, r, offs in zip(groups, rows, offsets, strict=True):
            held = table.column(table.size, r, g.layer, 0) > 0
            table.unset(r[held & (table.column(table.gen, r, g.layer, 0) == gen)], g.layer)
            self._arena.release_many([off for off in offs.tolist() if off not in freed], g.size)
        table.prune(_joined(list({id(r): r for r in rows}.values())))

    def _write_items(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        """The general path: any buffers (spans, arrays, tensors, device memory), item by item."""
        ids = [it[0] for it in items]
        bufs = [it[1] for it in items]
        sizes = list(map(nbytes, bufs))
        arena, table = self._arena, self._table
        with self._write_lock:
            with self._lock:
                for key, layer in ids:
                    self._release(table.clear(table.find([key]), layer))
                offsets: list[int | None] = []
                for size in sizes:
                    got = arena.allocate_many(size, 1)
                    offsets.append(int(got[0]) if len(got) else None)
                gen = self._issued = next(self._generation)
            placed = [i for i, off in enumerate(offsets) if off is not None]
            try:
                copy_many([(arena.span(offsets[i], sizes[i]), bufs[i]) for i in placed], background=True)  # type: ignore[arg-type]
            except BaseException:
                with self._lock:
                    for i in placed:
                        arena.release_many([offsets[i]], sizes[i])  # type: ignore[list-item]
                raise
            with self._lock:
                for i in placed:
                    key, layer = ids[i]
                    row = table.make([key])
                    self._release(table.clear(row, table.layer(layer)))  # twice in this batch: the last one stays
                    table.set(row, layer, np.array([offsets[i]], np.int64), sizes[i], gen)
        return [off is not None for off in offsets]

    # ------------------------------------------------------------------ read
    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        if type(items) is SpanBatch and self._arena.base is not None:
            return self._read_spans(items.groups)
        return self._read_items(items)

    def _read_spans(self, groups: list[SpanGroup]) -> list[ReadStatus]:
        arena, table = self._arena, self._table
        base = arena.base or 0
        square = _square(groups) and max(g.layer for g in groups) < table.off.shape[1]
        with self._lock:
            epoch, releases, writing, issued = table.epoch, arena.releases, self._writing, self._issued
            rows = self._rows(groups, create=False)
            if square:  # every layer of the same keys (a load's usual batch): one gather per table array
                layers = np.fromiter((g.layer for g in groups), np.int64, len(groups))
                off2: np.ndarray = table.block(table.off, rows[0], layers).T
                good2: np.ndarray = table.block(table.size, rows[0], layers).T == groups[0].size  # noqa: SIM300
                if writing >= 0:  # the batch being copied in is not there yet
                    good2 &= table.block(table.gen, rows[0], layers).T != writing  # noqa: SIM300
                offs, good = list(off2), list(good2)
            else:
                offs = [table.column(table.off, r, g.layer, -1) for g, r in zip(groups, rows, strict=True)]
                good = [table.column(table.size, r, g.layer, 0) == g.size for g, r in zip(groups, rows, strict=True)]
                if writing >= 0:  # the batch being copied in is not there yet
                    for i, (g, r) in enumerate(zip(groups, rows, strict=True)):
                        good[i] &= table.column(table.gen, r, g.layer, 0) != writing
        every = bool(good2.all()) if square else all(ok.all() for ok in good)
        if square and every:
            Copy(square_runs([g.addresses for g in groups], off2 + base, groups[0].size, False)).finish()
        else:
            Copy(_read_runs(groups, offs, good, base)).finish()
        with self._lock:  # a slot freed (and maybe reused) while we copied: those bytes are not this block's
            if arena.releases != releases or table.epoch != epoch:
                good = self._still(groups, rows, offs, good, issued)
            elif every:
                return [ReadStatus.OK] * sum(len(g.keys) for g in groups)
        out: list[ReadStatus] = []
        for ok in good:
            out += [ReadStatus.OK] * len(ok) if ok.all() else [_STATUS[x] for x in ok.tolist()]
        return out

    def _still(
        self,
        groups: list[SpanGroup],
        rows: list[np.ndarray],
        offs: list[np.ndarray],
        good: list[np.ndarray],
        issued: int,
    ) -> list[np.ndarray]:
        """Lock held: which good reads still find their block where they copied it from, written
        no later than the read began (a slot freed and filled again since is another write's)."""
        table = self._table
        now_rows = self._rows(groups, create=False)
        out = []
        for g, r, now_r, off, ok in zip(groups, rows, now_rows, offs, good, strict=True):
            same = (now_r == r) & (table.column(table.off, now_r, g.layer, -1) == off)
            out.append(ok & same & (table.column(table.gen, now_r, g.layer, 0) <= issued))
        return out

    def _locate(self, key: Key, layer: int) -> tuple[int, int, int] | None:
        """Lock held: (offset, size, generation) of one layer-block, None when absent (or being written)."""
        table = self._table
        row = table.find([key])
        size = int(table.column(table.size, row, layer, 0)[0])
        gen = int(table.column(table.gen, row, layer, 0)[0])
        if not size or gen == self._writing:
            return None
        return int(table.column(table.off, row, layer, -1)[0]), size, gen

    def _read_items(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        """The general path: any destination buffers, item by item (a destination's size is read
        after its block is located)."""
        ids = [it[0] for it in items]
        dsts = [it[1] for it in items]
        arena = self._arena
        with self._lock:
            locs = [self._locate(key, layer) for key, layer in ids]
            releases = arena.releases
        out = [
            ReadStatus.OK if loc is not None and loc[1] == nbytes(dst) else ReadStatus.MISSING
            for loc, dst in zip(locs, dsts, strict=True)
        ]
        ok = [i for i, st in enumerate(out) if st is ReadStatus.OK]
        copy_many([(dsts[i], arena.span(locs[i][0], locs[i][1])) for i in ok])  # type: ignore[index]
        with self._lock:
            if arena.releases != releases:
                for i in ok:
                    if self._locate(*ids[i]) != locs[i]:
                        out[i] = ReadStatus.MISSING
        return out

    # ------------------------------------------------------------------ the rest
    def peek(self, ids: Sequence[BlockId]) -> list[Buffer | None]:
        """Zero-copy views of stored blocks (valid while the engine keeps them pinned)."""
        with self._lock:
            locs = [self._locate(key, layer) for key, layer in ids]
        return [None if loc is None else self._arena.view(loc[0], loc[1]) for loc in locs]

    def delete(self, ids: Sequence[BlockId]) -> None:
        groups: Sequence[KeyGroup] = ids.groups if type(ids) is IdBatch else _by_layer(ids)
        table = self._table
        with self._lock:
            touched = []
            for same in _by_keys(groups):  # the layers of one key list go as one keys x layers block
                rows = table.find(same[0].keys)
                touched.append(rows)
                real = rows[rows != NO_ROW]
                layers = np.fromiter((g.layer for g in same), np.int64, len(same))
                if len(same) > 1 and layers.max() < table.off.shape[1] and len(np.unique(real)) == len(real):
                    self._release(table.clear_square(real, layers))
                    continue
                for g in same:
                    self._release(table.clear(rows, g.layer))
            table.prune(_joined(touched))

    @property
    def used_bytes(self) -> int:
        return self._arena.used

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        if live_bytes + total_size(sizes) > self.capacity:
            return False
        with self._lock:
            return self._arena.can_allocate(sizes)


_STATUS = {True: ReadStatus.OK, False: ReadStatus.MISSING}


def _square(groups: Sequence[SpanGroup]) -> bool:
    """Whether ``groups`` are layers of one key list and one size (every layer of the same keys)."""
    if len(groups) < 2:
        return False
    keys, size = groups[0].keys, groups[0].size
    return all(g.keys is keys and g.size == size for g in groups)


def _by_keys(groups: Sequence[KeyGroup]) -> list[list[KeyGroup]]:
    """``groups`` gathered by key list (the same list object), in order of first appearance."""
    out: dict[int, list[KeyGroup]] = {}
    for g in groups:
        out.setdefault(id(g.keys), []).append(g)
    return list(out.values())


def _by_layer(ids: Sequence[BlockId]) -> list[KeyGroup]:
    """``ids`` as one group per layer."""
    groups: dict[int, list[Key]] = {}
    for key, layer in ids:
        groups.setdefault(layer, []).append(key)
    return [KeyGroup(layer, keys) for layer, keys in groups.items()]


def _read_runs(groups: list[SpanGroup], offs: list[np.ndarray], good: list[np.ndarray], base: int) -> list[Run]:
    """The copies of a read, merged into runs. Layers of one size all found (a load's usual
    batch) are merged in one pass over every layer: a pass per layer cost ~10-30 us of numpy
    calls each, most of a load of 1 KiB layer-blocks after the copy itself."""
    if len(groups) > 1 and len({g.size for g in groups}) == 1 and all(ok.all() for ok in good):
        dst = np.concatenate([int64_array(g.addresses) for g in groups])
        return merge_runs(dst, np.concatenate(offs) + base, groups[0].size)
    runs: list[Run] = []
    for g, off, ok in zip(groups, offs, good, strict=True):
        if ok.all():
            runs += merge_runs(g.addresses, off + base, g.size)
        else:
            runs += merge_runs(int64_array(g.addresses)[ok], off[ok] + base, g.size)
    return runs


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _sizes(groups: Sequence[SpanGroup], parts: list[np.ndarray]) -> int | np.ndarray:
    """The size of each copy of ``parts`` (one per group): one int when every group has one size."""
    first = groups[0].size if groups else 0
    if all(g.size == first for g in groups):
        return first
    return np.concatenate([np.full(len(p), g.size, np.int64) for g, p in zip(groups, parts, strict=True)])


def _copy_lists(groups: list[SpanGroup], offsets: list[np.ndarray], base: int) -> tuple[Any, Any, Any]:
    """(destinations, sources, sizes) of a span batch's copy into ``offsets`` of the arena at ``base``."""
    dst = [int64_array(offs) + base for offs in offsets]
    src = [
        int64_array(g.addresses if len(offs) == len(g.keys) else g.addresses[: len(offs)])
        for g, offs in zip(groups, offsets, strict=True)
    ]
    return _joined(dst), _joined(src), _sizes(groups, dst)


class DRAMTier(_MemoryTier):
    """Host-memory pool; pinned (page-locked) when CUDA is present so H2D/D2H copies are DMA."""

    capabilities = TierCapabilities(alignment=64, peek=True, space="slots", host_spans=True)

    def _make_arena(self, capacity: int) -> SlotArena:
        mode = getattr(self.options, "pin_memory", "auto")
        pin = mode == "on" or (mode == "auto" and cuda_available())
        return SlotArena(capacity, "cpu", pin=pin, prefault=bool(getattr(self.options, "prefault", False)))


class HBMTier(_MemoryTier):
    """Device-memory block pool: CUDA memory when present, a host stand-in otherwise.

    Inside vLLM the GPU cache is vLLM's own; standalone (``kvstrata replay``) this
    tier models an inference engine's GPU prefix cache.
    """

    capabilities = TierCapabilities(device_memory=True, alignment=256, peek=True, space="slots")

    def _available_memory(self) -> tuple[int | None, str]:
        if not cuda_available():  # the host stand-in
            return available_memory(), "memory"
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free), "GPU memory"

    def _make_arena(self, capacity: int) -> SlotArena:
        device = "cuda" if cuda_available() else "cpu"
        return SlotArena(capacity, device)
