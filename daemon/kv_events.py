"""vLLM KV events for what the daemon moves, on its own ZMQ endpoint, in vLLM's wire format.

Off unless ``[daemon] kv_events_endpoint`` is set. When the daemon demotes a block it publishes
``BlockStored`` for the tier below, then ``BlockRemoved`` for the tier above (a router never sees
a gap); a drop (no tier below, or a layer policy), an fs expiry and a scrubbed-out block publish
``BlockRemoved``; a promotion publishes ``BlockStored`` for the top persistent tier. Media and
locality are the connector's (:data:`MEDIA`, the same as ``integrations/vllm/events.py``).

The daemon sees only kvstrata's keys; a block's vLLM hashes (the values vLLM itself publishes)
come from the connector's sidecar (:mod:`kvstrata.daemon.block_hashes`). A key the sidecar does
not know publishes nothing and is counted (``kvstrata_daemon_kv_events_unknown_keys_total``).

Wire format, as vLLM's ``ZmqEventPublisher`` (0.32) sends it, without importing vLLM: a ZMQ PUB
socket (bound when the endpoint has ``*``, ``::``, or is ``ipc://`` / ``inproc://``, connected
otherwise), one multipart message per batch ``(topic, sequence as 8 bytes big-endian, payload)``,
sequence numbers from 0, the payload msgspec's msgpack of ``KVEventBatch`` (an array ``[ts,
events, data_parallel_rank]``; each event a map tagged ``"type"``, fields in declaration order,
``None`` defaults omitted). :func:`packb` writes msgpack as msgspec does (smallest int/str/bin/
container forms, floats as float64), so the bytes are the same. No replay socket.

Never blocking: :meth:`KVEventPublisher.publish` puts a batch in a bounded queue (full: dropped
and counted) and a thread sends it without waiting (``NOBLOCK``; a PUB socket drops for slow or
absent subscribers at its high-water mark, and a refused send is counted as dropped).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError

from .block_hashes import BlockHashReader, Entry, sidecar_path
from .state import DaemonError

log = logging.getLogger("kvstrata.daemon.kv_events")

#: tier kind -> (medium, locality), as the connector publishes them (vLLM's "CPU" / "STORAGE").
MEDIA: dict[str, tuple[str, str]] = {
    "hbm": ("GPU", "LOCAL"),
    "dram": ("CPU", "LOCAL"),
    "nvme": ("STORAGE", "LOCAL"),
    "mooncake": ("STORAGE", "REMOTE"),
    "fs": ("STORAGE", "REMOTE"),
}
DEFAULT_MEDIUM = ("STORAGE", "REMOTE")
RESTART_ONLY_KV_EVENTS = ("kv_events_endpoint", "kv_events_topic", "kv_events_queue", "kv_events_hwm")
DATA_PARALLEL_RANK = 0  # vLLM's publisher stamps its rank; the daemon is one publisher per node


def medium_of(kind: str) -> tuple[str, str]:
    return MEDIA.get(kind, DEFAULT_MEDIUM)


# ---------------------------------------------------------------------------- msgpack
def packb(obj: Any) -> bytes:
    """msgpack of ``obj`` (None, bool, int, float, str, bytes, list/tuple, dict), byte for byte
    as ``msgspec.msgpack.Encoder`` writes the same values."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True:
        out.append(0xC3)
    elif obj is False:
        out.append(0xC2)
    elif isinstance(obj, int):
        _pack_int(obj, out)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _pack_len(len(data), out, 0xA0, 31, (0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        _pack_len(len(data), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += data
    elif isinstance(obj, (list, tuple)):
        _pack_len(len(obj), out, 0x90, 15, (None, 0xDC, 0xDD))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        _pack_len(len(obj), out, 0x80, 15, (None, 0xDE, 0xDF))
        for k, v in obj.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(f"cannot msgpack {type(obj).__name__}")


def _pack_len(n: int, out: bytearray, fix: int | None, fix_max: int, heads: tuple[int | None, ...]) -> None:
    if fix is not None and n <= fix_max:
        out.append(fix | n)
    elif heads[0] is not None and n < 1 << 8:
        out += bytes((heads[0], n))
    elif n < 1 << 16:
        out += bytes((heads[1],)) + struct.pack(">H", n)  # type: ignore[arg-type]
    else:
        out += bytes((heads[2],)) + struct.pack(">I", n)  # type: ignore[arg-type]


_UINTS = ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64))
_INTS = ((0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15), (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63))


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 0x80 or -32 <= n < 0:
        out += struct.pack(">b", n) if n < 0 else bytes((n,))
    elif n >= 0:
        for head, fmt, lim in _UINTS:
            if n < lim:
                out += bytes((head,)) + struct.pack(fmt, n)
                return
        raise OverflowError(f"int {n} does not fit msgpack")
    else:
        for head, fmt, lim in _INTS:
            if n >= -lim:
                out += bytes((head,)) + struct.pack(fmt, n)
                return
        raise OverflowError(f"int {n} does not fit msgpack")


# ---------------------------------------------------------------------------- events
def block_stored(entry: Entry, medium: str, locality: str) -> dict[str, Any]:
    """vLLM's ``BlockStored`` for the blocks of one kvstrata key (msgspec's field order; fields
    whose default is None are left out when None, as ``omit_defaults`` does)."""
    first = entry.blocks[0]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [b.block_hash for b in entry.blocks],
        "parent_block_hash": first.parent_hash,
        "token_ids": [t for b in entry.blocks for t in b.token_ids],
        "block_size": first.block_size,
        "lora_id": first.lora_id,
        "medium": medium,
        "lora_name": first.lora_name,
    }
    if first.group_idx is not None:
        ev["group_idx"] = first.group_idx
    ev["locality"] = locality
    return ev


