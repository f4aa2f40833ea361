"""The simulator's mirror of the engine's per-layer policies (hybrid layouts), at layer-mask granularity.

When a layout's :class:`~kvstrata.policies.layers.LayerPolicies` are not trivial (sliding-window
or linear-attention groups under ``per-layer``, placement rules, group priorities), the engine
takes its hybrid path (``engine/engine.py`` from "per-layer policies (hybrid layouts)" on) and
so does the simulator, here: per tier and block key the mask of layers held, with the engine's
decisions and the policies' own helpers (``restore_points``, ``keep_masks``, ``restorable``,
``needed_masks``, ``tier_mask``) rather than a re-derivation:

* lookup: the longest prefix at which every group is restorable (full/MLA layers every block,
  sliding layers the window before it, state layers a snapshot at it); a lookup whose
  full-attention blocks reach further marks a *branch point*, a restore point of later stores;
* restore: each needed layer of each block from the fastest tier holding it (the block counts
  for the slowest of those), touching each contributing tier's eviction order, then promotion
  of what the source tier holds of the block into the first tier above with ``promote``;
* store (``kvstrata replay``'s: the request's blocks from the first one the top tier did not
  serve): restore points (turn end, ``checkpoint_every``, branch points), the layers each block
  keeps, minus what the tier each layer goes to first holds; into the top tier, the layers the
  top tier may not hold into the first tier that may, and write-through of what the next tier
  may hold;
* writing into a tier: its placement mask, admission, the snapshot budget (a new snapshot drops
  shorter-prefix ones or is refused), make room at layer-record granularity
  (:mod:`kvstrata.planner.space`), victims in policy order shedding their lowest-priority
  layers first, demoted into the next tier, and broken chains cooled (their later blocks become
  the first victims).

The decisions themselves are the engine's, not copies: the block index of each tier is the
engine's pure :class:`~kvstrata.engine.index.BlockIndex` (entries, pins, live bytes, snapshot
accounting), victims come from :func:`~kvstrata.engine.index.pick_victims`, the snapshot budget
from :func:`~kvstrata.engine.index.snapshot_room`, the layers a store lacks from
:func:`~kvstrata.engine.index.missing_layers`, where a restore reads from
:func:`~kvstrata.engine.index.split_need`, and broken chains are cooled by the engine's
:class:`~kvstrata.engine.chains.Chains`. What stays the simulator's own: the order of transfers,
the backpressure bounds, and physical space (:mod:`kvstrata.planner.space`).

Not mirrored (as for uniform layouts): concurrency, faults, adoption of blocks other processes
wrote. Where the engine runs two transfers on different threads, one order is taken: a hit's
promotion copy lands after the request's store checked what the top tier holds and before it
writes; a store's write below the top tier (placement rules only) before its write-through
copy. The engine's outcome can depend on that timing when tiers are under pressure (the same
replay then differs between runs); without promotion or placement rules it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.engine.chains import Chains
from kvstrata.engine.index import (
    BlockIndex,
    Entry,
    held_layers,
    lowest_priority_fn,
    missing_layers,
    pick_victims,
    snapshot_room,
    split_need,
)
from kvstrata.engine.queue import budget_parts
from kvstrata.planner.space import MaskSizes, RecordSpace, make_record_space
from kvstrata.planner.spec import EngineLimits, PlanTier
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.policies.layers import LayerPolicies

__all__ = ["HybridInstance", "HybridTier"]

MAX_ROOM_ROUNDS = 10_000  # the engine's bound on evict-until-it-fits rounds
UNBOUNDED = 1 << 62

HEntry = Entry[int]


@dataclass
class _Job:
    """Blocks to write into one tier (``engine.plans.WriteJob``): keys, chain parents, layer masks
    and the block count a state snapshot after each key restores."""

    keys: list[int]
    parents: list[int | None]
    masks: list[int]
    positions: list[int]

    def part(self, a: int, b: int) -> _Job:
        return _Job(self.keys[a:b], self.parents[a:b], self.masks[a:b], self.positions[a:b])


class HybridTier(BlockIndex[int]):
    """One copy of a tier under per-layer policies: the engine's block index, plus physical space."""

    def __init__(self, spec: PlanTier, position: int, sizes: MaskSizes, policies: LayerPolicies) -> None:
        super().__init__(
            EVICTION.get(spec.eviction)(),
            ADMISSION.get(spec.admission)(),
            mask_bytes=sizes.nbytes,
            snap_mask=policies.snapshot_mask,
        )
        self.spec = spec
        self.name = spec.name
        self.position = position
        self.capacity = spec.capacity
        self.cap = spec.capacity if spec.capacity is not None else UNBOUNDED
        self.m = sizes
        self.tmask = policies.tier_mask(spec.name, spec.kind)
        self.budget = policies.checkpoint_budget * spec.capacity if spec.capacity is not None else float("inf")
        self.live_ri = 0  # of live_bytes: rank-independent layers (MLA under per-layer)
        self.space: RecordSpace = make_record_space(
            spec.kind, spec.capacity, sizes, segment_size=spec.segment_size, compact_threshold=spec.compact_threshold
        )
        self.hit_blocks = 0
        self.written_blocks = 0
        self.written_bytes = 0
        self.written_ri = 0
        self.evictions = 0
        self.demotions = 0
        self.promotions = 0
        self.not_admitted = 0
        self.write_failures = 0
        self.snapshots_not_admitted = 0
        self.snapshots_dropped = 0
        self.peak_blocks = 0
        self.peak_bytes = 0


