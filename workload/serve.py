"""``kvstrata experiment serve``: a fleet of real ``vllm serve`` instances behind HAProxy or nginx, driven by aiperf.

Per mode it starts one fleet, on 127.0.0.1 and free ports, and runs the rows N = 1..max (x routings)
on the first N instances of it (the fleet itself: :mod:`kvstrata.workload.serve_fleet`):

* ``max_instances`` ``vllm serve`` processes (``python -m vllm.entrypoints.openai.api_server``) on a
  tiny random-weight Llama with a locally trained tokenizer (:mod:`kvstrata.workload.fleet_model`),
  each pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``: instance ``i`` on the ``i``-th allowed CPU,
  modulo their number, the same in every mode) and with a KV cache of ``kv_blocks`` blocks
  (``--num-gpu-blocks-override``), several times smaller than the workload's working set;
* mode ``none``: no connector; ``kvstrata``: KVStrataConnector with a private DRAM tier over an NVMe
  tier in a directory of its own on local disk; ``kvstrata+pool``: the same plus a Mooncake pool tier
  between them (one ``mooncake_master`` per fleet, :class:`kvstrata.servers.MooncakeMaster`), which
  every instance shares;
* per row, the load balancer in front of the row's instances (:mod:`kvstrata.workload.balancers`):
  HAProxy (``balance roundrobin``, or for ``sticky`` ``balance hdr(X-Session-ID)`` with consistent
  hashing) or nginx (round-robin, or ``hash $http_x_session_id consistent``), its config generated
  and checked;
* routing ``kv-events`` instead of a balancer: every instance publishes vLLM's KV events (its own
  and kvstrata's tiers') on an ipc socket, and per row Dynamo's standalone KV indexer and the
  stand-in front end of :mod:`kvstrata.workload.kv_router` route each request by them;
* per row, aiperf (its own virtual environment: its pins conflict with vLLM's) replaying a
  multi-turn agentic dataset written here (:func:`write_dataset`, seeded per row so no row hits what
  an earlier row cached): every session's first turn is a shared system prompt plus a first turn of
  its own, every later turn adds ``turn_tokens`` of tool output after a think time; aiperf sends
  the whole history each turn (chat endpoint, streaming), all sessions at once.

TTFT, end-to-end latency, output throughput and failures come from aiperf's own
``profile_export_aiperf.json``; the token hit rate from vLLM's Prometheus counter
``vllm:prompt_tokens_by_source_total`` (``local_cache_hit`` + ``external_kv_transfer`` over all
sources), summed over the instances. The ideal hit rate counts, per request, the tokens seen before
(the previous turn's prompt and output for a later turn; the shared system prompt for a first turn
after the first session's), rounded down to whole blocks, over all prompt tokens (server counts).

Every process runs in a session of its own and is stopped (SIGTERM to its group, then SIGKILL) when
its row or fleet ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.servers import LOOPBACK, free_ports
from kvstrata.workload.balancers import Balancer
from kvstrata.workload.kv_router import DYNAMO_REQUIREMENT, DynamoIndexer, KVRouter, default_dynamo_venv, ensure_dynamo
from kvstrata.workload.serve_fleet import (
    fleet,
    prompt_token_sources,
    vllm_env,
)
from kvstrata.workload.serve_procs import (
    AIPERF_VERSION,
    BLOCK_TOKENS,
    MODES,
    ROUTINGS,
    SESSION_HEADER,
    Proc,
    Progress,
    ServeExperimentError,
    default_client_venv,
    ensure_aiperf,
    last_line,
)
from kvstrata.workload.serve_trace import TraceSetup, write_trace_dataset


@dataclass(frozen=True)
class ServeSetup:
    """The workload and the instances' sizes (scaled down so one core per instance can prefill it)."""

    sessions: int = 12
    turns: int = 4
    shared_tokens: int = 512
    first_turn_tokens: int = 256
    turn_tokens: int = 96
    output_tokens: int = 16
    think_time_s: float = 0.5
    kv_blocks: int = 17
    max_model_len: int = 2048
    dram: str = "128MiB"
    nvme: str = "1GiB"
    pool_segment: str = "128MiB"
    seed: int = 7
    trace: TraceSetup | None = None  # replay the Mooncake trace (scaled down) instead of the sessions
    #: The served model (a random-weight Llama, ``fleet_model``): the default prefills a turn in
    #: milliseconds, so TTFT is queueing and process overhead; 8 x 1024 (the TTFT benchmark's size)
    #: takes seconds a turn on one core, where prefill dominates as in the study's regime.
    model_layers: int = 4
    model_hidden: int = 256

    def __post_init__(self) -> None:
        need = self.shared_tokens + self.first_turn_tokens + (self.turns - 1) * self.turn_tokens
        # Outputs (a random model's text can take twice its tokens when the next turn sends it back),
        # chat-template markers and the turns' own prefixes ("Task 3:", "Tool output 2:"): seen 769
        # tokens in a last turn that a smaller estimate put at 736.
        need += self.turns * (2 * self.output_tokens + 24) + 32
        if need > self.max_model_len and self.trace is None:
            raise ValueError(
                f"a session's last turn needs about {need} tokens, more than max_model_len {self.max_model_len}: "
                "use fewer --turns or smaller --shared-tokens/--first-turn-tokens/--turn-tokens"
            )
        if self.model_layers < 1 or self.model_hidden < 128 or self.model_hidden % 128:
            raise ValueError(
                f"model_layers {self.model_layers} / model_hidden {self.model_hidden}: need >= 1 layer and a hidden "
                "size that is a multiple of 128 (heads of 64, 2 KV heads)"
            )
        # vLLM keeps one block back (its null block): the rest must hold one longest request.
        if (self.kv_blocks - 1) * BLOCK_TOKENS < self.max_model_len:
            raise ValueError(
                f"kv_blocks {self.kv_blocks} ({self.kv_blocks - 1} usable, {(self.kv_blocks - 1) * BLOCK_TOKENS} "
                f"tokens) cannot hold one max_model_len {self.max_model_len} request"
            )

    def model_shape(self) -> dict[str, int]:
        """``make_served_model``'s layers, hidden size and heads (head dim 64, 2 KV heads)."""
        return {
            "layers": self.model_layers,
            "hidden": self.model_hidden,
            "heads": self.model_hidden // 64,
            "kv_heads": 2,
        }

    def working_set_tokens(self) -> int:
        last = self.shared_tokens + self.first_turn_tokens + (self.turns - 1) * self.turn_tokens
        return self.shared_tokens + self.sessions * (last - self.shared_tokens + self.turns * self.output_tokens)


