"""A capacity plan: simulate the configured tiers, sweep capacities, compare with Belady, cost it.

:func:`make_plan` runs, over one trace:

1. the simulator (:mod:`kvstrata.planner.simulate`) on the configured tiers: token hit rate
   per tier, bytes resident and written, exactly as the engine would (the "truth" figures);
2. one hit curve per tier (:mod:`kvstrata.planner.mrc`): the token hit rate of the tiers up to
   and including it, against its capacity, from one pass; private tiers are evaluated per
   instance (their requests), shared ones over the whole trace. A tier under a
   ``write-through`` tier holds copies of what is above it, so its curve is evaluated at its
   own capacity (or the capacity above, if larger); under a ``write-back`` tier, at the sum; a
   shared tier under private ones, on its own. The curves of lower tiers are fitted to the
   simulation at their configured capacity (see :func:`_calibrate`);
3. the smallest capacity of each tier that reaches ``target_hit_rate``, checked by
   simulating the configured tiers with that one capacity changed (``verify_target``);
4. Belady's offline optimum for one cache with the configured bytes of the tiers up to each
   tier (all instances together);
5. the cost model (:mod:`kvstrata.planner.costmodel`).

Hybrid layouts under per-layer policies (:mod:`kvstrata.policies.layers`): the simulation
mirrors the engine's per-layer decisions exactly (:mod:`kvstrata.planner.hybrid`), so its hit
rates and bytes are the "truth" figures as for uniform layouts. The curves and Belady stay
block-granular: they count a block of a tier at the mean bytes per stored block that the
policies keep and that tier may hold (from the simulation), and they do not know restore
points (a prefix is restorable at any block boundary there), so each tier's curve, the top
tier's included, is fitted to the simulation at its configured capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvstrata.core.layout import KVLayout
from kvstrata.planner.costmodel import CostModel, CostReport
from kvstrata.planner.kinds import in_device_memory
from kvstrata.planner.mrc import HitCurve, belady_hit_tokens, hit_curve
from kvstrata.planner.simulate import SimResult, Simulator
from kvstrata.planner.space import capacity_for_blocks, make_space, space_model
from kvstrata.planner.spec import EngineLimits, PlanTier
from kvstrata.planner.workload import BlockTrace
from kvstrata.policies.layers import LayerPolicies

__all__ = ["Plan", "PlanOptions", "TierCurve", "TierTarget", "make_plan"]

DAY_S = 86_400.0


@dataclass(frozen=True)
class PlanOptions:
    instances: int = 1
    routing: str = "round-robin"
    target_hit_rate: float | None = None
    sweep_points: int = 20
    belady: bool = True
    verify_target: bool = False


@dataclass
class TierCurve:
    """Cumulative token hit rate (tiers up to this one) against this tier's capacity."""

    policy: str
    scope: str  # "per instance" or "all instances"
    capacity_bytes: list[int]
    hit_rate: list[float]
    at_configured: float  # the curve's value at the configured capacity (calibrated: the simulated value)
    uncalibrated_at_configured: float = 0.0  # the one-pass curve alone at the configured capacity
    calibration: float = 1.0  # blocks held per block of nominal capacity, fitted to the simulation


@dataclass
class TierTarget:
    capacity_bytes: int | None  # None: no capacity reaches the target
    reached_by_tiers_above: bool
    max_hit_rate: float  # with this tier unbounded
    simulated_hit_rate: float | None = None  # cumulative, simulated with that capacity


@dataclass
class Plan:
    """Everything a plan found; :mod:`kvstrata.planner.report` renders it."""

    model: str
    layout: KVLayout
    tiers: list[PlanTier]
    trace: BlockTrace
    trace_label: str
    options: PlanOptions
    limits: EngineLimits
    sim: SimResult
    curves: dict[str, TierCurve]
    belady: dict[str, float | None]  # cumulative Belady hit rate at the configured bytes up to each tier
    targets: dict[str, TierTarget]
    cost: CostReport
    calibration: dict[str, float]
    timings: dict[str, float]
    tp: int = 1
    kv_dtype: str = ""
    notes: list[str] = field(default_factory=list)
    policies: LayerPolicies | None = None
    block_bytes_used: dict[str, float] = field(default_factory=dict)  # per tier: bytes a curve counts per block

    @property
    def layer_policy(self) -> str:
        return self.policies.mode if self.policies is not None else "uniform"

    # -- headline figures ----------------------------------------------------------------------
    @property
    def token_hit_rate(self) -> float:
        return self.sim.token_hit_rate

    @property
    def belady_token_hit_rate(self) -> float | None:
        return self.belady.get(self.tiers[-1].name) if self.tiers else None

    def per_day(self, nbytes: float) -> float | None:
        duration = self.trace.duration_s
        return nbytes * DAY_S / duration if duration > 0 else None

    @property
    def ssd_bytes_written(self) -> int:
        """Bytes written to nvme tiers' drives (all instances and ranks; padding and compaction included)."""
        total = 0
        for t in self.sim.tiers:
            if space_model(t.kind) == "segments":
                total += t.physical_written if t.physical_written is not None else t.bytes_written
        return total * self.tp

    def all_ranks(self, nbytes: int, rank_independent: int) -> int:
        """Bytes of every tensor-parallel rank: rank-independent layers (MLA under the per-layer
        policy) once, the others once per rank (as ``kvstrata layers`` counts)."""
        return rank_independent + self.tp * (nbytes - rank_independent)

    @property
    def bytes_stored(self) -> dict[str, Any]:
        """What the tiers hold at the end (``kvstrata replay``'s ``bytes_stored``, all copies and ranks)."""
        per = {t.name: self.all_ranks(t.bytes_stored, t.bytes_stored_ri) for t in self.sim.tiers}
        return {"total": sum(per.values()), "per_tier": per}

    @property
    def ssd_bytes_written_per_day(self) -> float | None:
        return self.per_day(self.ssd_bytes_written)

    def to_dict(self) -> dict[str, Any]:
        from kvstrata.planner.report import plan_to_dict

        return plan_to_dict(self)


