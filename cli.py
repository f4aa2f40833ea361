"""The ``kvstrata`` command line: a thin layer over the library.

Commands: ``trace synth``, ``replay``, ``plan``, ``verify``, ``models``, ``bench``, ``demo``,
``config show``, ``daemon``, ``status``, ``prefetch``. Every error kvstrata raises on purpose is printed as one line and
exits with status 2 (bad input), never as a traceback.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvstrata import __version__
from kvstrata.errors import KVStrataError
from kvstrata.units import format_size, parse_size

if TYPE_CHECKING:
    from kvstrata.config import KVStrataConfig

console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 132)


class _Group(click.Group):
    """Turns kvstrata errors into one clear line and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVStrataError as exc:
            console.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
            sys.exit(2)


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _write_json(path: str | None, data: Any) -> None:
    if not path:
        return
    text = json.dumps(data, indent=2, sort_keys=False, default=str)
    if path == "-":
        click.echo(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvstrata")
def main() -> None:
    """kvstrata: a tiered KV-cache storage engine for LLM inference."""


# --------------------------------------------------------------------------- trace
@main.group()
def trace() -> None:
    """Make and inspect workload traces."""


@trace.command("synth")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="JSONL file to write.")
@click.option("--sessions", default=8, show_default=True, type=click.IntRange(1))
@click.option("--turns", default=30, show_default=True, type=click.IntRange(1))
@click.option("--shared-tokens", default=20000, show_default=True, type=click.IntRange(0))
@click.option("--first-turn-tokens", default=10000, show_default=True, type=click.IntRange(0))
@click.option("--turn-tokens", default=2048, show_default=True, type=click.IntRange(0))
@click.option("--output-tokens", default=900, show_default=True, type=click.IntRange(0))
@click.option("--turn-gap-ms", default=30000.0, show_default=True, type=click.FloatRange(0))
@click.option("--seed", default=0, show_default=True, type=int)
def trace_synth(out_path: str, **params: Any) -> None:
    """Write an agentic multi-turn trace (defaults: the vLLM x Mooncake agentic study)."""
    from kvstrata.workload.traces import agentic_header, synth_agentic, write_jsonl

    reqs = synth_agentic(**params)
    write_jsonl(out_path, reqs, agentic_header(**params))
    tokens = sum(r.input_length for r in reqs)
    console.print(f"wrote {len(reqs)} requests ({tokens:,} prompt tokens) to {out_path}")


# --------------------------------------------------------------------------- replay
def _progress(total: int, label: str) -> tuple[Progress, Callable[[int], None]]:
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


def _report_table(reports: dict[str, dict[str, Any]]) -> Table:
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


def _run_replay(
    trace_path: str, config: Any, model: str, hbm_capacity: int | None, limit: int | None, salt: str, label: str
) -> dict[str, Any]:
    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.replay import replay_trace
    from kvstrata.workload.traces import read_trace

    tr = read_trace(trace_path, limit=limit)
    layout = get_layout(model, block_size=tr.block_size)
    prog, tick = _progress(len(tr), label)
    with prog:
        report = replay_trace(tr, layout, config, hbm_capacity=hbm_capacity, tenant_salt=salt, on_request=tick)
    return report.to_dict()


