"""kvstrata under real ``vllm serve`` (issue 17, items 2 and 3): greedy outputs equal a server
without a connector, and the connector survives what serving does to it.

Two servers, one after the other (never both: 2 cores): first ``vllm serve`` without a connector
(a KV cache large enough for everything) computes the reference of every prompt the tests send;
then one ``vllm serve`` with kvstrata (DRAM over a Mooncake pool over NVMe, a real
``mooncake_master``) and a KV cache of 11 usable blocks, so concurrent requests cannot all fit and
vLLM preempts. Both run float32 on the same single CPU (``VLLM_CPU_OMP_THREADS_BIND``, checked in
their logs), so greedy tokens compare; a token is compared only up to the reference's first step
whose lead is below ``serve_client.MARGIN_FLOOR`` (rounding decides there), and the tests check that
nearly every token was compared. The kvstrata server's tests run in file order, each on what the
earlier ones left:

* a sample of prompts, sent one at a time, then re-sent after vLLM's own prefix cache was reset:
  the second answers come through kvstrata (external hits) and equal the reference;
* 40 concurrent streams over the small KV cache: all complete, equal the reference, and vLLM
  preempted (``vllm:num_preemptions``) and resumed them;
* clients that drop the connection mid-stream or before their first token (queued, loading from
  the pool / NVMe, or in prefill): vLLM aborts them, the others complete correctly, and once the
  server is quiet kvstrata holds nothing (``vllm:kvstrata_live_*``: no pinned block, held plan,
  pending load, staging buffer out or request tracked);
* the ``mooncake_master`` killed mid-load and restarted: no request fails or differs, the outage
  shows as pool faults (``vllm:kvstrata_tier_faults``), and after the restart the pool serves hits
  again;
* a soak of ``$KVSTRATA_SOAK_S`` seconds (default 120, so the module takes about 3.5 min on a
  quiet 2-core machine; the issue's 10 minutes with ``KVSTRATA_SOAK_S=600``): a closed loop of
  clients over a fixed set of multi-turn prompts, some dropping mid-stream, the server's resident
  memory and kvstrata's gauges sampled every few seconds: no request stuck or wrong, no growth
  trend, nothing held at the end.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import serve_client as sc

#: Read at import: tests/conftest.py drops KVSTRATA* variables from each test's environment.
SOAK_S = float(os.environ.get("KVSTRATA_SOAK_S") or 120)
SOAK_REPORT = os.environ.get("KVSTRATA_SOAK_REPORT")  # a path: the soak's figures and samples as JSON
MAX_TOKENS = 24
#: The concurrent streams decode longer: every one crosses a block boundary while the KV cache is
#: full, so vLLM must preempt. The reference runs this long for every prompt (greedy continuations
#: of a shorter request are its prefix).
STREAM_TOKENS = REF_TOKENS = 64
#: Requests whose clients leave: longer than any could decode before that (the longest prompt,
#: 703 tokens, plus this stays within max_model_len, 1024)
DROP_TOKENS = 300

_rng = random.Random(17)
SHARED = sc.prompt(_rng, 384)  # a system prompt: 3 blocks every stream shares
SAMPLE = [sc.prompt(_rng, n) for n in (300, 420, 520, 640, 700, 770)]
STREAMS = [sc.prompt(_rng, 384 + _rng.randrange(64, 320), SHARED) for _ in range(40)]
DROPS = [sc.prompt(_rng, 384 + _rng.randrange(160, 320), SHARED) for _ in range(12)]
RESTART = [sc.prompt(_rng, 384 + _rng.randrange(160, 320), SHARED) for _ in range(10)]
RECOVER = [sc.prompt(_rng, _rng.randrange(400, 600)) for _ in range(4)]
#: Soak: 6 sessions of 4 turns (each turn its predecessor plus 96 tokens), replayed in a loop.
SOAK = []
for _s in range(6):
    turn = sc.prompt(_rng, 300, SHARED[:256])
    for _t in range(4):
        SOAK.append(turn)
        turn = [*turn, *sc.prompt(_rng, 96)]
PROBE = sc.prompt(_rng, 40)  # under one block: it stores and loads nothing, but drives steps
ALL = [*SAMPLE, *STREAMS, *DROPS, *RESTART, *RECOVER, *SOAK, PROBE]


def _core_ids(log: Path) -> str:
    found = re.findall(r"core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
    assert found, f"no OpenMP binding line in {log}"
    return str(found[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sc.served_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every prompt's greedy tokens and margins from ``vllm serve`` without a connector."""
    work = tmp_path_factory.mktemp("reference")
    with sc.server(model, work, connector=False, kv_blocks=64) as s:
        outs = sc.run_jobs(s.url, [sc.Job(p, REF_TOKENS) for p in ALL], concurrency=8)
        cores = _core_ids(s.proc.log)
    errors = [o.error for o in outs if o.error]
    assert not errors, errors[:3]
    return {"by_prompt": {tuple(p): o for p, o in zip(ALL, outs, strict=True)}, "cores": cores}


