"""``kvstrata experiment round-robin``: multi-instance hit rate and throughput on this machine."""

from __future__ import annotations

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
