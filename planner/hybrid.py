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

Not mirrored (as for uniform layouts): concurrency, faults, adoption of blocks other processes
wrote. Where the engine runs two transfers on different threads, one order is taken: a hit's
promotion copy lands after the request's store checked what the top tier holds and before it
writes; a store's write below the top tier (placement rules only) before its write-through
copy. The engine's outcome can depend on that timing when tiers are under pressure (the same
replay then differs between runs); without promotion or placement rules it does not.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.engine.engine import MAX_COLD_WALK, MAX_WANTED, SHED_SCAN
from kvstrata.planner.space import MaskSizes, RecordSpace, make_record_space
from kvstrata.planner.spec import EngineLimits, PlanTier
from kvstrata.policies import ADMISSION, EVICTION, AdmissionPolicy, EvictionPolicy
from kvstrata.policies.layers import LayerPolicies

__all__ = ["HybridInstance", "HybridTier"]

MAX_ROOM_ROUNDS = 10_000  # the engine's bound on evict-until-it-fits rounds
UNBOUNDED = 1 << 62


class HEntry:
    """What one tier holds of one block (``engine.index.Entry``)."""

    __slots__ = ("layers", "nbytes", "parent", "pins")

    def __init__(self, layers: int, nbytes: int, parent: int | None) -> None:
        self.layers = layers
        self.nbytes = nbytes
        self.parent = parent
        self.pins = 0


@dataclass
class _Job:
    """Blocks to write into one tier (``engine._WriteJob``): keys, chain parents, layer masks and
    the block count a state snapshot after each key restores."""

    keys: list[int]
    parents: list[int | None]
    masks: list[int]
    positions: list[int]


class HybridTier:
    """One copy of a tier under per-layer policies (``engine.index.TierIndex``)."""

    def __init__(self, spec: PlanTier, position: int, sizes: MaskSizes, policies: LayerPolicies) -> None:
        self.spec = spec
        self.name = spec.name
        self.position = position
        self.capacity = spec.capacity
        self.cap = spec.capacity if spec.capacity is not None else UNBOUNDED
        self.m = sizes
        self.tmask = policies.tier_mask(spec.name, spec.kind)
        self.snap_mask = policies.snapshot_mask
        self.budget = policies.checkpoint_budget * spec.capacity if spec.capacity is not None else float("inf")
        self.entries: dict[int, HEntry] = {}
        self.evicting: set[int] = set()
        self.snapshots: dict[int, int] = {}  # key -> block count its snapshot restores
        self.snapshot_bytes = 0
        self.live_bytes = 0
        self.live_ri = 0  # of live_bytes: rank-independent layers (MLA under per-layer)
        self.eviction: EvictionPolicy[int] = EVICTION.get(spec.eviction)()
        self.admission: AdmissionPolicy[int] = ADMISSION.get(spec.admission)()
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

    # -- index (TierIndex) ---------------------------------------------------------------------
    def add(self, key: int, layers: int, nbytes: int, parent: int | None, position: int) -> HEntry:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = HEntry(layers, nbytes, parent)
            self.eviction.insert(key, parent)
        else:
            entry.layers |= layers
            entry.nbytes += nbytes
            self.eviction.access(key)
        if layers & self.snap_mask:
            self.snapshot_bytes += self.m.nbytes(layers & self.snap_mask)
            self.snapshots[key] = max(position, self.snapshots.get(key, 0))
        return entry

    def pop(self, key: int) -> HEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.eviction.remove(key)
            if key in self.snapshots:
                del self.snapshots[key]
                self.snapshot_bytes -= self.m.nbytes(entry.layers & self.snap_mask)
        return entry

    def shed(self, key: int, layers: int) -> int:
        entry = self.entries[key]
        layers &= entry.layers
        size = self.m.nbytes(layers)
        entry.layers &= ~layers
        entry.nbytes -= size
        if key in self.snapshots and layers & self.snap_mask:
            self.snapshot_bytes -= self.m.nbytes(layers & self.snap_mask)
            if not entry.layers & self.snap_mask:
                del self.snapshots[key]
        return size

    def pin(self, keys: Sequence[int | None]) -> list[HEntry]:
        out = []
        for k in keys:
            e = self.entries.get(k) if k is not None else None
            if e is not None:
                e.pins += 1
                out.append(e)
        return out

    @staticmethod
    def unpin(pinned: Sequence[HEntry]) -> None:
        for e in pinned:
            e.pins -= 1


