"""``kvstrata models`` and ``kvstrata config show``: the model catalog and the effective configuration."""

from __future__ import annotations

import json

import click
from rich.table import Table

from kvstrata.cli.common import out


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models(as_json: bool) -> None:
    """List the model catalog (KV bytes per token at each model's default block size)."""
    from kvstrata.core.catalog import list_models

    entries = list_models()
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    table = Table(title="kvstrata model catalog")
    for col in ("name", "layers", "kinds", "bytes/token", "description"):
        table.add_column(col)
    for e in entries:
        table.add_row(
            e["name"],
            str(e["num_layers"]),
            ",".join(e["kinds"]),
            f"{e['bytes_per_token']:,.0f}",
            e.get("description", ""),
        )
    out.print(table)


@click.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("show")
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default).")
def config_show(config: str | None) -> None:
    """Print the effective configuration (after env overrides, with auto sizes resolved)."""
    from kvstrata.config import load_config, resolve_auto_capacity

    cfg = load_config(config)
    data = cfg.model_dump(mode="json")
    for t, tc in zip(data["tiers"], cfg.tiers, strict=True):
        t["capacity_bytes"] = resolve_auto_capacity(tc)
    click.echo(json.dumps(data, indent=2))
