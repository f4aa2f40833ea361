"""``kvstrata trace synth``: write a synthetic agentic trace."""

from __future__ import annotations

from typing import Any

import click

from kvstrata.cli.common import FiniteFloatRange, console, output_file, writing


@click.group()
def trace() -> None:
    """Make and inspect workload traces."""


@trace.command("synth")
@click.option(
    "--out",
    "out_path",
    required=True,
    type=click.Path(dir_okay=False),
    callback=output_file,
    help="JSONL file to write.",
)
@click.option("--sessions", default=8, show_default=True, type=click.IntRange(1))
@click.option("--turns", default=30, show_default=True, type=click.IntRange(1))
@click.option("--shared-tokens", default=20000, show_default=True, type=click.IntRange(0))
@click.option("--first-turn-tokens", default=10000, show_default=True, type=click.IntRange(0))
@click.option("--turn-tokens", default=2048, show_default=True, type=click.IntRange(0))
@click.option("--output-tokens", default=900, show_default=True, type=click.IntRange(0))
@click.option("--turn-gap-ms", default=30000.0, show_default=True, type=FiniteFloatRange(0))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
def trace_synth(out_path: str, **params: Any) -> None:
    """Write an agentic multi-turn trace (defaults: the vLLM x Mooncake agentic study)."""
    from kvstrata.workload.traces import agentic_header, synth_agentic, write_jsonl

    reqs = synth_agentic(**params)
    with writing(out_path):
        write_jsonl(out_path, reqs, agentic_header(**params))
    tokens = sum(r.input_length for r in reqs)
    console.print(f"wrote {len(reqs)} requests ({tokens:,} prompt tokens) to {out_path}", markup=False, highlight=False)
