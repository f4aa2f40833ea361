"""KV events for routers on a real vLLM (CPU build): with ``kv_events_config`` on, a ZMQ
subscriber decoding vLLM's own ``KVEventBatch`` receives kvstrata's ``BlockStored`` for a served
prompt (medium CPU for the DRAM tier, STORAGE for NVMe) with the same block hashes and tokens
as vLLM's own GPU ``BlockStored``, and ``BlockRemoved`` (medium CPU) once a second prompt
evicts the first from a small DRAM tier; and a subscriber that stops (SIGSTOP, like a hung
router) stalls neither serving nor kvstrata's events, which reach it again once it resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from . import sessions
from .event_subscriber import read_payloads
from .sessions import BLOCK, counter, kvstrata_config

pytestmark = pytest.mark.slow


class _Subscriber(threading.Thread):
    """Collects every event vLLM publishes until stopped. It binds a free 127.0.0.1 port
    (``endpoint``): vLLM's publisher connects to a tcp endpoint with a host, binds only ``*``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list[Any] = []
        self.stop = threading.Event()
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if poller.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        self.sock.close(0)
        self.ctx.term()


def _settle(count: Callable[[], int], quiet_s: float = 1.0, cap_s: float = 30.0) -> None:
    """Wait until ``count()`` (events received so far) has not grown for ``quiet_s``, ``cap_s``
    at most: the last events are in, however slow the machine (a fixed pause was a guess)."""
    last, since, end = count(), time.monotonic(), time.monotonic() + cap_s
    while time.monotonic() < end:
        time.sleep(0.1)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def test_routers_see_kvstrata_tiers_as_vllm_kv_events(
    run_vllm: Any, vllm_models: dict[str, Path], tmp_path: Path
) -> None:
    first = sessions.random_ids(181, 9 * BLOCK + 30)
    second = sessions.random_ids(182, 9 * BLOCK + 30)  # evicts ``first`` from the 6 MiB DRAM tier
    cfg = kvstrata_config(tmp_path / "nvme")
    cfg["kv_connector_extra_config"]["config"]["tiers"][0]["capacity"] = "6MiB"  # 12 blocks of 512 KiB
    sub = _Subscriber()
    sub.start()
    try:
        run = run_vllm(
            vllm_models["llama"],
            [first, second, {"ids": sessions.random_ids(183, 40), "pause_s": 1.0}],
            kv_transfer_config=cfg,
            llm_kwargs={
                "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint}
            },
        )
        _settle(lambda: len(sub.events))  # the publisher's thread flushes the last batch
    finally:
        sub.close()
    full = len(first) // BLOCK
    seen = Counter((type(e).__name__, getattr(e, "medium", None)) for e in sub.events)
    why = f"events received: {dict(seen)}; vLLM log: {run['log_path']}"
    stored = [e for e in sub.events if isinstance(e, BlockStored)]
    gpu = {h: e for e in stored if e.medium == "GPU" for h in e.block_hashes}
    by_tokens = {tuple(_tokens_of(gpu, h)): h for h in gpu}  # vLLM's own hash of each block it cached
    first_hashes = [by_tokens.get(tuple(first[i * BLOCK : (i + 1) * BLOCK])) for i in range(full)]
    assert None not in first_hashes, why
    ours = [e for e in stored if e.medium in ("CPU", "STORAGE")]
    for medium in ("CPU", "STORAGE"):  # the DRAM tier, then NVMe (write-through)
        hashes = {h for e in ours if e.medium == medium for h in e.block_hashes}
        assert set(first_hashes) <= hashes, (medium, why)  # the very hashes vLLM publishes for them
    for e in ours:
        assert e.locality == "LOCAL" and e.block_size == BLOCK, e
        for i, h in enumerate(e.block_hashes):  # the tokens vLLM's own event gave that hash
            assert list(e.token_ids[i * BLOCK : (i + 1) * BLOCK]) == _tokens_of(gpu, h)
    removed = {h for e in sub.events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}
    assert removed & set(first_hashes), f"no BlockRemoved for the first prompt's blocks evicted from DRAM; {why}"
    assert counter(run, "vllm:kvstrata_kv_events_dropped") == 0


def _tokens_of(gpu: dict[Any, BlockStored], h: Any) -> list[int]:
    e = gpu[h]
    i = e.block_hashes.index(h)
    return list(e.token_ids[i * e.block_size : (i + 1) * e.block_size])