def block_removed(hashes: list[Any], medium: str, group_idx: int | None, locality: str) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group_idx is not None:
        ev["group_idx"] = group_idx
    ev["locality"] = locality
    return ev


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = DATA_PARALLEL_RANK) -> bytes:
    """The payload of one message: ``KVEventBatch`` as msgspec encodes it (array-like)."""
    return packb([ts, events, data_parallel_rank])


# ---------------------------------------------------------------------------- endpoint
def is_bind(endpoint: str) -> bool:
    """vLLM's rule: bind wildcards and ipc/inproc, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """A PUB socket fed from a bounded queue by one thread (vLLM's framing and sequence numbers)."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        queue_max: int = 10_000,
        hwm: int = 100_000,
        on_drop: Callable[[int], None] | None = None,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        try:
            import zmq
        except ImportError as exc:  # pragma: no cover - pyzmq ships with vLLM
            raise ConfigError(
                f"daemon.kv_events_endpoint = {endpoint!r} needs pyzmq (pip install pyzmq)",
                field="daemon.kv_events_endpoint",
                value=endpoint,
            ) from exc
        self._zmq = zmq
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self._queue: queue.Queue[tuple[float, list[dict[str, Any]]] | None] = queue.Queue(maxsize=queue_max)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if is_bind(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            self._ctx.term()
            raise DaemonError(f"kv_events_endpoint {endpoint!r}: cannot {_verb(endpoint)} it: {exc}") from exc
        self.seq = 0  # the next sequence number (the sender thread's)
        self.sent_batches = 0
        self.sent_events = 0
        self.dropped_events = 0
        self._on_drop = on_drop
        self._on_sent = on_sent
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstrata-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> bool:
        """Queue one batch (never waits); False when the queue was full (the events are dropped)."""
        if not events:
            return True
        try:
            self._queue.put_nowait((time.time(), events))  # encoded by the sender thread
        except queue.Full:
            self._dropped(len(events))
            return False
        return True

    def _dropped(self, n: int) -> None:
        with self._lock:
            self.dropped_events += n
        if self._on_drop is not None:
            self._on_drop(n)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "sent_batches": self.sent_batches,
                "sent_events": self.sent_events,
                "dropped_events": self.dropped_events,
                "queued_batches": self._queue.qsize(),
            }

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            item = self._queue.get()
            if item is None:
                break
            ts, events = item
            n = len(events)
            try:
                payload = encode_batch(ts, events)
            except (TypeError, OverflowError) as exc:  # a value msgpack cannot carry: never sent
                log.warning("kv events batch dropped: %s", exc)
                self._dropped(n)
                continue
            try:
                self._pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # Again: refused at the high-water mark
                self._dropped(n)
                continue
            self.seq += 1
            with self._lock:
                self.sent_batches += 1
                self.sent_events += n
            if self._on_sent is not None:
                self._on_sent(n)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=2.0)
        self._pub.close(0)
        self._ctx.term()