@pytest.fixture(scope="module")
def kvs(model: Path, reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.Server]:
    """``vllm serve`` with kvstrata (started after the reference server stopped)."""
    with sc.server(model, tmp_path_factory.mktemp("kvstrata"), connector=True) as s:
        assert _core_ids(s.proc.log) == reference["cores"], "the two servers compute with different threads"
        yield s


class Checker:
    """Compares completions with the reference; counts the tokens compared."""

    def __init__(self, reference: dict[str, Any]) -> None:
        self.ref = reference["by_prompt"]
        self.compared = self.tokens = 0

    def check(self, prompts: list[list[int]], outs: list[sc.Completion], max_tokens: int = MAX_TOKENS) -> None:
        errors = [(i, o.error) for i, o in enumerate(outs) if o.error]
        assert not errors, errors[:3]
        for p, o in zip(prompts, outs, strict=True):
            ref = self.ref[tuple(p)]
            assert len(o.tokens) == max_tokens and o.finish_reason == "length", (len(o.tokens), o.finish_reason)
            self.compared += sc.compare(ref, o)
            self.tokens += len(o.tokens)

    def assert_enough(self) -> None:
        assert self.tokens and self.compared >= 0.8 * self.tokens, (
            f"only {self.compared} of {self.tokens} tokens had decisive reference margins"
        )


def quiet(s: sc.Server, timeout_s: float = 60.0) -> tuple[dict[str, float], int]:
    return sc.quiet(s, PROBE, timeout_s)


