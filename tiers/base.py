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

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from kvstrata.core.buffers import Buffer
from kvstrata.core.keys import Key, Namespace
from kvstrata.core.layout import KVLayout

BlockId = tuple[Key, int]  # (key, layer)


class ReadStatus(Enum):
    OK = "ok"
    MISSING = "missing"  # not (or no longer) in the tier
    CORRUPT = "corrupt"  # checksum mismatch: never hand these bytes to a model
    ERROR = "error"  # I/O fault


@dataclass(frozen=True)
class TierCapabilities:
    """What the engine may assume about a tier (plan from these, not from isinstance)."""

    persistent: bool = False  # survives a process restart
    shared: bool = False  # visible to other hosts
    gpu_direct: bool = False  # can move bytes to/from device memory without a host bounce
    device_memory: bool = False  # the tier's own storage is accelerator memory
    checksums: bool = False  # verifies a checksum on every read
    alignment: int = 1  # preferred buffer alignment in bytes
    peek: bool = False  # zero-copy view of stored bytes


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
    repaired: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_checksums == 0 and self.missing_data == 0

    def to_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "ok": self.ok,
            "blocks_checked": self.blocks_checked,
            "bad_checksums": self.bad_checksums,
            "missing_data": self.missing_data,
            "orphan_bytes": self.orphan_bytes,
            "repaired": self.repaired,
            "problems": self.problems[:100],
        }


class Tier(ABC):
    """Base class of all tiers. Subclasses register themselves in ``kvstrata.tiers.TIERS``."""

    capabilities: ClassVar[TierCapabilities] = TierCapabilities()
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
        return live_bytes + sum(sizes) <= self.capacity

    # -- persistence ---------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[BlockId, int]]:
        """Blocks already present when the tier opens (persistent tiers), with their sizes."""
        return iter(())

    def verify(self, repair: bool = False) -> VerifyReport:
        """Check checksums and index/data consistency (persistent tiers)."""
        return VerifyReport(tier=self.name)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; idempotent."""