def _run_multi(
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
    prog, tick = _progress(len(tr), f"replay x{instances} ({routing})")
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


def _multi_table(reports: list[dict[str, Any]]) -> Table:
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


@main.command()
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option("--model", default="tiny", show_default=True, help="Catalog model name or a config.json path.")
@click.option("--hbm-capacity", callback=_size, help="Add an hbm tier (GPU prefix cache stand-in) of this size.")
@click.option("--limit", type=click.IntRange(0), help="Replay only the first N requests.")
@click.option("--salt", default="", help="Tenant salt (a fresh namespace: ignores what earlier runs stored).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the report here.")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1), help="Engine processes.")
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
    source = _tiers_or_config(config, tiers)
    if layer_policy is not None:
        from kvstrata.config import load_config
        from kvstrata.workload.replay import with_layer_policy

        source = with_layer_policy(load_config(source), layer_policy)
    if instances > 1 or not shared_pool:
        report = _run_multi(trace_path, source, model, hbm_capacity, limit, salt, instances, routing, shared_pool)
        out.print(_multi_table([report]))
        _write_json(json_out, report)
        if report["mismatched_loads"]:
            console.print(f"[bold red]{report['mismatched_loads']} loaded blocks had wrong bytes[/]")
            sys.exit(1)
        return
    report = _run_replay(trace_path, source, model, hbm_capacity, limit, salt, "replay")
    out.print(_report_table({"kvstrata": report}))
    stored = report["bytes_stored"]
    per = ", ".join(f"{t} {format_size(b)}" for t, b in stored["per_tier"].items())
    out.print(f"layer policy {report['layer_policy']}: bytes stored {format_size(stored['total'])} ({per})")
    _write_json(json_out, report)
    if report["mismatched_loads"]:
        console.print(f"[bold red]{report['mismatched_loads']} loaded blocks had wrong bytes[/]")
        sys.exit(1)


def _tiers_or_config(config: str | None, tiers: str | None) -> str | KVStrataConfig | None:
    """``--tiers`` shorthand as a validated config (``--config`` and ``--tiers`` exclude each other)."""
    if tiers is None:
        return config
    if config is not None:
        raise click.UsageError("give --config or --tiers, not both")
    from kvstrata.config import tiers_from_shorthand

    return tiers_from_shorthand(tiers)


