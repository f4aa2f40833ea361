"""The daemon's vLLM KV events: vLLM's wire format, the connector's hashes, bounded, never blocking.

Real daemon processes, a real LMDB sidecar, real ZMQ sockets, and vLLM's own classes and decoder
on the subscriber side (the daemon itself never imports vLLM).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_daemon_support import DaemonProcess, config_dict, kvstrata, wait_for, write_config

from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Key
from kvstrata.daemon.block_hashes import (
    BlockHashReader,
    BlockHashWriter,
    BlockMeta,
    Entry,
    encode_entry,
    sidecar_path,
)
from kvstrata.daemon.kv_events import (
    DaemonKVEvents,
    KVEventPublisher,
    block_removed,
    block_stored,
    encode_batch,
    packb,
)
from kvstrata.daemon.metrics import DaemonMetrics
from kvstrata.engine.engine import Engine
from kvstrata.workload.content import block_contents

zmq = pytest.importorskip("zmq")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

TOPIC = "kvstrata-test"
STATE = ".kvstrata-daemon"


def vllm_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")  # as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 64-bit ints


def store_with_hashes(
    cfg: dict[str, Any],
    layout: Any,
    state_dir: Path,
    chains: int,
    blocks: int,
    seed: int,
    unknown: tuple[int, ...] = (),
) -> list[list[Key]]:
    """Store ``chains`` prefixes as the connector does: the vLLM hashes of each block recorded in
    the sidecar before its store (one vLLM block per kvstrata key); the ``unknown`` chains unrecorded."""
    out = []
    rng = np.random.default_rng(seed)
    with Engine(cfg, layout=layout) as engine:
        writer = BlockHashWriter(sidecar_path(state_dir, engine.namespace.fingerprint), max_keys=4096)
        try:
            for c in range(chains):
                keys = engine.keys_for_tokens(rng.integers(0, 32000, size=layout.block_size * blocks, dtype=np.uint32))
                parent = None
                for i, key in enumerate(keys):
                    h = vllm_hash(key)
                    tokens = tuple(range(i * layout.block_size, (i + 1) * layout.block_size))
                    if c not in unknown:
                        writer.add(key, Entry((BlockMeta(h, parent, tokens, layout.block_size, 0),)))
                    parent = h
                writer.flush()
                bufs = {layer: block_contents(keys, layer, layout.layer_nbytes(layer)) for layer in range(4)}
                assert engine.store_sync(keys, bufs).stored == blocks
                out.append(keys)
        finally:
            writer.close()
    assert writer.dropped == 0
    return out


class Subscriber:
    """A SUB socket decoding with vLLM's ``KVEventBatch`` (binds 127.0.0.1, or connects), read
    by its own thread as a router would (a bound SUB hands its subscription to a connecting
    publisher only while it is polled). ``stall``: connected, never reads."""

    def __init__(self, connect: str | None = None, rcvhwm: int = 0, stall: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        if rcvhwm:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if connect is None:
            self.sock.bind("tcp://127.0.0.1:*")
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(connect)
            self.endpoint = connect
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self.seqs: list[int] = []
        self.events: list[Any] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(stall,), daemon=True)
        self.thread.start()

    def _run(self, stall: bool) -> None:
        while not self.stop.is_set():
            if stall or not self.sock.poll(20):
                self.stop.wait(0.02)
                continue
            topic, seq, payload = self.sock.recv_multipart()
            batch = self.decoder.decode(payload)
            with self.lock:
                if topic != TOPIC.encode() or len(seq) != 8 or batch.data_parallel_rank != 0 or batch.ts <= 0:
                    self.errors.append(f"bad frame {topic!r} {seq!r}")
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events += batch.events

    def drain(self) -> bool:
        assert not self.errors, self.errors
        return True

    def hashes(self, kind: Any, medium: str, locality: str) -> set[Any]:
        with self.lock:
            events: list[Any] = list(self.events)
        return {
            h
            for e in events
            if isinstance(e, kind) and e.medium == medium and e.locality == locality
            for h in e.block_hashes
        }

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


# -------------------------------------------------------------------- wire format, sidecar
def test_packb_is_byte_identical_to_vllms_encoder() -> None:
    """Every width of int, str, bin and array msgpack has, in vLLM's event classes."""
    stored = kv_events.BlockStored(
        block_hashes=[0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 + 5, 2**64 - 1],
        parent_block_hash=b"\xab" * 32,
        token_ids=list(range(70_000)),  # array32
        block_size=16,
        lora_id=7,
        medium="STORAGE",
        lora_name="x" * 300,  # str16
        group_idx=3,
        locality="REMOTE",
    )
    small = kv_events.BlockStored(
        block_hashes=[b"\x01" * 300],  # bin16
        parent_block_hash=None,
        token_ids=list(range(20)),  # array16
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    removed = kv_events.BlockRemoved(block_hashes=[-1, -33, -200, -40000, -(2**40)], medium="CPU", locality="LOCAL")
    for events in ([], [stored], [small, removed], [removed] * 20):
        batch = kv_events.KVEventBatch(ts=1234.5678, events=events, data_parallel_rank=0)
        want = msgspec.msgpack.Encoder().encode(batch)
        ours = encode_batch(1234.5678, [msgspec.to_builtins(e, builtin_types=(bytes,)) for e in events])
        assert ours == want
    assert packb({"a": [True, False, None, 1.5]}) == msgspec.msgpack.encode({"a": [True, False, None, 1.5]})
    # the daemon's own event builders give the same bytes as vLLM's classes
    entry = Entry((BlockMeta(b"\x02" * 32, 9, (1, 2), 2, 0), BlockMeta(10, b"\x02" * 32, (3, 4), 2, 0, 3, "l")))
    ours = encode_batch(
        5.0, [block_stored(entry, "CPU", "LOCAL"), block_removed([b"\x02" * 32, 10], "STORAGE", 0, "REMOTE")]
    )
    vllm = [
        kv_events.BlockStored(
            block_hashes=[b"\x02" * 32, 10],
            parent_block_hash=9,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            locality="LOCAL",
        ),
        kv_events.BlockRemoved(block_hashes=[b"\x02" * 32, 10], medium="STORAGE", group_idx=0, locality="REMOTE"),
    ]
    assert ours == msgspec.msgpack.encode(kv_events.KVEventBatch(ts=5.0, events=vllm, data_parallel_rank=0))


def test_media_are_the_connectors() -> None:
    from kvstrata.daemon.kv_events import MEDIA
    from kvstrata.integrations.vllm.events import MEDIA as CONNECTOR_MEDIA

    assert MEDIA == CONNECTOR_MEDIA


def test_sidecar_is_bounded_and_read_back_untrusted(tmp_path: Path) -> None:
    path = sidecar_path(tmp_path, "ns")
    keys = [bytes([i]) * 16 for i in range(40)]
    writer = BlockHashWriter(path, max_keys=8)
    for i, key in enumerate(keys):
        h = b"\x10" * 31 + bytes([i]) if i % 2 else i  # bytes and int hashes
        writer.add(key, Entry((BlockMeta(h, None, (1, 2), 2, 0, 5, "lora"),), removed_only=i == 39))
        if i % 5 == 4:
            writer.flush()  # batches, as the writer thread makes them
    writer.close()
    reader = BlockHashReader(path)
    known = reader.get(keys)
    assert 4 <= len(known) <= 8 and keys[-1] in known and keys[0] not in known  # the newest, at most max_keys
    assert known[keys[-1]].removed_only and known[keys[-1]].blocks[0].block_hash == b"\x10" * 31 + b"\x27"
    assert known[keys[-2]].blocks[0] == BlockMeta(38, None, (1, 2), 2, 0, 5, "lora")
    reader.close()
    # a damaged record is an unknown key, not a crash or a wrong hash
    import lmdb

    env = lmdb.open(str(path), max_dbs=3)
    db = env.open_db(b"g0")
    with env.begin(write=True) as txn:
        txn.put(b"bad", b"{not json", db=db)
        txn.put(b"bad2", encode_entry(Entry((BlockMeta(1, None, (), 2, 0),)))[:-3] + b'"x"]', db=db)
    env.close()
    assert BlockHashReader(path).get([b"bad", b"bad2", b"missing"]) == {}


def test_a_publisher_nobody_drains_drops_and_counts_and_never_waits() -> None:
    dropped: list[int] = []
    pub = KVEventPublisher("inproc://stalled", TOPIC, queue_max=2, on_drop=dropped.append)
    pub.close()  # the sender thread is gone: nothing drains the queue any more
    ev = {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}
    assert [pub.publish([ev, ev]) for _ in range(5)] == [True, True, False, False, False]
    assert sum(dropped) == 6 and pub.counts()["dropped_events"] == 6
    metrics = DaemonMetrics()
    sink = DaemonKVEvents(pub, Path("/nonexistent"), metrics)
    sink.moved("ns", ("nvme", [b"k" * 16]))  # no sidecar: nothing published, counted
    assert metrics.total("kvstrata_daemon_kv_events_unknown_keys_total") == 1


# -------------------------------------------------------------------- a real daemon
def test_demotion_and_promotion_are_published_with_vllms_hashes(tmp_path: Path) -> None:
    layout = get_layout("tiny")
    cfg = config_dict(tmp_path)
    sub = Subscriber()
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path, kv_events_endpoint=sub.endpoint, kv_events_topic=TOPIC)
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        time.sleep(0.3)  # the daemon's PUB socket has connected to the subscriber
        state = tmp_path / "nvme" / STATE
        chains = store_with_hashes(cfg, layout, state, 12, 32, seed=1, unknown=(1,))  # 1.5 of 2 MiB
        wait_for(lambda: d.metric("kvstrata_daemon_demoted_blocks_total") > 0, 20, "a demotion")
        wait_for(lambda: d.status()["last_cycle"].get("demoted", 1) == 0, 20, "the demotion done")
        old = {vllm_hash(k) for k in chains[0]}
        wait_for(lambda: (sub.drain(), old <= sub.hashes(kv_events.BlockRemoved, "STORAGE", "LOCAL"))[1], 10, "events")
        # demoted: left nvme (STORAGE, LOCAL), arrived in the shared fs tier (STORAGE, REMOTE)
        gone = sub.hashes(kv_events.BlockRemoved, "STORAGE", "LOCAL")
        assert gone == sub.hashes(kv_events.BlockStored, "STORAGE", "REMOTE")
        assert old <= gone and not gone & {vllm_hash(k) for k in chains[-1]}  # the newest stayed
        assert not gone & {vllm_hash(k) for k in chains[1]}  # demoted too, but its hashes are unknown:
        assert d.metric("kvstrata_daemon_kv_events_unknown_keys_total") >= 32  # nothing published, counted
        stored = [e for e in sub.events if isinstance(e, kv_events.BlockStored)]
        first = next(e for e in stored if e.block_hashes == [vllm_hash(chains[0][1])])
        assert first.parent_block_hash == vllm_hash(chains[0][0]) and first.block_size == layout.block_size
        assert first.token_ids == list(range(layout.block_size, 2 * layout.block_size)) and first.group_idx == 0
        i_stored = min(i for i, e in enumerate(sub.events) if vllm_hash(chains[0][0]) in e.block_hashes)
        assert isinstance(sub.events[i_stored], kv_events.BlockStored)  # stored below before removed above
        assert sub.seqs == list(range(len(sub.seqs)))  # vLLM's sequence numbers, from 0, none lost
        # a hint brings session 0 back up: stored in nvme again
        res = kvstrata("prefetch", "--config", str(cfg_path), *[k.hex() for k in chains[0]])
        assert res.returncode == 0, res.stderr
        back = lambda: old <= sub.hashes(kv_events.BlockStored, "STORAGE", "LOCAL")  # noqa: E731
        wait_for(lambda: (sub.drain(), back())[1], 10, "the promotion published")
        sent = lambda: d.status()["kv_events"]["sent_events"]  # noqa: E731
        wait_for(lambda: (sub.drain(), sent() == len(sub.events))[1], 10, "every sent event received")
        status = d.status()["kv_events"]
        assert status["endpoint"] == sub.endpoint and status["dropped_events"] == 0
        assert status["sent_events"] == d.metric("kvstrata_daemon_kv_events_total")
        assert d.metric("kvstrata_daemon_kv_events_dropped_total") == 0
    finally:
        rc, _ = d.stop()
        sub.close()
    assert rc == 0


