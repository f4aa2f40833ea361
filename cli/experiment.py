"""``kvstrata experiment round-robin``: multi-instance hit rate and throughput on this machine."""

from __future__ import annotations

import contextlib
from typing import Any

import click

from kvstrata.cli.common import console, host_port, http_url, known_model, out, output_file, progress, write_json
from kvstrata.cli.replay import multi_table


@click.group()
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
@click.option(
    "--master",
    "master_address",
    callback=host_port,
    help="host:port of a running mooncake_master (default: start one).",
)
@click.option("--s3-endpoint", callback=http_url, help="URL of a running S3 server (default: start SeaweedFS).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the results here.",
)
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

    known_model(model)  # before any server starts
    setup = ExperimentSetup(model=model, sessions_per_instance=sessions_per_instance, turns=turns)
    total = sum(len(trace_for(setup, n)) for n in range(1, max_instances + 1)) * 2 * len(routings)
    prog, tick = progress(total, "experiment")
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
    out.print(multi_table(result["results"]))
    write_json(json_out, result)


def _modes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from kvstrata.workload.serve import MODES

    modes = tuple(m.strip() for m in value.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise click.BadParameter(f"{value!r}: use a comma-separated list of {', '.join(MODES)}")
    return tuple(dict.fromkeys(modes))


def _routings(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from kvstrata.workload.serve_procs import BALANCER_ROUTINGS, ROUTINGS

    names: list[str] = []
    for name in (r.strip() for r in value.split(",") if r.strip()):
        names += list(BALANCER_ROUTINGS) if name == "both" else [name]
    bad = [r for r in names if r not in ROUTINGS]
    if bad or not names:
        raise click.BadParameter(f"{value!r}: use a comma-separated list of {', '.join(ROUTINGS)} (or both)")
    return tuple(dict.fromkeys(names))


def _instance_counts(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        counts = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        counts = ()
    if not counts or not all(1 <= n <= 64 for n in counts):
        raise click.BadParameter(f"{value!r}: use comma-separated instance counts from 1 to 64 (e.g. 3, or 1,3)")
    return counts


@experiment.command("serve")
@click.option("--max-instances", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option(
    "--instances",
    "instance_counts",
    default=None,
    callback=_instance_counts,
    help="Comma-separated instance counts to run instead of 1..--max-instances (e.g. 3, or 1,3).",
)
@click.option(
    "--routing",
    "routings",
    default="round-robin",
    show_default=True,
    callback=_routings,
    help="Comma-separated: round-robin (per request), sticky (a hash of the session header), kv-events (Dynamo's "
    "KV indexer over vLLM's and kvstrata's KV events, and a stand-in scorer); both = round-robin,sticky.",
)
@click.option(
    "--balancer",
    default="haproxy",
    show_default=True,
    type=click.Choice(["haproxy", "nginx"]),
    help="The load balancer in front of the instances (Debian packages).",
)
@click.option(
    "--modes", default="none,kvstrata", show_default=True, callback=_modes, help="none, kvstrata, kvstrata+pool."
)
@click.option("--sessions", default=12, show_default=True, type=click.IntRange(1, 256))
@click.option("--turns", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--shared-tokens", default=512, show_default=True, type=click.IntRange(1), help="Shared system prompt.")
@click.option("--first-turn-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option(
    "--turn-tokens", default=96, show_default=True, type=click.IntRange(1), help="New tokens a later turn adds."
)
@click.option("--output-tokens", default=16, show_default=True, type=click.IntRange(1))
@click.option("--think-time", default=0.5, show_default=True, type=click.FloatRange(0), help="Seconds between turns.")
@click.option(
    "--kv-blocks",
    default=17,
    show_default=True,
    type=click.IntRange(1),
    help="Each instance's KV cache, 128-token blocks.",
)
@click.option("--max-model-len", default=2048, show_default=True, type=click.IntRange(128))
@click.option(
    "--model-layers",
    default=4,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Layers of the served random-weight Llama.",
)
@click.option(
    "--model-hidden",
    default=256,
    show_default=True,
    type=click.IntRange(128, 8192),
    help="Its hidden size (a multiple of 128; heads of 64, 2 KV heads). 8 x 1024 prefills a turn in seconds "
    "on one core, so prefill, not overhead, dominates TTFT.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Replay this Mooncake trace (e.g. shared/traces/mooncake_conversation_trace.jsonl), scaled down, "
    "instead of the agentic sessions (round-robin only).",
)
@click.option(
    "--trace-conversations",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="The trace's longest conversations to keep.",
)
@click.option(
    "--trace-block-tokens",
    default=16,
    show_default=True,
    type=click.IntRange(1, 512),
    help="Tokens per trace hash id (512 in the trace).",
)
@click.option(
    "--trace-duration",
    default=120.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds the kept requests' arrivals are compressed into.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Logs, model, NVMe tiers, aiperf's files (default: a temporary directory).",
)
@click.option(
    "--client-venv",
    type=click.Path(file_okay=False),
    help="aiperf's virtual environment (made when missing; default ~/.cache/kvstrata/aiperf-venv).",
)
@click.option(
    "--dynamo-venv",
    type=click.Path(file_okay=False),
    help="The virtual environment of Dynamo's KV indexer, for --routing kv-events (made when missing; "
    "default ~/.cache/kvstrata/dynamo-venv).",
)
@click.option(
    "--haproxy",
    "haproxy_path",
    type=click.Path(dir_okay=False),
    help="The haproxy binary (default: from PATH or /usr/sbin).",
)
@click.option(
    "--nginx",
    "nginx_path",
    type=click.Path(dir_okay=False),
    help="The nginx binary (default: from PATH or /usr/sbin).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the results here.",
)
@click.option(
    "--plot", "plot_out", type=click.Path(dir_okay=False), callback=output_file, help="Write a PNG plot here."
)
def experiment_serve(
    max_instances: int,
    instance_counts: tuple[int, ...] | None,
    routings: tuple[str, ...],
    balancer: str,
    modes: tuple[str, ...],
    sessions: int,
    turns: int,
    shared_tokens: int,
    first_turn_tokens: int,
    turn_tokens: int,
    output_tokens: int,
    think_time: float,
    kv_blocks: int,
    max_model_len: int,
    model_layers: int,
    model_hidden: int,
    trace_path: str | None,
    trace_conversations: int,
    trace_block_tokens: int,
    trace_duration: float,
    workdir: str | None,
    client_venv: str | None,
    dynamo_venv: str | None,
    haproxy_path: str | None,
    nginx_path: str | None,
    json_out: str | None,
    plot_out: str | None,
) -> None:
    """N = 1..max real `vllm serve` instances behind HAProxy or nginx, driven by aiperf over a multi-turn agentic
    workload: no connector vs kvstrata (vs kvstrata with a Mooncake pool)."""
    import tempfile
    from pathlib import Path

    from kvstrata.workload.serve import ServeSetup, keyboard_interrupt_as_error, plot, run_serve_experiment
    from kvstrata.workload.serve_trace import TraceSetup

    try:
        trace = (
            None
            if trace_path is None
            else TraceSetup(trace_path, trace_conversations, trace_block_tokens, trace_duration)
        )
        setup = ServeSetup(
            trace=trace,
            sessions=sessions,
            turns=turns,
            shared_tokens=shared_tokens,
            first_turn_tokens=first_turn_tokens,
            turn_tokens=turn_tokens,
            output_tokens=output_tokens,
            think_time_s=think_time,
            kv_blocks=kv_blocks,
            max_model_len=max_model_len,
            model_layers=model_layers,
            model_hidden=model_hidden,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if trace_path is not None and "sticky" in routings:
        raise click.UsageError(
            f"--trace replays single requests, with no session to stick to: --routing {','.join(routings)}"
        )

    def say(msg: str) -> None:
        console.print(msg, highlight=False, markup=False)

    with contextlib.ExitStack() as stack:
        root = (
            Path(workdir)
            if workdir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-serve-")))
        )
        load = (
            f"working set ~{setup.working_set_tokens():,} tokens"
            if trace is None
            else f"the {trace.conversations} longest conversations of {trace.path} ({trace.block_tokens} tokens "
            f"per hash id, arrivals within {trace.duration_s:g} s)"
        )
        say(f"{load}; each instance's KV cache {(setup.kv_blocks - 1) * 128:,} tokens; work directory {root}")
        with keyboard_interrupt_as_error():
            result = run_serve_experiment(
                max_instances=max_instances,
                instances=instance_counts,
                routings=routings,
                modes=modes,
                setup=setup,
                workdir=root,
                client_venv=Path(client_venv) if client_venv else None,
                dynamo_venv=Path(dynamo_venv) if dynamo_venv else None,
                balancer=balancer,
                balancer_path=haproxy_path if balancer == "haproxy" else nginx_path,
                progress=say,
                on_row=lambda r: say(
                    f"N={r['instances']} {r['routing']} {r['mode']}: token hit rate {r['token_hit_rate']:.1%} "
                    f"(ideal {r['ideal_token_hit_rate']:.1%}), P50 TTFT {r['ttft_p50_s']:.3f} s, "
                    f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['failed_requests']} failed"
                ),
            )
    out.print(serve_table(result["results"]))
    write_json(json_out, result)
    if plot_out:
        plot(result, Path(plot_out))


def serve_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="kvstrata experiment serve")
    for col in (
        "N",
        "routing",
        "mode",
        "hit rate",
        "ideal",
        "TTFT p50 s",
        "TTFT p90 s",
        "E2E p50 s",
        "out tok/s",
        "failed",
    ):
        table.add_column(col, justify="left" if col in ("routing", "mode") else "right")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        table.add_row(
            str(r["instances"]),
            r["routing"],
            r["mode"],
            f(r["token_hit_rate"], ".1%"),
            f(r["ideal_token_hit_rate"], ".1%"),
            f(r["ttft_p50_s"], ".3f"),
            f(r["ttft_p90_s"], ".3f"),
            f(r["e2e_p50_s"], ".3f"),
            f(r["output_tokens_per_s"], ".1f"),
            str(r["failed_requests"]),
        )
    return table
