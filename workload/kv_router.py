"""Routing by KV events, for ``kvstrata experiment serve --routing kv-events``.

The router users run that consumes vLLM's KV events and can run here is **Dynamo's standalone KV
indexer** (``python -m dynamo.indexer`` from ``ai-dynamo-runtime``, in a virtual environment of its
own): it subscribes to every instance's ZMQ event stream (vLLM's own events for its GPU cache and
kvstrata's with the tier as medium, one stream per instance), keeps a radix tree per instance and
tier, and answers ``POST /query`` with, per instance, how many prompt tokens its GPU cache, host
tier (``cpu``: kvstrata's DRAM) and disk tier (``disk``: NVMe, the pool, fs) reach, cumulatively.

The indexer does not route; Dynamo's own router needs its distributed runtime (etcd/NATS). The
front end here (:func:`serve`, an aiohttp proxy, clearly a stand-in for a router) does only what
such a router's selection step does with those numbers: it tokenizes the request with vLLM's own
``/tokenize`` (the chat template applied, so the ids are those vLLM hashes), asks the indexer, and
sends the request to the instance of least cost (:func:`choose`, the shape of Dynamo's own cost:
the tokens left to prefill there, where a token the GPU holds counts 1, a host token 0.75 and a
disk token 0.25, plus the prompt tokens in flight there), ties in turn. When the tokenizer or
the indexer does not answer within ``QUERY_TIMEOUT_S`` the request goes to the least loaded
instance (counted as a fallback): a router whose index is down never holds a request back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstrata.config import default_cache_dir
from kvstrata.servers import LOOPBACK, free_ports
from kvstrata.workload.serve_procs import (
    BLOCK_TOKENS,
    Proc,
    Progress,
    ServeExperimentError,
    ensure_tool_venv,
    wait_http,
)

__all__ = [
    "DYNAMO_REQUIREMENT",
    "WEIGHTS",
    "DynamoIndexer",
    "KVRouter",
    "Selector",
    "choose",
    "count_dump",
    "default_dynamo_venv",
    "ensure_dynamo",
    "reach_score",
]

DYNAMO_REQUIREMENT = "ai-dynamo-runtime==1.6.1"
#: Weight of a matched prompt token by the tier it is reached through (the indexer's names).
WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.75, "disk": 0.25}
QUERY_TIMEOUT_S = 2.0  # tokenize + indexer query, per request, before falling back to the least loaded
MODEL_NAME = "tiny"  # the served model name (serve_fleet.vllm_argv) and the indexer's model key


def default_dynamo_venv() -> Path:
    return default_cache_dir() / "dynamo-venv"


def ensure_dynamo(venv: Path, progress: Progress) -> Path:
    """The python of Dynamo's venv (``DYNAMO_REQUIREMENT``), made when missing."""
    return ensure_tool_venv(venv, DYNAMO_REQUIREMENT, "python", progress, "Dynamo's KV indexer")


def reach_score(entry: Mapping[str, Any]) -> tuple[float, str]:
    """Weighted reach of one instance (``/query``'s ``instances`` entry: cumulative token counts
    ``gpu`` <= ``cpu`` <= ``disk``) and the deepest tier that added to it (``none`` for 0)."""
    gpu = int(entry.get("gpu") or 0)
    cpu = max(int(entry.get("cpu") or 0), gpu)
    disk = max(int(entry.get("disk") or 0), cpu)
    score = gpu * WEIGHTS["gpu"] + (cpu - gpu) * WEIGHTS["cpu"] + (disk - cpu) * WEIGHTS["disk"]
    deepest = "disk" if disk > cpu else "cpu" if cpu > gpu else "gpu" if gpu else "none"
    return score, deepest


def choose(
    instances: Mapping[str, Mapping[str, Any]], active: Sequence[int], turn: int, prompt_tokens: int
) -> tuple[int, int, str]:
    """The backend (index into ``active``, which is also the indexer's instance id) for a request
    of ``prompt_tokens``, in the shape of Dynamo's KV router cost: the least cost, where the cost
    of an instance is the prompt tokens it would still have to prefill (its :func:`reach_score`
    taken off) plus the prefill work already routed to it and still in flight (``active``: each
    request's own such cost), so a hot prefix does not pile every request on one instance, while a
    request whose prefix is cached costs the queue little; ties go to the first from ``turn`` on.
    Returns it, its cost and the tier its reach came through (``none``: nothing cached there)."""
    n = len(active)
    best: tuple[float, int] | None = None
    pick, own, why = turn % n, prompt_tokens, "none"
    for i in range(n):
        score, deepest = reach_score(instances.get(str(i), {}))
        left = max(0.0, prompt_tokens - score)
        key = (left + active[i], (i - turn) % n)
        if best is None or key < best:
            best, pick, own, why = key, i, round(left), deepest
    return pick, own, why