def _verb(endpoint: str) -> str:
    return "bind" if is_bind(endpoint) else "connect to"


class DaemonKVEvents:
    """What the daemon's movers call: kvstrata keys in, vLLM events out (through the sidecar)."""

    def __init__(self, publisher: KVEventPublisher, state_dir: str | Path, metrics: Any) -> None:
        self.publisher = publisher
        self.state_dir = Path(state_dir)
        self.metrics = metrics
        self._readers: dict[str, BlockHashReader] = {}
        self._lock = threading.Lock()  # the main loop and the scrubber's thread both report moves
        self.unknown_keys = 0

    def _lookup(self, fingerprint: str, keys: Iterable[bytes]) -> dict[bytes, Entry]:
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        with self._lock:
            reader = self._readers.get(fingerprint)
            if reader is None:
                reader = self._readers[fingerprint] = BlockHashReader(sidecar_path(self.state_dir, fingerprint))
            found = reader.get(keys)
            missing = len(keys) - len(found)
            self.unknown_keys += missing
        if missing:
            self.metrics.kv_events_unknown.inc(missing)
        return found

    def moved(
        self,
        fingerprint: str,
        removed: tuple[str, list[bytes]] | None,
        stored: tuple[str, list[bytes]] | None = None,
    ) -> None:
        """Keys that entered a tier (``stored``: tier kind, keys) and left one (``removed``), as one
        batch: the stores first, so a router never sees a demoted block nowhere."""
        keys = (stored[1] if stored else []) + (removed[1] if removed else [])
        if not keys:
            return
        found = self._lookup(fingerprint, keys)
        events: list[dict[str, Any]] = []
        if stored:
            medium, locality = medium_of(stored[0])
            for key in dict.fromkeys(bytes(k) for k in stored[1]):
                entry = found.get(key)
                if entry is not None and not entry.removed_only:
                    events.append(block_stored(entry, medium, locality))
        if removed:
            medium, locality = medium_of(removed[0])
            by_group: dict[int | None, list[Any]] = {}
            for key in dict.fromkeys(bytes(k) for k in removed[1]):
                entry = found.get(key)
                if entry is not None:
                    by_group.setdefault(entry.blocks[0].group_idx, []).extend(b.block_hash for b in entry.blocks)
            events += [block_removed(h, medium, g, locality) for g, h in by_group.items()]
        self.publisher.publish(events)  # a full queue drops them: counted by the publisher

    def status(self) -> dict[str, Any]:
        return {"endpoint": self.publisher.endpoint, **self.publisher.counts(), "unknown_keys": self.unknown_keys}

    def close(self) -> None:
        self.publisher.close()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def open_kv_events(d: Any, state_dir: str | Path, metrics: Any, watermarks: Any = None) -> DaemonKVEvents | None:
    """The daemon's events for ``[daemon]`` settings ``d``, fed by ``watermarks``' moves (None when
    ``kv_events_endpoint`` is unset). A bind or connect that fails is a clear error (DaemonError)."""
    if d.kv_events_endpoint is None:
        return None
    publisher = KVEventPublisher(
        d.kv_events_endpoint,
        d.kv_events_topic,
        d.kv_events_queue,
        d.kv_events_hwm,
        on_drop=metrics.kv_events_dropped.inc,
        on_sent=metrics.kv_events.inc,
    )
    log.info(
        "publishing KV events on %s",
        d.kv_events_endpoint,
        extra={"event": "kv_events", "endpoint": d.kv_events_endpoint, "topic": d.kv_events_topic},
    )
    events = DaemonKVEvents(publisher, state_dir, metrics)
    if watermarks is not None:
        watermarks.on_moved = events.moved
    return events
