"""Storage tiers, registered by name.

============  ==================================================================
name          what it is
============  ==================================================================
``hbm``       device-memory block pool (CUDA when present, host stand-in otherwise)
``dram``      host-memory pool with its own allocator (pinned when CUDA is present)
``nvme``      local directory of large segment files with an LMDB index
``mooncake``  cluster-wide DRAM pool on Mooncake Store (shared between hosts)
``fs``        objects on a shared filesystem or object store (fsspec: file://, s3://)
============  ==================================================================

Third-party tiers register through the ``kvstrata.tier`` entry-point group.
"""

from __future__ import annotations

from kvstrata.registry import Registry
from kvstrata.tiers.base import (
    BlockId,
    ConnectedTier,
    IdBatch,
    IndexedTier,
    KeyGroup,
    PeekableTier,
    ReadStatus,
    ShrinkableTier,
    SpanBatch,
    SpanGroup,
    Tier,
    TierCapabilities,
    TierContext,
    TierOptions,
    VerifyReport,
    connectable,
    indexed,
    peekable,
    shrinkable,
)
from kvstrata.tiers.wrappers import LatencyTier

TIERS: Registry[Tier] = Registry("tier")
TIERS.register("hbm", "kvstrata.tiers.memory:HBMTier")
TIERS.register("dram", "kvstrata.tiers.memory:DRAMTier")
TIERS.register("nvme", "kvstrata.tiers.nvme:NVMeTier")
TIERS.register("mooncake", "kvstrata.tiers.mooncake:MooncakeTier", install_hint="pip install 'kvstrata[mooncake]'")
TIERS.register("fs", "kvstrata.tiers.fs:FSTier")

__all__ = [
    "TIERS",
    "BlockId",
    "ConnectedTier",
    "IdBatch",
    "IndexedTier",
    "KeyGroup",
    "LatencyTier",
    "PeekableTier",
    "ReadStatus",
    "ShrinkableTier",
    "SpanBatch",
    "SpanGroup",
    "Tier",
    "TierCapabilities",
    "TierContext",
    "TierOptions",
    "VerifyReport",
    "connectable",
    "indexed",
    "peekable",
    "shrinkable",
]
