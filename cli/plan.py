"""``kvstrata plan``: tier capacities from a trace (the planner's command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvstrata.cli.common import FiniteFloatRange, console, out, output_file, size_bytes, write_json, writing


@click.command()
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), help="kvstrata or Mooncake trace.")
@click.option("--synth", help="Plan a synthetic agentic trace instead: 'sessions=8,turns=30,shared-tokens=20000'.")
@click.option("--limit", type=click.IntRange(0), help="Plan only the first N requests.")
@click.option("--model", default="tiny", show_default=True, help="Catalog model name or a config.json path.")
@click.option(
    "--layer-policy",
    type=click.Choice(["per-layer", "uniform"]),
    help="Per-layer-group policies for hybrid models, or every layer of every block "
    "(default: the config's, per-layer).",
)
@click.option("--kv-dtype", help="KV cache dtype (bf16, fp8, ...; default: the model's).")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1, 1024), help="Tensor-parallel size.")
@click.option("--config", type=click.Path(), help="kvstrata TOML config with the tiers to plan.")
@click.option("--tiers", help="Tiers shorthand, e.g. 'hbm=40GiB,dram=256GiB,nvme=4TiB,fs=inf' (inf: unbounded).")
@click.option("--hbm-capacity", callback=size_bytes, help="Add an hbm tier (GPU prefix cache stand-in) of this size.")
@click.option("--shared", multiple=True, help="A tier all instances share (mooncake and fs are shared anyway).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--routing", default="round-robin", show_default=True, type=click.Choice(["round-robin", "sticky", "cache-aware"])
)
@click.option("--target-hit-rate", type=FiniteFloatRange(0, 1), help="Find the capacities reaching this hit rate.")
@click.option("--verify-target", is_flag=True, help="Simulate each tier at its needed capacity (slower).")
@click.option("--sweep-points", default=20, show_default=True, type=click.IntRange(2, 500))
@click.option("--belady/--no-belady", default=True, show_default=True, help="Compute the offline optimum.")
@click.option("--ignore-queue-limits", is_flag=True, help="Plan as if no store batch or copy were too large.")
@click.option("--gpu", default="h100", show_default=True, help="GPU profile (h100, h200, b200, a100, l40s, mi300x).")
@click.option("--nvme-profile", default="nvme-gen5", show_default=True, help="Drive profile of nvme tiers.")
@click.option("--nic-profile", default="rdma-4x200g", show_default=True, help="NIC profile of mooncake tiers.")
@click.option("--fs-profile", default="3fs-400g", show_default=True, help="Profile of fs tiers.")
@click.option("--bandwidth", multiple=True, help="TIER=RATE per rank, e.g. 'dram=40GB/s' (overrides profiles).")
@click.option("--mfu", default=0.5, show_default=True, type=FiniteFloatRange(0.01, 1.0), help="Prefill MFU.")
@click.option("--compute-dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp8"]))
@click.option("--active-params", type=FiniteFloatRange(min=1.0), help="Active parameters per token (overrides).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the plan here.",
)
@click.option(
    "--markdown", "md_out", type=click.Path(dir_okay=False), callback=output_file, help="Write the plan as Markdown."
)
@click.option(
    "--plot", "plot_out", type=click.Path(dir_okay=False), callback=output_file, help="Save the hit-rate curves (PNG)."
)
def plan(json_out: str | None, md_out: str | None, plot_out: str | None, **options: Any) -> None:
    """Plan tier capacities: hit rate per tier, hit rate against capacity, Belady, TTFT, SSD writes."""
    from kvstrata.planner.command import PlanRequest, run_plan
    from kvstrata.planner.report import plan_tables, plan_to_dict, render_markdown, render_plot

    result = run_plan(PlanRequest(**options), on_progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    for item in plan_tables(result):
        out.print(item)
    write_json(json_out, plan_to_dict(result))
    if md_out:
        with writing(md_out):
            Path(md_out).write_text(render_markdown(result), encoding="utf-8")
    if plot_out:
        with writing(plot_out):
            render_plot(result, plot_out)
    console.print(f"[dim]planned in {result.timings['total_s']:.1f}s[/]")
