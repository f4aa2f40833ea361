"""What every command shares: the two consoles, the error-to-exit-status group, option callbacks,
JSON output and the progress bar.

Bad input of any kind (a usage error, a :class:`~kvstrata.errors.KVStrataError`, an ``OSError`` on
a path the user gave, a corrupt LMDB index) ends in :meth:`KVStrataGroup.main` as ONE unwrapped
line on standard error, ``error: ...``, and exit status 2; never a traceback. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvstrata.errors import KVStrataError, TierError
from kvstrata.units import parse_size

if TYPE_CHECKING:
    from kvstrata.config import KVStrataConfig

#: Progress and notes (standard error; lines are never wrapped, so logs keep one line per note).
console = Console(stderr=True, soft_wrap=True)
#: Tables and reports (standard output; 132 columns when it is not a terminal).
out = Console(width=None if sys.stdout.isatty() else 132)

BAD_INPUT = 2  #: exit status of every usage, config and input error


def one_line(message: str) -> str:
    """``message`` on one line, with control characters escaped (a path may hold any byte)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def fail(message: str, code: int = BAD_INPUT) -> NoReturn:
    """Print ``error: message`` as one line on standard error and exit with ``code``."""
    click.echo(f"{click.style('error:', fg='red', bold=True)} {one_line(message)}", err=True)
    sys.exit(code)


def bad_input_message(exc: BaseException) -> str | None:
    """The line to print for an exception that is bad input (None: a bug, keep the traceback)."""
    if isinstance(exc, click.ClickException):
        msg = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        if isinstance(exc, click.UsageError) and ctx is not None:
            msg += f" (see '{ctx.command_path} --help')"
        return msg
    lmdb = sys.modules.get("lmdb")
    if lmdb is not None and isinstance(exc, lmdb.Error):  # py-lmdb names the index path first
        return str(TierError(f"corrupt or unreadable LMDB index {exc}"))
    if isinstance(exc, KVStrataError):
        return str(exc) or type(exc).__name__
    if isinstance(exc, OSError):
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        what = exc.strerror or str(exc)
        return f"{where}: {what}" if where else what
    return None


class _WarningLines(logging.StreamHandler):  # type: ignore[type-arg]
    """Warnings of the library as ``warning: ...`` lines on the current standard error."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter("warning: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def show_warnings() -> None:
    """Print the library's warnings (a skipped namespace directory, ...) as one line each; the
    daemon replaces this with its own log handler."""
    root = logging.getLogger()
    if not any(isinstance(h, _WarningLines) for h in root.handlers):
        root.addHandler(_WarningLines())


class KVStrataGroup(click.Group):
    """The ``kvstrata`` group: turns every bad input into one clear line and exit status 2."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        show_warnings()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # `kvstrata models | head`: the reader left, nothing to say
                sys.stdout = None  # type: ignore[assignment]  # no flush at exit into the closed pipe
                sys.exit(1)
            fail(bad_input_message(exc) or str(exc))
        except Exception as exc:
            message = bad_input_message(exc)
            if message is None:
                raise
            fail(message)
        sys.exit(rv if isinstance(rv, int) else 0)


# --------------------------------------------------------------------------- option callbacks


def size_bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A size option (``40GiB``, ``4TiB``) as bytes; a bad one is a usage error."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class FiniteFloatRange(click.FloatRange):
    """A float range that also refuses ``nan`` and ``inf`` (``click.FloatRange`` lets NaN through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


def _first_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_output_file(path: str, option: str = "--json") -> None:
    """Refuse, before any work is done, an output file that cannot be written: its directory is
    missing or is a file, it is a directory, or creating it fails (no permission, /proc, read-only)."""
    target = Path(os.path.expanduser(path))
    if target.is_dir():
        raise click.BadParameter(f"{path!r} is a directory, not a file", param_hint=f"'{option}'")
    parent = target.parent
    if not parent.is_dir():
        found = _first_existing(parent)
        why = f"{found} is not a directory" if found.exists() and not found.is_dir() else "it does not exist"
        raise click.BadParameter(f"cannot write {path!r}: directory {str(parent)!r}: {why}", param_hint=f"'{option}'")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write {path!r}: {exc.strerror or exc}", param_hint=f"'{option}'") from None
    if not existed:
        with contextlib.suppress(OSError):
            target.unlink()


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of ``--json``/``--markdown``/``--plot``/``--out``: the file must be writable (``-``: stdout)."""
    if value is None or value == "-":
        return value
    check_output_file(value, param.opts[0] if param.opts else str(param.name))
    return value


def output_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of a directory option the command writes into: it must exist and be writable."""
    if value is None:
        return None
    hint = f"'{param.opts[0]}'" if param.opts else None
    path = Path(os.path.expanduser(value))
    if not path.is_dir():
        why = "is not a directory" if path.exists() else "does not exist"
        raise click.BadParameter(f"{value!r} {why}", param_hint=hint)
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write into {value!r}: {exc.strerror or exc}", param_hint=hint) from None
    return value


def http_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of a URL option: ``http(s)://host[:port][/path]``."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    example = "e.g. http://127.0.0.1:9477"
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError when not a number in 0..65535
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not a URL ({exc}; {example})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        raise click.BadParameter(f"{value!r} is not an http:// or https:// URL ({example})")
    if port == 0:
        raise click.BadParameter(f"{value!r}: port 0 is not a port to connect to")
    return value


def valid_host(host: str) -> bool:
    """Whether ``host`` is an IP address or a well-formed host name (no look-up)."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
    return len(host) <= 253 and re.fullmatch(rf"{label}(\.{label})*\.?", host) is not None


def host_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of a host option (an address or a host name)."""
    if value is not None and not valid_host(value):
        raise click.BadParameter(f"{value!r} is not an IP address or host name")
    return value


def host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of a ``HOST:PORT`` option."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not valid_host(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return value


def known_model(model: str) -> None:
    """Resolve ``model`` (a catalog name or a config.json path) now: a bad one fails before any work."""
    from kvstrata.core.catalog import get_layout

    get_layout(model)


# --------------------------------------------------------------------------- output


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Name ``path`` in an ``OSError`` raised while writing it (a full disk says only "No space left")."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno != errno.EPIPE:
            raise OSError(exc.errno, f"cannot write: {exc.strerror or exc}", path) from None
        raise


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (``-``: standard output; none: nothing)."""
    if not path:
        return
    text = json.dumps(data, indent=2, sort_keys=False, default=str)
    if path == "-":
        click.echo(text)
    else:
        with writing(path):
            Path(path).write_text(text + "\n", encoding="utf-8")


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
