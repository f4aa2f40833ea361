"""``kvstrata demo``: a scaled-down agentic trace replayed with and without kvstrata."""

from __future__ import annotations

import uuid
from pathlib import Path

import click

from kvstrata.cli.common import console, out, output_file, write_json
from kvstrata.cli.replay import report_table, run_replay
from kvstrata.units import format_size, parse_size


@click.command()
@click.option("--sessions", default=6, show_default=True, type=click.IntRange(1))
@click.option("--turns", default=8, show_default=True, type=click.IntRange(1))
@click.option("--model", default="tiny", show_default=True)
@click.option(
    "--hbm-tokens", default=65536, show_default=True, type=click.IntRange(1), help="GPU prefix cache size in tokens."
)
@click.option("--config", type=click.Path(), help="kvstrata config (default: embedded default tiers).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), callback=output_file)
def demo(sessions: int, turns: int, model: str, hbm_tokens: int, config: str | None, json_out: str | None) -> None:
    """Synthesize a scaled-down agentic trace and replay it with and without kvstrata."""
    import tempfile

    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.traces import agentic_header, synth_agentic, write_jsonl

    layout = get_layout(model)
    hbm_bytes = int(hbm_tokens * layout.bytes_per_token)
    try:
        parse_size(hbm_bytes)
    except ValueError as exc:
        raise click.BadParameter(f"{hbm_tokens} tokens of {model}: {exc}", param_hint="'--hbm-tokens'") from None
    if config is not None:  # a bad config fails before the GPU-only run, not after it
        from kvstrata.config import load_config

        load_config(config)
    with tempfile.TemporaryDirectory(prefix="kvstrata-demo-") as tmp:
        trace_path = str(Path(tmp) / "agentic.jsonl")
        params = {"sessions": sessions, "turns": turns}
        write_jsonl(trace_path, synth_agentic(**params), agentic_header(**params))
        console.print(
            f"trace: {sessions} sessions x {turns} turns (agentic study defaults otherwise); "
            f"GPU prefix cache: {hbm_tokens:,} tokens ({format_size(hbm_bytes)}) of {model}"
        )
        gpu_only = {"tiers": [{"name": "hbm", "capacity": hbm_bytes, "eviction": "lru", "promote": False}]}
        salt = uuid.uuid4().hex  # fresh namespace: earlier runs' NVMe blocks don't count
        reports = {
            "gpu-only": run_replay(trace_path, gpu_only, model, None, None, salt, "gpu-only"),
            "kvstrata": run_replay(trace_path, config, model, hbm_bytes, None, salt, "kvstrata"),
        }
    out.print(report_table(reports))
    base = reports["gpu-only"]["token_hit_rate"]
    ks = reports["kvstrata"]["token_hit_rate"]
    out.print(
        f"token hit rate: GPU-only {base:.1%} -> kvstrata {ks:.1%} "
        f"({(1 - ks) / max(1 - base, 1e-9):.2f}x the prefill work of GPU-only)"
    )
    write_json(json_out, reports)
