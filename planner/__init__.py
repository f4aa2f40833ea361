"""Capacity planning: what a tier configuration would serve for a trace, and what it would take.

``kvstrata plan`` is the command line; :func:`make_plan` the library entry point. Modules:
:mod:`~kvstrata.planner.workload` (a trace as block references), :mod:`~kvstrata.planner.simulate`
(a fast mirror of the engine), :mod:`~kvstrata.planner.hybrid` (its per-layer-policy path for
hybrid layouts), :mod:`~kvstrata.planner.space` (tiers' physical space rules),
:mod:`~kvstrata.planner.mrc` (hit curves from stack distances, Belady's optimum),
:mod:`~kvstrata.planner.kinds` (what a tier kind can do, from its class),
:mod:`~kvstrata.planner.costmodel` (hardware profiles, TTFT and throughput) and
:mod:`~kvstrata.planner.report` (table, JSON, Markdown, plot).
"""

from __future__ import annotations

from kvstrata.planner.costmodel import GPUS, LINKS, CostModel, model_compute
from kvstrata.planner.plan import Plan, PlanOptions, make_plan
from kvstrata.planner.simulate import ROUTING, SimResult, Simulator, simulate
from kvstrata.planner.spec import EngineLimits, PlanTier, tiers_from_config, tiers_from_text
from kvstrata.planner.workload import BlockTrace, block_trace

__all__ = [
    "GPUS",
    "LINKS",
    "ROUTING",
    "BlockTrace",
    "CostModel",
    "EngineLimits",
    "Plan",
    "PlanOptions",
    "PlanTier",
    "SimResult",
    "Simulator",
    "block_trace",
    "make_plan",
    "model_compute",
    "simulate",
    "tiers_from_config",
    "tiers_from_text",
]