#: The indexer's storage tiers (``/dump``'s ``storage_tier``) by the names its ``/query`` reach uses.
DUMP_TIERS = {"device": "gpu", "host_pinned": "cpu"}


def count_dump(dump: Mapping[str, Any]) -> dict[str, int]:
    """Blocks stored per tier in an indexer ``/dump`` (per model: ``events``, each with its
    ``storage_tier`` and the blocks of a ``stored`` event); a tier it does not name is ``disk``.
    A dump replays the tree as stored events, so this counts what the index holds, not traffic."""
    out = {"gpu": 0, "cpu": 0, "disk": 0}
    for model in dump.values():
        for e in (model or {}).get("events") or ():
            stored = ((e.get("event") or {}).get("data") or {}).get("stored")
            if stored:
                out[DUMP_TIERS.get(str(e.get("storage_tier")), "disk")] += len(stored.get("blocks") or ())
    return out


class Selector:
    """The front end's routing state: the prefill cost in flight per backend, the turn counter and
    the decision counts. A decision and its reservation are one synchronous step
    (:meth:`decide`, :meth:`fallback`), so requests whose indexer answers arrive together each see
    the others' work: read at choose time and reserved only after the next await, every request of
    a burst saw the same idle fleet and the same turn, and all went to one instance."""

    def __init__(self, backends: int) -> None:
        if backends < 1:
            raise ValueError(f"a router needs at least one backend, got {backends}")
        self.active = [0] * backends
        self.turn = 0
        self.stats: dict[str, Any] = {
            "requests": 0,
            "by_backend": [0] * backends,
            "by_reach": {"gpu": 0, "cpu": 0, "disk": 0, "none": 0},
            "fallbacks": 0,
            "reached_tokens": 0,
            "below_gpu_tokens": 0,
        }

    def decide(self, instances: Mapping[str, Mapping[str, Any]], prompt_tokens: int) -> tuple[int, int]:
        """Pick a backend for a request from the indexer's answer and reserve its cost there.
        Returns ``(backend, cost)``; hand both to :meth:`release` when the request is done."""
        i, cost, why = choose(instances, self.active, self.turn, prompt_tokens)
        entry = instances.get(str(i), {})
        reached = max(int(entry.get(k) or 0) for k in ("gpu", "cpu", "disk")) if entry else 0
        self.stats["by_reach"][why] += 1
        self.stats["reached_tokens"] += reached
        self.stats["below_gpu_tokens"] += reached - int(entry.get("gpu") or 0)
        return self._reserve(i, cost)

    def fallback(self) -> tuple[int, int]:
        """No answer from the tokenizer or the indexer: the least loaded backend, ties in turn."""
        n = len(self.active)
        self.stats["fallbacks"] += 1
        return self._reserve(min(range(n), key=lambda k: (self.active[k], (k - self.turn) % n)), 0)

    def _reserve(self, i: int, cost: int) -> tuple[int, int]:
        self.stats["requests"] += 1
        self.stats["by_backend"][i] += 1
        self.turn += 1
        self.active[i] += cost
        return i, cost

    def release(self, i: int, cost: int) -> None:
        self.active[i] -= cost


