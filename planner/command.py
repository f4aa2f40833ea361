"""What ``kvstrata plan`` does, apart from parsing options: read the inputs, plan, write the outputs.

Every bad input raises a :class:`~kvstrata.errors.KVStrataError` naming it (the CLI prints one
line and exits with status 2).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import PoliciesConfig, apply_env_overrides, load_config
from kvstrata.errors import ConfigError
from kvstrata.planner.costmodel import DEFAULT_LINKS, GPUS, LINKS, CostModel, model_compute, parse_bandwidth
from kvstrata.planner.plan import Plan, PlanOptions, make_plan
from kvstrata.planner.simulate import ROUTING
from kvstrata.planner.spec import EngineLimits, PlanTier, tiers_from_config, tiers_from_text
from kvstrata.planner.workload import block_trace
from kvstrata.policies.layers import LAYER_POLICY_MODES, LayerPolicies

__all__ = ["PlanRequest", "parse_synth_params", "run_plan"]

UNLIMITED = 1 << 62


def parse_synth_params(text: str) -> dict[str, Any]:
    """``"sessions=8,turns=30,shared-tokens=20000"`` -> keyword arguments of ``synth_agentic``."""
    from kvstrata.workload.traces import synth_agentic

    params = inspect.signature(synth_agentic).parameters
    out: dict[str, Any] = {}
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or name not in params:
            known = ", ".join(k.replace("_", "-") for k in params)
            raise ConfigError(f"--synth: {item!r}: expected NAME=VALUE with NAME one of {known}", field="synth")
        default = params[name].default
        try:
            out[name] = float(value) if isinstance(default, float) or name.endswith("_ms") else int(value)
        except ValueError:
            raise ConfigError(f"--synth: {item!r}: {value!r} is not a number", field="synth", value=value) from None
    return out


@dataclass
class PlanRequest:
    """The options of ``kvstrata plan`` (see ``kvstrata plan --help``)."""

    trace_path: str | None = None
    synth: str | None = None
    limit: int | None = None
    model: str = "tiny"
    layer_policy: str | None = None  # per-layer | uniform; None: the config's (per-layer by default)
    kv_dtype: str | None = None
    tp: int = 1
    config: str | None = None
    tiers: str | None = None
    hbm_capacity: int | None = None
    shared: Sequence[str] = ()
    instances: int = 1
    routing: str = "round-robin"
    target_hit_rate: float | None = None
    verify_target: bool = False
    sweep_points: int = 20
    belady: bool = True
    ignore_queue_limits: bool = False
    gpu: str = "h100"
    nvme_profile: str = DEFAULT_LINKS["nvme"]
    nic_profile: str = DEFAULT_LINKS["mooncake"]
    fs_profile: str = DEFAULT_LINKS["fs"]
    bandwidth: Sequence[str] = field(default_factory=tuple)
    mfu: float = 0.5
    compute_dtype: str = "bf16"
    active_params: float | None = None


def _tiers(req: PlanRequest) -> tuple[list[PlanTier], EngineLimits, PoliciesConfig]:
    if req.config and req.tiers:
        raise ConfigError("give --config or --tiers, not both", field="tiers")
    if req.tiers:
        tiers, limits = tiers_from_text(req.tiers, req.shared), EngineLimits()
        policies = _env_policies()
    else:
        cfg = load_config(req.config)
        tiers, limits = tiers_from_config(cfg, req.shared), EngineLimits.from_config(cfg)
        policies = cfg.policies
    if req.hbm_capacity is not None and not any(t.kind == "hbm" for t in tiers):
        hbm = PlanTier("hbm", "hbm", req.hbm_capacity, eviction="lru", promote=False)
        tiers = [hbm, *tiers]
    if req.ignore_queue_limits:
        limits = EngineLimits(UNLIMITED, UNLIMITED)
    return tiers, limits, policies


def _env_policies() -> PoliciesConfig:
    """The ``[policies]`` a config made from the ``--tiers`` shorthand gets (``kvstrata replay
    --tiers``): the defaults, with ``KVSTRATA__POLICIES__...`` overrides."""
    env = {k: v for k, v in os.environ.items() if k.upper().startswith("KVSTRATA__POLICIES__")}
    data = apply_env_overrides({"policies": {}}, env)
    try:
        return PoliciesConfig.model_validate(data["policies"])
    except ValueError as exc:
        raise ConfigError(f"policies: {exc}", field="policies") from None


def _profile(table: dict[str, Any], name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise ConfigError(f"unknown {what} {name!r}; known: {known}", field=what, value=name) from None


def _cost_model(req: PlanRequest, tiers: Sequence[PlanTier]) -> CostModel:
    gpu = _profile(GPUS, req.gpu, "gpu")
    links = {}
    for kind, name in (("nvme", req.nvme_profile), ("mooncake", req.nic_profile), ("fs", req.fs_profile)):
        links[kind] = _profile(LINKS, name, f"{kind} profile")
    overrides: dict[str, float] = {}
    names = {t.name for t in tiers}
    for item in req.bandwidth:
        tier, sep, rate = str(item).partition("=")
        if not sep or tier.strip() not in names:
            raise ConfigError(
                f"--bandwidth {item!r}: expected TIER=RATE for a tier of the plan ({', '.join(sorted(names))})",
                field="bandwidth",
                value=item,
            )
        overrides[tier.strip()] = parse_bandwidth(rate)
    if req.compute_dtype not in ("bf16", "fp8"):
        raise ConfigError(f"compute dtype must be bf16 or fp8, got {req.compute_dtype!r}", field="compute_dtype")
    return CostModel(
        compute=model_compute(req.model, req.active_params),
        gpu=gpu,
        tp=req.tp,
        mfu=req.mfu,
        compute_dtype=req.compute_dtype,
        links=links,
        overrides=overrides,
    )


def run_plan(req: PlanRequest, on_progress: Callable[[str], None] | None = None) -> Plan:
    """Read the trace and the tiers, and plan."""
    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.traces import Trace, read_trace, synth_agentic

    if req.routing not in ROUTING:
        raise ConfigError(f"unknown routing {req.routing!r}; known: {', '.join(ROUTING)}", field="routing")
    if req.target_hit_rate is not None and not 0.0 <= req.target_hit_rate <= 1.0:
        raise ConfigError(f"target hit rate must be within 0..1, got {req.target_hit_rate}", field="target_hit_rate")
    if (req.trace_path is None) == (req.synth is None):
        raise ConfigError("give --trace FILE or --synth PARAMS (one of them)", field="trace")
    if req.layer_policy is not None and req.layer_policy not in LAYER_POLICY_MODES:
        raise ConfigError(
            f"unknown layer policy {req.layer_policy!r}; known: {', '.join(LAYER_POLICY_MODES)}",
            field="layer_policy",
            value=req.layer_policy,
        )
    tiers, limits, policies_config = _tiers(req)
    if req.synth is not None:
        params = parse_synth_params(req.synth)
        trace = Trace(synth_agentic(**params), format="kvstrata")
        if req.limit is not None:
            trace = trace.limit(req.limit)
        label = "synth " + ",".join(f"{k.replace('_', '-')}={v}" for k, v in params.items()) if params else "synth"
    else:
        assert req.trace_path is not None
        trace = read_trace(req.trace_path, limit=req.limit)
        label = Path(req.trace_path).name
    layout = get_layout(req.model, block_size=trace.block_size, kv_dtype=req.kv_dtype, tp_size=req.tp)
    policies = LayerPolicies.resolve(layout, policies_config, mode=req.layer_policy, tier_names=[t.name for t in tiers])
    cost = _cost_model(req, tiers)
    if on_progress is not None:
        on_progress(f"keying {len(trace):,} requests at {layout.block_size}-token blocks")
    blocks = block_trace(trace.requests, layout.block_size)
    options = PlanOptions(
        instances=req.instances,
        routing=req.routing,
        target_hit_rate=req.target_hit_rate,
        sweep_points=req.sweep_points,
        belady=req.belady,
        verify_target=req.verify_target,
    )
    return make_plan(
        blocks,
        layout,
        tiers,
        cost,
        limits=limits,
        options=options,
        trace_label=label,
        tp=req.tp,
        on_progress=on_progress,
        policies=policies,
    )