def test_deletion_is_published_and_a_stalled_subscriber_does_not_slow_the_daemon(tmp_path: Path) -> None:
    """nvme only (drops at the bottom); the daemon binds (ipc://), one subscriber never reads."""
    layout = get_layout("tiny")
    cfg = {"tiers": [{"name": "nvme", "capacity": "2MiB", "path": str(tmp_path / "nvme"), "write": "write-back"}]}
    endpoint = f"ipc://{tmp_path / 'events.sock'}"
    cfg_path = write_config(
        tmp_path / "kv.toml", tmp_path, kv_events_endpoint=endpoint, kv_events_topic=TOPIC, kv_events_hwm=4
    )
    text = cfg_path.read_text()
    cfg_path.write_text(text[text.index("[daemon]") :].replace("[daemon]", _nvme_only(tmp_path) + "[daemon]"))
    d = DaemonProcess(cfg_path, tmp_path).start()
    sub = stalled = None
    try:
        d.wait_ready()
        sub = Subscriber(connect=endpoint)
        stalled = Subscriber(connect=endpoint, rcvhwm=1, stall=True)  # never reads: its pipe fills up
        time.sleep(0.3)  # ZMQ's subscription handshake
        chains = store_with_hashes(cfg, layout, tmp_path / "nvme" / STATE, 12, 32, seed=3)
        cycles = d.metric("kvstrata_daemon_cycle_duration_seconds_count")
        wait_for(lambda: d.metric("kvstrata_daemon_dropped_blocks_total", reason="bottom") > 0, 20, "a drop")
        high = d.metric("kvstrata_tier_high_watermark_bytes", tier="nvme")
        wait_for(lambda: d.metric("kvstrata_tier_used_bytes", tier="nvme") <= high, 20, "nvme under its high mark")
        wait_for(lambda: d.metric("kvstrata_daemon_cycle_duration_seconds_count") > cycles + 5, 20, "more cycles")
        old = {vllm_hash(k) for k in chains[0]}
        wait_for(lambda: (sub.drain(), old <= sub.hashes(kv_events.BlockRemoved, "STORAGE", "LOCAL"))[1], 10, "drops")
        assert not [e for e in sub.events if isinstance(e, kv_events.BlockStored)]  # nothing below to store into
        assert d.status()["kv_events"]["sent_events"] >= len(sub.events) > 0
    finally:
        rc, seconds = d.stop()
        for s in (sub, stalled):
            if s is not None:
                s.close()
    assert rc == 0 and seconds < 30