class DynamoIndexer:
    """``python -m dynamo.indexer`` (``python``: of :func:`ensure_dynamo`'s venv) on 127.0.0.1 (it
    binds every interface: it has no host option), with each instance's ZMQ event stream registered."""

    def __init__(self, python: Path, rundir: Path) -> None:
        self.python = python
        self.rundir = rundir
        self.port = 0
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, streams: Sequence[tuple[str, str]], timeout: float = 60.0) -> None:
        """Start it and register instance ``i`` for ``streams[i]`` = (event endpoint, replay endpoint);
        returns once every listener is active."""
        self.port = free_ports(1)[0]
        argv = [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        self.proc = Proc("dynamo.indexer", argv, self.rundir / "dynamo-indexer.log")
        wait_http(self.proc, f"{self.url}/health", timeout)
        for i, (endpoint, replay) in enumerate(streams):
            self._call(
                "/register",
                {
                    "instance_id": i,
                    "endpoint": endpoint,
                    "replay_endpoint": replay,
                    "model_name": MODEL_NAME,
                    "block_size": BLOCK_TOKENS,
                },
            )
        deadline = time.monotonic() + timeout
        while True:
            workers = self._call("/workers", timeout=5)
            active = sum(1 for w in workers if w.get("status") == "active")
            if active == len(streams):
                return
            if time.monotonic() > deadline:
                raise ServeExperimentError(
                    f"dynamo.indexer: {active} of {len(streams)} event listeners active after {timeout:.0f} s: "
                    f"{workers} (log {self.proc.log})"
                )
            time.sleep(0.2)

    def indexed_blocks(self) -> dict[str, int]:
        """The blocks the indexer holds, by the tier they are in (``/dump``, taken now): ``gpu`` for
        vLLM's own device events, ``cpu`` for host tiers, ``disk`` for the rest. See :func:`count_dump`."""
        return count_dump(self._call("/dump", timeout=30) or {})

    def _call(self, path: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
        """GET ``path`` (POST ``body`` as JSON when given) and its JSON answer (None for none)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"null")
        except (OSError, ValueError) as exc:
            raise ServeExperimentError(f"dynamo.indexer {path} failed: {exc} (log {self.rundir})") from exc

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class KVRouter:
    """The stand-in front end (:func:`serve`) as a process: started over ``backends`` and an indexer."""

    def __init__(self, rundir: Path) -> None:
        self.rundir = rundir
        self.port = 0
        self.proc: Proc | None = None

    def start(self, backends: Sequence[int], indexer_url: str, env: dict[str, str], timeout: float = 60.0) -> int:
        """Start it on a free port (``env``: the instances' own, so it imports the same kvstrata)."""
        self.port = free_ports(1)[0]
        argv = [sys.executable, "-m", "kvstrata.workload.kv_router", "--port", str(self.port), "--indexer", indexer_url]
        for b in backends:
            argv += ["--backend", str(b)]
        self.proc = Proc("kv-router", argv, self.rundir / "kv-router.log", env)
        wait_http(self.proc, f"http://{LOOPBACK}:{self.port}/health", timeout)
        return self.port

    def decisions(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.port}/router/stats", timeout=10) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


# ---------------------------------------------------------------- the front end (its own process)


def serve(port: int, backends: Sequence[int], indexer: str) -> None:  # pragma: no cover - run as a process
    """Proxy ``/v1/*`` to the backend :func:`choose` picks, streaming the response through."""
    import aiohttp
    from aiohttp import web

    sel = Selector(len(backends))
    hop = {"host", "content-length", "transfer-encoding", "connection"}
    client = web.AppKey("client", aiohttp.ClientSession)

    async def route(session: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, int]:
        if isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            tokens = body["prompt"]
        else:
            ask: dict[str, Any] = {"model": body.get("model", MODEL_NAME)}
            if "messages" in body:
                ask.update(messages=body["messages"], add_generation_prompt=True)
            else:
                ask["prompt"] = body.get("prompt", "")
            async with session.post(f"http://{LOOPBACK}:{backends[sel.turn % len(backends)]}/tokenize", json=ask) as r:
                r.raise_for_status()
                tokens = (await r.json())["tokens"]
        async with session.post(f"{indexer}/query", json={"token_ids": tokens, "model_name": MODEL_NAME}) as r:
            r.raise_for_status()
            instances = (await r.json()).get("instances") or {}
        return sel.decide(instances, len(tokens))  # no await between the choice and its reservation

    async def proxy(request: web.Request) -> web.StreamResponse:
        session = request.app[client]
        raw = await request.read()
        target, cost = sel.turn % len(backends), 0
        routed = request.method == "POST" and request.path.startswith("/v1/")
        if routed:
            try:
                target, cost = await asyncio.wait_for(route(session, json.loads(raw)), QUERY_TIMEOUT_S)
            except Exception:
                target, cost = sel.fallback()
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            url = f"http://{LOOPBACK}:{backends[target]}{request.path_qs}"
            async with session.request(request.method, url, data=raw, headers=headers) as upstream:
                out = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in hop},
                )
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        finally:
            if routed:
                sel.release(target, cost)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def router_stats(request: web.Request) -> web.Response:
        return web.json_response(sel.stats)

    async def on_startup(app: web.Application) -> None:
        app[client] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def on_cleanup(app: web.Application) -> None:
        await app[client].close()

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_get("/health", health)
    app.router.add_get("/router/stats", router_stats)
    app.router.add_route("*", "/{tail:.*}", proxy)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    web.run_app(app, host=LOOPBACK, port=port, print=None, access_log=None)


def main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - run as a process
    p = argparse.ArgumentParser(description="kvstrata's stand-in KV-aware front end (see kvstrata.workload.kv_router)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", type=int, action="append", required=True, help="A vllm serve port on 127.0.0.1.")
    p.add_argument("--indexer", required=True, help="Dynamo's KV indexer, e.g. http://127.0.0.1:8090")
    a = p.parse_args(argv)
    serve(a.port, a.backend, a.indexer.rstrip("/"))


if __name__ == "__main__":  # pragma: no cover
    main()
