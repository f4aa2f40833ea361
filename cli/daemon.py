"""``kvstrata daemon``, ``status`` and ``prefetch``: run the tier-migration daemon and talk to it."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from kvstrata.cli.common import console, out, write_json
from kvstrata.units import format_size


@click.command("daemon")
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Port of /metrics etc. (0: any free port).")
@click.option("--metrics-host", help="Address of /metrics etc. (default 127.0.0.1).")
def daemon_cmd(config: str | None, metrics_port: int | None, metrics_host: str | None) -> None:
    """Run the tier-migration daemon (one per node) until SIGTERM; SIGHUP reloads the config."""
    from kvstrata.daemon.service import run_daemon

    sys.exit(run_daemon(config, metrics_port=metrics_port, metrics_host=metrics_host))


@click.command("status")
@click.option("--config", type=click.Path(), help="The daemon's config (finds its state directory).")
@click.option("--url", help="The daemon's HTTP address (default: from its state file).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the status here.")
def status_cmd(config: str | None, url: str | None, json_out: str | None) -> None:
    """Ask the running daemon what it is doing."""
    from kvstrata.config import load_config
    from kvstrata.daemon.client import daemon_url, fetch_status, token_for
    from kvstrata.daemon.state import state_dir_for

    cfg = load_config(config)
    data = fetch_status(url or daemon_url(state_dir_for(cfg)), token=token_for(cfg))
    if json_out != "-":
        totals = ", ".join(f"{k} {v:,.0f}" for k, v in data.get("totals", {}).items())
        out.print(f"daemon pid {data['pid']}: {data['state']} ({data['activity']}), up {data['uptime_s']:.0f}s")
        out.print(f"totals: {totals}")
        table = Table(title="tiers")
        for col in ("namespace", "model", "tier", "used", "capacity", "high", "low"):
            table.add_column(col)
        for ns in data.get("namespaces", []):
            for t in ns["tiers"]:
                used = "-" if t["used_bytes"] is None else format_size(t["used_bytes"])
                sizes = [format_size(t[k]) for k in ("capacity_bytes", "high_bytes", "low_bytes")]
                table.add_row(ns["namespace"], ns["model"], t["tier"], used, *sizes)
        out.print(table)
    write_json(json_out, data)


@click.command("prefetch")
@click.argument("keys", nargs=-1)
@click.option("--config", type=click.Path(), help="The daemon's config (finds its state directory).")
@click.option("--namespace", help="Namespace fingerprint (default: the only namespace on disk).")
@click.option("--keys-file", type=click.File("r"), help="One key (32 hex digits) per line; '-' for stdin.")
@click.option("--url", help="POST to the daemon at this address instead of appending to its hint file.")
def prefetch_cmd(
    keys: tuple[str, ...], config: str | None, namespace: str | None, keys_file: Any, url: str | None
) -> None:
    """Hint the daemon that these blocks will be wanted soon: it copies them up to NVMe."""
    from kvstrata.config import load_config
    from kvstrata.daemon.client import post_prefetch, token_for
    from kvstrata.daemon.hints import append_hint
    from kvstrata.daemon.namespaces import discover, persistent_chain
    from kvstrata.daemon.state import state_dir_for

    cfg = load_config(config)
    texts = list(keys) + ([line.strip() for line in keys_file if line.strip()] if keys_file else [])
    try:
        raw = [bytes.fromhex(k) for k in texts]
    except ValueError:
        raise click.BadParameter("keys are 32 hex digits each") from None
    if not raw or any(len(k) != 16 for k in raw):
        raise click.BadParameter("give one or more keys of 32 hex digits each")
    if namespace is None:
        found = sorted(discover(persistent_chain(cfg)))
        if len(found) != 1:
            raise click.UsageError(f"--namespace is needed; namespaces on disk: {', '.join(found) or 'none'}")
        namespace = found[0]
    if url:
        post_prefetch(url, namespace, raw, token=token_for(cfg))
    else:
        append_hint(state_dir_for(cfg), namespace, raw)
    console.print(f"hinted {len(raw)} keys of namespace {namespace}")
