"""Rendering a plan: a dict (``--json``), a terminal table, Markdown (``--markdown``) and a plot (``--plot``).

Byte figures: ``capacity_bytes`` is per engine, as configured (one engine per instance and
tensor-parallel rank; shared tiers have one copy); resident and written bytes are totals over
every copy and rank. ``bytes_stored`` is what the tiers hold at the end, as ``kvstrata replay``
reports it (logical bytes of the layers kept, per the layer policy), over every copy and rank
with rank-independent layers (MLA under the per-layer policy) counted once, as ``kvstrata
layers`` counts them; with ``--tp 1`` it is the replay's figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import KVStrataError
from kvstrata.units import format_size

if TYPE_CHECKING:
    from rich.table import Table

    from kvstrata.planner.plan import Plan

__all__ = ["plan_tables", "plan_to_dict", "render_markdown", "render_plot"]

MRC_METHOD = (
    "exact LRU stack distances over every block reference (no sampling), prefix rule applied; "
    "prefix-aware tiers: each request's blocks referenced deepest first"
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _size(n: float | None) -> str:
    return "unbounded" if n is None else format_size(n)


def _per_day(plan: Plan, nbytes: float) -> float | None:
    return plan.per_day(nbytes)


def _tier_dict(plan: Plan, k: int) -> dict[str, Any]:
    spec, res = plan.tiers[k], plan.sim.tiers[k]
    bs, tp = plan.sim.block_size, plan.tp
    prompt = plan.sim.prompt_tokens or 1
    cumulative = sum(t.hit_blocks for t in plan.sim.tiers[: k + 1]) * bs / prompt
    curve = plan.curves[spec.name]
    written = res.bytes_written * tp
    physical_written = None if res.physical_written is None else res.physical_written * tp
    out: dict[str, Any] = {
        "kind": spec.kind,
        "shared": spec.shared,
        "copies": res.copies,
        "capacity_bytes": spec.capacity,
        "eviction": spec.eviction,
        "admission": spec.admission,
        "write": spec.write,
        "promote": spec.promote,
        "hit_tokens": res.hit_blocks * bs,
        "hit_rate": res.hit_blocks * bs / prompt,
        "cumulative_hit_rate": cumulative,
        "bytes_stored": plan.all_ranks(res.bytes_stored, res.bytes_stored_ri),
        "bytes_resident": res.bytes_stored * tp,
        "bytes_resident_peak_per_copy": res.peak_bytes,
        "physical_bytes": None if res.physical_bytes is None else res.physical_bytes * tp,
        "bytes_written": written,
        "physical_bytes_written": physical_written,
        "bytes_written_per_day": _per_day(plan, physical_written if physical_written is not None else written),
        "evictions": res.evictions,
        "demotions": res.demotions,
        "promotions": res.promotions,
        "not_admitted": res.not_admitted,
        "write_failures": res.write_failures,
        "snapshots_not_admitted": res.snapshots_not_admitted,
        "snapshots_dropped": res.snapshots_dropped,
        "load_time_s": plan.cost.load_time_s.get(spec.name, 0.0),
        "load_bandwidth": plan.cost.assumptions.get("load_bandwidth", {}).get(spec.name),
        "curve_hit_rate_at_capacity": curve.at_configured,
        "curve_uncalibrated_at_capacity": curve.uncalibrated_at_configured,
        "curve_calibration": curve.calibration,
        "belady_cumulative_hit_rate": plan.belady.get(spec.name),
    }
    target = plan.targets.get(spec.name)
    if target is not None:
        out["target"] = {
            "capacity_bytes": target.capacity_bytes,
            "reached_by_tiers_above": target.reached_by_tiers_above,
            "max_hit_rate": target.max_hit_rate,
            "simulated_hit_rate": target.simulated_hit_rate,
        }
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document."""
    sim = plan.sim
    ssd = plan.ssd_bytes_written_per_day
    ssd_capacity = sum(
        (t.capacity or 0) * r.copies * plan.tp for t, r in zip(plan.tiers, sim.tiers, strict=True) if t.is_ssd
    )
    return {
        "model": plan.model,
        "kv_dtype": plan.kv_dtype,
        "tp": plan.tp,
        "block_size": sim.block_size,
        "block_bytes": sim.block_bytes,
        "bytes_per_token": sim.block_bytes / sim.block_size,
        "trace": {
            "label": plan.trace_label,
            "requests": sim.requests,
            "prompt_tokens": sim.prompt_tokens,
            "duration_s": plan.trace.duration_s,
        },
        "instances": sim.instances,
        "routing": sim.routing,
        "layer_policy": plan.layer_policy,
        "token_hit_rate": sim.token_hit_rate,
        "bytes_stored": plan.bytes_stored,
        "hit_tokens": sim.hit_tokens,
        "prefill_tokens_avoided": sim.hit_tokens,
        "per_tier": {t.name: _tier_dict(plan, k) for k, t in enumerate(plan.tiers)},
        "belady_token_hit_rate": plan.belady_token_hit_rate,
        "ssd_bytes_written": plan.ssd_bytes_written,
        "ssd_bytes_written_per_day": ssd,
        "ssd_drive_writes_per_day": (ssd / ssd_capacity) if ssd is not None and ssd_capacity else None,
        "ttft_speedup": plan.cost.ttft_speedup,
        "prefill_throughput_speedup": plan.cost.prefill_throughput_speedup,
        "cost": plan.cost.to_dict(),
        "mrc": {
            "method": MRC_METHOD,
            "sampling_error": 0.0,
            "note": (
                "curves of lower tiers are fitted to the simulation at the configured capacity "
                "(curve_calibration); curve_uncalibrated_at_capacity vs cumulative_hit_rate is the "
                "one-pass model's error there"
            )
            if not sim.hybrid
            else (
                "per-layer policies: the curves and Belady count a block at block_bytes (the mean bytes the "
                "policies keep of a stored block in that tier, from the simulation) and treat every block "
                "boundary as restorable (no restore points); every tier's curve, the top tier's included, "
                "is fitted to the simulation at the configured capacity (curve_calibration)"
            ),
            "block_bytes": dict(plan.block_bytes_used) if sim.hybrid else None,
            "curves": {
                name: {
                    "policy": c.policy,
                    "scope": c.scope,
                    "capacity_bytes": c.capacity_bytes,
                    "cumulative_hit_rate": c.hit_rate,
                }
                for name, c in plan.curves.items()
            },
        },
        "target_hit_rate": plan.options.target_hit_rate,
        "engine_limits": {
            "max_pending_bytes": plan.limits.max_pending_bytes,
            "max_background_bytes": plan.limits.max_background_bytes,
        },
        "layer_policies": plan.policies.describe() if plan.policies is not None else None,
        "notes": list(plan.notes),
        "dropped_store_batches": sim.dropped_stores,
        "dropped_store_blocks": sim.dropped_blocks,
        "stored_blocks": sim.stored_blocks,
        "timings_s": plan.timings,
    }