MIDDLE = 40  # prompts served while the subscriber is stopped: ~1 MB of events, 5x a Unix socket's buffer


def test_a_stopped_subscriber_stalls_neither_serving_nor_kvstrata(
    run_vllm: Any, vllm_models: dict[str, Path], tmp_path: Path
) -> None:
    """The subscriber stops itself after its first message, so vLLM's publisher has a peer that
    takes nothing while 40 prompts are served; vLLM's queue and high-water mark are cut to 4
    batches (so a publisher that waited for a slow peer would stall the scheduler within a few
    steps and the run would time out). Then the runner has the subscriber resumed, and a last
    prompt's kvstrata events must reach it with vLLM's hashes."""
    marks = {name: tmp_path / name for name in ("stopped", "resume", "resumed")}
    out = tmp_path / "events.bin"
    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    script = Path(__file__).with_name("event_subscriber.py")
    args = [endpoint, str(out), str(marks["stopped"]), str(marks["resumed"])]
    sub = subprocess.Popen([sys.executable, str(script), *args])
    resumed_at: list[float] = []

    def resume_when_asked() -> None:  # the runner marks "resume" after the middle prompts
        while not marks["resume"].exists() and sub.poll() is None:
            time.sleep(0.05)
        resumed_at.append(time.time())
        os.kill(sub.pid, signal.SIGCONT)

    waker = threading.Thread(target=resume_when_asked, daemon=True)
    waker.start()
    prompts = [sessions.random_ids(300 + i, 22 * BLOCK + 20) for i in range(MIDDLE + 2)]
    first, middle, last = prompts[0], prompts[1:-1], prompts[-1]
    turns: list[Any] = [first, {"ids": middle[0], "wait_for": str(marks["stopped"])}, *middle[1:]]
    turns.append({"ids": last, "mark": str(marks["resume"]), "wait_for": str(marks["resumed"]), "pause_s": 1.0})
    cfg = kvstrata_config(tmp_path / "nvme")
    cfg["kv_connector_extra_config"]["config"]["tiers"][0]["capacity"] = "24MiB"  # evictions: BlockRemoved too
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "hwm": 4,
        "max_queue_size": 4,
    }
    try:
        run = run_vllm(vllm_models["llama"], turns, kv_transfer_config=cfg, llm_kwargs={"kv_events_config": events_cfg})
        _settle(lambda: out.stat().st_size if out.exists() else 0)  # the last batches reach the file
    finally:
        os.kill(sub.pid, signal.SIGCONT)  # in case the run failed while it was stopped
        sub.terminate()
        sub.wait(10)
        waker.join(5)
    assert [len(t["requests"][0]["output_ids"]) for t in run["turns"]] == [sessions.MAX_TOKENS] * len(turns)
    # the runner served the middle prompts after "stopped" appeared and before it asked for "resume"
    assert marks["stopped"].exists() and marks["resumed"].exists() and resumed_at, "never stopped or resumed"
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = [e for p in read_payloads(out) for e in decoder.decode(p).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    gpu = {h: e for e in stored if e.medium == "GPU" for h in e.block_hashes}
    by_tokens = {tuple(_tokens_of(gpu, h)): h for h in gpu}
    ours = {h for e in stored if e.medium == "CPU" for h in e.block_hashes}
    full = len(last) // BLOCK
    last_hashes = [by_tokens.get(tuple(last[i * BLOCK : (i + 1) * BLOCK])) for i in range(full)]
    seen = Counter((type(e).__name__, getattr(e, "medium", None)) for e in events)
    why = f"events received: {dict(seen)}; vLLM log: {run['log_path']}"
    assert None not in last_hashes, why  # vLLM's own events reach the resumed subscriber...
    assert set(last_hashes) <= ours, why  # ...and kvstrata's, with the same hashes
    # while it was stopped the publisher dropped (ZMQ's high-water mark), it did not wait: most
    # of the middle prompts' blocks never reached it (the buffers hold a fifth of their events)
    middle_blocks = {tuple(p[i * BLOCK : (i + 1) * BLOCK]) for p in middle for i in range(full)}
    got_middle = len(middle_blocks & by_tokens.keys())
    assert got_middle < len(middle_blocks) // 2, (got_middle, len(middle_blocks), why)
    assert counter(run, "vllm:kvstrata_kv_events_dropped") == 0  # kvstrata's own queue never filled
