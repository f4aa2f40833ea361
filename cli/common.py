"""What every command shares: the two consoles, the error-to-exit-status group, option callbacks,
JSON output and the progress bar."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvstrata.errors import KVStrataError
from kvstrata.units import parse_size

if TYPE_CHECKING:
    from kvstrata.config import KVStrataConfig

#: Progress, notes and errors (standard error).
console = Console(stderr=True)
#: Tables and reports (standard output; 132 columns when it is not a terminal).
out = Console(width=None if sys.stdout.isatty() else 132)


class KVStrataGroup(click.Group):
    """Turns kvstrata errors into one clear line and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVStrataError as exc:
            console.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
            sys.exit(2)


def size_bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A size option (``40GiB``, ``4TiB``) as bytes; a bad one is a usage error."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (``-``: standard output; none: nothing)."""
    if not path:
        return
    text = json.dumps(data, indent=2, sort_keys=False, default=str)
    if path == "-":
        click.echo(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def progress(total: int, label: str) -> tuple[Progress, Callable[[int], None]]:
    """A progress bar over ``total`` requests (on standard error, only on a terminal) and its tick."""
    prog = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )
    task = prog.add_task(label, total=total)
    return prog, lambda _tokens: prog.advance(task)


def tiers_or_config(config: str | None, tiers: str | None) -> str | KVStrataConfig | None:
    """``--tiers`` shorthand as a validated config (``--config`` and ``--tiers`` exclude each other)."""
    if tiers is None:
        return config
    if config is not None:
        raise click.UsageError("give --config or --tiers, not both")
    from kvstrata.config import tiers_from_shorthand

    return tiers_from_shorthand(tiers)
