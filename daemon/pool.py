"""The node's Mooncake pool segment, held by the daemon: with a ``mooncake`` tier configured (and
``hold_pool_segment``), the daemon opens it and keeps it open, so objects in its segment outlive
the inference processes that come and go."""

from __future__ import annotations

import logging

from kvstrata.config import KVStrataConfig, resolve_auto_capacity
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import uniform_layout
from kvstrata.errors import KVStrataError
from kvstrata.tiers import TIERS, Tier, TierContext

from .metrics import DaemonMetrics

log = logging.getLogger("kvstrata.daemon")


def hold_pool_segments(config: KVStrataConfig, metrics: DaemonMetrics) -> list[Tier]:
    """Open every ``mooncake`` tier of ``config`` (one that cannot be opened is logged and counted)."""
    held: list[Tier] = []
    for tc in config.tiers:
        if tc.kind != "mooncake":
            continue
        layout = uniform_layout("kvstrata-daemon", num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
        ns = Namespace(layout.model, layout.layers[0].dtype, layout.fingerprint(), layout.block_size)
        try:
            tier = TIERS.get(tc.kind)(tc.name, resolve_auto_capacity(tc), tc.options, TierContext(layout, ns))
        except (KVStrataError, ImportError, OSError) as exc:
            metrics.errors.labels("pool").inc()
            log.error("cannot hold the pool segment of tier %s: %s", tc.name, exc, extra={"event": "pool_failed"})
            continue
        held.append(tier)
        log.info("holding the pool segment of tier %s", tc.name, extra={"event": "pool", "tier": tc.name})
    return held
