"""The block index of one tier, and the decisions made on it: pure Python, no I/O.

This is the "manager" half of the manager/mover split (vLLM's kv_offload): which blocks a tier
holds (per block, a layer mask and its bytes), pins, the bytes it counts as live, the state
snapshots it holds against its snapshot budget, and the choices made from that state: victims,
snapshot room, the layers a store still misses. It imports nothing but the data model (and the
extension's :class:`Entry`): the eviction and admission policies, mask sizes and budgets come in
as arguments, and keys may be any hashable that holds no entry (the engine's are bytes, the
planner's simulator uses ints). Callers hold the engine lock (the simulator is single-threaded).

Live bytes change only here: :meth:`BlockIndex.add` counts a block's bytes, :meth:`pop`,
:meth:`shed` and :meth:`evict` take bytes out of the index but keep them live (they are still on
the tier until deleted), and :meth:`release` gives them back once the delete is done.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from kvstrata.core import native
from kvstrata.policies.admission import AdmissionPolicy
from kvstrata.policies.eviction import EvictionPolicy, PolicyKey

__all__ = [
    "SHED_SCAN",
    "BlockIndex",
    "Entry",
    "held_layers",
    "lowest_priority_fn",
    "missing_layers",
    "pick_victims",
    "snapshot_room",
    "split_need",
]

#: Eviction candidates a tier looks at for low-priority layers to shed before whole blocks leave.
SHED_SCAN = 256

K = TypeVar("K", bound=PolicyKey)


@dataclass(slots=True)
class Entry(Generic[K]):
    """What one tier holds of one block.

    Where the extension runs, ``Entry`` is its ``kvstrata._native.Entry``: the same fields in a
    type the garbage collector does not track (nothing an entry holds, ints and a key, can lead
    back to an entry, so no cycle passes through one). A dict of them under bytes or int keys is
    then untracked too: with this dataclass, every full collection visited the whole index (115
    ms for 1M entries, README "The garbage collector and the index")."""

    layers: int  # bitmask of the layers present
    nbytes: int
    parent: K | None = None
    pins: int = 0
    doomed: bool = False  # forgotten while pinned: delete its bytes at the last unpin


if not TYPE_CHECKING and native.NATIVE is not None:
    Entry = native.NATIVE.Entry  # the same fields, untracked by the collector


class BlockIndex(Generic[K]):
    """Entries, pins, live bytes and state snapshots of one tier.

    ``mask_bytes``: bytes of a layer mask (for :meth:`shed` and snapshot accounting);
    ``snap_mask``: the layers that are state snapshots (0: none, every layout but hybrids)."""

    def __init__(
        self,
        eviction: EvictionPolicy[K],
        admission: AdmissionPolicy[K],
        *,
        mask_bytes: Callable[[int], int] = lambda mask: 0,
        snap_mask: int = 0,
    ) -> None:
        self.eviction = eviction
        self.admission = admission
        self.mask_bytes = mask_bytes
        self.snap_mask = snap_mask
        self.entries: dict[K, Entry[K]] = {}
        self.evicting: set[K] = set()  # left the index, bytes not deleted yet (never written meanwhile)
        self.snapshot_bytes = 0
        self.snapshots: dict[K, int] = {}  # key -> position (blocks) its snapshot restores
        self._live = 0  # committed + being evicted (reserved room is the space lock's business)
        #: called as ``on_event(key, True)`` when a block enters the index and ``(key, False)`` when
        #: it leaves (:meth:`add` / :meth:`pop`), under the caller's lock: must be cheap, never block
        self.on_event: Callable[[K, bool], None] | None = None

    @property
    def live_bytes(self) -> int:
        """Bytes of every entry plus those evicted whose delete has not finished."""
        return self._live

    @property
    def leaving_bytes(self) -> int:
        """Bytes taken out of the index and not yet released."""
        return self._live - sum(e.nbytes for e in self.entries.values())

    def add(self, key: K, layers: int, nbytes: int, parent: K | None, position: int = 0) -> Entry[K]:
        """Record ``layers`` (``nbytes``) of ``key``; ``position``: the block count a state
        snapshot among ``layers`` restores (its value)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(layers, nbytes, parent)
            self.eviction.insert(key, parent)
            if self.on_event is not None:
                self.on_event(key, True)
        else:
            entry.layers |= layers
            entry.nbytes += nbytes
            self.eviction.access(key)
        self._live += nbytes
        if layers & self.snap_mask:
            self.snapshot_bytes += self.mask_bytes(layers & self.snap_mask)
            self.snapshots[key] = max(position, self.snapshots.get(key, 0))
        return entry

    def add_blocks(self, keys: Sequence[K], layers: int, nbytes: int, parents: Sequence[K | None]) -> None:
        """:meth:`add` of ``layers`` (``nbytes``) for each of ``keys`` with its parent, in one
        call (the planner's simulator writes whole blocks by the million, the engine a store's)."""
        if layers & self.snap_mask:
            for key, parent in zip(keys, parents, strict=True):
                self.add(key, layers, nbytes, parent)
            return
        entries = self.entries
        get = entries.get
        insert = self.eviction.insert
        event = self.on_event
        for key, parent in zip(keys, parents, strict=True):
            entry = get(key)
            if entry is None:
                entries[key] = Entry(layers, nbytes, parent)
                insert(key, parent)
                if event is not None:
                    event(key, True)
            else:
                entry.layers |= layers
                entry.nbytes += nbytes
                self.eviction.access(key)
        self._live += nbytes * len(keys)

    def pop(self, key: K) -> Entry[K] | None:
        """Take ``key`` out of the index; its bytes stay live until :meth:`release`."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.eviction.remove(key)
            if key in self.snapshots:
                del self.snapshots[key]
                self.snapshot_bytes -= self.mask_bytes(entry.layers & self.snap_mask)
            if self.on_event is not None:
                self.on_event(key, False)
        return entry

    def drop_blocks(self, victims: Sequence[tuple[K, Entry[K]]]) -> None:
        """:meth:`pop` then :meth:`release` of each whole-block victim (as :func:`pick_victims`
        gives them without ``lowest``): blocks deleted as they leave (the planner's simulator,
        which has no delete in flight)."""
        entries = self.entries
        remove = self.eviction.remove
        snapshots = self.snapshots
        for key, e in victims:
            if entries.pop(key, None) is not None:
                remove(key)
                if key in snapshots:
                    del snapshots[key]
                    self.snapshot_bytes -= self.mask_bytes(e.layers & self.snap_mask)
            self._live -= e.nbytes
            self.evicting.discard(key)

    def shed(self, key: K, layers: int) -> int:
        """Take ``layers`` of ``key`` out of its entry, keeping the rest; returns their bytes
        (live until :meth:`release`)."""
        entry = self.entries[key]
        layers &= entry.layers
        size = self.mask_bytes(layers)
        entry.layers &= ~layers
        entry.nbytes -= size
        if key in self.snapshots and layers & self.snap_mask:
            self.snapshot_bytes -= self.mask_bytes(layers & self.snap_mask)
            if not entry.layers & self.snap_mask:
                del self.snapshots[key]
        return size

    def evict(self, key: K, part: Entry[K]) -> None:
        """A victim leaves: all of it (``part`` is its entry) or the layers ``part`` describes."""
        if self.entries.get(key) is part:
            self.pop(key)
        else:  # a victim that sheds only some layers stays in the tier
            self.shed(key, part.layers)
        self.evicting.add(key)

    def evict_many(self, victims: Sequence[tuple[K, Entry[K]]]) -> None:
        """:meth:`evict` of each victim, in one call."""
        if self.snapshots or self.on_event is not None:
            for key, part in victims:
                self.evict(key, part)
            return
        entries = self.entries
        remove = self.eviction.remove
        for key, part in victims:
            if entries.get(key) is part:
                del entries[key]
                remove(key)
            else:  # a victim that sheds only some layers stays in the tier
                self.shed(key, part.layers)
        self.evicting.update([key for key, _ in victims])

    def release(self, key: K, nbytes: int) -> None:
        """The bytes of an evicted or forgotten ``key`` are deleted: they stop being live."""
        self._live -= nbytes
        self.evicting.discard(key)

    def release_many(self, victims: Sequence[tuple[K, Entry[K]]]) -> None:
        """:meth:`release` of each victim's bytes (its entry's ``nbytes``), in one call."""
        self._live -= sum([e.nbytes for _, e in victims])
        self.evicting.difference_update([key for key, _ in victims])

    def pin(self, keys: Iterable[K | None]) -> list[tuple[K, Entry[K]]]:
        """Pin the entries of ``keys`` held here (they cannot be evicted)."""
        pinned: list[tuple[K, Entry[K]]] = []
        get = self.entries.get
        for key in keys:
            e = get(key) if key is not None else None  # type: ignore[arg-type]
            if e is not None:
                e.pins += 1
                pinned.append((key, e))  # type: ignore[arg-type]
        return pinned

    @staticmethod
    def unpin(pinned: Iterable[tuple[K, Entry[K]]]) -> list[tuple[K, Entry[K]]]:
        """Release pins; returns the doomed entries nothing pins any more (delete them now)."""
        free = []
        for key, e in pinned:
            e.pins -= 1
            if e.pins == 0 and e.doomed:
                free.append((key, e))
        return free

    def pick_victims(self, need_bytes: int) -> list[tuple[K, Entry[K]]]:
        """Whole blocks to evict, in policy order, until ``need_bytes`` are covered."""
        return pick_victims(self, need_bytes)


def pick_victims(
    index: BlockIndex[K], need_bytes: int, lowest: Callable[[int], int] | None = None, scan: int = SHED_SCAN
) -> list[tuple[K, Entry[K]]]:
    """Victims in policy order, skipping pinned and evicting blocks, until ``need_bytes`` are
    covered (or every candidate is taken). With ``lowest`` (layers -> its lowest-priority
    layers), the first ``scan`` candidates shed only those layers (a detached entry describes the
    part that leaves); whole blocks leave only when that is not enough."""
    out: list[tuple[K, Entry[K]]] = []
    got = 0
    entries = index.entries
    evicting = index.evicting
    taken: set[K] = set()
    if lowest is not None:
        for key in itertools.islice(index.eviction.victims(), scan):
            e = entries.get(key)
            if e is None or e.pins or key in evicting:
                continue
            low = lowest(e.layers)
            if low != e.layers:
                part = Entry(low, index.mask_bytes(low), e.parent)
                out.append((key, part))
                taken.add(key)
                got += part.nbytes
                if got >= need_bytes:
                    return out
    for key in index.eviction.victims():
        e = entries.get(key)
        if e is None or e.pins or key in evicting or (taken and key in taken):
            continue
        out.append((key, e))
        got += e.nbytes
        if got >= need_bytes:
            break
    return out


def snapshot_room(
    index: BlockIndex[K], key: K, size: int, position: int, budget: float, shed: list[tuple[K, Entry[K]]]
) -> bool:
    """Make ``size`` more snapshot bytes fit ``budget`` by dropping snapshots that restore shorter
    prefixes than ``position`` (value: prefill saved per byte). Each dropped one is taken out
    of the index (evicting) and appended to ``shed``, for the caller to delete; False: no room."""
    entries = index.entries
    while index.snapshot_bytes + size > budget:
        victims = (k for k in index.snapshots if k != key and k not in index.evicting and not entries[k].pins)
        victim = min(victims, key=index.snapshots.__getitem__, default=None)
        if victim is None or index.snapshots[victim] >= position:
            return False
        e = entries[victim]
        layers = e.layers & index.snap_mask
        part = Entry(layers, index.shed(victim, layers), e.parent)
        index.evicting.add(victim)
        shed.append((victim, part))
    return True


def lowest_priority_fn(groups: Sequence[tuple[int, int]]) -> Callable[[int], int] | None:
    """From (layer mask, priority) per group: layers -> the layers of its lowest-priority groups,
    or None when every group has the same priority (nothing to shed)."""
    if len({p for _, p in groups}) <= 1:
        return None

    def lowest(layers: int) -> int:
        present = [(m, p) for m, p in groups if m & layers]
        if len({p for _, p in present}) <= 1:
            return layers
        low = min(p for _, p in present)
        return sum(m & layers for m, p in present if p == low)

    return lowest


def held_layers(indexes: Sequence[BlockIndex[K]], key: K) -> int:
    """Every layer of ``key`` some index holds."""
    held = 0
    for index in indexes:
        e = index.entries.get(key)
        if e is not None:
            held |= e.layers
    return held


def missing_layers(indexes: Sequence[BlockIndex[K]], tier_masks: Sequence[int], key: K, want: int) -> int:
    """The layers of ``want`` that the tier each layer goes to first (its placement mask) lacks."""
    missing = 0
    for index, tmask in zip(indexes, tier_masks, strict=True):
        part = want & tmask
        if part:
            e = index.entries.get(key)
            missing |= part & ~(e.layers if e is not None else 0)
            want &= ~tmask
        if not want:
            break
    return missing


def split_need(indexes: Sequence[BlockIndex[K]], key: K, need: int) -> list[tuple[int, Entry[K], int]]:
    """Where a restore reads the layers ``need`` of ``key``: (position, entry, layers) per tier
    contributing, each layer from the fastest tier holding it (fewer layers when some are nowhere)."""
    left = need
    out = []
    for pos, index in enumerate(indexes):
        e = index.entries.get(key)
        if e is not None and e.layers & left:
            out.append((pos, e, e.layers & left))
            left &= ~e.layers
        if not left:
            break
    return out
