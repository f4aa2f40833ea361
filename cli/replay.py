"""``kvstrata replay``: a trace through the real engine (one process or several), and the report tables
``demo`` and ``experiment`` share."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from kvstrata.cli.common import console, out, output_file, progress, size_bytes, tiers_or_config, write_json
from kvstrata.units import format_size


def report_table(reports: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="kvstrata replay", show_lines=False)
    table.add_column("run")
    table.add_column("requests", justify="right")
    table.add_column("prompt tokens", justify="right")
    table.add_column("token hit rate", justify="right")
    table.add_column("hits per tier", justify="left")
    table.add_column("mismatched", justify="right")
    table.add_column("time", justify="right")
    for name, r in reports.items():
        per = ", ".join(f"{t} {v / r['prompt_tokens']:.1%}" for t, v in r["per_tier"].items() if r["prompt_tokens"])
        table.add_row(
            name,
            str(r["requests"]),
            f"{r['prompt_tokens']:,}",
            f"{r['token_hit_rate']:.1%}",
            per,
            str(r["mismatched_loads"]),
            f"{r['elapsed_s']:.1f}s",
        )
    return table


def run_replay(
    trace_path: str, config: Any, model: str, hbm_capacity: int | None, limit: int | None, salt: str, label: str
) -> dict[str, Any]:
    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.replay import replay_trace
    from kvstrata.workload.traces import read_trace

    tr = read_trace(trace_path, limit=limit)
    layout = get_layout(model, block_size=tr.block_size)
    prog, tick = progress(len(tr), label)
    with prog:
        report = replay_trace(tr, layout, config, hbm_capacity=hbm_capacity, tenant_salt=salt, on_request=tick)
    return report.to_dict()


def run_multi(
    trace_path: str,
    config: Any,
    model: str,
    hbm_capacity: int | None,
    limit: int | None,
    salt: str,
    instances: int,
    routing: str,
    shared_pool: bool,
) -> dict[str, Any]:
    from kvstrata.workload.multi import replay_multi
    from kvstrata.workload.traces import read_trace

    tr = read_trace(trace_path, limit=limit)
    prog, tick = progress(len(tr), f"replay x{instances} ({routing})")
    with prog:
        report = replay_multi(
            tr,
            model,
            config,
            instances=instances,
            routing=routing,
            shared_pool=shared_pool,
            hbm_capacity=hbm_capacity,
            tenant_salt=salt,
            on_request=tick,
        )
    return report.to_dict()


def multi_table(reports: list[dict[str, Any]]) -> Table:
    table = Table(title="multi-instance replay")
    for col in ("instances", "routing", "shared pool", "requests", "token hit rate", "tokens/s", "elapsed"):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(
            str(r["instances"]),
            r["routing"],
            "yes" if r["shared_pool"] else "no",
            f"{r['requests']:,}",
            f"{r['token_hit_rate']:.1%}",
            f"{r['throughput_tokens_per_s']:,.0f}",
            f"{r['elapsed_s']:.1f} s",
        )
    return table


@click.command()
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option("--model", default="tiny", show_default=True, help="Catalog model name or a config.json path.")
@click.option("--hbm-capacity", callback=size_bytes, help="Add an hbm tier (GPU prefix cache stand-in) of this size.")
@click.option("--limit", type=click.IntRange(0), help="Replay only the first N requests.")
@click.option("--salt", default="", help="Tenant salt (a fresh namespace: ignores what earlier runs stored).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the report here.",
)
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 64), help="Engine processes.")
@click.option("--routing", default="round-robin", show_default=True, type=click.Choice(["round-robin", "sticky"]))
@click.option("--shared-pool/--no-shared-pool", default=True, help="With --instances: keep the cluster tiers.")
@click.option("--tiers", help="Tiers instead of --config, e.g. 'hbm=40GiB,dram=256GiB,nvme=4TiB' (as for plan).")
@click.option(
    "--layer-policy",
    type=click.Choice(["per-layer", "uniform"]),
    help="Per-layer-group policies for hybrid models, or store every layer of every block "
    "(default: the config's, per-layer).",
)
def replay(
    trace_path: str,
    config: str | None,
    model: str,
    hbm_capacity: int | None,
    limit: int | None,
    salt: str,
    json_out: str | None,
    instances: int,
    routing: str,
    shared_pool: bool,
    tiers: str | None,
    layer_policy: str | None,
) -> None:
    """Replay a trace through the real engine and its tiers, checking every loaded byte.

    With --instances N, N engine processes share the config's cluster tiers (mooncake, fs) and
    each has its own private tiers; requests go to them by --routing."""
    source = tiers_or_config(config, tiers)
    if layer_policy is not None:
        from kvstrata.config import load_config
        from kvstrata.workload.replay import with_layer_policy

        source = with_layer_policy(load_config(source), layer_policy)
    if instances > 1 or not shared_pool:
        report = run_multi(trace_path, source, model, hbm_capacity, limit, salt, instances, routing, shared_pool)
        out.print(multi_table([report]))
        write_json(json_out, report)
        if report["mismatched_loads"]:
            console.print(f"[bold red]{report['mismatched_loads']} loaded blocks had wrong bytes[/]")
            sys.exit(1)
        return
    report = run_replay(trace_path, source, model, hbm_capacity, limit, salt, "replay")
    out.print(report_table({"kvstrata": report}))
    stored = report["bytes_stored"]
    per = ", ".join(f"{t} {format_size(b)}" for t, b in stored["per_tier"].items())
    out.print(f"layer policy {report['layer_policy']}: bytes stored {format_size(stored['total'])} ({per})")
    write_json(json_out, report)
    if report["mismatched_loads"]:
        console.print(f"[bold red]{report['mismatched_loads']} loaded blocks had wrong bytes[/]")
        sys.exit(1)
