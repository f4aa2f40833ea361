"""Helpers for the robustness tests on real ``vllm serve`` (``test_serve_robustness.py``).

* :func:`server`: one ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``) on the
  local tiny model with a real tokenizer (:mod:`kvstrata.workload.fleet_model`), float32 (so greedy
  margins are decisive, see ``runner.MARGIN_FLOORS``), pinned to one CPU, with or without the
  kvstrata connector (DRAM over a Mooncake pool over NVMe), its ``mooncake_master`` controllable
  (kill, restart on the same port).
* :func:`complete` / :func:`run_jobs`: streaming ``/v1/completions`` with token-id prompts
  (aiohttp), greedy, with the top-2 log-probabilities of every step (the greedy margins); a job
  may close its connection after its first streamed token or before any token came.
* :func:`metrics`, :func:`live`, :func:`group_rss`: vLLM's Prometheus counters, kvstrata's
  ``vllm:kvstrata_live_*`` gauges (summed over sources) and the resident memory of a server's
  process group.
* :func:`compare`: greedy tokens against a reference, up to the reference's first step whose lead
  over the runner-up is below the floor (after it, rounding may decide).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvstrata.servers import LOOPBACK, MooncakeMaster, free_ports
from kvstrata.workload import serve, serve_fleet
from kvstrata.workload.serve_procs import Proc, http_get, wait_http

#: float32: equal computations differ by ~1e-5 nats, so a lead of 1e-3 is decisive (runner.py).
MARGIN_FLOOR = 1e-3
#: The tests' shapes: max_model_len 1024; the kvstrata server's KV cache holds 11 usable blocks of
#: 128 tokens (1,408 tokens: two or three of the tests' requests at once), so loads preempt.
SETUP = serve.ServeSetup(
    sessions=1,
    turns=2,
    shared_tokens=256,
    first_turn_tokens=128,
    turn_tokens=64,
    output_tokens=16,
    kv_blocks=12,
    max_model_len=1024,
    dram="6MiB",  # 12 fp32 blocks of this model: most hits come from the pool or NVMe (async loads)
    nvme="512MiB",
    pool_segment="64MiB",
)
VOCAB = 1024


def prompt(rng: random.Random, n: int, prefix: Sequence[int] = ()) -> list[int]:
    """``prefix`` then random token ids (3.. : no pad, bos or eos) up to ``n`` tokens."""
    return [*prefix, *(rng.randrange(3, VOCAB) for _ in range(n - len(prefix)))]


# ---------------------------------------------------------------- the server


@dataclass
class Server:
    port: int
    proc: Proc
    master: MooncakeMaster | None
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def reset_prefix_cache(self) -> None:
        """vLLM's own prefix cache (dev-mode endpoint): the next identical prompt must come from kvstrata."""
        import urllib.request

        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()


@contextlib.contextmanager
def server(
    model: Path,
    workdir: Path,
    *,
    connector: bool,
    kv_blocks: int = SETUP.kv_blocks,
    cpu: int | None = None,
    tiers: list[dict[str, Any]] | None = None,
) -> Iterator[Server]:
    """One ``vllm serve`` (and, with the connector, a ``mooncake_master``); everything stops on leaving.
    ``tiers``: kvstrata's tiers instead of DRAM over the pool over NVMe (then no master is started)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    bind = cpus[0] if cpu is None else cpu
    setup = serve.ServeSetup(**{**SETUP.__dict__, "kv_blocks": kv_blocks})
    with contextlib.ExitStack() as stack:
        master = None
        transfer = None
        if connector and tiers is not None:
            transfer = serve_fleet.kvstrata_transfer_config(workdir / "nvme", setup, None, f"rob{os.getpid()}")
            transfer["kv_connector_extra_config"]["config"]["tiers"] = tiers
        elif connector:
            master = MooncakeMaster(workdir / "mooncake")
            master.start()
            stack.callback(master.stop)
            transfer = serve_fleet.kvstrata_transfer_config(
                workdir / "nvme", setup, master.address, f"rob{os.getpid()}"
            )
        (port,) = free_ports(1)
        argv = serve_fleet.vllm_argv(model, port, setup, transfer)
        argv[argv.index("--dtype") + 1] = "float32"
        env = serve_fleet.vllm_env(bind)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
        proc = Proc("vllm serve", argv, workdir / "vllm.log", env)
        stack.callback(proc.stop)
        wait_http(proc, f"http://{LOOPBACK}:{port}/health", 900)
        yield Server(port, proc, master, workdir)


# ---------------------------------------------------------------- the client


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    #: "none": read to the end; "stream": close after the first streamed token; "load": close
    #: ``close_after_s`` after sending, before any token arrived (the request is queued, loading
    #: or in prefill)
    disconnect: str = "none"
    close_after_s: float = 0.0
    #: called (on the client's event loop; keep it short) when this stream's first token arrives
    on_first_token: Callable[[], None] | None = field(default=None, repr=False)
    #: "load" only: close once this is set (by a thread watching the server's progress), or after
    #: ``close_after_s`` at the latest
    close_when: threading.Event | None = field(default=None, repr=False)


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    wall_s: float = 0.0
    disconnected: bool = False
    started: float = 0.0  # time.monotonic() when sent and when its stream ended
    ended: float = 0.0


def _step(choice: dict[str, Any], out: Completion) -> None:
    lp = choice.get("logprobs") or {}
    for tok, top in zip(lp.get("tokens") or [], lp.get("top_logprobs") or [], strict=False):
        out.tokens.append(int(str(tok).split(":", 1)[1]))
        vals = sorted((float(v) for v in (top or {}).values()), reverse=True)
        out.margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))


async def complete(session: aiohttp.ClientSession, url: str, job: Job, timeout_s: float) -> Completion:
    body = {
        "model": "tiny",
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    out = Completion()
    t0 = out.started = time.monotonic()

    async def run() -> None:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices", []):
                    before = len(out.tokens)
                    _step(choice, out)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                    if out.ttft_s is None and len(out.tokens) > before:
                        out.ttft_s = time.monotonic() - t0
                        if job.on_first_token is not None:
                            job.on_first_token()
                if job.disconnect == "stream" and out.tokens:
                    out.disconnected = True
                    resp.close()  # drop the connection mid-stream
                    return

    try:
        if job.disconnect == "load":
            task = asyncio.ensure_future(run())
            closer = asyncio.ensure_future(_close_time(job))
            done, _ = await asyncio.wait({task, closer}, return_when=asyncio.FIRST_COMPLETED)
            closer.cancel()
            if task not in done:
                task.cancel()  # closes the connection (mostly before any token arrived)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                out.disconnected = True
            elif task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        else:
            await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        out.error = f"no end of stream within {timeout_s:.0f} s (stuck)"
    except aiohttp.ClientError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    out.wall_s = out.ended - t0
    return out


async def _close_time(job: Job) -> None:
    """Returns when a "load" job's client should leave."""
    if job.close_when is None:
        await asyncio.sleep(job.close_after_s)
        return
    deadline = time.monotonic() + job.close_after_s
    while not job.close_when.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def peak_open(outs: Sequence[Completion]) -> int:
    """The most streams open at once on the client's side."""
    edges = sorted([(o.started, 1) for o in outs] + [(o.ended, -1) for o in outs])
    peak = now = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


