"""vLLM KV events for kvstrata's tiers, so routers that read vLLM's event stream see them.

On only when vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``) or
``kv_connector_extra_config.kv_events`` says so. The scheduler half knows vLLM's block hashes
(``request.block_hashes``, the same values vLLM's own ``BlockStored`` carry) and attaches a
:class:`BlockInfo` to the store specs of blocks a router may score (:func:`block_info`). The
worker half remembers them by engine key (:class:`TierEvents`, bounded) and the engine calls
:meth:`TierEvents.hook` when a block enters or leaves a tier's index (under its lock: one dict
test and one append). Each step the worker drains the queue into ``BlockStored`` /
``BlockRemoved`` with the tier's medium (:data:`MEDIA`) and hands them to vLLM
(``get_kv_connector_kv_cache_events``); the scheduler half passes them to vLLM's publisher
(``take_events``) once every tensor-parallel worker reported them. Bounded everywhere: a full
queue drops events and counts them (``kv_events_dropped``), nothing waits.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from kvstrata.core.keys import Key
from kvstrata.daemon.block_hashes import BlockHashWriter, entries_of

#: tier kind -> (medium, locality). vLLM's own constants: "CPU" for host memory, "STORAGE" for
#: anything below it; locality tells a node's own tiers from pooled / shared ones.
MEDIA: dict[str, tuple[str, str]] = {
    "hbm": ("GPU", "LOCAL"),
    "dram": (MEDIUM_CPU, "LOCAL"),
    "nvme": (MEDIUM_STORAGE, "LOCAL"),
    "mooncake": (MEDIUM_STORAGE, "REMOTE"),
    "fs": (MEDIUM_STORAGE, "REMOTE"),
}
QUEUE_MAX = 16384  # raw tier events waiting for the next step (worker)
TRACKED_MAX = 65536  # blocks whose vLLM hash a worker remembers (older ones fire nothing)
PENDING_MAX = 65536  # events the scheduler holds waiting for the other TP ranks / the publisher


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What vLLM's ``BlockStored`` says of one block (one vLLM KV cache group block)."""

    block_hash: Any  # ExternalBlockHash: bytes, or int under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    parent_hash: Any
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int
    lora_id: int | None = None
    lora_name: str | None = None


def external_hashes(request: Any, hash_block_size: int, block_size: int) -> list[Any]:
    """vLLM's published hashes of ``request``'s blocks of ``block_size`` tokens (as its block
    pool computes them for ``BlockStored``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = list(request.block_hashes)
    stride = block_size // hash_block_size
    return [maybe_convert_block_hash(hashes[(i + 1) * stride - 1]) for i in range(len(hashes) // stride)]


def block_info(request: Any, ext: list[Any], i: int, block_size: int, group_idx: int) -> BlockInfo:
    lora = getattr(request, "lora_request", None)
    tokens = request.all_token_ids[i * block_size : (i + 1) * block_size]
    return BlockInfo(
        ext[i],
        ext[i - 1] if i > 0 else None,
        tuple(tokens),
        block_size,
        group_idx,
        lora.adapter_id if lora else None,
        lora.name if lora else None,
    )


@dataclass(slots=True)
class EventSpec:
    """Blocks to announce for one key of a store spec: ``blocks`` enter a tier when key
    ``index`` does and leave it when it leaves; ``removed_only``: only the leaving is told (an
    attention block between restore points of a hybrid model)."""

    index: int
    blocks: tuple[BlockInfo, ...]
    removed_only: bool = False


class KVStrataKVEvents(KVConnectorKVEvents):
    """The workers' events of one step (vLLM's ``KVOutputAggregator`` adds them up)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self.events = list(events or [])
        self.workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KVStrataKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events.clear()
        self.workers = 1


class TierEvents:
    """Worker side: vLLM hashes by engine key, and the engine's tier events until drained."""

    def __init__(self, media: list[tuple[str, str]], queue_max: int = QUEUE_MAX, tracked_max: int = TRACKED_MAX):
        self.media = media  # by tier position
        self.queue: deque[tuple[int, Key, bool]] = deque()
        self.queue_max = queue_max
        self.tracked: OrderedDict[Key, EventSpec] = OrderedDict()
        self.tracked_max = tracked_max
        self.dropped = 0  # events lost to a full queue (cumulative; the worker reports deltas)
        self.sidecar: BlockHashWriter | None = None  # vLLM hashes for the daemon's events (block_hashes.py)

    def track(self, key: Key, spec: EventSpec) -> None:
        if self.sidecar is not None and spec.blocks:
            self.sidecar.add(key, entries_of(spec.blocks, spec.removed_only))
        tracked = self.tracked
        tracked[key] = spec
        tracked.move_to_end(key)
        while len(tracked) > self.tracked_max:
            tracked.popitem(last=False)

    def hook(self, tier: Any, key: Key, stored: bool) -> None:
        """The engine's callback (under its lock): one dict test, one append."""
        if key not in self.tracked:
            return
        if len(self.queue) >= self.queue_max:
            self.dropped += 1
            return
        self.queue.append((tier.position, key, stored))

    def drain(self) -> list[KVCacheEvent]:
        """The queued tier events as vLLM events: one ``BlockStored`` per block batch stored,
        the removals of a step merged per medium."""
        out: list[KVCacheEvent] = []
        removed: dict[tuple[str, str, int], list[Any]] = {}
        for _ in range(len(self.queue)):
            pos, key, stored = self.queue.popleft()
            spec = self.tracked.get(key)
            if spec is None or not spec.blocks:
                continue
            medium, locality = self.media[pos]
            if not stored:
                removed.setdefault((medium, locality, spec.blocks[0].group_idx), []).extend(
                    b.block_hash for b in spec.blocks
                )
            elif not spec.removed_only:
                out.append(stored_event(spec.blocks, medium, locality))
        for (medium, locality, group), hashes in removed.items():
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality))
        return out


def stored_event(blocks: tuple[BlockInfo, ...], medium: str, locality: str) -> BlockStored:
    first = blocks[0]
    return BlockStored(
        block_hashes=[b.block_hash for b in blocks],
        parent_block_hash=first.parent_hash,
        token_ids=[t for b in blocks for t in b.token_ids],
        block_size=first.block_size,
        lora_id=first.lora_id,
        medium=medium,
        lora_name=first.lora_name,
        group_idx=first.group_idx,
        locality=locality,
    )


class EventGate:
    """Scheduler side: events every TP worker reported, in order, bounded."""

    def __init__(self, workers: int, pending_max: int = PENDING_MAX) -> None:
        self.workers = workers
        self.pending_max = pending_max
        self.seen: Counter[KVCacheEvent] = Counter()
        self.ready: deque[KVCacheEvent] = deque()
        self.dropped = 0  # since the last stats report

    def add(self, events: list[KVCacheEvent]) -> None:
        for ev in events:
            if len(self.ready) >= self.pending_max:
                self.dropped += 1
                continue
            if self.workers == 1:
                self.ready.append(ev)
                continue
            if len(self.seen) >= self.pending_max and ev not in self.seen:
                self.dropped += 1
                continue
            self.seen[ev] += 1
            if self.seen[ev] >= self.workers:
                del self.seen[ev]
                self.ready.append(ev)

    def take(self) -> list[KVCacheEvent]:
        out = list(self.ready)
        self.ready.clear()
        return out
