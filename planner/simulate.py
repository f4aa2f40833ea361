"""A fast, single-threaded mirror of :class:`~kvstrata.engine.engine.Engine` at block granularity.

For each request, in trace order, it does what ``kvstrata replay`` makes the engine do
(see :meth:`Simulator.step`), with the same decisions and the same policy objects
(:mod:`kvstrata.policies`), but with integers for keys and no bytes:

* lookup: the longest prefix of the prompt's full blocks that some tier holds; each
  block is served by the fastest tier holding it, and the load touches its eviction order;
* promotion: blocks served below the top go up into the first tier above with
  ``promote = true``: into a write-through tier (or the last one) before the store looks at the
  top tier, as the engine does from the load's buffers; into a write-back tier after it, as a
  background copy (skipped when larger than ``max_background_bytes``);
* store: the blocks from the first one not served by the top tier onwards (prompt and
  output) go into the top tier, in parts of at most ``max_pending_bytes`` (prefix first, as the
  engine's store queue admits them when nothing else is queued; a block larger than the budget
  is dropped with what follows it); blocks the top tier holds and the batch's parent are pinned
  while it is written, and each later part's parent while that part is written;
* write into a tier: admission for each block it lacks, then in chunks of half the tier,
  make room and write; making room evicts victims in policy order (pinned ones skipped),
  at least a quarter of the bytes asked for, demoting each victim into the next tier when
  that tier lacks (and admits) it, then deleting it;
* write-through: blocks written into a ``write-through`` tier are copied into the next
  tier and so on down, while the chain's bytes stay within ``max_background_bytes``.

The block index of each tier is the engine's pure :class:`~kvstrata.engine.index.BlockIndex`
(entries, pins, live bytes, with the tier's eviction and admission policy objects) and victims
come from the engine's :func:`~kvstrata.engine.index.pick_victims`, not from a copy; what stays
the simulator's own is the order of transfers, the backpressure bounds and physical space. Its
hot loop uses the index's bulk calls (``add_blocks``, ``drop_blocks``: the same bookkeeping as
``add``, ``pop`` and ``release`` per block) and runs with the cyclic garbage collector paused.

Physical space per tier follows :mod:`kvstrata.planner.space`. Several instances have
private copies of the tiers not marked shared and one copy of the shared ones; a router
sends each request to one instance. What is not modelled: concurrency (the replay runs one
request at a time and waits for its copies, so order is what matters), faults, the store
queue's count limit, and blocks other processes wrote.

Hybrid layouts: given the layout's :class:`~kvstrata.policies.layers.LayerPolicies`, a
simulator whose policies are not trivial (what makes the engine take its hybrid path) runs
:mod:`kvstrata.planner.hybrid` instead, at layer-mask granularity; uniform layouts (and
``layer_policy = "uniform"``) keep the block-granular path above.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvstrata.engine.index import BlockIndex, Entry, pick_victims
from kvstrata.engine.queue import budget_parts
from kvstrata.errors import ConfigError
from kvstrata.planner.hybrid import HybridInstance, HybridTier
from kvstrata.planner.space import MaskSizes, Space, make_space
from kvstrata.planner.spec import EngineLimits, PlanTier
from kvstrata.planner.workload import BlockTrace
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.policies.layers import LayerPolicies

__all__ = ["ROUTING", "SimResult", "SimTier", "Simulator", "TierResult", "simulate"]

ROUTING = ("round-robin", "sticky", "cache-aware")
MAX_ROOM_ROUNDS = 10_000  # the engine's bound on evict-until-it-fits rounds


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the simulator runs. Its index entries are objects the
    collector tracks: it makes about one per block written and frees them by reference count
    (no cycles), and collecting while they come and go cost a fifth of its time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SimTier(BlockIndex[int]):
    """One copy of a tier: the engine's block index (entries, pins, live bytes, victims) with
    its policies, plus physical space and counters. Every entry holds every layer."""

    def __init__(self, spec: PlanTier, position: int, layer_sizes: Sequence[int]) -> None:
        super().__init__(EVICTION.get(spec.eviction)(), ADMISSION.get(spec.admission)())
        self.spec = spec
        self.name = spec.name
        self.position = position
        self.block_bytes = sum(layer_sizes)
        self.every = (1 << len(layer_sizes)) - 1  # the layer mask of a block
        self.capacity = spec.capacity
        self.space: Space = make_space(
            spec.kind,
            spec.capacity,
            layer_sizes,
            segment_size=spec.segment_size,
            compact_threshold=spec.compact_threshold,
        )
        cap = spec.capacity
        self.chunk = max(1, cap // (2 * self.block_bytes)) if cap is not None else 1 << 62
        self.hit_blocks = 0
        self.written_blocks = 0
        self.evictions = 0
        self.demotions = 0
        self.promotions = 0
        self.not_admitted = 0
        self.write_failures = 0
        self.peak_blocks = 0


class _Instance:
    """The tiers one engine sees (private copies and the shared ones), top first."""

    def __init__(self, tiers: list[SimTier], limits: EngineLimits) -> None:
        self.tiers = tiers
        self.limits = limits
        self.bb = tiers[0].block_bytes
        self.requests = 0
        self.dropped_stores = 0
        self.dropped_blocks = 0
        self.stored_blocks = 0

    def serving(self, key: int) -> int | None:
        for t in self.tiers:
            if key in t.entries:
                return t.position
        return None

    def restorable(self, keys: Sequence[int]) -> int:
        """Blocks of the longest prefix some tier holds (a lookup without side effects)."""
        n = 0
        tiers = self.tiers
        for key in keys:
            if not any(key in t.entries for t in tiers):
                break
            n += 1
        return n

    # -- one request (Replayer.step) ----------------------------------------------------------
    def step(self, keys: list[int], n_prompt: int) -> list[int]:
        """Look up, load, promote and store one request; returns the serving tier of each hit block."""
        self.requests += 1
        served: list[int] = []
        tiers = self.tiers
        for key in keys[:n_prompt]:
            pos = self.serving(key)
            if pos is None:
                break
            tiers[pos].eviction.access(key)  # the load touches the serving tier
            served.append(pos)
        for pos in served:
            tiers[pos].hit_blocks += 1
        first_new = next((i for i, p in enumerate(served) if p != 0), len(served))
        store = keys[first_new:]
        parent = keys[first_new - 1] if first_new else None
        top = tiers[0]
        self.promote(keys, served, from_load=True)  # done before the load returns
        todo: list[int] = []
        present: list[int] = []
        for i, key in enumerate(store):  # the store's check runs before queued promotions land
            if key in top.entries:
                top.eviction.access(key)
                present.append(key)
            else:
                todo.append(i)
        self.promote(keys, served, from_load=False)
        if todo:
            self.store(store, todo, present, parent)
        return served

    def promote(self, keys: list[int], served: list[int], from_load: bool) -> None:
        """The promotions the engine makes from the load's own buffers, on the load's thread
        (``from_load``: into a write-through tier or the last one, with no background budget),
        or the others, queued as background copies read from the lower tier."""
        by_src: dict[int, list[int]] = {}
        for key, pos in zip(keys, served, strict=False):
            if pos > 0:
                by_src.setdefault(pos, []).append(key)
        background = 0
        for pos, src_keys in by_src.items():
            dst = next((t for t in self.tiers[:pos] if t.spec.promote), None)
            if dst is None or from_load != (dst.spec.write == "write-through" or dst.position + 1 >= len(self.tiers)):
                continue
            src = self.tiers[pos]
            held = [k for k in src_keys if k in src.entries]
            if not held:
                continue
            cost = len(held) * self.bb
            if not from_load:
                if background + cost > self.limits.max_background_bytes:
                    continue
                background += cost
            pinned = src.pin(held)
            written = self.write_into(dst, held, [e.parent for _, e in pinned])
            dst.promotions += len(written)
            src.unpin(pinned)

    def store(self, keys: list[int], todo: list[int], present: list[int], parent: int | None) -> None:
        top = self.tiers[0]
        job = [keys[i] for i in todo]
        parents = [keys[i - 1] if i > 0 else parent for i in todo]
        parts = budget_parts([self.bb] * len(job), self.limits.pending_bytes)
        kept = parts[-1][1] if parts else 0
        if kept < len(job):  # blocks larger than the whole budget: dropped, counted per block
            self.dropped_stores += 1
            self.dropped_blocks += len(job) - kept
        if not parts:
            return
        pinned = top.pin([*present, parent])
        for a, b in parts:  # the engine's store queue, when nothing else is queued
            part_pin = top.pin([parents[a]]) if a else []
            written = self.write_into(top, job[a:b], parents[a:b])
            self.stored_blocks += len(written)
            if written:
                self.write_through(top, [job[a + j] for j in written], 0)
            top.unpin(part_pin)
        top.unpin(pinned)

    def write_through(self, idx: SimTier, keys: list[int], background: int) -> None:
        if idx.spec.write != "write-through" or idx.position + 1 >= len(self.tiers):
            return
        cost = len(keys) * self.bb
        if background + cost > self.limits.max_background_bytes:
            return  # too far behind: these blocks reach the next tier on eviction instead
        pinned = idx.pin(keys)
        held = [k for k, _ in pinned]
        nxt = self.tiers[idx.position + 1]
        written = self.write_into(nxt, held, [e.parent for _, e in pinned])
        if written:
            self.write_through(nxt, [held[j] for j in written], background + cost)
        idx.unpin(pinned)

    # -- writing into a tier (Engine._write_into, _make_room, _evict) ---------------------------
    def write_into(self, idx: SimTier, keys: list[int], parents: list[int | None]) -> list[int]:
        """Admit, make room and write ``keys`` into ``idx``; returns the positions written."""
        positions: list[int] = []
        entries = idx.entries
        admit = idx.admission.admit
        for j, key in enumerate(keys):
            if key in entries:
                continue
            if admit(key):
                positions.append(j)
            else:
                idx.not_admitted += 1
        written: list[int] = []
        for start in range(0, len(positions), idx.chunk):
            part = positions[start : start + idx.chunk]
            if not self.make_room(idx, len(part)):
                idx.write_failures += len(part)
                continue
            part_keys = [keys[j] for j in part]
            idx.space.added(part_keys)
            idx.add_blocks(part_keys, idx.every, idx.block_bytes, [parents[j] for j in part])
            idx.written_blocks += len(part)
            if len(entries) > idx.peak_blocks:
                idx.peak_blocks = len(entries)
            written.extend(part)
        return written

    def make_room(self, idx: SimTier, n: int) -> bool:
        cap = idx.capacity
        if cap is None:
            return True
        need = n * self.bb
        if need > cap:
            return False
        for _ in range(MAX_ROOM_ROUNDS):
            if idx.space.fits(len(idx.entries), n):
                return True
            over = max(idx.live_bytes + need - cap, need // 4, 1)
            victims = pick_victims(idx, over)
            if not victims:
                return False
            idx.evictions += len(victims)
            self.evict(idx, victims)
        return False

    def evict(self, idx: SimTier, victims: list[tuple[int, Entry[int]]]) -> None:
        """Engine._evict: the victims leave the index, are demoted into the next tier and deleted.
        Whole blocks only (nothing sheds layers here), and deleted at once: no tier looks at this
        one while its victims are demoted below it."""
        idx.drop_blocks(victims)
        keys = [k for k, _ in victims]
        if idx.position + 1 < len(self.tiers):
            moved = self.write_into(self.tiers[idx.position + 1], keys, [e.parent for _, e in victims])
            idx.demotions += len(moved)
        idx.space.removed(keys)


@dataclass
class TierResult:
    """What one tier (all its copies) did over the trace."""

    name: str
    kind: str
    shared: bool
    copies: int
    capacity: int | None  # per copy
    hit_blocks: int
    written_blocks: int
    evictions: int
    demotions: int
    promotions: int
    not_admitted: int
    write_failures: int
    resident_blocks: int  # at the end, all copies
    peak_blocks: int  # largest copy, at its peak
    physical_bytes: int | None  # at the end, all copies (nvme: segment files)
    physical_written: int | None  # bytes written to the medium (nvme: padding and compaction included)
    bytes_stored: int = 0  # logical bytes held at the end, all copies, one rank (replay's bytes_stored)
    bytes_written: int = 0  # logical bytes written, all copies, one rank
    bytes_stored_ri: int = 0  # of bytes_stored: rank-independent layers (stored once for all tp ranks)
    bytes_written_ri: int = 0  # of bytes_written: rank-independent layers
    snapshots_not_admitted: int = 0  # state snapshots refused by the snapshot budget (per-layer policies)
    snapshots_dropped: int = 0  # state snapshots dropped for a more valuable one
    peak_bytes: int = 0  # largest copy, at its peak (logical bytes, one rank)


@dataclass
class SimResult:
    """The simulation of one trace on one set of tiers."""

    block_size: int
    block_bytes: int
    tiers: list[TierResult]
    requests: int
    prompt_tokens: int
    hit_blocks_by_tier: np.ndarray  # int32 [requests, tiers]
    instance_of: np.ndarray  # int32 [requests]
    instances: int
    routing: str
    dropped_stores: int
    stored_blocks: int
    dropped_blocks: int = 0  # blocks of those stores that were dropped (larger than the whole budget)
    extra: dict[str, float] = field(default_factory=dict)
    layer_policy: str = "uniform"  # the policies' mode (uniform when none were given)
    hybrid: bool = False  # the engine's hybrid path (per-layer policies change what is stored where)
    load_bytes_by_tier: np.ndarray | None = None  # int64 [requests, tiers]: bytes each restore read (hybrid)
    # hybrid: per tier, the mean bytes of a stored block that the policies keep and the tier may hold
    kept_bytes_per_block: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_stored(self) -> int:
        """Logical bytes the tiers hold at the end (all copies, one tensor-parallel rank)."""
        return sum(t.bytes_stored for t in self.tiers)

    @property
    def hit_tokens(self) -> int:
        return int(self.hit_blocks_by_tier.sum()) * self.block_size

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tier_hit_rate(self, name: str) -> float:
        i = [t.name for t in self.tiers].index(name)
        if not self.prompt_tokens:
            return 0.0
        return int(self.hit_blocks_by_tier[:, i].sum()) * self.block_size / self.prompt_tokens


class Simulator:
    """Instances of the engine over one tier list, and a router in front of them."""

    def __init__(
        self,
        tiers: Sequence[PlanTier],
        layer_sizes: Sequence[int],
        *,
        limits: EngineLimits | None = None,
        instances: int = 1,
        routing: str = "round-robin",
        balance: float = 0.1,
        policies: LayerPolicies | None = None,
    ) -> None:
        """``policies``: the layout's layer policies (``None``: every layer of every block)."""
        if instances < 1:
            raise ConfigError(f"instances must be >= 1, got {instances}", field="instances", value=instances)
        if routing not in ROUTING:
            raise ConfigError(
                f"unknown routing {routing!r}; known: {', '.join(ROUTING)}", field="routing", value=routing
            )
        self.specs = list(tiers)
        self.layer_sizes = list(layer_sizes)
        self.limits = (limits or EngineLimits()).resolved(self.specs[0].capacity if self.specs else None)
        self.routing = routing
        self.balance = balance
        self.policies = policies
        self.hybrid = policies is not None and not policies.trivial
        ri = sum(g.mask for g in policies.groups if g.rank_independent) if policies is not None else 0
        self.sizes = MaskSizes(layer_sizes, ri)
        self.copies: list[list[SimTier | HybridTier]] = [[] for _ in self.specs]
        self.instances: list[_Instance | HybridInstance] = []
        shared = {i: self._tier(spec, i) for i, spec in enumerate(self.specs) if spec.shared}
        for _ in range(instances):
            row = [shared.get(i) or self._tier(spec, i) for i, spec in enumerate(self.specs)]
            for i, t in enumerate(row):
                if not any(t is c for c in self.copies[i]):
                    self.copies[i].append(t)
            if self.hybrid:
                assert policies is not None
                hrow = [t for t in row if isinstance(t, HybridTier)]
                self.instances.append(HybridInstance(hrow, self.limits, policies, self.sizes))
            else:
                self.instances.append(_Instance([t for t in row if isinstance(t, SimTier)], self.limits))
        self._sticky: dict[str, int] = {}

    def _tier(self, spec: PlanTier, position: int) -> SimTier | HybridTier:
        if self.hybrid:
            assert self.policies is not None
            return HybridTier(spec, position, self.sizes, self.policies)
        return SimTier(spec, position, self.layer_sizes)

    def route(self, index: int, keys: list[int], n_prompt: int, session: str | None) -> int:
        n = len(self.instances)
        if n == 1:
            return 0
        if self.routing == "round-robin":
            return index % n
        if self.routing == "sticky":
            # every request of a session to one instance (sessions numbered in order of first
            # sight); requests without a session go round-robin, as kvstrata replay routes them
            if session is None:
                return index % n
            got = self._sticky.get(session)
            if got is None:
                got = self._sticky[session] = len(self._sticky) % n
            return got
        loads = [inst.requests for inst in self.instances]
        limit = min(loads) + max(1.0, self.balance * sum(loads) / n)
        prompt = keys[:n_prompt]
        best, best_key = 0, (-1, 0, 0)
        for i, inst in enumerate(self.instances):
            if loads[i] > limit:
                continue
            score = (inst.restorable(prompt), -loads[i], -i)
            if score > best_key:
                best, best_key = i, score
        return best

    def run(self, trace: BlockTrace, on_request: Callable[[int], None] | None = None) -> SimResult:
        n = len(trace)
        hits = np.zeros((n, len(self.specs)), dtype=np.int32)
        where = np.zeros(n, dtype=np.int32)
        starts = trace.starts.tolist()
        n_prompt = trace.n_prompt.tolist()
        keys_all = trace.keys.tolist()
        loads = np.zeros((n, len(self.specs)), dtype=np.int64) if self.hybrid else None
        with _gc_paused():
            for i in range(n):
                keys = keys_all[starts[i] : starts[i + 1]]
                inst = self.route(i, keys, n_prompt[i], trace.sessions[i])
                where[i] = inst
                engine = self.instances[inst]
                served = engine.step(keys, n_prompt[i])
                if served:
                    hits[i] = np.bincount(served, minlength=len(self.specs))
                    if loads is not None and isinstance(engine, HybridInstance):
                        loads[i] = engine.load_bytes
                if on_request is not None:
                    on_request(i)
        return self._result(trace, hits, where, loads)

    def _bytes(self, t: SimTier | HybridTier) -> tuple[int, int, int, int]:
        """Logical bytes stored and written by one tier copy, and their rank-independent parts."""
        if isinstance(t, HybridTier):
            return t.live_bytes, t.written_bytes, t.live_ri, t.written_ri
        every = (1 << len(self.layer_sizes)) - 1
        bb, ri = self.sizes.nbytes(every), self.sizes.ri_bytes(every)
        return len(t.entries) * bb, t.written_blocks * bb, len(t.entries) * ri, t.written_blocks * ri

    def _kept_per_block(self) -> dict[str, float]:
        kept = [0] * len(self.specs)
        blocks = 0
        for inst in self.instances:
            if isinstance(inst, HybridInstance):
                blocks += inst.kept_blocks
                kept = [a + b for a, b in zip(kept, inst.kept_bytes, strict=True)]
        if not blocks:
            return {}
        return {spec.name: k / blocks for spec, k in zip(self.specs, kept, strict=True)}

    def _result(
        self, trace: BlockTrace, hits: np.ndarray, where: np.ndarray, loads: np.ndarray | None = None
    ) -> SimResult:
        tiers = []
        for spec, copies in zip(self.specs, self.copies, strict=True):
            phys = [c.space.physical_bytes for c in copies]
            written = [c.space.physical_written for c in copies]
            nbytes = [self._bytes(c) for c in copies]
            tiers.append(
                TierResult(
                    name=spec.name,
                    kind=spec.kind,
                    shared=spec.shared,
                    copies=len(copies),
                    capacity=spec.capacity,
                    hit_blocks=sum(c.hit_blocks for c in copies),
                    written_blocks=sum(c.written_blocks for c in copies),
                    evictions=sum(c.evictions for c in copies),
                    demotions=sum(c.demotions for c in copies),
                    promotions=sum(c.promotions for c in copies),
                    not_admitted=sum(c.not_admitted for c in copies),
                    write_failures=sum(c.write_failures for c in copies),
                    resident_blocks=sum(len(c.entries) for c in copies),
                    peak_blocks=max(c.peak_blocks for c in copies),
                    physical_bytes=None if None in phys else sum(p for p in phys if p is not None),
                    physical_written=None if None in written else sum(w for w in written if w is not None),
                    bytes_stored=sum(b[0] for b in nbytes),
                    bytes_written=sum(b[1] for b in nbytes),
                    bytes_stored_ri=sum(b[2] for b in nbytes),
                    bytes_written_ri=sum(b[3] for b in nbytes),
                    snapshots_not_admitted=sum(c.snapshots_not_admitted for c in copies if isinstance(c, HybridTier)),
                    snapshots_dropped=sum(c.snapshots_dropped for c in copies if isinstance(c, HybridTier)),
                    peak_bytes=max(
                        c.peak_bytes if isinstance(c, HybridTier) else c.peak_blocks * c.block_bytes for c in copies
                    ),
                )
            )
        return SimResult(
            block_size=trace.block_size,
            block_bytes=sum(self.layer_sizes),
            tiers=tiers,
            requests=len(trace),
            prompt_tokens=trace.prompt_tokens,
            hit_blocks_by_tier=hits,
            instance_of=where,
            instances=len(self.instances),
            routing=self.routing,
            dropped_stores=sum(i.dropped_stores for i in self.instances),
            dropped_blocks=sum(i.dropped_blocks for i in self.instances),
            stored_blocks=sum(i.stored_blocks for i in self.instances),
            layer_policy=self.policies.mode if self.policies is not None else "uniform",
            hybrid=self.hybrid,
            load_bytes_by_tier=loads,
            kept_bytes_per_block=self._kept_per_block(),
        )


def simulate(
    trace: BlockTrace,
    tiers: Sequence[PlanTier],
    layer_sizes: Sequence[int],
    *,
    limits: EngineLimits | None = None,
    instances: int = 1,
    routing: str = "round-robin",
    policies: LayerPolicies | None = None,
) -> SimResult:
    """Simulate ``trace`` on ``tiers`` (see :class:`Simulator`)."""
    sim = Simulator(tiers, layer_sizes, limits=limits, instances=instances, routing=routing, policies=policies)
    return sim.run(trace)
