"""The tier interface: a tier stores layer-blocks by (key, layer) and moves bytes.

Tiers are pure data movers plus their own physical bookkeeping. The engine's
index (:mod:`kvstrata.engine.index`) owns lookups, pins, eviction choices and
capacity accounting, and talks to a tier only through the batch methods below
(vLLM's kv_offload split: manager vs. handler). A tier never decides to evict.

Every method that moves bytes takes a batch; a tier may pack many layer-blocks
into one physical record. Methods report per-item outcomes instead of raising
for ordinary misses; an ``OSError``/``TierError`` from a method is a fault that
the engine turns into misses and counts.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import (
    Any,
    ClassVar,
    Generic,
    Literal,
    NamedTuple,
    Protocol,
    TypeGuard,
    TypeVar,
    overload,
    runtime_checkable,
)

from pydantic import BaseModel, ConfigDict

from kvstrata.core.buffers import Buffer, HostSpan
from kvstrata.core.keys import Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.units import total_size

BlockId = tuple[Key, int]  # (key, layer)


class SpanGroup(NamedTuple):
    """Layer-blocks of one layer in host memory: ``(keys[i], layer)`` is ``size`` bytes at ``addresses[i]``."""

    layer: int
    keys: Sequence[Key]
    addresses: Sequence[int]
    size: int


class KeyGroup(NamedTuple):
    """Layer-blocks of one layer: ``(keys[i], layer)``."""

    layer: int
    keys: Sequence[Key]


G = TypeVar("G", SpanGroup, KeyGroup)
T = TypeVar("T")


class _Groups(Sequence[T], Generic[G, T]):
    """A sequence of items made of groups of one layer each (no tuple built per item until one is read)."""

    __slots__ = ("_starts", "groups")

    def __init__(self, groups: Sequence[G]) -> None:
        self.groups: list[G] = list(groups)
        self._starts = list(itertools.accumulate((len(g.keys) for g in self.groups), initial=0))

    def _item(self, g: G, j: int) -> T:
        raise NotImplementedError

    def _items(self, g: G) -> Iterator[T]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._starts[-1]

    def __iter__(self) -> Iterator[T]:
        for g in self.groups:
            yield from self._items(g)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"item {i} of a batch of {n}")
        k = bisect.bisect_right(self._starts, i) - 1
        return self._item(self.groups[k], i - self._starts[k])


class SpanBatch(_Groups[SpanGroup, tuple[BlockId, HostSpan]]):
    """A batch of layer-blocks in host memory as groups of one layer each: what the engine hands
    ``write``/``read`` of a tier that declares ``host_spans`` (no tuple, view or id built per
    layer-block). It reads as the sequence of ``((key, layer), (address, size))`` items of its
    groups in order, so a tier or wrapper that does not look inside treats it as that list."""

    @property
    def nbytes(self) -> int:
        return sum(len(g.keys) * g.size for g in self.groups)

    def _item(self, g: SpanGroup, j: int) -> tuple[BlockId, HostSpan]:
        return (g.keys[j], g.layer), (g.addresses[j], g.size)

    def _items(self, g: SpanGroup) -> Iterator[tuple[BlockId, HostSpan]]:
        return zip(zip(g.keys, itertools.repeat(g.layer)), zip(g.addresses, itertools.repeat(g.size)), strict=True)


class IdBatch(_Groups[KeyGroup, BlockId]):
    """Block ids as groups of one layer each: what the engine hands ``delete`` of a tier that
    declares ``host_spans``. It reads as the sequence of the ``(key, layer)`` ids it stands for."""

    def _item(self, g: KeyGroup, j: int) -> BlockId:
        return g.keys[j], g.layer

    def _items(self, g: KeyGroup) -> Iterator[BlockId]:
        return zip(g.keys, itertools.repeat(g.layer))


class ReadStatus(Enum):
    OK = "ok"
    MISSING = "missing"  # not (or no longer) in the tier
    CORRUPT = "corrupt"  # checksum mismatch: never hand these bytes to a model
    ERROR = "error"  # I/O fault


SpaceModel = Literal["slots", "segments", "bytes"]


@dataclass(frozen=True)
class TierCapabilities:
    """What callers may assume about a tier: plan from these, not from ``isinstance``,
    ``getattr`` or the tier's kind name.

    A tier class declares its set as the class attribute ``capabilities``. A tier whose
    abilities depend on the machine (the ``nvme`` tier: GPUDirect Storage, ``O_DIRECT``)
    sets an instance attribute built with ``dataclasses.replace(type(self).capabilities,
    ...)`` and never rewrites its class's. A flag for an optional method (``peek``,
    ``records``, ``shrink``, ``connection``) promises the method of the matching protocol
    below; check the flag, then narrow with :func:`peekable`, :func:`indexed`,
    :func:`shrinkable` or :func:`connectable`.
    """

    persistent: bool = False  # survives a process restart
    shared: bool = False  # visible to other hosts (and to other processes on this one)
    gpu_direct: bool = False  # can move bytes to/from device memory without a host bounce
    device_memory: bool = False  # the tier's own storage is accelerator memory
    checksums: bool = False  # verifies a checksum on every read
    alignment: int = 1  # preferred buffer alignment in bytes
    direct_io: bool = False  # reads and writes bypass the page cache (O_DIRECT)
    # write/read take a HostSpan (address, size) of host memory in place of a buffer, and a
    # SpanBatch in place of the items list, delete an IdBatch (the engine then hands over host
    # rows by address and ids by layer, building nothing per layer-block)
    host_spans: bool = False
    # Optional methods (see the protocols below).
    peek: bool = False  # PeekableTier: zero-copy views of stored bytes (memory tiers)
    records: bool = False  # IndexedTier: a shared index the daemon may walk and edit (records/delete_at/compact)
    shrink: bool = False  # ShrinkableTier: expires its oldest data on request and has housekeeping (maintain)
    connection: bool = False  # ConnectedTier: reports whether it reaches its remote store now (connected)
    # How the tier spends capacity (the planner's space model): "slots" an arena of fixed-size
    # slots (memory tiers), "segments" append-only segment files with compaction, "bytes" the
    # stored bytes.
    space: SpaceModel = "bytes"


class TierOptions(BaseModel):
    """Tier-specific options; each tier subclasses this with its own fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class TierContext:
    """What a tier knows about the data it stores."""

    layout: KVLayout
    namespace: Namespace


