"""The vLLM hashes of stored blocks, for the daemon's KV events: a small sidecar the connector writes.

The daemon sees kvstrata's keys only; routers join on vLLM's block hashes. When the connector's
KV events are on and ``[daemon] kv_events_endpoint`` is set, the connector (TP rank 0's worker)
records, for each kvstrata key it stores, what vLLM's ``BlockStored`` says of the blocks under it
(hash, parent hash, token ids, block size, group, LoRA), in
``<state_dir>/block-hashes/<namespace fingerprint>/`` (an LMDB environment, one per namespace).

Bounded: two generations (named databases ``g0``/``g1``) of at most ``max_keys / 2`` keys each;
when the current one is full, the older one is emptied and becomes current, in the same write
transaction (so concurrent writers on the node agree). A key's record is under 16 KiB
(:data:`MAX_RECORD`, larger ones are skipped and counted) and the map size is bounded by both. The
oldest keys are forgotten first; the daemon then publishes nothing for them (counted).
Crash-safe: LMDB transactions (a writer killed mid-batch leaves the previous state; with
``metasync`` off a power loss may undo the last batch, never corrupt), and nothing read back is
trusted: a record that does not parse is an unknown key. No pickle: records are JSON
(``{"r": removed_only, "b": [[hash, parent, tokens, block_size, group, lora_id, lora_name], ...]}``,
a bytes hash as a hex string, an int hash as an int). The writer never blocks its caller: records
wait in a bounded queue (full: dropped and counted) for a thread that writes one transaction per
batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

log = logging.getLogger("kvstrata.daemon.block_hashes")

SUBDIR = "block-hashes"
MAX_RECORD = 16 * 1024  # bytes of one key's record
DEFAULT_MAX_KEYS = 65536
MAX_KEYS = 1 << 20  # the most [daemon] kv_events_tracked_keys allows (the reader maps that much)
QUEUE_MAX = 16384  # records waiting for the writer thread
FLUSH_S = 0.1  # the writer thread's batching period
_DBS = (b"g0", b"g1")
_META = b"meta"


def sidecar_path(state_dir: str | Path, fingerprint: str) -> Path:
    return Path(state_dir) / SUBDIR / fingerprint


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """One vLLM block as its ``BlockStored`` describes it."""

    block_hash: Any  # bytes or int (vLLM's ExternalBlockHash)
    parent_hash: Any
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int | None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """The vLLM blocks under one kvstrata key. ``removed_only``: announce their leaving only (an
    attention block between the restore points of a hybrid model)."""

    blocks: tuple[BlockMeta, ...]
    removed_only: bool = False


def encode_entry(entry: Entry) -> bytes:
    rows = [
        [_hash_out(b.block_hash), _hash_out(b.parent_hash), list(b.token_ids), b.block_size, b.group_idx]
        + ([b.lora_id, b.lora_name] if b.lora_id is not None or b.lora_name is not None else [])
        for b in entry.blocks
    ]
    return json.dumps({"r": int(entry.removed_only), "b": rows}, separators=(",", ":")).encode()


def decode_entry(raw: bytes) -> Entry | None:
    """The entry, or None when ``raw`` is not one (damaged, foreign): never trusted blindly."""
    try:
        obj = json.loads(raw)
        blocks = []
        for row in obj["b"]:
            h, parent, tokens, size, group, *lora = row
            lora_id, lora_name = [*lora, None, None][:2]
            if not (isinstance(size, int) and size > 0 and isinstance(tokens, list)):
                return None
            if not all(isinstance(t, int) for t in tokens) or not (group is None or isinstance(group, int)):
                return None
            if not (lora_id is None or isinstance(lora_id, int)):
                return None
            if not (lora_name is None or isinstance(lora_name, str)):
                return None
            parent_hash = None if parent is None else _hash_in(parent)
            blocks.append(BlockMeta(_hash_in(h), parent_hash, tuple(tokens), size, group, lora_id, lora_name))
        if not blocks:
            return None
        return Entry(tuple(blocks), bool(obj["r"]))
    except (ValueError, KeyError, TypeError):
        return None


def _hash_out(h: Any) -> Any:
    if h is None or isinstance(h, int):
        return h
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h).hex()
    raise TypeError(f"block hash {h!r}: neither bytes nor int")


def _hash_in(h: Any) -> Any:
    if isinstance(h, bool):
        raise TypeError("bool is not a block hash")
    if isinstance(h, int):
        return h
    if isinstance(h, str):
        return bytes.fromhex(h)
    raise TypeError(f"block hash {h!r}")


def _open(path: Path, max_keys: int, readonly: bool) -> lmdb.Environment:
    map_size = max(16 * 1024**2, max_keys * MAX_RECORD + 16 * 1024**2)
    return lmdb.open(
        str(path),
        map_size=map_size,
        max_dbs=3,
        subdir=True,
        readonly=readonly,
        create=not readonly,
        metasync=False,
        readahead=False,
        max_readers=256,
    )


class BlockHashWriter:
    """The connector's half: ``add`` queues (never waits), a thread writes batches."""

    def __init__(self, path: str | Path, max_keys: int = DEFAULT_MAX_KEYS, queue_max: int = QUEUE_MAX) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_keys = max(2, max_keys)
        self.env = _open(self.path, self.max_keys, readonly=False)
        self.dbs = [self.env.open_db(name) for name in _DBS]
        self.meta = self.env.open_db(_META)
        self.queue: deque[tuple[bytes, Entry]] = deque()
        self.queue_max = queue_max
        self.dropped = 0  # records lost: queue full, too large, or a failed write
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-block-hashes", daemon=True)
        self._thread.start()

    def add(self, key: bytes, entry: Entry) -> None:
        if len(self.queue) >= self.queue_max:
            self.dropped += 1
            return
        self.queue.append((bytes(key), entry))  # encoded by the writer thread

    def flush(self) -> None:
        """Write what is queued now (the thread does this every :data:`FLUSH_S`)."""
        raw = [self.queue.popleft() for _ in range(len(self.queue))]
        batch = []
        for key, entry in raw:
            try:
                value = encode_entry(entry)
            except (TypeError, ValueError):  # a hash neither bytes nor int
                value = b""
            if 0 < len(value) <= MAX_RECORD:
                batch.append((key, value))
        self.dropped += len(raw) - len(batch)
        half = self.max_keys // 2
        for i in range(0, len(batch), half):
            try:
                self._write(batch[i : i + half], half)
            except lmdb.Error as exc:
                self.dropped += len(batch[i : i + half])
                log.warning("kvstrata: block hash sidecar %s: write failed: %s", self.path, exc)

    def _write(self, batch: list[tuple[bytes, bytes]], half: int) -> None:
        with self.env.begin(write=True) as txn:
            cur = 1 if txn.get(b"cur", db=self.meta) == b"1" else 0
            if txn.stat(self.dbs[cur])["entries"] + len(batch) > half:
                cur = 1 - cur
                txn.drop(self.dbs[cur], delete=False)
                txn.put(b"cur", str(cur).encode(), db=self.meta)
            for k, v in batch:
                txn.put(k, v, db=self.dbs[cur])

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            if self.queue:
                self.flush()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(lmdb.Error):
            self.flush()
        self.env.close()