def test_blocks_the_fs_tier_expires_are_published_as_removed(tmp_path: Path) -> None:
    """A small fs tier under nvme: demoted into it, then expired from it (its watermark)."""
    layout = get_layout("tiny")
    cfg = config_dict(tmp_path, fs="1MiB")
    sub = Subscriber()
    cfg_path = write_config(
        tmp_path / "kv.toml", tmp_path, fs="1MiB", kv_events_endpoint=sub.endpoint, kv_events_topic=TOPIC
    )
    # Stored before the daemon starts: its first pass then finds 1.6 MiB on nvme (high watermark
    # 1.2 MiB) and demotes down to 0.8 MiB, so fs (high watermark 0.6 MiB) receives >= 0.8 MiB and
    # must expire. Storing while it ran made that timing-dependent: a pass landing mid-way moved
    # only ~0.45 MiB and left nvme just under its high watermark, so fs never passed its own.
    # 13 chains stay below the engine's own 2 MiB, so only the daemon moves blocks (and publishes).
    chains = store_with_hashes(cfg, layout, tmp_path / "nvme" / STATE, 13, 32, seed=4)
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        d.wait_ready()
        # eventual, not timed: under load the demotion into fs and its expiry can take a while
        wait_for(lambda: d.metric("kvstrata_daemon_expired_objects_total") > 0, 90, "an fs expiry")
        old = {vllm_hash(k) for k in chains[0]}
        expired = lambda: sub.hashes(kv_events.BlockRemoved, "STORAGE", "REMOTE")  # noqa: E731
        wait_for(lambda: old <= expired(), 60, "the oldest blocks removed from fs")
        assert expired() <= sub.hashes(kv_events.BlockStored, "STORAGE", "REMOTE")  # only what went there
        assert not expired() & {vllm_hash(k) for k in chains[-1]}
    finally:
        rc, _ = d.stop()
        sub.close()
    assert rc == 0


