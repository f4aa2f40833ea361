"""The ``kvstrata`` command line: a thin layer over the library.

Commands: ``trace synth``, ``replay``, ``plan``, ``verify``, ``models``, ``bench``, ``demo``,
``config show``, ``daemon``, ``status``, ``prefetch``. Every bad input (a usage error, an error kvstrata raises on
purpose, an ``OSError`` on a path the user gave, a corrupt LMDB index) is printed as one unwrapped line and exits
with status 2, never as a traceback: :class:`~kvstrata.cli.common.KVStrataGroup` maps them in one place.

One module per command or family of commands (:mod:`~kvstrata.cli.replay`, :mod:`~kvstrata.cli.plan`,
:mod:`~kvstrata.cli.daemon`, ...); what they share (consoles, option callbacks, JSON output) is in
:mod:`kvstrata.cli.common`. Each module imports the library it drives inside its command, so
``kvstrata --help`` stays fast.
"""

from __future__ import annotations

import click

from kvstrata import __version__
from kvstrata.cli.bench import bench
from kvstrata.cli.common import KVStrataGroup
from kvstrata.cli.daemon import daemon_cmd, prefetch_cmd, status_cmd
from kvstrata.cli.demo import demo
from kvstrata.cli.experiment import experiment
from kvstrata.cli.info import config_group, models
from kvstrata.cli.layers import layers
from kvstrata.cli.plan import plan
from kvstrata.cli.replay import replay
from kvstrata.cli.trace import trace
from kvstrata.cli.verify import verify


@click.group(cls=KVStrataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvstrata")
def main() -> None:
    """kvstrata: a tiered KV-cache storage engine for LLM inference."""


for _command in (
    trace,
    replay,
    plan,
    experiment,
    demo,
    layers,
    models,
    verify,
    bench,
    config_group,
    daemon_cmd,
    status_cmd,
    prefetch_cmd,
):
    main.add_command(_command)

__all__ = ["main"]