class BlockHashReader:
    """The daemon's half: entries by key (read-only; absent until a connector made the sidecar)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.env: lmdb.Environment | None = None
        self.dbs: list[Any] = []
        self.meta: Any = None

    def _ready(self) -> bool:
        if self.env is not None:
            return True
        if not (self.path / "data.mdb").exists():
            return False
        try:
            env = _open(self.path, MAX_KEYS, readonly=True)
            dbs = [env.open_db(name, create=False) for name in _DBS]
            meta = env.open_db(_META, create=False)
        except lmdb.Error as exc:
            log.debug("block hash sidecar %s not usable yet: %s", self.path, exc)
            with contextlib.suppress(NameError, lmdb.Error):
                env.close()
            return False
        self.env, self.dbs, self.meta = env, dbs, meta
        return True

    def get(self, keys: Iterable[bytes]) -> dict[bytes, Entry]:
        """The entries known for ``keys`` (unknown or unreadable ones are left out)."""
        out: dict[bytes, Entry] = {}
        if not self._ready():
            return out
        assert self.env is not None
        try:
            with self.env.begin() as txn:
                cur = 1 if txn.get(b"cur", db=self.meta) == b"1" else 0
                order = (self.dbs[cur], self.dbs[1 - cur])
                for key in keys:
                    for db in order:
                        raw = txn.get(bytes(key), db=db)
                        if raw is not None:
                            entry = decode_entry(raw)
                            if entry is not None:
                                out[bytes(key)] = entry
                            break
        except lmdb.Error as exc:
            log.warning("block hash sidecar %s unreadable: %s", self.path, exc)
            self.close()
        return out

    def close(self) -> None:
        if self.env is not None:
            with contextlib.suppress(lmdb.Error):
                self.env.close()
        self.env = None


def entries_of(blocks: Sequence[Any], removed_only: bool) -> Entry:
    """An :class:`Entry` from objects with the attributes of the connector's ``BlockInfo``."""
    return Entry(
        tuple(
            BlockMeta(
                b.block_hash,
                b.parent_hash,
                tuple(b.token_ids),
                b.block_size,
                b.group_idx,
                b.lora_id,
                b.lora_name,
            )
            for b in blocks
        ),
        removed_only,
    )
