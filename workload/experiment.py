"""The round-robin experiment: the vLLM x Mooncake study's fleet result, in miniature.

Under round-robin routing every turn of a session lands on another instance. With a shared
pool (the ``mooncake`` DRAM pool, backed by the ``fs`` tier on S3) the next instance finds the
session's KV anyway; without one, it finds only what it computed itself, in its small private
tiers. :func:`run_round_robin` replays the study's agentic workload (20K shared tokens, 10K
first turn, 2,048 tokens and 900 output tokens per turn, 30 turns; sessions scaled with N) on
N = 1..max instances, with and without the shared tiers, and reports hit rate and throughput.

It starts its own ``mooncake_master`` and SeaweedFS S3 server on 127.0.0.1 (free ports) unless
given addresses of running ones, and stops what it started.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.units import parse_size
from kvstrata.workload.multi import replay_multi
from kvstrata.workload.traces import Trace, synth_agentic


@dataclass(frozen=True)
class ExperimentSetup:
    """Sizes of one instance and of the workload (defaults: the study's parameters, tiny model)."""

    model: str = "tiny"
    sessions_per_instance: int = 4
    turns: int = 30
    shared_tokens: int = 20000
    first_turn_tokens: int = 10000
    turn_tokens: int = 2048
    output_tokens: int = 900
    # per instance: the GPU cache stand-in holds about two full contexts (115K tokens at turn 30,
    # 29 MB with the tiny model), private DRAM about four. The pool share is larger than the bytes
    # suggest: the tiny model makes 4 KiB objects, and with 256 MiB shares the master evicted at N=4
    hbm: str = "64MiB"
    dram: str = "128MiB"
    pool_segment: str = "1GiB"  # DRAM each instance contributes to the Mooncake pool
    fs_capacity: str = "4GiB"
    seed: int = 0


@dataclass
class Cluster:
    """Addresses of the shared services the experiment uses."""

    master_address: str
    s3_endpoint: str
    bucket: str


def trace_for(setup: ExperimentSetup, instances: int) -> Trace:
    reqs = synth_agentic(
        sessions=setup.sessions_per_instance * instances,
        turns=setup.turns,
        shared_tokens=setup.shared_tokens,
        first_turn_tokens=setup.first_turn_tokens,
        turn_tokens=setup.turn_tokens,
        output_tokens=setup.output_tokens,
        seed=setup.seed,
    )
    return Trace(reqs)


def experiment_config(setup: ExperimentSetup, cluster: Cluster, run_tag: str) -> dict[str, Any]:
    """Private DRAM, then the cluster tiers (Mooncake pool, then S3 through the ``fs`` tier)."""
    return {
        "tiers": [
            {"name": "dram", "capacity": setup.dram},
            {
                "name": "pool",
                "kind": "mooncake",
                "capacity": setup.pool_segment,
                "master_address": cluster.master_address,
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "local_hostname": "127.0.0.1",
                "global_segment_size": setup.pool_segment,
                "local_buffer_size": "16MiB",
                "staging_size": "16MiB",
                "prefix": f"kvx-{run_tag}",
            },
            {
                "name": "s3",
                "kind": "fs",
                "capacity": setup.fs_capacity,
                "url": f"s3://{cluster.bucket}/{run_tag}",
                "storage_options": {
                    "key": "any",
                    "secret": "any",
                    "client_kwargs": {"endpoint_url": cluster.s3_endpoint, "region_name": "us-east-1"},
                },
            },
        ]
    }


@contextlib.contextmanager
def local_cluster(
    workdir: Path, master_address: str | None = None, s3_endpoint: str | None = None
) -> Iterator[Cluster]:
    """Start what is not given (a ``mooncake_master``, a SeaweedFS S3 server) and stop it after."""
    from kvstrata.servers import MooncakeMaster, SeaweedS3

    with contextlib.ExitStack() as stack:
        if master_address is None:
            master = MooncakeMaster(workdir / "mooncake")
            master.start()
            stack.callback(master.stop)
            master_address = master.address
        bucket = "kvstrata-experiment"
        if s3_endpoint is None:
            s3 = SeaweedS3.start(workdir / "s3")
            stack.callback(s3.stop)
            s3.create_bucket(bucket)
            s3_endpoint = s3.endpoint
        else:
            _create_bucket(s3_endpoint, bucket)
        yield Cluster(master_address, s3_endpoint, bucket)


def _create_bucket(endpoint: str, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key="any", secret="any", client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"}
    )
    with contextlib.suppress(FileExistsError):
        fs.mkdir(bucket)


def run_round_robin(
    max_instances: int = 4,
    *,
    setup: ExperimentSetup | None = None,
    workdir: Path | None = None,
    master_address: str | None = None,
    s3_endpoint: str | None = None,
    routings: tuple[str, ...] = ("round-robin",),
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_request: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replays for N = 1..max_instances, with and without the shared tiers. Returns the JSON."""
    if max_instances < 1:
        raise ConfigError(f"max_instances must be at least 1, got {max_instances}", field="max_instances")
    setup = setup or ExperimentSetup()
    hbm = parse_size(setup.hbm)
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's clients log every connection at INFO
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-exp-")))
        cluster = stack.enter_context(local_cluster(workdir, master_address, s3_endpoint))
        for n in range(1, max_instances + 1):
            trace = trace_for(setup, n)
            for routing in routings:
                for shared in (True, False):
                    tag = f"{int(time.time())}-n{n}-{routing}-{'pool' if shared else 'local'}"
                    cfg = experiment_config(setup, cluster, tag)
                    rep = replay_multi(
                        trace,
                        setup.model,
                        cfg,
                        instances=n,
                        routing=routing,
                        shared_pool=shared,
                        hbm_capacity=hbm,
                        on_request=on_request,
                    )
                    row = rep.to_dict()
                    row["sessions"] = setup.sessions_per_instance * n
                    results.append(row)
                    if on_result is not None:
                        on_result(row)
    base = {r["routing"]: r["throughput_tokens_per_s"] for r in results if r["instances"] == 1 and r["shared_pool"]}
    for r in results:
        b = base.get(r["routing"])
        r["throughput_vs_one_instance"] = round(r["throughput_tokens_per_s"] / b, 3) if b else None
    return {
        "experiment": "round-robin",
        "setup": setup.__dict__,
        "results": results,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "cpu_count": _cpu_count(),
    }


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


__all__ = ["Cluster", "ExperimentSetup", "experiment_config", "local_cluster", "run_round_robin", "trace_for"]
