"""Clients that leave while their request's KV is still loading (issue 17, item 3: "mid-load").

One ``vllm serve`` with kvstrata over a single NVMe tier whose reads take ``READ_LATENCY_S``
longer (the tier config's ``read_latency_s``: an emulated slow medium), so every restore is an
async load that runs for over a second. Then:

1. prompts sent one at a time are computed and stored (their answers are this test's reference:
   the same server, the same pinned thread, computed without a restore);
2. after vLLM's own prefix cache is reset, the same prompts are sent at once and every client
   disconnects once every load is pending (or ``CLOSE_AFTER_S`` after sending), while the loads
   still run: vLLM aborts requests in ``WAITING_FOR_REMOTE_KVS``, and kvstrata's workers count
   each abort that lands during a load
   (``vllm:kvstrata_aborted_during_load``), so the test proves the disconnects were mid-load;
3. once the server is quiet, kvstrata holds nothing (no pinned block, held plan, pending load,
   staging buffer out, request tracked) and vLLM's KV cache is empty again;
4. the same prompts, sent again to the end, are restored through kvstrata and equal step 1.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import serve_client as sc

READ_LATENCY_S = 1.5  # every NVMe read batch: a load takes at least this long
#: the clients leave once every prompt's load is pending (the connector's gauge), or this long after
#: sending at the latest: inside the load either way, on a fast machine or a loaded one
CLOSE_AFTER_S = 1.0
MAX_TOKENS = 16

_rng = random.Random(29)
SHARED = sc.prompt(_rng, 256)
PROMPTS = [sc.prompt(_rng, 256 + _rng.randrange(200, 400), SHARED) for _ in range(6)]
PROBE = sc.prompt(_rng, 40)  # under one block: stores and loads nothing, but drives steps


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sc.served_model(tmp_path_factory)


@pytest.fixture(scope="module")
def slow(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.Server]:
    work = tmp_path_factory.mktemp("slow-nvme")
    tiers = [
        {
            "name": "nvme",
            "capacity": "256MiB",
            "path": str(work / "nvme"),
            "direct_io": "off",
            "read_latency_s": READ_LATENCY_S,
        }
    ]
    with sc.server(model, work, connector=True, kv_blocks=32, tiers=tiers) as s:
        yield s


def _quiet(s: sc.Server) -> dict[str, float]:
    """Once vLLM and kvstrata hold nothing (:func:`serve_client.quiet`), the server's metrics."""
    sc.quiet(s, PROBE)
    return sc.metrics(s.port)


def _ext_tokens(m: dict[str, float]) -> float:
    return sc.total(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_clients_gone_mid_load_leave_nothing_held_and_the_next_restore_is_right(slow: sc.Server) -> None:
    first = [sc.run_jobs(slow.url, [sc.Job(p, MAX_TOKENS)])[0] for p in PROMPTS]
    assert not [o.error for o in first if o.error]
    stored = _quiet(slow)  # the stores reached NVMe (queued store bytes 0)
    assert sc.total(stored, "vllm:kvstrata_stored_blocks_total") > 0

    slow.reset_prefix_cache()
    before = sc.metrics(slow.port)
    loading = threading.Event()
    seen: list[float] = [0.0]

    def watch() -> None:  # the clients leave when the loads run, not after a fixed time
        deadline = time.monotonic() + CLOSE_AFTER_S
        while not loading.is_set() and time.monotonic() < deadline:
            seen.append(sc.live(sc.metrics(slow.port)).get("pending_loads", 0.0))
            if seen[-1] >= len(PROMPTS):
                loading.set()
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    jobs = [sc.Job(p, MAX_TOKENS, "load", CLOSE_AFTER_S, close_when=loading) for p in PROMPTS]
    watcher.start()
    try:
        outs = sc.run_jobs(slow.url, jobs)
    finally:
        loading.set()
        watcher.join()
    dropped = sum(o.disconnected for o in outs)
    assert dropped == len(PROMPTS), [(o.disconnected, len(o.tokens), o.error) for o in outs]
    after = _quiet(slow)

    def delta(name: str, **labels: str) -> float:
        return sc.total(after, name, **labels) - sc.total(before, name, **labels)

    mid_load = delta("vllm:kvstrata_aborted_during_load_total")
    usage = sc.total(after, "vllm:kv_cache_usage_perc")
    print(
        f"\nmid-load aborts: {dropped} clients gone (at most {max(seen):.0f} loads pending then), {mid_load:.0f} "
        f"aborts landed during a load ({READ_LATENCY_S} s reads); KV cache usage after {usage}"
    )
    assert mid_load >= len(PROMPTS) - 1, "the disconnects did not land while the loads ran"
    assert usage < 0.05, f"vLLM still holds {usage:.1%} of its KV cache after every request left"

    slow.reset_prefix_cache()
    ext0 = _ext_tokens(sc.metrics(slow.port))
    again = [sc.run_jobs(slow.url, [sc.Job(p, MAX_TOKENS)])[0] for p in PROMPTS]
    compared = sum(sc.compare(ref, got) for ref, got in zip(first, again, strict=True))
    ext = _ext_tokens(sc.metrics(slow.port)) - ext0
    # the shared prefix comes through kvstrata once, then from vLLM's own cache for the others
    full = sum(len(p) // 128 * 128 for p in PROMPTS) - len(SHARED) * (len(PROMPTS) - 1)
    assert not [o.error for o in again if o.error]
    assert ext >= 0.9 * full, f"only {ext:.0f} of {full} prompt tokens were restored after the aborts"
    assert compared >= 0.8 * sum(len(o.tokens) for o in again)
    failed = sc.total(sc.metrics(slow.port), "vllm:kvstrata_failed_loads_total")
    print(f"after the aborts: {ext:.0f} of {full} tokens restored, {compared} compared, failed loads {failed:.0f}")
    _quiet(slow)
