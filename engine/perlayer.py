"""Per-layer placement: the per-layer-group policies of hybrid layouts (:mod:`kvstrata.policies.layers`).

``store`` keeps of each layer only what a restore needs (window blocks before restore points,
state snapshots at restore points), each group lives only in the tiers it may occupy, and a
lookup or load of every layer restores the longest prefix at which every group is consistent.
Victims shed their lowest-priority groups' layers first; a block whose full-attention layers no
tier holds any more cools the rest of its chain (:class:`~kvstrata.engine.chains.Chains`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvstrata.core import native
from kvstrata.core.keys import Key
from kvstrata.core.masks import layers_of, or_all
from kvstrata.engine.adopt import Adopter
from kvstrata.engine.chains import Chains
from kvstrata.engine.index import Entry, held_layers, lowest_priority_fn, missing_layers, pick_victims, snapshot_room
from kvstrata.engine.mover import Mover
from kvstrata.engine.placement import BlockPlacement, Buffers, layer_items
from kvstrata.engine.plans import LoadPlan, Pin, RestoreRead, WriteJob
from kvstrata.engine.results import LoadHandle, LoadResult, LookupResult, StoreResult, done_future
from kvstrata.engine.slots import TierSlot
from kvstrata.engine.state import EngineState
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers import ReadStatus

__all__ = ["PerLayerPlacement", "prefix_run"]

_NOTHING: Entry[Key] = Entry(0, 0)  # what a tier holds of a key it lacks
_LAYERS = operator.attrgetter("layers")


def prefix_run(masks: Sequence[int], prefix: int, num_layers: int) -> int:
    """How many of ``masks``, from the first, hold every layer of ``prefix`` (no Python step per
    mask: a 128K-token prompt is 8,192 of them, and a lookup is a few passes over them)."""
    ext = native.NATIVE
    if ext is not None and num_layers < 63:
        return ext.prefix_run(masks, prefix)
    if num_layers < 63:
        arr = np.fromiter(masks, np.int64, len(masks))
        short = (arr & prefix) != prefix
        return int(short.argmax()) if short.any() else len(masks)
    held = list(map(prefix.__eq__, map(prefix.__and__, masks)))
    return held.index(False) if False in held else len(held)


class PerLayerPlacement(BlockPlacement):
    """What each layer group keeps, and where, under per-layer policies."""

    per_layer = True

    def __init__(self, state: EngineState, mover: Mover, adopter: Adopter, policies: LayerPolicies) -> None:
        super().__init__(state, mover, adopter)
        self.policies = policies
        self.tier_masks = [policies.tier_mask(t.config.name, t.config.kind) for t in state.tiers]
        self.chains: Chains[Key] = Chains(policies.prefix_mask)
        self.lowest = lowest_priority_fn([(g.mask, g.priority) for g in policies.groups])
        adopter.tier_masks = self.tier_masks

    @property
    def wanted(self) -> Mapping[Key, None]:
        return self.chains.wanted

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[Key], mask: int, count: bool) -> LookupResult:
        if mask != self.s.all_mask:
            return super().lookup(keys, mask, count)
        s = self.s
        with s.lock:
            per_tier = self._held_masks(keys)
            avail = self._avail(keys, per_tier=per_tier)
            if len(avail) == len(keys) or not s.shared:
                return self._restore_result(keys, per_tier, avail, count)
        self.adopter.adopt_restore(keys, len(avail), self.policies.prefix_mask)  # shared tiers may hold more
        with s.lock:
            per_tier = self._held_masks(keys)
            return self._restore_result(keys, per_tier, self._avail(keys, per_tier=per_tier), count)

    def _held_masks(self, keys: Sequence[Key]) -> list[list[int]]:
        """Lock held: per tier, the layer mask it holds of each key (0: none). C-level passes only:
        a 128K-token prompt is 8,192 keys, and a Python step per key is most of a lookup."""
        ext = native.NATIVE
        if ext is not None:
            return [ext.attr_values(idx.entries, keys, "layers", _NOTHING.layers) for idx in self.s.tiers]
        return [list(map(_LAYERS, map(idx.entries.get, keys, itertools.repeat(_NOTHING)))) for idx in self.s.tiers]

    def _avail(self, keys: Sequence[Key], inflight: bool = True, per_tier: list[list[int]] | None = None) -> list[int]:
        """Lock held: per key, the layers held by any tier (and queued stores), up to the first key
        lacking a full-attention layer (no restore reaches past it)."""
        per_tier = self._held_masks(keys) if per_tier is None else per_tier
        if len(per_tier) == 1:
            avail = per_tier[0]
        elif len(per_tier) == 2:
            avail = [a | b for a, b in zip(*per_tier, strict=True)]
        else:
            avail = list(map(or_all, zip(*per_tier, strict=True)))
        pending = self.s.inflight
        if inflight and pending:
            avail = [a | p[0] if (p := pending.get(k)) is not None else a for k, a in zip(keys, avail, strict=True)]
        return avail[: prefix_run(avail, self.policies.prefix_mask, self.s.layout.num_layers)]

    def _serving(self, key: Key, need: int) -> int | None:
        """Lock held: the slowest of the fastest tiers holding each layer of ``need`` (queued stores
        count as the top tier), or None when some layer is nowhere."""
        pending = self.s.inflight.get(key)
        left = need & ~pending[0] if pending is not None else need
        pos = 0
        for idx in self.s.tiers:
            if not left:
                break
            e = idx.entries.get(key)
            if e is not None and e.layers & left:
                left &= ~e.layers
                pos = idx.position
        return pos if not left else None

    def _restore_result(
        self, keys: Sequence[Key], per_tier: list[list[int]], avail: list[int], count: bool
    ) -> LookupResult:
        """Lock held: the longest consistent prefix, and the tier each of its blocks needs."""
        s = self.s
        n = self.policies.restorable(avail, held=len(avail))  # ``_avail`` ends where a prefix layer is missing
        if n < len(avail):  # full-attention blocks reach further: a restore point there would pay
            self.chains.want(keys[len(avail) - 1])
        need = self.policies.needed_masks(n)
        top = per_tier[0][:n]
        if len(per_tier) == 1 or list(map(operator.and_, top, need)) == need:  # usual: the top tier holds it all
            served = [0] * n
        else:
            served = [0 if t & m == m else (self._serving(k, m) or 0) for k, t, m in zip(keys, top, need, strict=False)]
        if count:
            s.count_lookup(served, len(keys) - n)
        return LookupResult(n, served, s.names, s.layout.block_size)

    # ------------------------------------------------------------------ load (restore)
    def plan(self, keys: Sequence[Key], mask: int) -> LoadPlan:
        if mask != self.s.all_mask:
            return super().plan(keys, mask)
        inflight = self.s.inflight
        waits = list({id(p[1]): p[1] for k in keys if (p := inflight.get(k)) is not None}.values())
        return LoadPlan(list(keys), mask, True, waits, None if waits else self._plan_restore(keys))

    def replan(self, plan: LoadPlan) -> LoadPlan:
        if not plan.restore:
            return super().replan(plan)
        return LoadPlan(plan.keys, plan.mask, True, [], self._plan_restore(plan.keys), True)

    def _plan_restore(self, keys: Sequence[Key]) -> RestoreRead:
        """Lock held: the longest consistent prefix and, per block, which layers come from which
        tier (the fastest holder of each), pinned."""
        tiers = self.s.tiers
        avail = self._avail(keys, inflight=False)
        n = self.policies.restorable(avail, held=len(avail))
        need = self.policies.needed_masks(n)
        parts: list[list[tuple[TierSlot, Entry[Key], int]]] = []
        for key, m in zip(keys[:n], need, strict=True):
            mine = []
            for left_idx in _split(tiers, key, m):
                idx, e, layers = left_idx
                e.pins += 1
                idx.eviction.access(key)
                mine.append((idx, e, layers))
            parts.append(mine)
        return RestoreRead(list(keys[:n]), n, need, parts)

    def finish_empty(self, plan: LoadPlan, handle: LoadHandle) -> None:
        if not plan.restore:
            super().finish_empty(plan, handle)
            return
        handle.finish(LoadResult(len(plan.keys), 0, [], layer_blocks={}))

    def read(self, plan: LoadPlan, buffers: Buffers, layers: list[int], handle: LoadHandle) -> None:
        if not plan.restore:
            super().read(plan, buffers, layers, handle)
            return
        read = plan.read
        assert isinstance(read, RestoreRead)
        tiers = self.s.tiers
        failed: dict[int, int] = {}  # block -> layers that did not arrive intact
        bad: list[tuple[TierSlot, Key, bool]] = []  # (tier, key, whether the tier no longer had it)
        try:
            for layer in layers:
                bit = 1 << layer
                by_tier: dict[int, list[int]] = {}
                for i, mine in enumerate(read.parts):
                    for idx, _, m in mine:
                        if m & bit:
                            by_tier.setdefault(idx.position, []).append(i)
                size = self.s.layer_bytes[layer]
                for pos, members in by_tier.items():
                    spans = tiers[pos].tier.capabilities.host_spans
                    items = layer_items(
                        [read.keys[i] for i in members], layer, buffers[layer], members, size, spans, True
                    )
                    statuses = self.mover.safe_read(tiers[pos], items)
                    if statuses.count(ReadStatus.OK) == len(statuses):
                        continue
                    for i, st in zip(members, statuses, strict=True):
                        if st is not ReadStatus.OK:
                            failed[i] = failed.get(i, 0) | bit
                            bad.append((tiers[pos], read.keys[i], st is ReadStatus.MISSING))
                handle._layer_done(layer)
            handle.future.set_result(self._finish_restore(read, failed, bad, len(plan.keys)))
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            with self.s.lock:
                self.mover.unpin(read.pins())
            handle.future.set_exception(exc)
        finally:
            handle._all_done()

    def _finish_restore(
        self, read: RestoreRead, failed: dict[int, int], bad: list[tuple[TierSlot, Key, bool]], requested: int
    ) -> LoadResult:
        ok = [m & ~failed.get(i, 0) for i, m in enumerate(read.need)]
        n = self.policies.restorable(ok) if failed else read.n
        tiers = [max((idx.position for idx, _, _ in mine), default=0) for mine in read.parts[:n]]
        with self.s.lock:
            self.mover.unpin(read.pins())
            for idx, key, missing in bad:
                self.mover.forget(idx, key, missing)
        served = [(k, idx, e) for k, mine in zip(read.keys[:n], read.parts[:n], strict=True) for idx, e, _ in mine]
        self.mover.promote(served)
        names = [self.s.names[p] for p in tiers]
        failed_keys = [read.keys[i] for i in sorted(failed)]
        return LoadResult(requested, n, names, failed_keys, layer_blocks=self.policies.needed(n))

    # ------------------------------------------------------------------ store
    def store(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None, mask: int, first_block: int | None
    ) -> Future[StoreResult]:
        s = self.s
        top = s.tiers[0]
        provided = _provided(len(keys), buffers)
        with s.lock:
            wanted = self.chains.wanted
            points = self.policies.restore_points(len(keys), first_block, lambda i: keys[i] in wanted)
            keep = self.policies.keep_masks(len(keys), points)
            todo: list[int] = []
            masks: list[int] = []
            for i, key in enumerate(keys):
                missing = missing_layers(s.tiers, self.tier_masks, key, keep[i] & provided[i])
                if missing:
                    todo.append(i)
                    masks.append(missing)
                elif key in top.entries:
                    top.eviction.access(key)
            result = StoreResult(present=len(keys) - len(todo))
            if not todo:
                return done_future(result)
            present = [k for k in keys if k in top.entries]
            pinned = s.pin(top, present + ([parent] if parent is not None else []))
            base = first_block if first_block is not None else 0
            job = WriteJob(
                [keys[i] for i in todo],
                [keys[i - 1] if i > 0 else parent for i in todo],
                mask,
                [(layer, buffers[layer]) for layer in sorted(buffers)],
                todo,
                masks=masks,
                positions=[base + i + 1 for i in todo],
            )
            return self.queue.submit(job, [s.mask_bytes(m) for m in masks], result, pinned)

    def write_below_top(self, job: WriteJob, written: list[int]) -> list[int]:
        """Write the layers the top tier may not hold into the first tier that may (caller's buffers)."""
        rest = [m & ~self.tier_masks[0] for m in job.masks or ()]
        got_any: set[int] = set()
        for idx, tmask in zip(self.s.tiers[1:], self.tier_masks[1:], strict=True):
            if not any(rest):
                break
            sub = WriteJob(job.keys, job.parents, job.mask, job.layer_bufs, job.src_index, masks=list(rest))
            sub.positions = job.positions
            got = self.mover.write_into(idx, sub, source=None)
            if got:
                self.mover.write_through(idx, got, sub)
            got_any.update(got)
            rest = [m & ~tmask for m in rest]
        return sorted(set(written) | got_any)

    # ------------------------------------------------------------------ writing into a tier
    def admit(self, idx: TierSlot, job: WriteJob) -> tuple[list[tuple[int, int]], list[tuple[Key, Entry[Key]]]]:
        """Caller holds ``idx.space_lock``: the layers ``idx`` may hold and lacks, admitted, with
        state snapshots within its budget (shorter-prefix snapshots shed for them)."""
        tmask = self.tier_masks[idx.position]
        todo: list[tuple[int, int]] = []
        shed: list[tuple[Key, Entry[Key]]] = []
        reserved = 0
        with self.s.lock:
            budget = self.policies.checkpoint_budget * idx.tier.capacity
            for j, key in enumerate(job.keys):
                want = job.mask_of(j) & tmask
                if not want or key in idx.evicting:
                    continue
                e = idx.entries.get(key)
                if e is not None:
                    want &= ~e.layers
                if not want:
                    continue
                if not idx.admission.admit(key):
                    idx.counters.not_admitted += 1
                    continue
                if want & idx.snap_mask:
                    size = idx.mask_bytes(want & idx.snap_mask)
                    before = len(shed)
                    room = snapshot_room(idx, key, size + reserved, job.position_of(j), budget, shed)
                    idx.counters.snapshots_dropped += len(shed) - before
                    idx.counters.evictions += len(shed) - before
                    if room:
                        reserved += size
                    else:
                        idx.counters.snapshots_not_admitted += 1
                        want &= ~idx.snap_mask
                if want:
                    todo.append((j, want))
        return todo, shed

    def per_key_bytes(self, job: WriteJob, todo: list[tuple[int, int]]) -> int:
        return max((self.s.mask_bytes(m) for _, m in todo), default=1) or 1

    def part_sizes(self, job: WriteJob, part: list[tuple[int, int]]) -> list[int]:
        """In the order :meth:`items` writes them (layer-major): a tier that packs records in order
        (nvme) prices the layout the write will have."""
        lb = self.s.layer_bytes
        return [lb[layer] for layer, _ in job.layer_bufs for _, m in part if m >> layer & 1]

    def victims(self, idx: TierSlot, need: int) -> list[tuple[Key, Entry[Key]]]:
        return pick_victims(idx, need, self.lowest)

    def committed(self, idx: TierSlot, key: Key, parent: Key | None, layers: int, position: int) -> None:
        self.chains.note(key, parent, layers & idx.snap_mask, position)

    def after_drop(self, dropped: Sequence[tuple[Key, Any]]) -> None:
        s = self.s
        with s.lock:
            self.chains.after_drop(dropped, lambda k: held_layers(s.tiers, k), s.cold)

    def positions(self, keys: Sequence[Key]) -> list[int] | None:
        return [self.chains.position(k) for k in keys]

    # ------------------------------------------------------------------ background copies
    def write_through_picks(
        self, idx: TierSlot, nxt: TierSlot, positions: list[int], job: WriteJob
    ) -> list[tuple[int, int]]:
        nxt_mask = self.tier_masks[nxt.position]
        picked = []
        for j in positions:
            e = idx.entries.get(job.keys[j])
            m = job.mask_of(j) & nxt_mask & (e.layers if e is not None else 0)
            if m:
                picked.append((j, m))
        return picked

    def copy_job(self, job: WriteJob, picked: list[tuple[int, int]], pinned: list[Pin]) -> WriteJob:
        by_key = {job.keys[j]: (m, job.position_of(j)) for j, m in picked}
        return WriteJob(
            [k for _, k, _ in pinned],
            [e.parent for _, _, e in pinned],
            job.mask,
            [(layer, None) for layer in layers_of(job.mask)],
            list(range(len(pinned))),
            masks=[by_key[k][0] for _, k, _ in pinned],
            positions=[by_key[k][1] for _, k, _ in pinned],
        )

    def promotable(self, src: TierSlot, keys: list[Key]) -> list[Key]:
        return [k for k in keys if k in src.entries]  # a block moves up with what its tier holds of it

    def promote_job(self, pinned: list[Pin]) -> WriteJob:
        job = super().promote_job(pinned)
        job.masks = [e.layers for _, _, e in pinned]
        job.positions = [self.chains.position(k) for _, k, _ in pinned]
        return job

    def restore_needs(self, n: int) -> dict[int, range]:
        return self.policies.needed(n)


def _split(tiers: Sequence[TierSlot], key: Key, need: int) -> list[tuple[TierSlot, Entry[Key], int]]:
    from kvstrata.engine.index import split_need

    return [(tiers[pos], e, layers) for pos, e, layers in split_need(tiers, key, need)]


def _provided(count: int, buffers: Buffers) -> list[int]:
    """Per key position, the layers the caller gave a buffer for."""
    dense = 0
    masks = [0] * count
    for layer, bufs in buffers.items():
        if isinstance(bufs, Mapping):
            for i in bufs:
                masks[int(i)] |= 1 << layer
        else:
            dense |= 1 << layer
    return [m | dense for m in masks]