def _curve_scope(spec: PlanTier, instances: int) -> str:
    return "all instances" if spec.shared or instances == 1 else "per instance"


class _Curves:
    """Hit curves, computed once per (scope, policy)."""

    def __init__(self, trace: BlockTrace, sim: SimResult) -> None:
        self.trace = trace
        self.sim = sim
        self._cache: dict[tuple[str, str], HitCurve] = {}

    def get(self, scope: str, policy: str) -> HitCurve:
        kind = "lru" if policy == "lru" else "prefix-aware"
        key = (scope, kind)
        if key not in self._cache:
            groups = None
            if scope == "per instance":
                groups = [np.flatnonzero(self.sim.instance_of == i) for i in range(self.sim.instances)]
            self._cache[key] = hit_curve(self.trace, kind, groups)
        return self._cache[key]


def _own_blocks(
    spec: PlanTier, capacity: int | None, layer_sizes: Sequence[int], factor: float, block_bytes: float | None = None
) -> float:
    """Useful blocks one copy of a tier holds at ``capacity`` (``inf`` when unbounded); with
    ``block_bytes`` (hybrid layouts: what the policies keep per block), that many bytes a block."""
    if capacity is None:
        return math.inf
    if block_bytes is not None:
        return float(math.floor(capacity / block_bytes * factor))
    got = make_space(spec.kind, capacity, layer_sizes).max_blocks() if not spec.is_ssd else None
    nominal = got if got is not None else capacity // sum(layer_sizes)
    return float(math.floor(nominal * factor))