def write_dataset(path: Path, setup: ServeSetup, tokenizer_dir: Path, seed: int | None = None) -> dict[str, int]:
    """aiperf's ``multi_turn`` JSONL: every session's first turn is the shared system prompt and a
    first turn of its own, every later turn ``turn_tokens`` of new text after ``think_time_s``. Text is
    drawn (seeded) from the tokenizer's training corpus and cut to the token counts with the tokenizer.
    Returns the token counts measured with the tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    from kvstrata.workload.fleet_model import corpus_words

    words = corpus_words()
    rng = random.Random(setup.seed if seed is None else seed)

    def text(n_tokens: int) -> str:
        out: list[str] = []
        count = 0
        while count < n_tokens:
            chunk = " ".join(rng.choice(words) for _ in range(16))
            out.append(chunk)
            count += len(tok.encode(" " + chunk).ids)
        s = " ".join(out)
        ids = tok.encode(s).ids[:n_tokens]
        return str(tok.decode(ids))

    shared = "You are a coding agent. Tools: shell, read_file, edit_file. " + text(setup.shared_tokens)
    with open(path, "w") as f:
        for s in range(setup.sessions):
            turns: list[dict[str, Any]] = [
                {"text": f"{shared}\n\nTask {s}: {text(setup.first_turn_tokens)}", "output_length": setup.output_tokens}
            ]
            for t in range(1, setup.turns):
                turns.append(
                    {
                        "text": f"Tool output {t}: {text(setup.turn_tokens)}",
                        "delay": int(setup.think_time_s * 1000),
                        "output_length": setup.output_tokens,
                    }
                )
            f.write(json.dumps({"session_id": f"session-{s}", "turns": turns}) + "\n")
    return {"shared_tokens": len(tok.encode(shared).ids)}


def ideal_hits(records: list[dict[str, Any]], shared_tokens: int) -> tuple[int, int]:
    """(ideal hit tokens, prompt tokens) from aiperf's per-request records (server token counts)."""
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_conv.setdefault(str(r["metadata"].get("conversation_id")), []).append(r)
    hits = total = 0
    first_seen = True
    for recs in by_conv.values():
        recs.sort(key=lambda r: int(r["metadata"].get("turn_index", 0)))
        prev = 0
        for r in recs:
            m = r.get("metrics", {})
            isl = int((m.get("usage_prompt_tokens") or m.get("input_sequence_length") or {}).get("value", 0))
            osl = int((m.get("usage_completion_tokens") or m.get("output_sequence_length") or {}).get("value", 0))
            seen = prev if prev else (0 if first_seen else shared_tokens)
            first_seen = False
            hits += (min(seen, isl - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
            total += isl
            prev = isl + osl
    return hits, total


def aiperf_env() -> dict[str, str]:
    """aiperf's environment: without the Hugging Face offline switches. The tokenizer is a local
    directory, but in offline mode aiperf 0.13 resolves every tokenizer name through the hub cache
    (``snapshot_download(local_files_only=True)``), which rejects a path as a repo id."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("KVSTRATA")}


def _stat(d: dict[str, Any], key: str, stat: str) -> float | None:
    v = d.get(key)
    return None if not isinstance(v, dict) or v.get(stat) is None else float(v[stat])


def aiperf_argv(
    exe: Path, model: Path, url: str, dataset: Path, setup: ServeSetup, artifacts: Path, requests: int
) -> list[str]:
    if setup.trace is not None:  # single requests on the trace's (compressed) fixed schedule
        workload = ["--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--fixed-schedule-auto-offset"]
    else:
        workload = ["--custom-dataset-type", "multi_turn", "--concurrency", str(setup.sessions)]
    return [
        str(exe),
        "profile",
        "--model",
        "tiny",
        "--tokenizer",
        str(model),
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--input-file",
        str(dataset),
        *workload,
        "--request-count",
        str(requests),
        "--session-header",
        SESSION_HEADER,
        "--artifact-dir",
        str(artifacts),
        "--ui",
        "none",
        "--random-seed",
        str(setup.seed),
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--use-server-token-count",
        "--extra-inputs",
        "ignore_eos:true",
        "--request-timeout-seconds",
        "600",
    ]


@dataclass
class Row:
    instances: int
    routing: str
    mode: str
    token_hit_rate: float
    ideal_token_hit_rate: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    output_tokens_per_s: float | None
    failed_requests: int
    requests: int
    prompt_tokens: int
    prompt_tokens_by_source: dict[str, float]
    wall_s: float
    router: str = ""  # what routed the row: haproxy | nginx | kv-router (Dynamo's indexer + the stand-in scorer)
    router_decisions: dict[str, Any] | None = None  # kv-events: the front end's counts (workload.kv_router)


def run_row(
    backends: Sequence[int],
    routing: str,
    mode: str,
    *,
    setup: ServeSetup,
    model: Path,
    aiperf: Path,
    balancer: Balancer,
    workdir: Path,
    progress: Progress,
    seed: int,
    streams: Sequence[tuple[str, str]] = (),
    dynamo_python: Path | None = None,
    client_timeout: float = 1800.0,
) -> Row:
    """One row: the load balancer over ``backends`` with ``routing`` (``kv-events``: Dynamo's KV
    indexer over the instances' event ``streams`` and the stand-in front end of
    :mod:`kvstrata.workload.kv_router`, both started for the row, so the index holds what this
    row's traffic cached), aiperf over a dataset of its own (seeded with ``seed``, so nothing an
    earlier row cached can hit), vLLM's counters read before and after."""
    instances = len(backends)
    tag = f"n{instances}-{routing}-{mode.replace('+', '-')}"
    rowdir = workdir / tag
    shutil.rmtree(rowdir, ignore_errors=True)
    rowdir.mkdir(parents=True)
    dataset = rowdir / "sessions.jsonl"
    if setup.trace is not None:
        counts = write_trace_dataset(
            dataset,
            setup.trace,
            max_model_len=setup.max_model_len,
            output_tokens=setup.output_tokens,
            tokenizer_dir=model,
            seed=seed,
        )
        requests, shared_tokens = counts["requests"], 0
    else:
        requests, shared_tokens = (
            setup.sessions * setup.turns,
            write_dataset(dataset, setup, model, seed=seed)["shared_tokens"],
        )
    router_stats: dict[str, Any] | None = None
    with contextlib.ExitStack() as stack:
        front: KVRouter | None = None
        indexer: DynamoIndexer | None = None
        if routing == "kv-events":
            if len(streams) < instances or dynamo_python is None:
                raise ServeExperimentError("routing kv-events needs a fleet started with KV events on, and Dynamo")
            indexer = DynamoIndexer(dynamo_python, rowdir)
            stack.callback(indexer.stop)
            indexer.start(streams[:instances])
            front = KVRouter(rowdir)
            stack.callback(front.stop)
            lb_port, router = front.start(backends, indexer.url, vllm_env(0)), "kv-router"
        else:
            lb_port, router = free_ports(1)[0], balancer.kind
            stack.callback(balancer.start(lb_port, backends, routing, rowdir).stop)
        before = [prompt_token_sources(p) for p in backends]
        what = f"{requests} trace requests" if setup.trace else f"{setup.sessions} sessions x {setup.turns} turns"
        progress(f"[{tag}] aiperf: {what} through {router} :{lb_port}")
        art = rowdir / "aiperf"
        t1 = time.monotonic()
        client = Proc(
            "aiperf",
            aiperf_argv(aiperf, model, f"http://{LOOPBACK}:{lb_port}", dataset, setup, art, requests),
            rowdir / "aiperf.log",
            aiperf_env(),
        )
        stack.callback(client.stop)
        try:
            rc = client.popen.wait(timeout=client_timeout)
        except subprocess.TimeoutExpired:
            raise ServeExperimentError(
                f"aiperf did not finish within {client_timeout:.0f} s (log {client.log})"
            ) from None
        wall = time.monotonic() - t1
        summary_path = art / "profile_export_aiperf.json"
        if rc != 0 or not summary_path.is_file():
            raise ServeExperimentError(f"aiperf failed (status {rc}): {last_line(client.tail())} (log {client.log})")
        after = [prompt_token_sources(p) for p in backends]
        if front is not None and indexer is not None:
            router_stats = front.decisions()
            # What the index holds once the sessions are done, by tier: whether the instances' events
            # (kvstrata's with its tiers as medium) reached it, whatever the GPU caches happened to evict.
            router_stats["indexed_blocks"] = indexer.indexed_blocks()
    summary = json.loads(summary_path.read_text())
    records = [json.loads(line) for line in (art / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    sources: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for k, v in a.items():
            sources[k] = sources.get(k, 0.0) + v - b.get(k, 0.0)
    prompt = sum(sources.values())
    hit = sources.get("local_cache_hit", 0.0) + sources.get("external_kv_transfer", 0.0)
    if setup.trace is not None:
        ideal, total = counts["ideal_hit_tokens"], counts["prompt_tokens"]
    else:
        ideal, total = ideal_hits(records, shared_tokens)
    failed = sum(int(e.get("count", 1)) for e in summary.get("error_summary") or [])
    failed = max(failed, sum(1 for r in records if r.get("error")))
    # A request aiperf never completed is a failure too.
    failed = max(failed, requests - sum(1 for r in records if not r.get("error")))
    ms = 1e-3
    ttft50, ttft90 = _stat(summary, "time_to_first_token", "p50"), _stat(summary, "time_to_first_token", "p90")
    e2e50 = _stat(summary, "request_latency", "p50")
    progress(f"[{tag}] done in {wall:.0f} s")
    return Row(
        instances=instances,
        routing=routing,
        mode=mode,
        token_hit_rate=hit / prompt if prompt else 0.0,
        ideal_token_hit_rate=ideal / total if total else 0.0,
        ttft_p50_s=None if ttft50 is None else ttft50 * ms,
        ttft_p90_s=None if ttft90 is None else ttft90 * ms,
        e2e_p50_s=None if e2e50 is None else e2e50 * ms,
        output_tokens_per_s=_stat(summary, "output_token_throughput", "avg"),
        failed_requests=failed,
        requests=len(records),
        prompt_tokens=int(prompt),
        prompt_tokens_by_source=sources,
        wall_s=wall,
        router=router,
        router_decisions=router_stats,
    )


def sweep_plan(counts: Sequence[int], routings: Sequence[str]) -> list[tuple[int, str]]:
    """The rows' (instances, routing), in order: every routing per count, one row for N = 1 (with one
    instance every routing is the same)."""
    return [(n, routing) for n in counts for routing in routings if not (n == 1 and routing != routings[0])]


def run_serve_experiment(
    *,
    max_instances: int,
    routings: Sequence[str],
    modes: Sequence[str],
    setup: ServeSetup,
    workdir: Path,
    instances: Sequence[int] | None = None,
    client_venv: Path | None = None,
    haproxy: str | None = None,
    balancer: str = "haproxy",
    balancer_path: str | None = None,
    dynamo_venv: Path | None = None,
    progress: Progress = print,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The sweep. Per mode, one fleet of ``max_instances`` instances is started; the rows N = 1..max
    (x routings) put the load balancer over the first N of them; ``instances`` (e.g. ``[3]``) runs only
    those N, on a fleet of the largest. Every row replays a dataset with its own seed,
    so what earlier rows left in the caches cannot hit (it only takes space, as in a long-running
    fleet); vLLM's counters are read as differences around each row."""
    from kvstrata.workload.fleet_model import make_served_model

    counts = sorted(set(instances)) if instances else list(range(1, max_instances + 1))
    if not counts or counts[0] < 1:
        raise ValueError(f"instance counts must be at least 1, got {counts}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}: use {', '.join(MODES)}")
    bad = [r for r in routings if r not in ROUTINGS]
    if bad:
        raise ValueError(f"unknown routing(s) {bad}: use {', '.join(ROUTINGS)}")
    if setup.trace is not None and "sticky" in routings:
        raise ValueError(
            "the trace workload replays single requests, with no session to stick to: use --routing round-robin"
        )
    lb = Balancer(balancer, balancer_path or (haproxy if balancer == "haproxy" else None))
    exe = ensure_aiperf(client_venv or default_client_venv(), progress)
    events = "kv-events" in routings
    # before any fleet starts: a missing tool is one clear error, not a failed row
    dynamo = ensure_dynamo(dynamo_venv or default_dynamo_venv(), progress) if events else None
    workdir.mkdir(parents=True, exist_ok=True)
    progress("building the model and tokenizer (reused when present)")
    shape = setup.model_shape()
    default = (setup.model_layers, setup.model_hidden) == (ServeSetup.model_layers, ServeSetup.model_hidden)
    name = "model" if default else f"model-{setup.model_layers}x{setup.model_hidden}"
    model = make_served_model(workdir / name, max_pos=max(8192, setup.max_model_len), **shape)
    plan = sweep_plan(counts, routings)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        with fleet(mode, counts[-1], setup=setup, model=model, workdir=workdir, progress=progress, events=events) as fl:
            for k, (n, routing) in enumerate(plan):
                row = run_row(
                    fl.ports[:n],
                    routing,
                    mode,
                    setup=setup,
                    model=model,
                    aiperf=exe,
                    balancer=lb,
                    workdir=workdir,
                    progress=progress,
                    seed=setup.seed + 1000 * k,
                    streams=fl.streams,
                    dynamo_python=dynamo,
                )
                rows.append(asdict(row))
                if on_row is not None:
                    on_row(rows[-1])
    order = {(n, r): k for k, (n, r) in enumerate(plan)}
    rows.sort(key=lambda r: (order[(r["instances"], r["routing"])], list(modes).index(r["mode"])))
    return {
        "setup": asdict(setup),
        "workload": "agentic sessions" if setup.trace is None else "mooncake trace",
        "working_set_tokens": setup.working_set_tokens(),
        "kv_cache_tokens_per_instance": (setup.kv_blocks - 1) * BLOCK_TOKENS,
        "client": f"aiperf {AIPERF_VERSION}",
        "load_balancer": lb.kind,
        "kv_router": f"dynamo.indexer ({DYNAMO_REQUIREMENT}) + kvstrata's stand-in scorer" if events else None,
        "results": rows,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars per row: token hit rate (vs ideal) and P50 TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    labels = [f"N={r['instances']}\n{r['routing']}\n{r['mode']}" for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4.5))
    a.bar(x, [r["token_hit_rate"] for r in rows], label="measured")
    a.plot(list(x), [r["ideal_token_hit_rate"] for r in rows], "k_", markersize=30, label="ideal")
    a.set_ylim(0, 1)
    a.set_title("token hit rate (vLLM counters)")
    a.legend()
    b.bar(x, [r["ttft_p50_s"] or 0 for r in rows], color="tab:orange")
    b.set_title("P50 TTFT, s (aiperf)")
    for ax in (a, b):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
    lb = result.get("load_balancer", "haproxy")
    fig.suptitle(f"kvstrata experiment serve: vllm serve x {lb} x aiperf")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def keyboard_interrupt_as_error() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        raise ServeExperimentError("interrupted: every process it started was stopped") from None