async def _run(url: str, jobs: Sequence[Job], timeout_s: float, concurrency: int | None) -> list[Completion]:
    limit = asyncio.Semaphore(concurrency or len(jobs) or 1)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(job: Job) -> Completion:
            async with limit:
                return await complete(session, url, job, timeout_s)

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def run_jobs(
    url: str, jobs: Sequence[Job], timeout_s: float = 300.0, concurrency: int | None = None
) -> list[Completion]:
    """Every job at once (or ``concurrency`` at a time), each on a connection of its own."""
    return asyncio.run(_run(url, jobs, timeout_s, concurrency))


# ---------------------------------------------------------------- observing the server


def metrics(port: int) -> dict[str, float]:
    """Prometheus samples of one server: ``name{labels}`` (as printed) -> value."""
    out: dict[str, float] = {}
    for line in http_get(f"http://{LOOPBACK}:{port}/metrics", timeout=30).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{", 1)[0] == name and all(w in k for w in want))


def live(m: dict[str, float]) -> dict[str, float]:
    """kvstrata's ``vllm:kvstrata_live_*`` gauges, each summed over its sources (workers, scheduler)."""
    out: dict[str, float] = {}
    for k, v in m.items():
        name = k.split("{", 1)[0]
        if name.startswith("vllm:kvstrata_live_"):
            short = name[len("vllm:kvstrata_live_") :]
            out[short] = out.get(short, 0.0) + v
    return out


def group_rss(pgid: int) -> dict[str, int]:
    """Resident bytes of the processes in process group ``pgid`` (a server's API server, engine core
    and worker), by process name (``comm``)."""
    out: dict[str, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp, ...
                continue
            rss = int(Path(f"/proc/{d}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        out[name] = out.get(name, 0) + rss
    return out


# ---------------------------------------------------------------- comparing


def compare(ref: Completion, got: Completion, floor: float = MARGIN_FLOOR) -> int:
    """Assert ``got`` has ``ref``'s greedy tokens up to and excluding the first step whose lead in
    ``ref`` is below ``floor`` (there rounding may decide; everything after depends on it).
    Returns how many tokens were compared."""
    n = next((i for i, m in enumerate(ref.margins) if m < floor), len(ref.tokens))
    n = min(n, len(got.tokens))  # the reference may run longer than the request
    if got.tokens[:n] != ref.tokens[:n]:
        i = next(i for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=False)) if a != b)
        raise AssertionError(
            f"greedy token {i} differs ({got.tokens[i]} instead of {ref.tokens[i]}; reference lead there "
            f"{ref.margins[i]:.2e} nats, decisive above {floor}): got {got.tokens[: n + 1]}, want {ref.tokens[: n + 1]}"
        )
    return n


def served_model(tmp_path_factory: Any) -> Path:
    """The served tiny model (a module fixture's body): built once into ``$VLLM_E2E_MODEL_CACHE``
    when that is set, else into the session's temporary directory."""
    from kvstrata.workload.fleet_model import make_served_model

    cache = os.environ.get("VLLM_E2E_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("served-model")
    return make_served_model(root / "served-tiny", max_pos=8192)


def quiet(s: Server, probe: list[int], timeout_s: float = 60.0) -> tuple[dict[str, float], int]:
    """Drive steps with short ``probe`` requests (under one block: nothing stored or loaded) until
    vLLM runs and queues nothing and every kvstrata gauge except the idle staging buffers is 0
    (held plans expire ``held.HOLD_S`` after their lookup); the last gauges and the number of
    probes. A leak keeps one above 0 and fails here."""
    deadline = time.monotonic() + timeout_s
    probes = 0
    while True:
        probes += 1
        (out,) = run_jobs(s.url, [Job(probe, 2)])
        assert out.error is None, out.error
        time.sleep(0.5)
        m = metrics(s.port)
        gauges = live(m)
        busy = total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")
        held = {k: v for k, v in gauges.items() if k != "staging_idle_bytes" and v}
        if not held and not busy and "pinned_blocks" in gauges and "tracked_requests" in gauges:
            return gauges, probes
        if time.monotonic() > deadline:
            raise AssertionError(f"still held {timeout_s:.0f} s after the load ended: {held}, busy {busy}")