def plan_tables(plan: Plan) -> list[Table | str]:
    """Rich tables and lines for the terminal."""
    from rich.table import Table

    d = plan_to_dict(plan)
    tr = d["trace"]
    title = (
        f"kvstrata plan: {plan.model} ({format_size(d['bytes_per_token'])}/token, {plan.kv_dtype}, tp {plan.tp}) "
        f"on {plan.trace_label or 'trace'}: {tr['requests']:,} requests, {tr['prompt_tokens']:,} prompt tokens"
        + (f", {tr['duration_s'] / 3600:.2f} h" if tr["duration_s"] else "")
        + (f"; {d['instances']} instances, {d['routing']}" if d["instances"] > 1 else "")
    )
    table = Table(title=title, title_justify="left")
    for col in ("tier", "capacity", "hit rate", "up to here", "curve", "Belady", "stored", "writes/day", "evictions"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in d["per_tier"].items():
        scope = "" if d["instances"] == 1 else (" shared" if t["shared"] else f" x{t['copies']}")
        per_day = t["bytes_written_per_day"]
        table.add_row(
            f"{name} ({t['kind']}{scope}, {t['eviction']})",
            _size(t["capacity_bytes"]),
            _pct(t["hit_rate"]),
            _pct(t["cumulative_hit_rate"]),
            _pct(t["curve_uncalibrated_at_capacity"]),
            _pct(t["belady_cumulative_hit_rate"]),
            format_size(t["bytes_stored"]),
            "n/a" if per_day is None else format_size(per_day),
            f"{t['evictions']:,}",
        )
    c = plan.cost
    lines: list[Table | str] = [table]
    lines.append(
        f"token hit rate {_pct(d['token_hit_rate'])} (Belady's optimum with the same bytes: "
        f"{_pct(d['belady_token_hit_rate'])}); prefill tokens avoided: {d['prefill_tokens_avoided']:,}"
    )
    lines.append(_stored_line(d))
    lines.append(
        f"TTFT (cost model): mean {c.ttft_mean_nocache_s:.3g}s -> {c.ttft_mean_s:.3g}s ({c.ttft_speedup:.2f}x), "
        f"p90 {c.ttft_p90_nocache_s:.3g}s -> {c.ttft_p90_s:.3g}s; prefill throughput "
        f"{c.prefill_throughput_speedup:.2f}x (bound by {c.bottleneck})"
    )
    if d["ssd_bytes_written_per_day"] is not None:
        dwpd = d["ssd_drive_writes_per_day"]
        lines.append(
            f"SSD writes: {format_size(d['ssd_bytes_written_per_day'])}/day"
            + (f" ({dwpd:.2f} drive writes per day)" if dwpd is not None else "")
        )
    if d["dropped_store_batches"]:
        lines.append(
            f"[yellow]{d['dropped_store_blocks']:,} blocks of {d['dropped_store_batches']:,} store batches are "
            f"larger than the whole store queue budget max_pending_bytes ({format_size(plan.limits.pending_bytes)}) "
            "and were dropped, as the engine would; raise the config's engine limits (or --ignore-queue-limits)[/]"
        )
    lines += [f"[yellow]note: {note}[/]" for note in plan.notes]
    if plan.targets:
        lines.append(_target_table(plan, d))
    return lines


def _stored_line(d: dict[str, Any]) -> str:
    stored = d["bytes_stored"]
    per = ", ".join(f"{name} {format_size(b)}" for name, b in stored["per_tier"].items())
    return f"layer policy {d['layer_policy']}: bytes stored {format_size(stored['total'])} ({per})"


def _target_table(plan: Plan, d: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title=f"capacity for a {_pct(plan.options.target_hit_rate)} token hit rate", title_justify="left")
    for col in ("tier", "configured", "needed", "max with this tier unbounded", "simulated at needed"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in d["per_tier"].items():
        tg = t.get("target")
        if tg is None:
            continue
        if tg["reached_by_tiers_above"]:
            needed = "reached above"
        elif tg["capacity_bytes"] is None:
            needed = "unreachable"
        else:
            needed = format_size(tg["capacity_bytes"])
        table.add_row(
            name, _size(t["capacity_bytes"]), needed, _pct(tg["max_hit_rate"]), _pct(tg["simulated_hit_rate"])
        )
    return table


def render_markdown(plan: Plan) -> str:
    """The plan as Markdown: figures, per-tier table, curves and the cost model's assumptions."""
    d = plan_to_dict(plan)
    c = plan.cost
    tr = d["trace"]
    out = [
        f"# kvstrata plan: {plan.model} on {plan.trace_label or 'trace'}",
        "",
        f"{tr['requests']:,} requests, {tr['prompt_tokens']:,} prompt tokens"
        + (f" over {tr['duration_s'] / 3600:.2f} h" if tr["duration_s"] else "")
        + f"; {d['instances']} instance(s), routing {d['routing']}; KV {plan.kv_dtype}, tp {plan.tp}, "
        f"{format_size(d['bytes_per_token'])} per token, {plan.sim.block_size}-token blocks.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| token hit rate | {_pct(d['token_hit_rate'])} |",
        f"| bytes stored ({d['layer_policy']} layer policy) | {format_size(d['bytes_stored']['total'])} |",
        f"| Belady's optimum, same bytes | {_pct(d['belady_token_hit_rate'])} |",
        f"| prefill tokens avoided | {d['prefill_tokens_avoided']:,} |",
        f"| TTFT mean (no cache -> cache) | {c.ttft_mean_nocache_s:.3g} s -> {c.ttft_mean_s:.3g} s "
        f"({c.ttft_speedup:.2f}x) |",
        f"| TTFT p90 | {c.ttft_p90_nocache_s:.3g} s -> {c.ttft_p90_s:.3g} s |",
        f"| prefill throughput | {c.prefill_throughput_speedup:.2f}x (bound by {c.bottleneck}) |",
        "| SSD bytes written per day | "
        + ("n/a" if d["ssd_bytes_written_per_day"] is None else format_size(d["ssd_bytes_written_per_day"]))
        + " |",
        "",
        "| tier | capacity | hit rate | up to here | one-pass curve | Belady | stored | written/day |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, t in d["per_tier"].items():
        per_day = t["bytes_written_per_day"]
        out.append(
            f"| {name} ({t['kind']}, {t['eviction']}) | {_size(t['capacity_bytes'])} | {_pct(t['hit_rate'])} | "
            f"{_pct(t['cumulative_hit_rate'])} | {_pct(t['curve_uncalibrated_at_capacity'])} | "
            f"{_pct(t['belady_cumulative_hit_rate'])} | {format_size(t['bytes_stored'])} | "
            f"{'n/a' if per_day is None else format_size(per_day)} |"
        )
    if plan.targets:
        out += ["", f"## Capacity for a {_pct(plan.options.target_hit_rate)} token hit rate", ""]
        out += ["| tier | needed | max with this tier unbounded | simulated at needed |"]
        out += ["| --- | ---: | ---: | ---: |"]
        for name, t in d["per_tier"].items():
            tg = t.get("target") or {}
            need = (
                "reached above"
                if tg.get("reached_by_tiers_above")
                else ("unreachable" if tg.get("capacity_bytes") is None else format_size(tg["capacity_bytes"]))
            )
            out.append(f"| {name} | {need} | {_pct(tg.get('max_hit_rate'))} | {_pct(tg.get('simulated_hit_rate'))} |")
    out += ["", "## Hit rate against capacity (tiers up to each one)", ""]
    for name, curve in plan.curves.items():
        pts = ", ".join(
            f"{format_size(x)}: {_pct(y)}" for x, y in zip(curve.capacity_bytes, curve.hit_rate, strict=True)
        )
        scope = f", {curve.scope}" if plan.options.instances > 1 else ""
        out.append(f"* **{name}** ({curve.policy}{scope}): {pts}")
    out += ["", f"Method: {MRC_METHOD}."]
    out += [f"Note: {note}." for note in plan.notes]
    out += ["", "## Cost model", ""]
    for key, value in c.assumptions.items():
        out.append(f"* {key}: {value}")
    return "\n".join(out) + "\n"


def render_plot(plan: Plan, path: str | Path) -> None:
    """Save the hit-rate curves (one per tier, log capacity) with the configured points, Belady and the target."""
    try:
        import matplotlib
    except ImportError:
        raise KVStrataError("--plot needs matplotlib (pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan_to_dict(plan)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, curve) in enumerate(plan.curves.items()):
        color = colors[k % len(colors)]
        xs = [x / 1024**3 for x in curve.capacity_bytes]
        scope = f", {curve.scope}" if plan.options.instances > 1 else ""
        ax.plot(xs, [100 * y for y in curve.hit_rate], color=color, label=f"{name} ({curve.policy}{scope})")
        t = d["per_tier"][name]
        if t["capacity_bytes"] is not None:
            x = t["capacity_bytes"] / 1024**3
            ax.plot([x], [100 * t["cumulative_hit_rate"]], "o", color=color, markersize=7)
            if t["belady_cumulative_hit_rate"] is not None:
                ax.plot([x], [100 * t["belady_cumulative_hit_rate"]], "x", color=color, markersize=8)
    ax.plot([], [], "o", color="gray", label="configured (simulated)")
    ax.plot([], [], "x", color="gray", label="Belady's optimum, bytes of the tiers up to it")
    if plan.options.target_hit_rate is not None:
        ax.axhline(100 * plan.options.target_hit_rate, color="gray", linestyle="--", linewidth=1, label="target")
    ax.set_xscale("log")
    ax.set_xlabel("capacity of the tier (GiB, per engine)")
    ax.set_ylabel("token hit rate of the tiers up to it (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{plan.model} on {plan.trace_label or 'trace'}: hit rate against capacity", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