# --------------------------------------------------------------------------- plan
@main.command()
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
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel size.")
@click.option("--config", type=click.Path(), help="kvstrata TOML config with the tiers to plan.")
@click.option("--tiers", help="Tiers shorthand, e.g. 'hbm=40GiB,dram=256GiB,nvme=4TiB,fs=inf' (inf: unbounded).")
@click.option("--hbm-capacity", callback=_size, help="Add an hbm tier (GPU prefix cache stand-in) of this size.")
@click.option("--shared", multiple=True, help="A tier all instances share (mooncake and fs are shared anyway).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1))
@click.option(
    "--routing", default="round-robin", show_default=True, type=click.Choice(["round-robin", "sticky", "cache-aware"])
)
@click.option("--target-hit-rate", type=click.FloatRange(0, 1), help="Find the capacities reaching this hit rate.")
@click.option("--verify-target", is_flag=True, help="Simulate each tier at its needed capacity (slower).")
@click.option("--sweep-points", default=20, show_default=True, type=click.IntRange(2, 500))
@click.option("--belady/--no-belady", default=True, show_default=True, help="Compute the offline optimum.")
@click.option("--ignore-queue-limits", is_flag=True, help="Plan as if no store batch or copy were too large.")
@click.option("--gpu", default="h100", show_default=True, help="GPU profile (h100, h200, b200, a100, l40s, mi300x).")
@click.option("--nvme-profile", default="nvme-gen5", show_default=True, help="Drive profile of nvme tiers.")
@click.option("--nic-profile", default="rdma-4x200g", show_default=True, help="NIC profile of mooncake tiers.")
@click.option("--fs-profile", default="3fs-400g", show_default=True, help="Profile of fs tiers.")
@click.option("--bandwidth", multiple=True, help="TIER=RATE per rank, e.g. 'dram=40GB/s' (overrides profiles).")
@click.option("--mfu", default=0.5, show_default=True, type=click.FloatRange(0.01, 1.0), help="Prefill MFU.")
@click.option("--compute-dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp8"]))
@click.option("--active-params", type=click.FloatRange(min=1.0), help="Active parameters per token (overrides).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the plan here.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), help="Write the plan as Markdown.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Save the hit-rate curves (PNG).")
def plan(json_out: str | None, md_out: str | None, plot_out: str | None, **options: Any) -> None:
    """Plan tier capacities: hit rate per tier, hit rate against capacity, Belady, TTFT, SSD writes."""
    from kvstrata.planner.command import PlanRequest, run_plan
    from kvstrata.planner.report import plan_tables, plan_to_dict, render_markdown, render_plot

    result = run_plan(PlanRequest(**options), on_progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    for item in plan_tables(result):
        out.print(item)
    _write_json(json_out, plan_to_dict(result))
    if md_out:
        Path(md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(md_out).write_text(render_markdown(result))
    if plot_out:
        render_plot(result, plot_out)
    console.print(f"[dim]planned in {result.timings['total_s']:.1f}s[/]")


# --------------------------------------------------------------------------- experiment
@main.group()
def experiment() -> None:
    """Reproducible experiments on this machine."""


@experiment.command("round-robin")
@click.option("--max-instances", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--sessions-per-instance", default=4, show_default=True, type=click.IntRange(1))
@click.option("--turns", default=30, show_default=True, type=click.IntRange(1))
@click.option("--model", default="tiny", show_default=True, help="Catalog model name.")
@click.option(
    "--routing",
    "routings",
    multiple=True,
    default=["round-robin"],
    show_default=True,
    type=click.Choice(["round-robin", "sticky"]),
    help="Repeat to compare routings.",
)
@click.option("--master", "master_address", help="host:port of a running mooncake_master (default: start one).")
@click.option("--s3-endpoint", help="URL of a running S3 server (default: start SeaweedFS).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the results here.")
def experiment_round_robin(
    max_instances: int,
    sessions_per_instance: int,
    turns: int,
    model: str,
    routings: tuple[str, ...],
    master_address: str | None,
    s3_endpoint: str | None,
    json_out: str | None,
) -> None:
    """Hit rate and throughput of N = 1..max instances under round-robin routing, with and
    without the shared tiers (a Mooncake DRAM pool and S3 through the fs tier)."""
    from kvstrata.workload.experiment import ExperimentSetup, run_round_robin, trace_for

    setup = ExperimentSetup(model=model, sessions_per_instance=sessions_per_instance, turns=turns)
    total = sum(len(trace_for(setup, n)) for n in range(1, max_instances + 1)) * 2 * len(routings)
    prog, tick = _progress(total, "experiment")
    with prog:
        result = run_round_robin(
            max_instances,
            setup=setup,
            master_address=master_address,
            s3_endpoint=s3_endpoint,
            routings=routings,
            on_request=tick,
            on_result=lambda r: console.print(
                f"instances={r['instances']} routing={r['routing']} shared_pool={r['shared_pool']}: "
                f"token hit rate {r['token_hit_rate']:.1%}, {r['throughput_tokens_per_s']:,.0f} tokens/s",
                highlight=False,
            ),
        )
    out.print(_multi_table(result["results"]))
    _write_json(json_out, result)


# --------------------------------------------------------------------------- demo
@main.command()
@click.option("--sessions", default=6, show_default=True, type=click.IntRange(1))
@click.option("--turns", default=8, show_default=True, type=click.IntRange(1))
@click.option("--model", default="tiny", show_default=True)
@click.option(
    "--hbm-tokens", default=65536, show_default=True, type=click.IntRange(1), help="GPU prefix cache size in tokens."
)
@click.option("--config", type=click.Path(), help="kvstrata config (default: embedded default tiers).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True))
def demo(sessions: int, turns: int, model: str, hbm_tokens: int, config: str | None, json_out: str | None) -> None:
    """Synthesize a scaled-down agentic trace and replay it with and without kvstrata."""
    import tempfile

    from kvstrata.core.catalog import get_layout
    from kvstrata.workload.traces import agentic_header, synth_agentic, write_jsonl

    layout = get_layout(model)
    hbm_bytes = int(hbm_tokens * layout.bytes_per_token)
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
            "gpu-only": _run_replay(trace_path, gpu_only, model, None, None, salt, "gpu-only"),
            "kvstrata": _run_replay(trace_path, config, model, hbm_bytes, None, salt, "kvstrata"),
        }
    out.print(_report_table(reports))
    base = reports["gpu-only"]["token_hit_rate"]
    ks = reports["kvstrata"]["token_hit_rate"]
    out.print(
        f"token hit rate: GPU-only {base:.1%} -> kvstrata {ks:.1%} "
        f"({(1 - ks) / max(1 - base, 1e-9):.2f}x the prefill work of GPU-only)"
    )
    _write_json(json_out, reports)


# --------------------------------------------------------------------------- layers
@main.command("layers")
@click.option("--model", "models_", multiple=True, required=True, help="Catalog model (repeat for several).")
@click.option("--context", default=100_000, show_default=True, type=click.IntRange(30_000), help="Context tokens.")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel ranks.")
@click.option("--config", type=click.Path(), help="kvstrata config: its tiers and [[policies.layers]] rules.")
@click.option("--tiers", "tier_names", default="dram,nvme,fs", show_default=True, help="Tier names (no --config).")
@click.option("--rule", "rules_", multiple=True, help="A layer rule MATCH=TIER[+TIER...], e.g. 'sliding=dram'.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the rows here.")
def layers(
    models_: tuple[str, ...],
    context: int,
    tp: int,
    config: str | None,
    tier_names: str,
    rules_: tuple[str, ...],
    json_out: str | None,
) -> None:
    """Bytes stored per tier for one agentic session of CONTEXT tokens: uniform vs per-layer policies.

    The session is the agentic synthetic trace's (20K shared + 10K first turn, then 2,048 + 900
    tokens a turn); every tier is unbounded and written through, so each holds what its policy
    lets it, and every row restores the same prefixes (its token hit rate is shown)."""
    from kvstrata.workload.layer_bytes import compare_policies

    rules: Any = None
    tiers = [(name.strip(), name.strip()) for name in tier_names.split(",") if name.strip()]
    if config is not None:
        from kvstrata.config import load_config

        cfg = load_config(config)
        tiers = [(t.name, t.kind) for t in cfg.tiers]
        rules = cfg.policies
    if rules_:
        rules = _layer_rules(rules_, [t for t, _ in tiers], rules)
    rows = [
        row
        for m in models_
        for row in compare_policies(m, context_tokens=context, tp_size=tp, tiers=tiers, rules=rules)
    ]
    table = Table(title=f"bytes stored per {context:,}-token context (tp {tp})")
    for col in ("model", "policy", *[t for t, _ in tiers], "total", "token hit rate"):
        table.add_column(col, justify="left" if col in ("model", "policy") else "right")
    for r in rows:
        per = r["bytes_stored"]["per_tier"]
        table.add_row(
            r["model"],
            r["policy"],
            *[format_size(per[t]) for t, _ in tiers],
            format_size(r["bytes_stored"]["total"]),
            f"{r['token_hit_rate']:.1%}",
        )
    out.print(table)
    _write_json(json_out, rows)


def _layer_rules(texts: tuple[str, ...], tier_names: list[str], base: Any) -> Any:
    """``--rule MATCH=TIER+TIER`` options appended to ``base``'s rules, validated like a config."""
    from pydantic import ValidationError

    from kvstrata.config import PoliciesConfig, _format_validation_error
    from kvstrata.errors import ConfigError

    layers = [r.model_dump() for r in getattr(base, "layers", ())]
    for text in texts:
        match, sep, tiers = text.partition("=")
        names = [t.strip() for t in tiers.split("+") if t.strip()]
        if not sep or not names:
            raise ConfigError(f"--rule {text!r}: expected MATCH=TIER[+TIER...], e.g. 'sliding=dram'", field="rule")
        unknown = [t for t in names if t not in tier_names]
        if unknown:
            raise ConfigError(
                f"--rule {text!r}: tier {unknown[0]!r} is not configured (tiers: {', '.join(tier_names)})",
                field="rule",
                value=text,
            )
        layers.append({"match": match, "tiers": names})
    try:
        return PoliciesConfig.model_validate({"layers": layers})
    except ValidationError as exc:
        raise _format_validation_error(exc, "--rule") from None


# --------------------------------------------------------------------------- models / config
@main.command()
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


@main.command()
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option("--repair", is_flag=True, help="Drop bad index entries and delete unreferenced segment files.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the report here.")
def verify(config: str | None, repair: bool, json_out: str | None) -> None:
    """Check every persistent block's checksum and the index/segment consistency."""
    from kvstrata.engine.verify import verify_config

    reports = verify_config(config, repair=repair)
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
    ok = all(r["ok"] for r in reports)
    _write_json(json_out, {"ok": ok, "repaired": repair, "namespaces": reports})
    if not ok and not repair:
        sys.exit(1)


@main.command()
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the figures here.")
@click.option("--quick", is_flag=True, help="Smaller batches (64 keys) and fewer repeats.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Directory for the NVMe benchmark.")
def bench(json_out: str | None, quick: bool, directory: str | None) -> None:
    """Measure tier bandwidth and lookup cost as ratios against baselines from the same run."""
    from kvstrata.workload.bench import run_all

    console.print("benchmarking (Llama-3-8B-like layout, 64 KiB layer-blocks)...")
    res = run_all(quick=quick, directory=directory)
    table = Table(title="kvstrata bench (ratio = kvstrata / baseline, same run)")
    for col in ("figure", "kvstrata", "baseline", "ratio", "target"):
        table.add_column(col)
    d, n, lk = res["dram"], res["nvme"], res["lookup"]
    table.add_row(
        "dram store",
        f"{d['store_gbps']:.2f} GB/s",
        f"{d['numpy_copy_gbps']:.2f} GB/s numpy",
        f"{d['store_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row(
        "dram load",
        f"{d['load_gbps']:.2f} GB/s",
        f"{d['numpy_copy_gbps']:.2f} GB/s numpy",
        f"{d['load_ratio']:.2f}x",
        ">= 0.8x",
    )
    raw = "O_DIRECT" if n["raw_o_direct"] else "buffered"
    table.add_row(
        "nvme write",
        f"{n['write_gbps']:.2f} GB/s",
        f"{n['raw_write_gbps']:.2f} GB/s raw {raw}",
        f"{n['write_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row(
        "nvme read",
        f"{n['read_gbps']:.2f} GB/s",
        f"{n['raw_read_gbps']:.2f} GB/s raw {raw}",
        f"{n['read_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row("hash+lookup 128K tokens", f"{lk['lookup_128k_ms']:.2f} ms", "", "", "<= 2 ms")
    table.add_row(
        "hash vs vLLM sha256",
        f"{lk['hash_128k_ms']:.2f} ms",
        f"{lk['vllm_sha256_hash_128k_ms']:.2f} ms",
        f"{lk['hash_speedup_vs_sha256']:.1f}x faster",
        "",
    )
    out.print(table)
    _write_json(json_out, res)


@main.group("config")
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


# --------------------------------------------------------------------------- daemon
@main.command("daemon")
@click.option("--config", type=click.Path(), help="kvstrata TOML config (default: embedded default tiers).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Port of /metrics etc. (0: any free port).")
@click.option("--metrics-host", help="Address of /metrics etc. (default 127.0.0.1).")
def daemon_cmd(config: str | None, metrics_port: int | None, metrics_host: str | None) -> None:
    """Run the tier-migration daemon (one per node) until SIGTERM; SIGHUP reloads the config."""
    from kvstrata.daemon.service import run_daemon

    sys.exit(run_daemon(config, metrics_port=metrics_port, metrics_host=metrics_host))


@main.command("status")
@click.option("--config", type=click.Path(), help="The daemon's config (finds its state directory).")
@click.option("--url", help="The daemon's HTTP address (default: from its state file).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), help="Write the status here.")
def status_cmd(config: str | None, url: str | None, json_out: str | None) -> None:
    """Ask the running daemon what it is doing."""
    from kvstrata.config import load_config
    from kvstrata.daemon.client import daemon_url, fetch_status
    from kvstrata.daemon.state import state_dir_for

    data = fetch_status(url or daemon_url(state_dir_for(load_config(config))))
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
    _write_json(json_out, data)


@main.command("prefetch")
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
    from kvstrata.daemon.client import post_prefetch
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
        post_prefetch(url, namespace, raw)
    else:
        append_hint(state_dir_for(cfg), namespace, raw)
    console.print(f"hinted {len(raw)} keys of namespace {namespace}")


if __name__ == "__main__":  # pragma: no cover
    main()