def _nvme_only(root: Path) -> str:
    return f'[[tiers]]\nname = "nvme"\ncapacity = "2MiB"\npath = "{root / "nvme"}"\nwrite = "write-back"\n'


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('kv_events_endpoint = "udp://127.0.0.1:5557"', "'udp://127.0.0.1:5557': must start with tcp://"),
        ('kv_events_endpoint = "tcp://127.0.0.1:99999"', "port '99999' is not 0-65535"),
        ('kv_events_endpoint = "tcp://5557"', "'tcp://5557': needs host:port"),
        ("kv_events_queue = 0", "daemon.kv_events_queue"),
    ],
)
def test_bad_kv_events_config_is_a_clear_error(tmp_path: Path, line: str, needle: str) -> None:
    cfg = write_config(tmp_path / "kv.toml", tmp_path)
    cfg.write_text(cfg.read_text() + line + "\n")
    res = kvstrata("daemon", "--config", str(cfg))
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr.replace("\n", " ") and "Traceback" not in res.stderr


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'missing' / 'dir' / 'events.sock'}"
    cfg = write_config(tmp_path / "kv.toml", tmp_path, kv_events_endpoint=endpoint)
    res = subprocess.run(
        [sys.executable, "-m", "kvstrata", "daemon", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert f"kv_events_endpoint {endpoint!r}: cannot bind it" in res.stderr and "Traceback" not in res.stderr


# -------------------------------------------------------------------- the connector's half
def test_the_connectors_tracked_blocks_reach_the_sidecar(tmp_path: Path) -> None:
    """What the worker's TierEvents tracks is what the daemon reads back, hash for hash."""
    from kvstrata.integrations.vllm.events import BlockInfo, EventSpec, TierEvents

    events = TierEvents([("CPU", "LOCAL")])
    events.sidecar = BlockHashWriter(sidecar_path(tmp_path, "fp"))
    infos = [BlockInfo(bytes([i]) * 32, bytes([i - 1]) * 32 if i else None, (i, i + 1), 2, 0, 4, "l") for i in range(3)]
    events.track(b"k1" * 8, EventSpec(0, (infos[0], infos[1])))
    events.track(b"k2" * 8, EventSpec(1, (infos[2],), removed_only=True))
    events.track(b"k3" * 8, EventSpec(2, ()))  # nothing to announce: nothing recorded
    events.sidecar.close()
    got = BlockHashReader(sidecar_path(tmp_path, "fp")).get([b"k1" * 8, b"k2" * 8, b"k3" * 8])
    assert set(got) == {b"k1" * 8, b"k2" * 8}
    assert [b.block_hash for b in got[b"k1" * 8].blocks] == [infos[0].block_hash, infos[1].block_hash]
    assert got[b"k1" * 8].blocks[1] == BlockMeta(*[getattr(infos[1], f) for f in BlockMeta.__slots__])
    assert got[b"k2" * 8].removed_only and not got[b"k1" * 8].removed_only


def test_the_daemon_does_not_import_vllm() -> None:
    code = (
        "import sys, kvstrata.daemon.service, kvstrata.daemon.kv_events, kvstrata.daemon.block_hashes\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'msgspec'))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