@dataclass
class VerifyReport:
    """Result of a consistency check of a persistent tier."""

    tier: str
    blocks_checked: int = 0
    bad_checksums: int = 0
    missing_data: int = 0  # index entries whose bytes are gone or truncated
    orphan_bytes: int = 0  # bytes in segments that no index entry references
    unindexed_files: int = 0  # data files an index that registers nothing does not know (it was lost)
    repaired: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_checksums == 0 and self.missing_data == 0 and self.unindexed_files == 0

    def to_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "ok": self.ok,
            "blocks_checked": self.blocks_checked,
            "bad_checksums": self.bad_checksums,
            "missing_data": self.missing_data,
            "orphan_bytes": self.orphan_bytes,
            "unindexed_files": self.unindexed_files,
            "repaired": self.repaired,
            "problems": self.problems[:100],
        }


class Tier(ABC):
    """Base class of all tiers. Subclasses register themselves in ``kvstrata.tiers.TIERS``."""

    # Read from the class (a registry lookup) or from an instance; an instance may refine
    # its class's set (see TierCapabilities), never the other way round.
    capabilities: TierCapabilities = TierCapabilities()
    Options: ClassVar[type[TierOptions]] = TierOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        self.name = name
        self.capacity = capacity
        self.options = options
        self.context = context

    # -- bytes -------------------------------------------------------------------------
    @abstractmethod
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        """Store each (block id, source buffer); True where the bytes are safely stored.

        Persistent tiers return only after the data and their index are durable.
        """

    @abstractmethod
    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        """Copy each block into the destination buffer (exactly one layer-block of bytes)."""

    @abstractmethod
    def delete(self, ids: Sequence[BlockId]) -> None:
        """Forget these blocks (missing ones are ignored) and reclaim their space eventually."""

    def contains(self, ids: Sequence[BlockId]) -> list[bool] | None:
        """Whether each block is present now, including blocks that other processes wrote.

        Tiers shared between processes (a directory on disk, a cluster pool) answer this so
        that an engine can find what another vLLM instance or worker stored after it opened.
        ``None``: the tier only ever holds what this process wrote (the engine's index knows).
        """
        return None

    # -- space ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Physical bytes in use (may exceed the sum of live blocks, e.g. before compaction)."""

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        """Whether blocks of ``sizes`` fit next to ``live_bytes`` of live data."""
        return live_bytes + total_size(sizes) <= self.capacity

    # -- persistence ---------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[BlockId, int]]:
        """Blocks already present when the tier opens (persistent tiers), with their sizes."""
        return iter(())

    def verify(self, repair: bool = False) -> VerifyReport:
        """Check checksums and index/data consistency (persistent tiers)."""
        return VerifyReport(tier=self.name)

    @classmethod
    def open_to_verify(cls, name: str, capacity: int, options: TierOptions, context: TierContext, repair: bool) -> Tier:
        """Open the tier for ``kvstrata verify`` (then ``verify(repair)``). A tier that can opens
        read-only unless ``repair``, so that a plain check changes nothing on disk."""
        return cls(name, capacity, options, context)

    @classmethod
    def rebuild_index(
        cls, name: str, options: TierOptions, context: TierContext, force: bool = False
    ) -> VerifyReport | None:
        """Rebuild a persistent tier's index from its self-describing records where it cannot be
        opened or was lost (``force``: in any case), before the tier is opened; what was done, or
        None when nothing was (the default: a tier without such an index)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; idempotent."""