def test_greedy_outputs_equal_no_connector(kvs: sc.Server, reference: dict[str, Any]) -> None:
    """Item 2: a sample sent one at a time, then again after vLLM's prefix cache was reset, so the
    second answers are restored by kvstrata; both equal the server without a connector."""
    check = Checker(reference)
    first = [sc.run_jobs(kvs.url, [sc.Job(p, MAX_TOKENS)])[0] for p in SAMPLE]
    check.check(SAMPLE, first)
    before = sc.metrics(kvs.port)
    kvs.reset_prefix_cache()
    again = [sc.run_jobs(kvs.url, [sc.Job(p, MAX_TOKENS)])[0] for p in SAMPLE]
    check.check(SAMPLE, again)
    after = sc.metrics(kvs.port)
    ext = sc.total(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - sc.total(
        before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    full = sum(len(p) // 128 * 128 for p in SAMPLE)
    assert ext >= 0.6 * full, (ext, full)  # vLLM keeps the last token (and block) to compute
    check.assert_enough()


def test_concurrent_streams_preempted_and_resumed(kvs: sc.Server, reference: dict[str, Any]) -> None:
    """40 streams at once over 11 KV blocks: vLLM preempts; every stream ends and equals the reference."""
    before = sc.metrics(kvs.port)
    outs = sc.run_jobs(kvs.url, [sc.Job(p, STREAM_TOKENS) for p in STREAMS])
    after = sc.metrics(kvs.port)
    check = Checker(reference)
    check.check(STREAMS, outs, STREAM_TOKENS)
    check.assert_enough()
    assert sc.peak_open(outs) >= 32, sc.peak_open(outs)
    preempted = sc.total(after, "vllm:num_preemptions_total") - sc.total(before, "vllm:num_preemptions_total")
    stored = sc.total(after, "vllm:kvstrata_stored_blocks_total") - sc.total(
        before, "vllm:kvstrata_stored_blocks_total"
    )
    print(f"\n40 streams ({sc.peak_open(outs)} open at once): {preempted:.0f} preemptions, {stored:.0f} blocks stored")
    assert preempted > 0, "the KV cache held every stream: nothing was preempted"
    assert stored > 0
    assert sc.total(after, "vllm:kvstrata_failed_loads_total") == 0


def test_disconnects_leave_nothing_held(kvs: sc.Server, reference: dict[str, Any]) -> None:
    """Clients drop mid-stream (after their first token) and before any token (queued, loading or in
    prefill; half of them re-send stored prompts, so their blocks load from the pool or NVMe): vLLM
    aborts them, the rest complete correctly, and then kvstrata holds nothing."""
    kvs.reset_prefix_cache()
    # the dropped requests ask for DROP_TOKENS: none can end before its client leaves, however fast
    # the machine (at MAX_TOKENS a fast one could finish some within the 0.03-0.3 s below)
    jobs = [sc.Job(p, DROP_TOKENS, "stream") for p in DROPS[:6]]
    jobs += [sc.Job(p, DROP_TOKENS, "load", 0.03 + 0.04 * i) for i, p in enumerate(STREAMS[:6])]  # hits
    jobs += [sc.Job(p, DROP_TOKENS, "load", 0.05 + 0.05 * i) for i, p in enumerate(DROPS[6:])]
    kept = STREAMS[6:18]
    jobs += [sc.Job(p, MAX_TOKENS) for p in kept]
    before = sc.metrics(kvs.port)
    outs = sc.run_jobs(kvs.url, jobs)
    dropped = [o for o in outs if o.disconnected]
    assert len(dropped) >= 12, [(j.disconnect, o.disconnected, len(o.tokens)) for j, o in zip(jobs, outs, strict=True)]
    Checker(reference).check(kept, outs[-len(kept) :])
    gauges, probes = quiet(kvs)
    after = sc.metrics(kvs.port)
    # vLLM counts finished requests, not aborted ones: the dropped ones that never finished were aborted
    finished = sc.total(after, "vllm:request_success_total") - sc.total(before, "vllm:request_success_total") - probes
    aborted = len(jobs) - finished
    loads = sc.total(after, "vllm:kvstrata_load_requests_total") - sc.total(before, "vllm:kvstrata_load_requests_total")
    print(
        f"\ndisconnects: {len(dropped)} dropped, {aborted:.0f} aborted by vLLM, {loads:.0f} kvstrata loads, "
        f"quiet gauges {gauges}"
    )
    assert aborted >= len(dropped) - 2  # a request may finish before vLLM noticed its client left


def test_master_killed_and_restarted(kvs: sc.Server, reference: dict[str, Any]) -> None:
    """The pool's master dies mid-load: no request fails or differs (the pool serves misses); after
    a restart on the same port the pool serves hits again."""
    import threading

    assert kvs.master is not None
    kvs.reset_prefix_cache()
    before = sc.metrics(kvs.port)
    prompts = [*STREAMS[18:28], *RESTART]
    killed_at: list[float] = []
    # the kill follows the load's progress, not the clock (a fast machine ran most of the batch
    # within a fixed 0.5 s): the master dies when the second stream's first token arrives, so a few
    # requests were served with the pool up and the rest run while it is down
    first_tokens: list[float] = []
    go = threading.Event()

    def tick() -> None:
        first_tokens.append(time.monotonic())
        if len(first_tokens) == 2:
            go.set()

    def kill() -> None:
        if go.wait(timeout=300):
            kvs.master.kill()  # type: ignore[union-attr]
            killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        outs = sc.run_jobs(kvs.url, [sc.Job(p, MAX_TOKENS, on_first_token=tick) for p in prompts])
    finally:
        go.set()
        killer.join()
    Checker(reference).check(prompts, outs)
    after_kill = sum(o.ended > killed_at[0] for o in outs)
    assert after_kill >= len(outs) // 2, f"only {after_kill} requests were still running when the master died"
    down = sc.metrics(kvs.port)
    # the outage is visible to an operator: the pool's failed writes and reads, per tier and kind
    pool_faults = {
        kind: sc.total(down, "vllm:kvstrata_tier_faults_total", tier="pool", kind=kind)
        - sc.total(before, "vllm:kvstrata_tier_faults_total", tier="pool", kind=kind)
        for kind in ("io_errors", "write_failures", "checksum_failures")
    }
    assert sum(pool_faults.values()) > 0, f"the master's outage left no pool fault in Prometheus: {pool_faults}"
    kvs.master.start()
    # the same prompts again (stored while the master was down or before), then fresh ones twice:
    # once the client re-mounted, the pool takes stores and serves them
    deadline = time.monotonic() + 120
    pool_hits = sc.total(down, "vllm:kvstrata_hit_blocks_total", tier="pool")
    rounds = 0
    while True:
        rounds += 1
        kvs.reset_prefix_cache()
        outs = [sc.run_jobs(kvs.url, [sc.Job(p, MAX_TOKENS)])[0] for p in RECOVER]
        Checker(reference).check(RECOVER, outs)
        m = sc.metrics(kvs.port)
        if sc.total(m, "vllm:kvstrata_hit_blocks_total", tier="pool") > pool_hits:
            break
        assert time.monotonic() < deadline, "the pool served no hit within 120 s of the master's restart"
        time.sleep(2)
    failed = sc.total(m, "vllm:kvstrata_failed_loads_total") - sc.total(before, "vllm:kvstrata_failed_loads_total")
    tiers = {
        t: sc.total(down, "vllm:kvstrata_hit_blocks_total", tier=t)
        - sc.total(before, "vllm:kvstrata_hit_blocks_total", tier=t)
        for t in ("dram", "pool", "nvme")
    }
    print(
        f"\nmaster restart: {after_kill} of {len(prompts)} requests ended after the kill; hits in that batch "
        f"{tiers}, failed loads (recomputed) {failed:.0f}, "
        f"pool hits again after {rounds} round(s); pool faults in Prometheus during the outage {pool_faults}"
    )
    quiet(kvs)


@pytest.mark.timeout(int(SOAK_S) + 300)  # the soak itself, then checking and quieting
def test_soak(kvs: sc.Server, reference: dict[str, Any], tmp_path: Path) -> None:
    """``SOAK_S`` seconds of steady load: no request stuck or wrong, no memory growth trend, nothing held."""
    import asyncio

    import aiohttp

    check = Checker(reference)
    samples: list[dict[str, Any]] = []
    pgid = kvs.proc.popen.pid
    stop_at = time.monotonic() + SOAK_S
    done: list[tuple[list[int], sc.Completion]] = []

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(k)
        while time.monotonic() < stop_at:
            s = rng.randrange(6)
            for t in range(4):  # a session's turns in order, each its predecessor plus new tokens
                p = SOAK[4 * s + t]
                job = sc.Job(p, MAX_TOKENS, "stream" if rng.random() < 0.1 else "none")
                done.append((p, await sc.complete(session, kvs.url, job, 180.0)))

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop_at:
            m = await asyncio.to_thread(sc.metrics, kvs.port)
            g = sc.live(m)
            procs = sc.group_rss(pgid)
            samples.append({"t": time.monotonic() - t0, "rss": sum(procs.values()), "rss_by_proc": procs, **g})
            await asyncio.sleep(max(2.0, SOAK_S / 60))

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(sampler(), *(client(k, session) for k in range(6)))

    asyncio.run(main())
    (tmp_path / "soak.json").write_text(json.dumps(samples))
    if SOAK_REPORT:
        Path(SOAK_REPORT).write_text(json.dumps({"samples": samples, "requests": len(done)}))
    stuck = [o.error for _, o in done if o.error]
    assert not stuck, stuck[:3]
    full = [(p, o) for p, o in done if not o.disconnected]
    check.check([p for p, _ in full], [o for _, o in full])
    check.assert_enough()
    gauges, _ = quiet(kvs)
    rss = [s["rss"] for s in samples]
    n = len(rss)
    assert n >= 6, samples
    mid = sorted(rss[n // 3 : 2 * n // 3])[len(rss[n // 3 : 2 * n // 3]) // 2]  # after warm-up
    end = sorted(rss[2 * n // 3 :])[len(rss[2 * n // 3 :]) // 2]
    mib = 1 << 20
    report = {
        "soak_s": SOAK_S,
        "requests": len(done),
        "dropped": len(done) - len(full),
        "samples": n,
        "rss_mib_first_mid_end_max": [round(rss[0] / mib), round(mid / mib), round(end / mib), round(max(rss) / mib)],
        "max_pinned_blocks": max(s.get("pinned_blocks", 0) for s in samples),
        "max_staging_out_mib": round(max(s.get("staging_out_bytes", 0) for s in samples) / mib, 1),
        "staging_idle_mib_end": round(samples[-1].get("staging_idle_bytes", 0) / mib, 1),
        "max_queued_store_mib": round(max(s.get("queued_store_bytes", 0) for s in samples) / mib, 1),
        "rss_mib_growth_by_process_after_warmup": {
            k: round((samples[-1]["rss_by_proc"].get(k, 0) - v) / mib, 1)
            for k, v in samples[n // 3]["rss_by_proc"].items()
        },
        "quiet_gauges": gauges,
    }
    print(f"\nsoak: {json.dumps(report)}")
    if SOAK_REPORT:
        Path(SOAK_REPORT).write_text(json.dumps({"report": report, "samples": samples}))
    # No growth trend: the last third's median within 5% (+16 MiB) of the middle third's. vLLM's CPU
    # worker keeps growing for minutes after start, decelerating, with or without a connector (seen
    # here over 200 s of this load: +330 MiB with kvstrata, +500 MiB without; Python objects flat),
    # so the window starts after a third of the soak; measured: +26 MiB (60 s soak), +52 MiB
    # (120 s), +37 MiB (300 s), +32 MiB (600 s) on about 2.4 GiB. A leak per request shows above it.
    assert end <= mid * 1.05 + 16 * mib, report
    idle = [s.get("staging_idle_bytes", 0) for s in samples]
    assert max(idle) <= 2 * max(idle[: max(1, n // 3)]) + 16 * mib, report  # the staging pool is bounded
    for gauge in ("pinned_blocks", "held_plans", "tracked_requests", "staging_out_bytes", "queued_store_bytes"):
        v = [s.get(gauge, 0) for s in samples]  # what is held under load: bounded, no climb
        early, late = max(v[: 2 * n // 3]), max(v[2 * n // 3 :])
        assert late <= 2 * early + (4 if "bytes" not in gauge else 16 * mib), (gauge, v)
