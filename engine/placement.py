"""Placement strategies: what a store keeps where, what a lookup finds, what a load reads.

:class:`BlockPlacement` (uniform layouts, and ``layer_policy = "uniform"``) stores every layer of
every block and serves a block from the fastest tier holding all the layers asked for, with a
dict fast path for whole-block lookups. It also serves requests for a subset of the layers under
either strategy. :class:`~kvstrata.engine.perlayer.PerLayerPlacement` follows the per-layer-group
policies of hybrid layouts. The engine picks one at construction.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvstrata.core import native
from kvstrata.core.buffers import layers_row_addresses, row_addresses
from kvstrata.core.keys import Key
from kvstrata.engine.adopt import Adopter
from kvstrata.engine.index import Entry, pick_victims
from kvstrata.engine.mover import Mover
from kvstrata.engine.plans import BlockRead, LoadPlan, Pin, WriteJob
from kvstrata.engine.queue import StoreQueue
from kvstrata.engine.results import LoadHandle, LoadResult, LookupResult, StoreResult, done_future
from kvstrata.engine.slots import TierSlot
from kvstrata.engine.state import EngineState
from kvstrata.policies.admission import AdmitAll
from kvstrata.tiers import BlockId, ReadStatus, SpanBatch, SpanGroup

log = logging.getLogger("kvstrata.engine")

__all__ = ["INFLIGHT_WAIT_S", "BlockPlacement", "layer_items"]

#: Longest a load waits for a queued store of a block it needs (then loads what is there).
INFLIGHT_WAIT_S = 30.0
#: A load from a ``host_spans`` tier reads layers in calls of at least this many bytes (a call
#: costs ~10-50 us whatever its size: 32 calls of 256 KiB each doubled a 1 KiB-block load).
CALL_MIN_BYTES = 4 * 1024 * 1024

Buffers = Mapping[int, Any]


def layer_items(
    keys: Sequence[Key], layer: int, bufs: Any, positions: Sequence[int], size: int, spans: bool, write: bool
) -> list[tuple[BlockId, Any]] | SpanBatch:
    """Items ``((keys[i], layer), bufs[positions[i]])`` of one layer for a tier: a
    :class:`~kvstrata.tiers.base.SpanBatch` (addresses, no views) when the tier takes host spans
    (``spans``) and the buffers are host memory, else a list of the buffers themselves."""
    if spans:
        addresses = row_addresses(bufs, positions, size, write)
        if addresses is not None:
            return SpanBatch([SpanGroup(layer, keys, addresses, size)])
    return list(zip(zip(keys, itertools.repeat(layer)), [bufs[p] for p in positions], strict=True))


def doubling(layers: list[int]) -> list[list[int]]:
    """The layers of a layer-wise load from a tier without host spans (nvme, the pool, ``fs``), a
    call each group: 1, 2, 4, ... layers, a short last group joining the one before when it is at
    most half its size (32 layers: 1, 2, 4, 8, 17). The first layer arrives as fast as alone, and
    the load makes ~log2(L) calls instead of L: each call of such a tier starts and drains its own
    queue of reads (an nvme load of one 8 MiB layer a call ran at ~0.75x of one call for all)."""
    groups: list[list[int]] = []
    at, size = 0, 1
    while at < len(layers):
        groups.append(layers[at : at + size])
        at += size
        size *= 2
    if len(groups) > 1 and len(groups[-1]) <= len(groups[-2]) // 2:
        last = groups.pop()
        groups[-1] += last
    return groups


def _as_range(positions: list[int]) -> Sequence[int]:
    """``positions`` as a range when they are consecutive (the rows of every layer: checked once)."""
    if positions and positions == list(range(positions[0], positions[0] + len(positions))):
        return range(positions[0], positions[0] + len(positions))
    return positions


class BlockPlacement:
    """Every layer of every block, in every tier (uniform layouts)."""

    per_layer = False

    def __init__(self, state: EngineState, mover: Mover, adopter: Adopter) -> None:
        self.s = state
        self.mover = mover
        self.adopter = adopter
        self.queue: StoreQueue  # set by the engine right after construction

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[Key], mask: int, count: bool) -> LookupResult:
        """Longest prefix of ``keys`` whose blocks some tier holds ``mask`` of (queued stores count
        as the top tier), adopting what shared tiers hold past it."""
        s = self.s
        full = mask == s.all_mask
        with s.lock:
            if full:
                ext = native.NATIVE
                if ext is not None:  # one pass, ending at the first key no tier holds
                    served: list[Any] = ext.prefix_values(s.best, keys)
                else:
                    served = list(map(s.best.get, keys))  # one C-level pass
                    if None in served:
                        del served[served.index(None) :]
            else:
                served = self._lookup_partial(keys, mask)
            if len(served) < len(keys) and s.inflight:
                self._extend_inflight(keys, served, mask, full)
            n = len(served)
        if n < len(keys) and s.shared:
            served += self.adopter.adopt(keys[n:], mask)
            n = len(served)
        if count:
            with s.lock:
                s.count_lookup(served, len(keys) - n)
        return LookupResult(n, served, s.names, s.layout.block_size)

    def _lookup_partial(self, keys: Sequence[Key], mask: int) -> list[int]:
        served: list[int] = []
        for key in keys:
            pos = self.s.serving_tier(key, mask)
            if pos is None:
                break
            served.append(pos)
        return served

    def _extend_inflight(self, keys: Sequence[Key], served: list[Any], mask: int, full: bool) -> None:
        """Lock held: extend ``served`` over blocks held by a tier or by a queued store (top tier)."""
        s = self.s
        for key in keys[len(served) :]:
            pos = s.best.get(key) if full else s.serving_tier(key, mask)
            if pos is None:
                pending = s.inflight.get(key)
                if pending is None or pending[0] & mask != mask:
                    return
                pos = 0
            served.append(pos)

    # ------------------------------------------------------------------ load
    def plan(self, keys: Sequence[Key], mask: int) -> LoadPlan:
        """Lock held: what a load of ``mask`` of ``keys`` reads, pinned (or the stores to wait for)."""
        waits = self._inflight_waits(keys, mask) if self.s.inflight else []
        read = None if waits else self._plan_blocks(keys, mask)
        return LoadPlan(list(keys), mask, False, waits, read)

    def _plan_blocks(self, keys: Sequence[Key], mask: int) -> BlockRead:
        s = self.s
        blocks: list[tuple[Key, TierSlot, Entry[Key]]] = []
        best = s.best.get if mask == s.all_mask else None  # every layer: the fastest tier holding them all
        tiers = s.tiers
        first = -1
        one = True
        for key in keys:
            pos = best(key) if best is not None else s.serving_tier(key, mask)
            if pos is None:
                break
            idx = tiers[pos]
            e = idx.entries[key]
            e.pins += 1
            idx.eviction.access(key)
            blocks.append((key, idx, e))
            if pos != first:
                one = first < 0
                first = pos
        return BlockRead(blocks, tiers[first] if blocks and one else None)

    def _inflight_waits(self, keys: Sequence[Key], mask: int) -> list[threading.Event]:
        """Lock held: the queued stores the restorable prefix of ``keys`` depends on."""
        s = self.s
        waits: dict[int, threading.Event] = {}
        for key in keys:
            if s.serving_tier(key, mask) is not None:
                continue
            pending = s.inflight.get(key)
            if pending is None or pending[0] & mask != mask:
                break
            waits[id(pending[1])] = pending[1]
        return list(waits.values())

    def release(self, plan: LoadPlan) -> None:
        """Lock held: give back the pins of a plan no load consumed."""
        if plan.read is not None and not plan.used:
            plan.used = True
            self.mover.unpin(plan.read.pins())

    def load(self, plan: LoadPlan, buffers: Buffers, layers: list[int], handle: LoadHandle) -> None:
        """Start the load ``plan`` describes (it is consumed)."""
        plan.used = True
        pool = self.mover.load_pool
        if plan.waits:
            pool.submit(self._deferred, plan, buffers, layers, handle)
        elif plan.read is None or not plan.read.n:
            self.finish_empty(plan, handle)
        else:
            pool.submit(self.read, plan, buffers, layers, handle)

    def finish_empty(self, plan: LoadPlan, handle: LoadHandle) -> None:
        handle.finish(LoadResult(len(plan.keys), 0, []))

    def _deferred(self, plan: LoadPlan, buffers: Buffers, layers: list[int], handle: LoadHandle) -> None:
        try:
            for ev in plan.waits:
                ev.wait(INFLIGHT_WAIT_S)  # a stuck store turns into a shorter prefix, not a hang
            with self.s.lock:
                again = self.replan(plan)
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            handle.fail(exc)
            return
        if again.read is None or not again.read.n:
            self.finish_empty(again, handle)
            return
        self.read(again, buffers, layers, handle)

    def replan(self, plan: LoadPlan) -> LoadPlan:
        """Lock held: the plan after the stores it waited for finished (no more waiting)."""
        return LoadPlan(plan.keys, plan.mask, False, [], self._plan_blocks(plan.keys, plan.mask), True)

    def read(self, plan: LoadPlan, buffers: Buffers, layers: list[int], handle: LoadHandle) -> None:
        read = plan.read
        assert isinstance(read, BlockRead)
        blocks = read.blocks
        bad: dict[int, ReadStatus] = {}  # plan position -> first failure
        try:
            by_tier: dict[int, Sequence[int]] = {}
            if read.tier is not None:  # usual: the whole prefix from one tier
                by_tier = {read.tier.position: range(len(blocks))}
                keys = {read.tier.position: [b[0] for b in blocks]}
            else:
                for i, (_, idx, _) in enumerate(blocks):
                    by_tier.setdefault(idx.position, []).append(i)  # type: ignore[attr-defined]
                keys = {pos: [blocks[i][0] for i in members] for pos, members in by_tier.items()}
            spans = {pos: self.s.tiers[pos].tier.capabilities.host_spans for pos in by_tier}
            chunked = not handle.layer_by_layer and all(spans.values())
            # waited for whole (load_sync): every layer in one call per tier, whatever the tier, so
            # an nvme read keeps its queue full across layers instead of draining at each one
            if handle.waited:
                chunks = [layers]
            elif handle.layer_by_layer and not all(spans.values()):
                chunks = doubling(layers)
            else:
                chunks = self._layer_chunks(layers, len(blocks), chunked)
            for chunk in chunks:
                for pos, members in by_tier.items():
                    items = self._chunk_items(keys[pos], chunk, buffers, members, spans[pos])
                    statuses = self.mover.safe_read(self.s.tiers[pos], items)
                    if statuses.count(ReadStatus.OK) != len(statuses):
                        for i, st in zip(itertools.cycle(members), statuses, strict=False):
                            if st is not ReadStatus.OK:
                                bad.setdefault(i, st)
                for layer in chunk:
                    handle._layer_done(layer)
            handle.future.set_result(
                self._finish(read, bad, len(plan.keys), {layer: buffers[layer] for layer in layers})
            )
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            log.exception("load failed")
            with self.s.lock:
                self.mover.unpin(read.pins())
            handle.future.set_exception(exc)
        finally:
            handle._all_done()

    def _layer_chunks(self, layers: list[int], blocks: int, chunked: bool) -> list[list[int]]:
        """The layers a load reads per tier call: one by one (layer-wise loads see each as soon as
        it is in place), or, for a load nobody waits on layer by layer from ``host_spans`` tiers
        (``chunked``), several per call up to :data:`CALL_MIN_BYTES`, so small blocks do not pay
        a call each."""
        if not chunked:
            return [[layer] for layer in layers]
        chunks: list[list[int]] = [[]]
        size = 0
        for layer in layers:
            if size >= CALL_MIN_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(layer)
            size += blocks * self.s.layer_bytes[layer]
        return [c for c in chunks if c]

    def _chunk_items(
        self, keys: list[Key], chunk: list[int], buffers: Buffers, members: Sequence[int], spans: bool
    ) -> list[tuple[BlockId, Any]] | SpanBatch:
        """Items of the layers of ``chunk`` for ``keys`` (layer-major: statuses come back in that order)."""
        sizes = self.s.layer_bytes
        if len(chunk) == 1:
            return layer_items(keys, chunk[0], buffers[chunk[0]], members, sizes[chunk[0]], spans, write=True)
        if not spans:
            return [it for layer in chunk for it in layer_items(keys, layer, buffers[layer], members, 0, False, True)]
        sz = [sizes[layer] for layer in chunk]
        found = layers_row_addresses([buffers[layer] for layer in chunk], members, sz, True)
        if found is None:  # not host memory after all: item by item
            return [it for layer in chunk for it in layer_items(keys, layer, buffers[layer], members, 0, False, True)]
        return SpanBatch([SpanGroup(layer, keys, a, n) for layer, a, n in zip(chunk, found, sz, strict=True)])

    def _finish(
        self, read: BlockRead, bad: dict[int, ReadStatus], requested: int, loaded: dict[int, Any] | None = None
    ) -> LoadResult:
        blocks = read.blocks
        first_bad = min(bad) if bad else len(blocks)
        if read.tier is not None:
            names = [read.tier.name] * first_bad
        else:
            names = [idx.name for _, idx, _ in blocks[:first_bad]]
        failed = [blocks[i][0] for i in sorted(bad)]
        with self.s.lock:
            self.mover.unpin(read.pins())
            for i in sorted(bad):
                self.mover.forget(blocks[i][1], blocks[i][0], missing=bad[i] is ReadStatus.MISSING)
        self.mover.promote(blocks[:first_bad], loaded)
        return LoadResult(requested, first_bad, names, failed)

    # ------------------------------------------------------------------ store
    def store(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None, mask: int, first_block: int | None
    ) -> Future[StoreResult]:
        s = self.s
        top = s.tiers[0]
        with s.lock:
            todo: list[int] = []
            present = []
            entries = top.entries
            if not any(map(entries.__contains__, keys)) and top.evicting.isdisjoint(keys):
                todo = list(range(len(keys)))  # usual: new blocks
            else:
                for i, key in enumerate(keys):
                    e = entries.get(key)
                    if e is not None and e.layers & mask == mask:
                        top.eviction.access(key)
                        present.append(key)
                    elif key not in top.evicting:
                        todo.append(i)
            result = StoreResult(present=len(keys) - len(todo))
            if not todo:
                return done_future(result)
            per_block = sum(s.layer_bytes[layer] for layer in buffers)
            # the batch's blocks already in the top tier (and its parent) must survive the batch
            pinned = s.pin(top, present + ([parent] if parent is not None else []))
            parents = [keys[i - 1] if i > 0 else parent for i in todo]
            job = WriteJob([keys[i] for i in todo], parents, mask, [(layer, buffers[layer]) for layer in buffers], todo)
            return self.queue.submit(job, [per_block] * len(todo), result, pinned)

    def write_job(self, job: WriteJob) -> tuple[int, int]:
        """Write one admitted part of a store into the top tier (and below): (stored, failed)."""
        s = self.s
        written = self.mover.write_into(s.tiers[0], job, source=None)
        if written:
            self.mover.write_through(s.tiers[0], written, job)
        written = self.write_below_top(job, written)
        return len(written), len(job.keys) - len(written)

    def write_below_top(self, job: WriteJob, written: list[int]) -> list[int]:
        """Layers the top tier may not hold go to the first tier that may (per-layer only)."""
        return written

    # ------------------------------------------------------------------ writing into a tier
    def admit(self, idx: TierSlot, job: WriteJob) -> tuple[list[tuple[int, int]], list[tuple[Key, Entry[Key]]]]:
        """Caller holds ``idx.space_lock``: (job position, layers to write) of the blocks ``idx``
        takes, and snapshots shed for them (none here)."""
        todo = []
        with self.s.lock:
            entries = idx.entries
            if (
                type(idx.admission) is AdmitAll
                and not any(map(entries.__contains__, job.keys))
                and idx.evicting.isdisjoint(job.keys)
            ):
                return [(j, job.mask) for j in range(len(job.keys))], []  # usual: new blocks, all admitted
            for j, key in enumerate(job.keys):
                e = idx.entries.get(key)
                if e is not None and e.layers & job.mask == job.mask:
                    continue
                if key in idx.evicting:
                    continue
                if idx.admission.admit(key):
                    todo.append((j, job.mask))
                else:
                    idx.counters.not_admitted += 1
        return todo, []

    def per_key_bytes(self, job: WriteJob, todo: list[tuple[int, int]]) -> int:
        return sum(self.s.layer_bytes[layer] for layer, _ in job.layer_bufs) or 1

    def part_sizes(self, job: WriteJob, part: list[tuple[int, int]]) -> list[int]:
        lb = self.s.layer_bytes
        return [lb[layer] for layer, _ in job.layer_bufs] * len(part)  # per key, every layer (in order)

    def items(
        self, job: WriteJob, part: list[tuple[int, int]], source: TierSlot | None, mover: Mover, spans: bool = False
    ) -> list[tuple[BlockId, Any]] | SpanBatch:
        """Layer-major: one layer's blocks are adjacent, so tiers that pack records in order
        (nvme) serve a layer-by-layer load of many keys with a few large reads. ``part``:
        (job position, layer mask to write) pairs. ``spans``: the tier takes host spans, so the
        caller's host rows go as a :class:`~kvstrata.tiers.base.SpanBatch` (addresses, no views)."""
        every = job.masks is None and not self.per_layer  # every key writes every layer of the job
        positions = [j for j, _ in part]
        keys = [job.keys[j] for j in positions]
        per_layer: list[tuple[int, Any, list[int], list[Key]]] = []
        for layer, lb in job.layer_bufs:
            mine = positions if every else [j for j, m in part if m >> layer & 1]
            if mine:
                per_layer.append((layer, lb, mine, keys if every else [job.keys[j] for j in mine]))
        if source is not None:
            ids = [(k, layer) for layer, _, _, ks in per_layer for k in ks]
            return list(zip(ids, mover.source_views(source, ids), strict=True))
        src: Sequence[int] = job.src_index
        batch = self._span_batch(per_layer, src, every) if spans else None
        if batch is not None:
            return batch
        return [((k, layer), lb[src[j]]) for layer, lb, mine, ks in per_layer for k, j in zip(ks, mine, strict=True)]

    def _span_batch(
        self, per_layer: list[tuple[int, Any, list[int], list[Key]]], src: Sequence[int], every: bool
    ) -> SpanBatch | None:
        """The caller's rows by address, or None when some are not host memory."""
        sizes = self.s.layer_bytes
        if every and per_layer:  # the same rows of every layer: every address in one call
            rows = _as_range([src[j] for j in per_layer[0][2]])
            sz = [sizes[layer] for layer, _, _, _ in per_layer]
            found = layers_row_addresses([lb for _, lb, _, _ in per_layer], rows, sz, False)
            if found is None:
                return None
            return SpanBatch(
                [SpanGroup(layer, ks, a, n) for (layer, _, _, ks), a, n in zip(per_layer, found, sz, strict=True)]
            )
        groups: list[SpanGroup] = []
        for layer, lb, mine, ks in per_layer:
            addresses = row_addresses(lb, [src[j] for j in mine], sizes[layer], False)
            if addresses is None:
                return None
            groups.append(SpanGroup(layer, ks, addresses, sizes[layer]))
        return SpanBatch(groups)

    def victims(self, idx: TierSlot, need: int) -> list[tuple[Key, Entry[Key]]]:
        """Lock held: victims in policy order."""
        return pick_victims(idx, need)

    def committed(self, idx: TierSlot, key: Key, parent: Key | None, layers: int, position: int) -> None:
        """Lock held: a write into ``idx`` committed ``layers`` of ``key``."""

    def after_drop(self, dropped: Sequence[tuple[Key, Any]]) -> None:
        """Parts of blocks left a tier (evicted or forgotten)."""

    def positions(self, keys: Sequence[Key]) -> list[int] | None:
        """Per key, the block count its state snapshot restores (None: no snapshots)."""
        return None

    # ------------------------------------------------------------------ background copies
    def write_through_picks(
        self, idx: TierSlot, nxt: TierSlot, positions: list[int], job: WriteJob
    ) -> list[tuple[int, int]]:
        """Lock held: (job position, layers) of what ``idx`` just wrote that the next tier takes."""
        return [(j, job.mask) for j in positions]

    def copy_job(self, job: WriteJob, picked: list[tuple[int, int]], pinned: list[Pin]) -> WriteJob:
        return WriteJob(
            [k for _, k, _ in pinned],
            [e.parent for _, _, e in pinned],
            job.mask,
            [(layer, None) for layer, _ in job.layer_bufs],
            list(range(len(pinned))),
        )

    def promotable(self, src: TierSlot, keys: list[Key]) -> list[Key]:
        """Lock held: the keys served from ``src`` that move up (complete blocks only)."""
        all_mask = self.s.all_mask
        return [k for k in keys if k in src.entries and src.entries[k].layers == all_mask]

    def promote_job(self, pinned: list[Pin]) -> WriteJob:
        n = self.s.layout.num_layers
        return WriteJob(
            [k for _, k, _ in pinned],
            [e.parent for _, _, e in pinned],
            self.s.all_mask,
            [(layer, None) for layer in range(n)],
            list(range(len(pinned))),
        )

    # ------------------------------------------------------------------ restore points
    @property
    def wanted(self) -> Mapping[Key, None]:
        """Branch points seen by lookups (none: uniform lookups do not look for them)."""
        return {}

    def restore_needs(self, n: int) -> dict[int, range]:
        return {layer: range(n) for layer in range(self.s.layout.num_layers)}
