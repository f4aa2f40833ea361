"""The fleet of ``kvstrata experiment serve`` (:mod:`kvstrata.workload.serve`): ``vllm serve``
instances on 127.0.0.1 (argv, environment, the connector's config per mode, vLLM's KV events on
ipc sockets for routing by events), a ``mooncake_master`` for the pool, and vLLM's prompt-token
counters read back."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.servers import LOOPBACK, MooncakeMaster, free_ports
from kvstrata.workload.serve_procs import Proc, Progress, http_get, wait_http

if TYPE_CHECKING:
    from kvstrata.workload.serve import ServeSetup

__all__ = [
    "Instances",
    "fleet",
    "kv_events_config",
    "kvstrata_transfer_config",
    "prompt_token_sources",
    "vllm_argv",
    "vllm_env",
]


def kvstrata_transfer_config(nvme_dir: Path, setup: ServeSetup, master: str | None, run_tag: str) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "dram", "capacity": setup.dram}]
    if master is not None:
        tiers.append(
            {
                "name": "pool",
                "kind": "mooncake",
                "capacity": setup.pool_segment,
                "master_address": master,
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "local_hostname": LOOPBACK,
                "global_segment_size": setup.pool_segment,
                "local_buffer_size": "16MiB",
                "staging_size": "16MiB",
                "prefix": f"kvs-{run_tag}",
            }
        )
    tiers.append({"name": "nvme", "capacity": setup.nvme, "path": str(nvme_dir), "direct_io": "off"})
    return {
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"tiers": tiers}},
    }


def kv_events_config(stream: tuple[str, str]) -> dict[str, Any]:
    """vLLM's ``--kv-events-config``: its ZMQ publisher (events, replay), bound on this machine
    (:func:`fleet`). kvstrata's connector follows it (``kv_events`` unset): its tiers' events go
    out on the same stream."""
    endpoint, replay = stream
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}


def vllm_argv(
    model: Path,
    port: int,
    setup: ServeSetup,
    transfer: dict[str, Any] | None,
    events: tuple[str, str] | None = None,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(setup.max_model_len),
        "--num-gpu-blocks-override",
        str(setup.kv_blocks),
        "--seed",
        str(setup.seed),
    ]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    if events is not None:
        argv += ["--kv-events-config", json.dumps(kv_events_config(events))]
    return argv


def vllm_env(cpu: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(cpu),
        PYTHONUNBUFFERED="1",
    )
    # The children import kvstrata from wherever this process did (a checkout's .typecheck link too).
    import kvstrata

    root = Path(kvstrata.__file__).absolute().parent.parent
    if (root / "kvstrata").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return env


def prompt_token_sources(port: int) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` of one instance, by source."""
    out: dict[str, float] = {}
    for line in http_get(f"http://{LOOPBACK}:{port}/metrics", timeout=10).splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, value = line.rsplit(" ", 1)
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(value)
    return out


@dataclass
class Instances:
    """A running fleet: each instance's HTTP port and (with events on) its ZMQ (event, replay) endpoints."""

    ports: list[int]
    streams: list[tuple[str, str]]


@contextlib.contextmanager
def fleet(
    mode: str,
    instances: int,
    *,
    setup: ServeSetup,
    model: Path,
    workdir: Path,
    progress: Progress,
    events: bool = False,
    start_timeout: float = 900.0,
) -> Iterator[Instances]:
    """``instances`` ``vllm serve`` processes in ``mode`` (and a ``mooncake_master`` for the pool),
    publishing KV events on ZMQ with ``events``; yields them and stops everything on leaving."""
    fleetdir = workdir / f"fleet-{mode.replace('+', '-')}"
    shutil.rmtree(fleetdir, ignore_errors=True)
    fleetdir.mkdir(parents=True)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    with contextlib.ExitStack() as stack:
        master_addr = None
        if mode == "kvstrata+pool":
            master = MooncakeMaster(fleetdir / "mooncake")
            master.start()
            stack.callback(master.stop)
            master_addr = master.address
            progress(f"[{mode}] mooncake_master on {master_addr}")
        ports = free_ports(instances)
        streams: list[tuple[str, str]] = []
        if events:
            # vLLM's publisher binds only a wildcard (tcp://*:PORT, every interface) or an ipc/inproc
            # endpoint and connects to anything else: an ipc socket keeps it on this machine. Its
            # replay socket binds what it is given. (The socket path must stay under ~100 bytes.)
            evdir = Path(tempfile.mkdtemp(prefix="kvstrata-ev-"))
            stack.callback(shutil.rmtree, evdir, True)
            streams = [
                (f"ipc://{evdir}/{i}.sock", f"tcp://{LOOPBACK}:{p}") for i, p in enumerate(free_ports(instances))
            ]
        procs: list[Proc] = []
        t0 = time.monotonic()
        for i, port in enumerate(ports):
            transfer = None
            if mode != "none":
                tag = f"{os.getpid()}-{mode.replace('+', '-')}"  # the pool's key prefix: no '+'
                transfer = kvstrata_transfer_config(fleetdir / f"nvme{i}", setup, master_addr, tag)
            p = Proc(
                f"vllm serve #{i}",
                vllm_argv(model, port, setup, transfer, streams[i] if events else None),
                fleetdir / f"vllm{i}.log",
                vllm_env(cpus[i % len(cpus)]),
            )
            stack.callback(p.stop)
            procs.append(p)
        progress(f"[{mode}] starting {instances} vllm serve instance(s) on ports {ports} (logs in {fleetdir})")
        for p, port in zip(procs, ports, strict=True):
            wait_http(p, f"http://{LOOPBACK}:{port}/health", start_timeout)
        progress(f"[{mode}] {instances} instance(s) ready after {time.monotonic() - t0:.0f} s")
        yield Instances(ports, streams)
        progress(f"[{mode}] stopping the fleet")
