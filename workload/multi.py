"""Replay a trace on N engine instances in separate processes, as a router would spread it.

Each instance is its own process with its own engine: private tiers (the ``hbm`` stand-in for
the GPU prefix cache, local DRAM, local NVMe, each NVMe under its own sub-directory) and the
cluster tiers of the config (tiers whose class declares ``shared``: the Mooncake pool and the
``fs`` tier), which all instances share. Requests go to instances by the routing policy:

* ``round-robin``: request ``i`` (in trace order) to instance ``i mod N``, so consecutive turns
  of a session land on different instances (what a load-balancing router does);
* ``sticky``: every request of a session to one instance (a session-affine router; requests
  without a session fall back to round-robin).

Causality: a request starts only after the previous request of its session has finished on
whichever instance served it (its stores flushed down to the shared tiers), as a user's next
turn follows the previous answer. Requests of different sessions run concurrently, so
throughput can scale with N up to the machine's cores. The trace's timestamps only order the
requests; the replay runs as fast as the instances go.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstrata.config import KVStrataConfig, TierConfig, load_config
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.workload.replay import HitCounts, with_hbm
from kvstrata.workload.traces import Request, Trace

Routing = Literal["round-robin", "sticky"]
ROUTINGS: tuple[str, ...] = ("round-robin", "sticky")

#: Longest the parent waits for any instance to report before declaring the replay stuck.
STALL_TIMEOUT_S = 600.0


def is_shared_tier(tier: TierConfig) -> bool:
    """Whether a tier is shared between instances (a cluster tier)."""
    from kvstrata.tiers import TIERS

    return bool(TIERS.get(tier.kind).capabilities.shared)


def instance_config(
    config: KVStrataConfig, instance: int, *, shared_pool: bool = True, hbm_capacity: int | None = None
) -> KVStrataConfig:
    """The config of one instance: private tiers get their own paths; without ``shared_pool``
    the cluster tiers are left out (each instance has only what it computed itself)."""
    tiers: list[TierConfig] = []
    for t in config.tiers:
        if is_shared_tier(t):
            if shared_pool:
                tiers.append(t)
            continue
        path = getattr(t.options, "path", None)
        if path:
            opts = t.options.model_copy(update={"path": str(Path(path) / f"instance-{instance}")})
            t = t.model_copy(update={"options": opts})
        tiers.append(t)
    if not tiers:
        raise ConfigError("an instance needs at least one private tier", field="tiers", value=[])
    return with_hbm(config.with_tiers(tuple(tiers)), hbm_capacity)


def route(requests: Sequence[Request], instances: int, routing: str) -> list[int]:
    """The instance of every request."""
    if instances < 1:
        raise ConfigError(f"instances must be at least 1, got {instances}", field="instances", value=instances)
    if routing not in ROUTINGS:
        raise ConfigError(
            f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}", field="routing", value=routing
        )
    out: list[int] = []
    sessions: dict[str, int] = {}
    for i, req in enumerate(requests):
        if routing == "sticky" and req.session is not None:
            out.append(sessions.setdefault(req.session, len(sessions) % instances))
        else:
            out.append(i % instances)
    return out


@dataclass(kw_only=True)
class MultiReport(HitCounts):
    """What a multi-instance replay measured. ``to_dict`` is the ``--json`` output."""

    instances: int
    routing: str
    shared_pool: bool
    tiers: list[str]
    per_instance: list[dict[str, Any]] = field(default_factory=list)
    #: (request index, hit tokens, tokens per serving tier) in completion order (not in the JSON)
    timeline: list[tuple[int, int, dict[str, int]]] = field(default_factory=list)

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "routing": self.routing,
            "shared_pool": self.shared_pool,
            "tiers": self.tiers,
            **self.hit_dict(sorted(self.per_tier)),
            "throughput_tokens_per_s": round(self.throughput_tokens_per_s, 1),
            "per_instance": self.per_instance,
        }


def replay_multi(
    trace: Trace,
    model: str,
    config: KVStrataConfig | dict[str, Any] | str | None = None,
    *,
    instances: int = 2,
    routing: str = "round-robin",
    shared_pool: bool = True,
    hbm_capacity: int | None = None,
    tenant_salt: str = "",
    verify: bool = True,
    on_request: Callable[[int], None] | None = None,
) -> MultiReport:
    """Replay ``trace`` on ``instances`` engine processes (see the module docstring)."""
    cfg = load_config(config)
    targets = route(trace.requests, instances, routing)
    configs = [
        instance_config(cfg, i, shared_pool=shared_pool, hbm_capacity=hbm_capacity).model_dump(mode="json")
        for i in range(instances)
    ]
    report = MultiReport(
        instances=instances, routing=routing, shared_pool=shared_pool, tiers=[t["name"] for t in configs[0]["tiers"]]
    )
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(instances)]
    procs = [
        ctx.Process(
            target=_instance_main,
            args=(i, configs[i], model, trace.block_size, tenant_salt, verify, inboxes[i], results),
            name=f"kvstrata-instance-{i}",
            daemon=True,
        )
        for i in range(instances)
    ]
    for p in procs:
        p.start()
    try:
        _wait_ready(results, instances, procs)
        start = time.perf_counter()
        _dispatch(trace.requests, targets, inboxes, results, procs, report, on_request)
        for box in inboxes:
            box.put(None)
        report.per_instance = _collect_final(results, instances, procs)
        report.elapsed_s = time.perf_counter() - start
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return report


def _dispatch(
    requests: Sequence[Request],
    targets: list[int],
    inboxes: list[Any],
    results: Any,
    procs: list[Any],
    report: MultiReport,
    on_request: Callable[[int], None] | None,
) -> None:
    """Send requests in order; a request waits for the previous one of its session."""
    last_of_session: dict[str, int] = {}  # session -> index of its latest dispatched request
    done: set[int] = set()
    outstanding = 0
    for i, req in enumerate(requests):
        prev = last_of_session.get(req.session) if req.session is not None else None
        while prev is not None and prev not in done:
            outstanding -= _absorb(_next_result(results, procs), done, report, on_request)
        inboxes[targets[i]].put((i, req))
        outstanding += 1
        if req.session is not None:
            last_of_session[req.session] = i
    while outstanding:
        outstanding -= _absorb(_next_result(results, procs), done, report, on_request)


def _absorb(msg: tuple[Any, ...], done: set[int], report: MultiReport, on_request: Callable[[int], None] | None) -> int:
    kind, *body = msg
    if kind == "error":
        raise KVStrataError(f"instance {body[0]} failed: {body[1]}")
    if kind != "done":  # pragma: no cover - protocol guard
        raise KVStrataError(f"unexpected message from an instance: {kind!r}")
    index, r = body
    done.add(index)
    report.requests += 1
    report.prompt_tokens += r["prompt_tokens"]
    report.hit_tokens += r["hit_tokens"]
    report.per_tier.update(r["per_tier"])
    report.mismatched_loads += r["mismatched_loads"]
    report.failed_loads += r["failed_loads"]
    report.blocks_stored += r["blocks_stored"]
    report.timeline.append((index, r["hit_tokens"], r["per_tier"]))
    if on_request is not None:
        on_request(r["prompt_tokens"])
    return 1


def _next_result(results: Any, procs: list[Any]) -> tuple[Any, ...]:
    deadline = time.monotonic() + STALL_TIMEOUT_S
    while True:
        try:
            msg: tuple[Any, ...] = results.get(timeout=1.0)
            return msg
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise KVStrataError(f"instance process exited unexpectedly: {', '.join(dead)}") from None
            if time.monotonic() > deadline:
                raise KVStrataError(f"no instance reported for {STALL_TIMEOUT_S:.0f}s; replay stuck") from None


def _wait_ready(results: Any, instances: int, procs: list[Any]) -> None:
    ready = 0
    while ready < instances:
        kind, *body = _next_result(results, procs)
        if kind == "error":
            raise KVStrataError(f"instance {body[0]} failed to start: {body[1]}")
        ready += kind == "ready"


def _collect_final(results: Any, instances: int, procs: list[Any]) -> list[dict[str, Any]]:
    finals: dict[int, dict[str, Any]] = {}
    while len(finals) < instances:
        kind, *body = _next_result(results, procs)
        if kind == "error":
            raise KVStrataError(f"instance {body[0]} failed: {body[1]}")
        if kind == "final":
            finals[body[0]] = body[1]
    return [finals[i] for i in range(instances)]


def _instance_main(
    instance: int,
    config: dict[str, Any],
    model: str,
    block_size: int | None,
    salt: str,
    verify: bool,
    inbox: Any,
    results: Any,
) -> None:
    """One instance: an engine and a replayer, fed requests by the parent."""
    from kvstrata.core.catalog import get_layout
    from kvstrata.engine.engine import Engine
    from kvstrata.workload.replay import Replayer

    try:
        layout = get_layout(model, block_size=block_size)
        engine = Engine(config, layout=layout, tenant_salt=salt)
    except Exception as exc:
        results.put(("error", instance, f"{type(exc).__name__}: {exc}"))
        return
    try:
        replayer = Replayer(engine, verify=verify)
        results.put(("ready", instance))
        busy = 0.0
        while (task := inbox.get()) is not None:
            index, req = task
            rep = replayer.report
            before = (rep.prompt_tokens, rep.hit_tokens, Counter(rep.per_tier), rep.mismatched_loads)
            before_more = (rep.failed_loads, rep.blocks_stored)
            t0 = time.perf_counter()
            replayer.step(req)
            busy += time.perf_counter() - t0
            delta = {
                "prompt_tokens": rep.prompt_tokens - before[0],
                "hit_tokens": rep.hit_tokens - before[1],
                "per_tier": dict(rep.per_tier - before[2]),
                "mismatched_loads": rep.mismatched_loads - before[3],
                "failed_loads": rep.failed_loads - before_more[0],
                "blocks_stored": rep.blocks_stored - before_more[1],
            }
            results.put(("done", index, delta))
        final = {
            "instance": instance,
            "requests": replayer.report.requests,
            "token_hit_rate": round(replayer.report.token_hit_rate, 6),
            "busy_s": round(busy, 3),
            "stats": engine.stats(),
        }
        results.put(("final", instance, final))
    except Exception as exc:
        results.put(("error", instance, f"{type(exc).__name__}: {exc}"))
    finally:
        engine.close()


__all__ = ["ROUTINGS", "MultiReport", "instance_config", "is_shared_tier", "replay_multi", "route"]