class HybridInstance:
    """The tiers one engine sees under per-layer policies, and the engine's hybrid decisions."""

    def __init__(
        self, tiers: list[HybridTier], limits: EngineLimits, policies: LayerPolicies, sizes: MaskSizes
    ) -> None:
        self.tiers = tiers
        self.limits = limits
        self.policies = policies
        self.m = sizes
        self.prefix = policies.prefix_mask
        self.snap_mask = policies.snapshot_mask
        self.shedding = len({g.priority for g in policies.groups}) > 1
        self.wanted: OrderedDict[int, None] = OrderedDict()  # branch points
        self.children: dict[int, set[int]] = {}
        self.snap_pos: dict[int, int] = {}
        self.requests = 0
        self.dropped_stores = 0
        self.stored_blocks = 0
        self.kept_blocks = 0  # blocks of store jobs (what the policy keeps of them: kept_bytes)
        self.kept_bytes = [0] * len(tiers)  # per tier: bytes of those jobs the tier may hold
        self.load_bytes = [0] * len(tiers)  # of the last request's restore, per serving tier

    # -- lookup (Engine._lookup_restore) -----------------------------------------------------------
    def _avail(self, keys: Sequence[int]) -> list[int]:
        prefix = self.prefix
        tiers = self.tiers
        avail: list[int] = []
        for key in keys:
            a = 0
            for t in tiers:
                e = t.entries.get(key)
                if e is not None:
                    a |= e.layers
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
            self.wanted[keys[len(avail) - 1]] = None
            if len(self.wanted) > MAX_WANTED:
                self.wanted.popitem(last=False)
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
        for key, need in zip(keys, self.policies.needed_masks(len(keys)), strict=True):
            left = need
            pos = 0
            for t in self.tiers:
                e = t.entries.get(key)
                if e is not None and e.layers & left:
                    load[t.position] += nbytes(e.layers & left)
                    left &= ~e.layers
                    t.eviction.access(key)
                    sources.append((key, t.position))
                    pos = t.position
                if not left:
                    break
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
            held = [k for k in keys if k in src.entries]
            pinned = src.pin(held)
            if not pinned:
                continue
            cost = sum(e.nbytes for e in pinned)
            if background + cost > self.limits.max_background_bytes:
                src.unpin(pinned)
                continue
            background += cost
            positions = [self.snap_pos.get(k, 0) for k in held]
            job = _Job(held, [e.parent for e in pinned], [e.layers for e in pinned], positions)
            written = self.write_into(dst, job)
            dst.promotions += len(written)
            src.unpin(pinned)

    # -- store (Replayer._store, Engine._store_hybrid, _run_store) ---------------------------------
    def prepare_store(self, keys: list[int], first: int) -> tuple[_Job, list[HEntry]] | None:
        if first >= len(keys):
            return None
        part = keys[first:]
        pol = self.policies
        wanted = self.wanted
        points = pol.restore_points(len(part), first, lambda i: part[i] in wanted)
        keep = pol.keep_masks(len(part), points)
        top = self.tiers[0]
        todo: list[int] = []
        masks: list[int] = []
        for i, key in enumerate(part):
            missing = self._missing(key, keep[i])
            if missing:
                todo.append(i)
                masks.append(missing)
            elif key in top.entries:
                top.eviction.access(key)
        if not todo:
            return None
        nbytes = self.m.nbytes
        if sum(nbytes(m) for m in masks) > self.limits.max_pending_bytes:
            self.dropped_stores += 1
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
        return job, pinned

    def _missing(self, key: int, want: int) -> int:
        missing = 0
        for t in self.tiers:
            part = want & t.tmask
            if part:
                e = t.entries.get(key)
                missing |= part & ~(e.layers if e is not None else 0)
                want &= ~t.tmask
            if not want:
                break
        return missing

    def store(self, job: _Job, pinned: list[HEntry]) -> None:
        top = self.tiers[0]
        written = self.write_into(top, job)
        # the engine schedules the write-through copy, then writes the layers the top tier may not
        # hold below it on the store's own thread, while the copy waits for an I/O thread
        below = self.write_below_top(job)
        if written:
            self.write_through(top, written, job, 0)
        self.stored_blocks += len(set(written) | below)
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
        sub = _Job(keys, [e.parent for e in pinned], [m for _, m in picked], [job.positions[j] for j, _ in picked])
        written = self.write_into(nxt, sub)
        if written:
            self.write_through(nxt, written, sub, background + cost)
        idx.unpin(pinned)

    # -- writing into a tier (Engine._write_into, _admit_hybrid, _make_room, _evict) ---------------
    def write_into(self, idx: HybridTier, job: _Job) -> list[int]:
        """Admit, make room and write ``job`` into ``idx``; returns the job positions written."""
        todo = self._admit(idx, job)
        if not todo:
            return []
        m = self.m
        per_key = max(m.nbytes(w) for _, w in todo) or 1
        chunk = max(1, idx.cap // (2 * per_key))
        written: list[int] = []
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
                idx.live_bytes += size
                ri = m.ri_bytes(w)
                idx.live_ri += ri
                idx.written_bytes += size
                idx.written_ri += ri
                if parent is not None:
                    kids = self.children.get(parent)
                    if kids is None:
                        kids = self.children[parent] = set()
                    kids.add(key)
                if w & self.snap_mask:
                    self.snap_pos[key] = max(position, self.snap_pos.get(key, 0))
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
                if self._snapshot_room(idx, key, size + reserved, job.positions[j], shed):
                    reserved += size
                else:
                    idx.snapshots_not_admitted += 1
                    want &= ~snap
            if want:
                todo.append((j, want))
        if shed:
            self.evict(idx, shed)
        return todo

    def _snapshot_room(
        self, idx: HybridTier, key: int, size: int, position: int, shed: list[tuple[int, HEntry]]
    ) -> bool:
        """Engine._snapshot_room: drop shorter-prefix snapshots to fit the tier's snapshot budget."""
        while idx.snapshot_bytes + size > idx.budget:
            entries = idx.entries
            victims = (k for k in idx.snapshots if k != key and k not in idx.evicting and not entries[k].pins)
            victim = min(victims, key=idx.snapshots.__getitem__, default=None)
            if victim is None or idx.snapshots[victim] >= position:
                return False
            e = entries[victim]
            layers = e.layers & idx.snap_mask
            part = HEntry(layers, idx.shed(victim, layers), e.parent)
            idx.evicting.add(victim)
            idx.snapshots_dropped += 1
            idx.evictions += 1
            shed.append((victim, part))
        return True

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
            victims = self._pick_victims(idx, over)
            if not victims:
                return False
            for key, entry in victims:
                if idx.entries.get(key) is entry:
                    idx.pop(key)
                else:  # a victim that sheds only its lowest-priority layers stays in the tier
                    idx.shed(key, entry.layers)
                idx.evicting.add(key)
                idx.evictions += 1
            self.evict(idx, victims)
        return False

    def _pick_victims(self, idx: HybridTier, need: int) -> list[tuple[int, HEntry]]:
        out: list[tuple[int, HEntry]] = []
        got = 0
        taken: set[int] = set()
        entries = idx.entries
        if self.shedding:
            for key in itertools.islice(idx.eviction.victims(), SHED_SCAN):
                e = entries.get(key)
                if e is None or e.pins or key in idx.evicting:
                    continue
                low = self._lowest_priority(e.layers)
                if low != e.layers:
                    part = HEntry(low, self.m.nbytes(low), e.parent)
                    out.append((key, part))
                    taken.add(key)
                    got += part.nbytes
                    if got >= need:
                        return out
        for key in idx.eviction.victims():
            e = entries.get(key)
            if e is None or e.pins or key in idx.evicting or key in taken:
                continue
            out.append((key, e))
            got += e.nbytes
            if got >= need:
                break
        return out

    def _lowest_priority(self, layers: int) -> int:
        present = [g for g in self.policies.groups if g.mask & layers]
        if len({g.priority for g in present}) <= 1:
            return layers
        low = min(g.priority for g in present)
        return sum(g.mask & layers for g in present if g.priority == low)

    def evict(self, idx: HybridTier, victims: list[tuple[int, HEntry]]) -> None:
        """Demote victims into the next tier (what it lacks and admits), then delete them here."""
        if idx.position + 1 < len(self.tiers):
            nxt = self.tiers[idx.position + 1]
            groups: dict[int, list[tuple[int, HEntry]]] = {}
            for key, e in victims:
                groups.setdefault(e.layers, []).append((key, e))
            for mask, group in groups.items():
                keys = [k for k, _ in group]
                positions = [self.snap_pos.get(k, 0) for k in keys]
                job = _Job(keys, [e.parent for _, e in group], [mask] * len(group), positions)
                idx.demotions += len(self.write_into(nxt, job))
        idx.space.remove_records([(k, e.layers) for k, e in victims])
        for key, e in victims:
            idx.live_bytes -= e.nbytes
            idx.live_ri -= self.m.ri_bytes(e.layers)
            idx.evicting.discard(key)
        self._after_drop(victims)

    def _after_drop(self, victims: list[tuple[int, HEntry]]) -> None:
        """A block whose full-attention layers no tier holds breaks its chain: cool its descendants."""
        prefix = self.prefix
        for key, part in victims:
            held = 0
            for t in self.tiers:
                e = t.entries.get(key)
                if e is not None:
                    held |= e.layers
            if not held:
                self.snap_pos.pop(key, None)
                if part.parent is not None:
                    siblings = self.children.get(part.parent)
                    if siblings is not None:
                        siblings.discard(key)
                        if not siblings:
                            del self.children[part.parent]
            if part.layers & prefix and held & prefix != prefix:
                self._cool_descendants(key)
            if not held:
                self.children.pop(key, None)

    def _cool_descendants(self, key: int) -> None:
        stack = list(self.children.get(key, ()))
        seen: set[int] = set()
        while stack and len(seen) < MAX_COLD_WALK:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for t in self.tiers:
                if k in t.entries:
                    t.eviction.cold(k)
            stack.extend(self.children.get(k, ()))
