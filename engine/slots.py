"""The engine's tier stack: per tier, the tier object, its config, its block index and counters.

:func:`build_tiers` opens the tiers a config describes (a caller may wrap some of them, e.g. in
:mod:`kvstrata.tiers.wrappers`, and pass the list to :class:`~kvstrata.engine.engine.Engine`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvstrata.config import KVStrataConfig, TierConfig, resolve_auto_capacity
from kvstrata.core.keys import Key
from kvstrata.core.masks import MaskBytes
from kvstrata.engine.index import BlockIndex
from kvstrata.engine.stats import TierCounters
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.tiers import TIERS, LatencyTier, Tier, TierContext

log = logging.getLogger("kvstrata.engine")

__all__ = ["TierSlot", "build_tiers", "close_tiers"]


class TierSlot(BlockIndex[Key]):
    """One tier of the stack: its :class:`BlockIndex`, the tier it indexes and its counters.

    ``tier`` may be replaced at any time (tests wrap it); the engine reads it on every call."""

    def __init__(
        self, position: int, config: TierConfig, tier: Tier, mask_bytes: MaskBytes, snap_mask: int = 0
    ) -> None:
        super().__init__(
            EVICTION.get(config.eviction)(),
            ADMISSION.get(config.admission)(),
            mask_bytes=mask_bytes,
            snap_mask=snap_mask,
        )
        self.position = position
        self.config = config
        self.tier = tier
        self.counters = TierCounters()
        self.space_lock = threading.Lock()  # one writer makes room in this tier at a time

    @property
    def name(self) -> str:
        return self.config.name

    def __repr__(self) -> str:
        return f"TierSlot({self.position}, {self.name!r})"


def build_tiers(config: KVStrataConfig, ctx: TierContext) -> list[Tier]:
    """Open the tiers ``config`` describes, top first (closing those opened when one fails)."""
    tiers: list[Tier] = []
    try:
        for tc in config.tiers:
            tier = TIERS.get(tc.kind)(tc.name, resolve_auto_capacity(tc), tc.options, ctx)
            if tc.read_latency_s or tc.write_latency_s:  # an emulated slower medium (TierConfig)
                tier = LatencyTier(tier, read_s=tc.read_latency_s, write_s=tc.write_latency_s)
            tiers.append(tier)
    except BaseException:
        close_tiers(tiers)
        raise
    return tiers


def close_tiers(tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        try:
            tier.close()
        except Exception:  # pragma: no cover - best effort
            log.exception("closing tier %s failed", tier.name)
