"""``kvstrata verify``: checksums and index/segment consistency of the persistent tiers."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from kvstrata.cli.common import console, out, output_file, write_json
from kvstrata.units import format_size

_SHOWN = 5  # problems printed per namespace (the --json report has up to 100)


@click.command()
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option(
    "--repair",
    is_flag=True,
    help="Drop bad index entries, delete unreferenced segment files, rebuild an index that cannot be opened "
    "(or was lost) from the segment files.",
)
@click.option(
    "--rebuild",
    is_flag=True,
    help="With --repair: rebuild every index from the segment files even if it opens (implies --repair; "
    "no process may use the tier meanwhile).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the report here.",
)
def verify(config: str | None, repair: bool, rebuild: bool, json_out: str | None) -> None:
    """Check every persistent block's checksum and the index/segment consistency."""
    from kvstrata.engine.verify import verify_config

    repair = repair or rebuild
    reports = verify_config(config, repair=repair, rebuild=rebuild)
    table = Table(title="kvstrata verify")
    for col in ("tier", "namespace", "model", "blocks", "bad checksums", "missing", "orphan bytes", "ok"):
        table.add_column(col)
    for r in reports:
        table.add_row(
            r["tier"],
            r.get("namespace", ""),
            r.get("model", ""),
            str(r.get("blocks_checked", 0)),
            str(r.get("bad_checksums", 0)),
            str(r.get("missing_data", 0)),
            format_size(r.get("orphan_bytes", 0)),
            "yes" if r["ok"] else "[red]NO[/]",
        )
    out.print(table)
    for r in reports:
        if not r["ok"]:
            where = f"{r['tier']} {r.get('namespace') or r.get('path', '')}".rstrip()
            for problem in r.get("problems", [])[:_SHOWN]:
                console.print(f"problem: {where}: {problem}", markup=False, highlight=False, soft_wrap=True)
    ok = all(r["ok"] for r in reports)
    write_json(json_out, {"ok": ok, "repaired": repair, "namespaces": reports})
    if any(not r["ok"] and not r.get("repaired") for r in reports):  # --repair fixes only what it checked
        sys.exit(1)  # with --repair too when a tier could not be checked (unusable path, unreachable store)