class _Hierarchy:
    """Effective cache size (blocks, in a tier's scope) seen through tiers ``0 .. k``.

    ``eff[name]``: useful blocks per block of nominal capacity (fitted by :func:`_calibrate`);
    ``block_bytes[name]``: bytes a block takes there, when not every layer of every block
    (hybrid layouts under per-layer policies)."""

    def __init__(
        self,
        tiers: Sequence[PlanTier],
        layer_sizes: Sequence[int],
        instances: int,
        efficiency: dict[str, float],
        block_bytes: dict[str, float] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.layer_sizes = list(layer_sizes)
        self.instances = instances
        self.eff = efficiency
        self.block_bytes = block_bytes or {}

    def above(self, k: int) -> tuple[float, bool]:
        """Blocks the tiers above ``k`` give, in tier ``k``'s scope, and whether they add to
        tier ``k``'s (``write-back`` above: exclusive) or overlap it (``write-through``: copies).

        Private tiers above a shared one count for nothing there: N private caches of ``C``
        blocks are not one cache of ``N * C`` (each instance sees only its own), so the shared
        tier is evaluated on its own."""
        if k == 0:
            return 0.0, True
        up = self.tiers[k - 1]
        if self.instances > 1 and up.shared != self.tiers[k].shared:
            return 0.0, True
        return self.blocks(k - 1, up.capacity), up.write == "write-back"

    def blocks(self, k: int, capacity: int | None) -> float:
        spec = self.tiers[k]
        own = _own_blocks(
            spec, capacity, self.layer_sizes, self.eff.get(spec.name, 1.0), self.block_bytes.get(spec.name)
        )
        above, additive = self.above(k)
        return own + above if additive else max(own, above)

    def capacity_for(self, k: int, blocks: int) -> tuple[int | None, bool]:
        """Smallest capacity of tier ``k`` giving ``blocks`` effective blocks; (None, True) when
        the tiers above already give them."""
        spec = self.tiers[k]
        above, additive = self.above(k)
        if k > 0 and above >= blocks:
            return None, True
        own = blocks - above if additive else blocks
        nominal = math.ceil(own / self.eff.get(spec.name, 1.0))
        bb = self.block_bytes.get(spec.name)
        if bb is not None:
            return math.ceil(nominal * bb), False
        return capacity_for_blocks(nominal, self.layer_sizes, spec.kind), False


def _sweep_range(configured: int | None, saturation: int, points: int) -> list[int]:
    """``points`` capacities, log-spaced, around the configured one and up past saturation."""
    hi = max(configured or 0, saturation) * 1.5
    lo = max(1.0, min(configured or saturation, saturation) / 50)
    return sorted({int(x) for x in np.geomspace(lo, hi, max(2, points))})


def make_plan(
    trace: BlockTrace,
    layout: KVLayout,
    tiers: Sequence[PlanTier],
    cost: CostModel,
    *,
    limits: EngineLimits | None = None,
    options: PlanOptions | None = None,
    trace_label: str = "",
    tp: int = 1,
    kv_dtype: str = "",
    on_progress: Callable[[str], None] | None = None,
    policies: LayerPolicies | None = None,
) -> Plan:
    """Plan ``tiers`` for ``trace`` (see the module doc). ``policies``: the layout's layer
    policies (default: resolved from the layout with the default ``[policies]``, per-layer)."""
    opts = options or PlanOptions()
    limits = limits or EngineLimits()
    tiers = list(tiers)
    layer_sizes = [s.nbytes for s in layout.layers]
    if policies is None:
        policies = LayerPolicies.resolve(layout, None, tier_names=[t.name for t in tiers])
    timings: dict[str, float] = {}
    say = on_progress or (lambda _msg: None)

    def simulate(specs: Sequence[PlanTier]) -> SimResult:
        sim = Simulator(
            specs, layer_sizes, limits=limits, instances=opts.instances, routing=opts.routing, policies=policies
        )
        return sim.run(trace)

    t0 = time.perf_counter()
    say("simulating the configured tiers")
    sim = simulate(tiers)
    timings["simulate_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    say("hit curves (stack distances)")
    curves_src = _Curves(trace, sim)
    block_bytes = _hybrid_block_bytes(sim, tiers, sum(layer_sizes)) if sim.hybrid else {}
    hierarchy = _Hierarchy(tiers, layer_sizes, opts.instances, {}, block_bytes)
    raw = [curves_src.get(_curve_scope(t, opts.instances), t.eviction) for t in tiers]
    uncalibrated = [raw[k].hit_rate(hierarchy.blocks(k, t.capacity)) for k, t in enumerate(tiers)]
    efficiency = _calibrate(sim, tiers, raw, hierarchy, fit_top=sim.hybrid)
    curves: dict[str, TierCurve] = {}
    for k, spec in enumerate(tiers):
        curve = raw[k]
        block = block_bytes.get(spec.name, sum(layer_sizes))
        sat_cap = hierarchy.capacity_for(k, curve.saturation_blocks)[0] or math.ceil(curve.saturation_blocks * block)
        points = _sweep_range(spec.capacity, sat_cap, opts.sweep_points)
        curves[spec.name] = TierCurve(
            policy=curve.policy,
            scope=_curve_scope(spec, opts.instances),
            capacity_bytes=points,
            hit_rate=[curve.hit_rate(hierarchy.blocks(k, c)) for c in points],
            at_configured=curve.hit_rate(hierarchy.blocks(k, spec.capacity)),
            uncalibrated_at_configured=uncalibrated[k],
            calibration=efficiency.get(spec.name, 1.0),
        )
    timings["curves_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    belady: dict[str, float | None] = {}
    if opts.belady:
        say("Belady's optimum at the configured capacities")
        total = 0.0
        memo: dict[float, float] = {}
        for spec in tiers:
            copies = 1 if spec.shared else opts.instances
            block = block_bytes.get(spec.name, sum(layer_sizes))
            total += math.inf if spec.capacity is None else copies * (spec.capacity // block)
            if total not in memo:
                memo[total] = belady_hit_tokens(trace, total) / trace.prompt_tokens if trace.prompt_tokens else 0.0
            belady[spec.name] = memo[total]
    timings["belady_s"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    targets: dict[str, TierTarget] = {}
    if opts.target_hit_rate is not None:
        say("capacities for the target hit rate")
        targets = _targets(tiers, opts, curves_src, hierarchy, simulate)
    timings["targets_s"] = time.perf_counter() - t3

    report = cost.evaluate(
        trace.input_tokens,
        sim.hit_blocks_by_tier,
        [(t.name, t.kind) for t in tiers],
        trace.block_size,
        sum(layer_sizes),
        load_bytes=sim.load_bytes_by_tier,
    )
    timings["total_s"] = time.perf_counter() - t0
    notes = []
    kinds = {spec.kind.value for spec in layout.layers}
    if sim.hybrid:
        per = ", ".join(f"{name} {b:,.0f} B" for name, b in block_bytes.items())
        notes.append(
            f"per-layer policies simulated as the engine applies them (window blocks before restore points, "
            f"state snapshots at restore points, placement, priorities); the hit curves and Belady count a "
            f"block at the mean bytes the policies keep of a stored block ({per} of {sum(layer_sizes):,} B) and "
            "treat every block boundary as restorable, so every tier's curve is fitted to the simulation "
            "at its configured capacity (curve_calibration)"
        )
    elif kinds & {"sliding", "linear"}:
        notes.append(
            "layer policy uniform: every layer of every block is stored in every tier "
            "(--layer-policy per-layer keeps only what a restore needs)"
        )
    return Plan(
        model=layout.model,
        layout=layout,
        tiers=tiers,
        trace=trace,
        trace_label=trace_label,
        options=opts,
        limits=limits.resolved(tiers[0].capacity if tiers else None),
        sim=sim,
        curves=curves,
        belady=belady,
        targets=targets,
        cost=report,
        calibration=efficiency,
        timings=timings,
        tp=tp,
        kv_dtype=kv_dtype or layout.layers[0].dtype,
        notes=notes,
        policies=policies,
        block_bytes_used=block_bytes,
    )


def _hybrid_block_bytes(sim: SimResult, tiers: Sequence[PlanTier], full: int) -> dict[str, float]:
    """Per tier, the bytes a curve counts per block: the mean the policies keep of a stored block
    and the tier may hold (every layer in an ``hbm`` tier; a full block when nothing was stored)."""
    out: dict[str, float] = {}
    for spec in tiers:
        kept = sim.kept_bytes_per_block.get(spec.name, 0.0)
        out[spec.name] = float(full) if in_device_memory(spec.kind) or kept <= 0 else kept
    return out


def _calibrate(
    sim: SimResult,
    tiers: Sequence[PlanTier],
    curves: Sequence[HitCurve],
    hierarchy: _Hierarchy,
    fit_top: bool = False,
) -> dict[str, float]:
    """Fit each tier's useful blocks per nominal block so that its curve meets the simulated
    hit rate at the configured capacity (fills ``hierarchy.eff``, top tier first).

    A lower tier holds fewer useful blocks than its bytes: nvme segment files keep dead space
    until compaction, and a tier under others is refreshed only by what reaches it. The sweep
    scales around the simulated point by this factor; where a tier does not limit the hit
    rate (saturated, no hits yet, or no larger than the tiers above) it stays 1, and the top
    tier, which sees every reference as the curve assumes, is not fitted (``fit_top``: it is too,
    for hybrid layouts, whose curves do not know restore points)."""
    cumulative = 0.0
    for k, (spec, res, curve) in enumerate(zip(tiers, sim.tiers, curves, strict=True)):
        cumulative += res.hit_blocks * sim.block_size / sim.prompt_tokens if sim.prompt_tokens else 0.0
        if spec.capacity is None or (k == 0 and not fit_top):
            continue  # the top tier sees every reference: its curve needs no fitting
        own = _own_blocks(spec, spec.capacity, hierarchy.layer_sizes, 1.0, hierarchy.block_bytes.get(spec.name))
        above, additive = hierarchy.above(k)
        limiting = own > 0 and (additive or own > above)
        if not limiting or cumulative <= 0 or cumulative >= curve.max_hit_rate - 1e-9:
            continue
        need = curve.blocks_for(cumulative)
        if need is None:
            continue
        factor = (need - (above if additive else 0.0)) / own
        hierarchy.eff[spec.name] = min(50.0, max(0.02, factor))
    return dict(hierarchy.eff)


def _targets(
    tiers: list[PlanTier],
    opts: PlanOptions,
    curves: _Curves,
    hierarchy: _Hierarchy,
    simulate: Callable[[Sequence[PlanTier]], SimResult],
) -> dict[str, TierTarget]:
    target = float(opts.target_hit_rate or 0.0)
    out: dict[str, TierTarget] = {}
    for k, spec in enumerate(tiers):
        curve = curves.get(_curve_scope(spec, opts.instances), spec.eviction)
        need = curve.blocks_for(target)
        if need is None:
            out[spec.name] = TierTarget(None, False, curve.max_hit_rate)
            continue
        capacity, above = hierarchy.capacity_for(k, need)
        result = TierTarget(capacity, above, curve.max_hit_rate)
        if opts.verify_target and capacity is not None and not above:
            trial = [replace(t, capacity=capacity) if i == k else t for i, t in enumerate(tiers)]
            sim = simulate(trial)
            result.simulated_hit_rate = sum(sim.tier_hit_rate(t.name) for t in trial[: k + 1])
        out[spec.name] = result
    return out