# -- optional abilities: the methods a capability flag promises ---------------------------------


@runtime_checkable
class PeekableTier(Protocol):
    """``capabilities.peek``: the tier hands out views of its stored bytes without a copy."""

    def peek(self, ids: Sequence[BlockId]) -> list[Buffer | None]:
        """A read-only view per block (``None``: not here); valid until the block is deleted."""
        ...


@runtime_checkable
class IndexedTier(Protocol):
    """``capabilities.records``: a shared index the daemon can walk and edit safely (the NVMe tier)."""

    @property
    def used_bytes(self) -> int: ...
    def refresh_used(self) -> int: ...
    def verify(self, repair: bool = ...) -> VerifyReport: ...
    def records(self) -> list[tuple[BlockId, Any]]: ...
    def delete_at(self, records: Sequence[tuple[BlockId, Any]]) -> list[bool]: ...
    def compact(self) -> int: ...


@runtime_checkable
class ShrinkableTier(Protocol):
    """``capabilities.shrink``: a bottom tier that expires its oldest data and keeps house (the fs tier)."""

    def shrink(self, target_bytes: int, why: str = ...) -> int: ...
    def maintain(self, now: float | None = ...) -> None: ...


@runtime_checkable
class ConnectedTier(Protocol):
    """``capabilities.connection``: a client of a remote store that says whether it reaches it."""

    @property
    def connected(self) -> bool: ...


def peekable(tier: Tier) -> TypeGuard[PeekableTier]:
    """Whether ``tier`` declares ``peek`` (narrows its type to :class:`PeekableTier`)."""
    return tier.capabilities.peek


def indexed(tier: Tier) -> TypeGuard[IndexedTier]:
    """Whether ``tier`` declares ``records`` (narrows its type to :class:`IndexedTier`)."""
    return tier.capabilities.records


def shrinkable(tier: Tier) -> TypeGuard[ShrinkableTier]:
    """Whether ``tier`` declares ``shrink`` (narrows its type to :class:`ShrinkableTier`)."""
    return tier.capabilities.shrink


def connectable(tier: Tier) -> TypeGuard[ConnectedTier]:
    """Whether ``tier`` declares ``connection`` (narrows its type to :class:`ConnectedTier`)."""
    return tier.capabilities.connection