class HybridInstance:
    """The tiers one engine sees under per-layer policies, and the engine's hybrid decisions."""

    def __init__(
        self, tiers: list[HybridTier], limits: EngineLimits, policies: LayerPolicies, sizes: MaskSizes
    ) -> None:
        self.tiers = tiers
        self.tmasks = [t.tmask for t in tiers]
        self.limits = limits
        self.policies = policies
        self.m = sizes
        self.prefix = policies.prefix_mask
        self.snap_mask = policies.snapshot_mask
        self.lowest = lowest_priority_fn([(g.mask, g.priority) for g in policies.groups])
        self.chains: Chains[int] = Chains(policies.prefix_mask)  # children, snapshot positions, branch points
        self.requests = 0
        self.dropped_stores = 0
        self.dropped_blocks = 0
        self.stored_blocks = 0
        self.kept_blocks = 0  # blocks of store jobs (what the policy keeps of them: kept_bytes)
        self.kept_bytes = [0] * len(tiers)  # per tier: bytes of those jobs the tier may hold
        self.load_bytes = [0] * len(tiers)  # of the last request's restore, per serving tier

    # -- lookup (PerLayerPlacement.lookup) ---------------------------------------------------------
    def _avail(self, keys: Sequence[int]) -> list[int]:
        prefix = self.prefix
        tiers = self.tiers
        avail: list[int] = []
        for key in keys:
            a = held_layers(tiers, key)
            if a & prefix != prefix:
                break
            avail.append(a)
        return avail

    def restorable(self, keys: Sequence[int]) -> int:
        """Blocks of the longest consistent prefix (a lookup without side effects)."""
        return self.policies.restorable(self._avail(keys))

    def lookup(self, keys: Sequence[int]) -> int:
        avail = self._avail(keys)
        n = self.policies.restorable(avail)
        if n < len(avail):  # full-attention blocks reach further: a branch point
            self.chains.want(keys[len(avail) - 1])
        return n

    # -- one request (Replayer.step) ---------------------------------------------------------------
    def step(self, keys: list[int], n_prompt: int) -> list[int]:
        """Look up, restore, promote and store one request; returns the serving tier of each hit block."""
        self.requests += 1
        n = self.lookup(keys[:n_prompt])
        load = self.load_bytes = [0] * len(self.tiers)
        served, sources = self.restore(keys[:n], load)
        for pos in served:
            self.tiers[pos].hit_blocks += 1
        first = next((i for i, p in enumerate(served) if p != 0), len(served))
        job = self.prepare_store(keys, first)  # the store's check runs before queued promotions land
        self.promote(sources)
        if job is not None:
            self.store(*job)
        return served

    def restore(self, keys: Sequence[int], load: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Engine._plan_restore: per block the slowest of the fastest tiers holding each needed
        layer; returns those and the (key, tier) pairs read from."""
        served: list[int] = []
        sources: list[tuple[int, int]] = []
        nbytes = self.m.nbytes
        tiers = self.tiers
        for key, need in zip(keys, self.policies.needed_masks(len(keys)), strict=True):
            pos = 0
            for pos, _, layers in split_need(tiers, key, need):
                load[pos] += nbytes(layers)
                tiers[pos].eviction.access(key)
                sources.append((key, pos))
            served.append(pos)
        return served, sources

    def promote(self, sources: list[tuple[int, int]]) -> None:
        by_src: dict[int, list[int]] = {}
        for key, pos in sources:
            if pos > 0:
                by_src.setdefault(pos, []).append(key)
        background = 0
        for pos, keys in by_src.items():
            dst = next((t for t in self.tiers[:pos] if t.spec.promote), None)
            if dst is None:
                continue
            src = self.tiers[pos]
            pinned = src.pin(k for k in keys if k in src.entries)
            if not pinned:
                continue
            cost = sum(e.nbytes for _, e in pinned)
            if background + cost > self.limits.max_background_bytes:
                src.unpin(pinned)
                continue
            background += cost
            held = [k for k, _ in pinned]
            positions = [self.chains.position(k) for k in held]
            job = _Job(held, [e.parent for _, e in pinned], [e.layers for _, e in pinned], positions)
            written = self.write_into(dst, job)
            dst.promotions += len(written)
            src.unpin(pinned)

    # -- store (Replayer._store, Engine._store_hybrid, _run_store) ---------------------------------
    def prepare_store(
        self, keys: list[int], first: int
    ) -> tuple[_Job, list[tuple[int, HEntry]], list[tuple[int, int]]] | None:
        if first >= len(keys):
            return None
        part = keys[first:]
        pol = self.policies
        wanted = self.chains.wanted
        points = pol.restore_points(len(part), first, lambda i: part[i] in wanted)
        keep = pol.keep_masks(len(part), points)
        top = self.tiers[0]
        todo: list[int] = []
        masks: list[int] = []
        for i, key in enumerate(part):
            missing = missing_layers(self.tiers, self.tmasks, key, keep[i])
            if missing:
                todo.append(i)
                masks.append(missing)
            elif key in top.entries:
                top.eviction.access(key)
        if not todo:
            return None
        nbytes = self.m.nbytes
        parts = budget_parts([nbytes(m) for m in masks], self.limits.pending_bytes)
        kept = parts[-1][1] if parts else 0
        if kept < len(masks):  # blocks larger than the whole budget: dropped, counted per block
            self.dropped_stores += 1
            self.dropped_blocks += len(masks) - kept
            del todo[kept:], masks[kept:]
        if not parts:
            return None
        self.kept_blocks += len(masks)
        for t in self.tiers:
            self.kept_bytes[t.position] += sum(nbytes(m & t.tmask) for m in masks)
        parent = keys[first - 1] if first else None
        pinned = top.pin([*(k for k in part if k in top.entries), parent])
        job = _Job(
            [part[i] for i in todo],
            [part[i - 1] if i > 0 else parent for i in todo],
            masks,
            [first + i + 1 for i in todo],
        )
        return job, pinned, parts

    def store(self, job: _Job, pinned: list[tuple[int, HEntry]], parts: list[tuple[int, int]]) -> None:
        top = self.tiers[0]
        for a, b in parts:  # the engine's store queue, when nothing else is queued
            part = job.part(a, b)
            part_pin = top.pin([part.parents[0]]) if a else []
            written = self.write_into(top, part)
            # the engine schedules the write-through copy, then writes the layers the top tier may
            # not hold below it on the store's own thread, while the copy waits for an I/O thread
            below = self.write_below_top(part)
            if written:
                self.write_through(top, written, part, 0)
            self.stored_blocks += len(set(written) | below)
            top.unpin(part_pin)
        top.unpin(pinned)

    def write_below_top(self, job: _Job) -> set[int]:
        rest = [m & ~self.tiers[0].tmask for m in job.masks]
        written: set[int] = set()
        for t in self.tiers[1:]:
            if not any(rest):
                break
            sub = _Job(job.keys, job.parents, list(rest), job.positions)
            got = self.write_into(t, sub)
            if got:
                self.write_through(t, got, sub, 0)
            written.update(got)
            rest = [m & ~t.tmask for m in rest]
        return written

    def write_through(self, idx: HybridTier, positions: list[int], job: _Job, background: int) -> None:
        if idx.spec.write != "write-through" or idx.position + 1 >= len(self.tiers):
            return
        nxt = self.tiers[idx.position + 1]
        picked: list[tuple[int, int]] = []
        for j in positions:
            e = idx.entries.get(job.keys[j])
            m = job.masks[j] & nxt.tmask & (e.layers if e is not None else 0)
            if m:
                picked.append((j, m))
        cost = sum(self.m.nbytes(m) for _, m in picked)
        if not picked or background + cost > self.limits.max_background_bytes:
            return  # nothing the next tier takes, or too far behind (demotion on eviction instead)
        keys = [job.keys[j] for j, _ in picked]
        pinned = idx.pin(keys)
        sub = _Job(keys, [e.parent for _, e in pinned], [m for _, m in picked], [job.positions[j] for j, _ in picked])
        written = self.write_into(nxt, sub)
        if written:
            self.write_through(nxt, written, sub, background + cost)
        idx.unpin(pinned)

    # -- writing into a tier (Mover.write_into, PerLayerPlacement.admit, Mover.make_room, _drop) -----
    def write_into(self, idx: HybridTier, job: _Job) -> list[int]:
        """Admit, make room and write ``job`` into ``idx``; returns the job positions written."""
        todo = self._admit(idx, job)
        if not todo:
            return []
        m = self.m
        per_key = max(m.nbytes(w) for _, w in todo) or 1
        chunk = max(1, idx.cap // (2 * per_key))
        written: list[int] = []
        note = self.chains.note
        snap = self.snap_mask
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            if not self.make_room(idx, [w for _, w in part]):
                idx.write_failures += len(part)
                continue
            idx.space.add_records([(job.keys[j], w) for j, w in part])
            for j, w in part:
                key, parent, position = job.keys[j], job.parents[j], job.positions[j]
                size = m.nbytes(w)
                idx.add(key, w, size, parent, position)
                ri = m.ri_bytes(w)
                idx.live_ri += ri
                idx.written_bytes += size
                idx.written_ri += ri
                note(key, parent, w & snap, position)
                written.append(j)
            idx.written_blocks += len(part)
            if len(idx.entries) > idx.peak_blocks:
                idx.peak_blocks = len(idx.entries)
            if idx.live_bytes > idx.peak_bytes:
                idx.peak_bytes = idx.live_bytes
        return written

    def _admit(self, idx: HybridTier, job: _Job) -> list[tuple[int, int]]:
        tmask = idx.tmask
        snap = idx.snap_mask
        entries = idx.entries
        admit = idx.admission.admit
        todo: list[tuple[int, int]] = []
        shed: list[tuple[int, HEntry]] = []
        reserved = 0
        for j, key in enumerate(job.keys):
            want = job.masks[j] & tmask
            if not want or key in idx.evicting:
                continue
            e = entries.get(key)
            if e is not None:
                want &= ~e.layers
                if not want:
                    continue
            if not admit(key):
                idx.not_admitted += 1
                continue
            if want & snap:
                size = self.m.nbytes(want & snap)
                before = len(shed)
                room = snapshot_room(idx, key, size + reserved, job.positions[j], idx.budget, shed)
                idx.snapshots_dropped += len(shed) - before
                idx.evictions += len(shed) - before
                if room:
                    reserved += size
                else:
                    idx.snapshots_not_admitted += 1
                    want &= ~snap
            if want:
                todo.append((j, want))
        if shed:
            self.evict(idx, shed)
        return todo

    def make_room(self, idx: HybridTier, masks: list[int]) -> bool:
        if idx.capacity is None:
            return True
        need = sum(self.m.nbytes(w) for w in masks)
        if need > idx.capacity:
            return False
        for _ in range(MAX_ROOM_ROUNDS):
            if idx.space.fits_records(masks, idx.live_bytes):
                return True
            over = max(idx.live_bytes + need - idx.capacity, need // 4, 1)
            victims = pick_victims(idx, over, self.lowest)
            if not victims:
                return False
            for key, entry in victims:
                idx.evict(key, entry)
            idx.evictions += len(victims)
            self.evict(idx, victims)
        return False

    def evict(self, idx: HybridTier, victims: list[tuple[int, HEntry]]) -> None:
        """Demote victims into the next tier (what it lacks and admits), then delete them here."""
        if idx.position + 1 < len(self.tiers):
            nxt = self.tiers[idx.position + 1]
            groups: dict[int, list[tuple[int, HEntry]]] = {}
            for key, e in victims:
                groups.setdefault(e.layers, []).append((key, e))
            for mask, group in groups.items():
                keys = [k for k, _ in group]
                positions = [self.chains.position(k) for k in keys]
                job = _Job(keys, [e.parent for _, e in group], [mask] * len(group), positions)
                idx.demotions += len(self.write_into(nxt, job))
        idx.space.remove_records([(k, e.layers) for k, e in victims])
        for key, e in victims:
            idx.release(key, e.nbytes)
            idx.live_ri -= self.m.ri_bytes(e.layers)
        tiers = self.tiers
        self.chains.after_drop(victims, lambda k: held_layers(tiers, k), self._cold)

    def _cold(self, key: int) -> None:
        for t in self.tiers:
            if key in t.entries:
                t.eviction.cold(key)
