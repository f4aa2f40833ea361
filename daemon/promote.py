"""Promotion ahead of demand: copy a hinted session's blocks back into the top persistent tier.

For each hint (namespace, keys in prefix order) the daemon asks the top persistent tier (NVMe)
which layer-blocks it lacks, among the layers the per-layer policies let it hold; finds them in
the tiers below (the shared ``fs`` tier), reads them (checksums verified) and writes them to
NVMe, where every inference process of the node finds them on its next lookup (DRAM is private
to each process). The copies below stay: promotion copies, it never moves. Room is made first
by demoting other, older blocks (hinted keys are protected from demotion for ``hint_ttl_s``);
at most ``max_promote_bytes`` are promoted per hint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstrata.errors import TierError
from kvstrata.tiers import BlockId, ReadStatus, Tier

from .hints import Hint
from .metrics import DaemonMetrics
from .namespaces import ManagedNamespace, TierPlan

log = logging.getLogger("kvstrata.daemon.promote")

MakeRoom = Callable[[ManagedNamespace, TierPlan, int], None]


@dataclass
class PromoteResult:
    wanted: int = 0  # layer-blocks the fast tier lacked
    promoted: int = 0
    promoted_bytes: int = 0
    absent: int = 0  # in no tier below either
    failed: int = 0
    seconds: float = 0.0
    keys: set[bytes] = field(default_factory=set)  # keys with a layer-block written into the top tier
    incomplete: set[bytes] = field(default_factory=set)  # keys with a layer-block that failed to arrive

    @property
    def outcome(self) -> str:
        if self.promoted:
            return "promoted"
        return "present" if not self.wanted else "absent"


class Promoter:
    def __init__(self, metrics: DaemonMetrics, max_bytes: int) -> None:
        self.metrics = metrics
        self.max_bytes = max_bytes

    def promote(self, ns: ManagedNamespace, hint: Hint, make_room: MakeRoom | None) -> PromoteResult:
        res = PromoteResult()
        if not ns.chain:
            return res
        top = ns.chain[0]
        dst = ns.tier(top, create=True)
        if dst is None:
            return res
        layers = [layer for layer in range(ns.layout.num_layers) if ns.mask(top) >> layer & 1]
        ids: list[BlockId] = [(key, layer) for key in hint.keys for layer in layers]  # type: ignore[misc]
        try:
            here = dst.contains(ids) or [False] * len(ids)
        except TierError:
            return res
        want = [bid for bid, h in zip(ids, here, strict=True) if not h]
        res.wanted = len(want)
        for plan in ns.chain[1:]:
            if not want:
                break
            src = ns.tier(plan)
            if src is None:
                continue
            want = self._from(ns, top, dst, plan, src, want, res, make_room)
        res.absent = len(want)
        res.keys -= {bytes(bid[0]) for bid in want} | res.incomplete  # whole in the top tier now
        res.seconds = max(0.0, time.time() - hint.at)
        return res

    def _from(
        self,
        ns: ManagedNamespace,
        top: TierPlan,
        dst: Tier,
        plan: TierPlan,
        src: Tier,
        want: list[BlockId],
        res: PromoteResult,
        make_room: MakeRoom | None,
    ) -> list[BlockId]:
        """Copy what ``src`` holds of ``want`` into ``dst``; returns what is still wanted."""
        try:
            have = src.contains(want) or [False] * len(want)
        except TierError:
            return want
        take: list[BlockId] = []
        rest: list[BlockId] = []
        total = res.promoted_bytes
        for bid, h in zip(want, have, strict=True):
            size = ns.layout.layer_nbytes(bid[1])
            if h and total + size <= self.max_bytes:
                take.append(bid)
                total += size
            else:
                rest.append(bid)
        if not take:
            return want
        sizes = [ns.layout.layer_nbytes(bid[1]) for bid in take]
        if make_room is not None and dst.used_bytes + sum(sizes) > top.high:
            make_room(ns, top, sum(sizes))
        while take and not dst.has_room(sizes, 0):  # promote the prefix that fits
            rest.append(take.pop())
            sizes.pop()
        bufs = [np.empty(n, dtype=np.uint8) for n in sizes]
        try:
            statuses = src.read(list(zip(take, bufs, strict=True)))
        except TierError:
            statuses = [ReadStatus.ERROR] * len(take)
        good = [(bid, buf) for bid, buf, s in zip(take, bufs, statuses, strict=True) if s is ReadStatus.OK]
        rest += [bid for bid, s in zip(take, statuses, strict=True) if s is not ReadStatus.OK]
        try:
            written = dst.write(good) if good else []
        except TierError as exc:
            log.warning("promotion into tier %s failed: %s", top.name, exc)
            written = [False] * len(good)
        for (bid, buf), ok in zip(good, written, strict=True):
            if ok:
                res.keys.add(bytes(bid[0]))
                res.promoted += 1
                res.promoted_bytes += buf.nbytes
            else:
                res.incomplete.add(bytes(bid[0]))
                res.failed += 1
        done = sum(1 for ok in written if ok)
        self.metrics.promoted_blocks.labels(top.name, plan.name).inc(done)
        self.metrics.promoted_bytes.labels(top.name, plan.name).inc(
            sum(buf.nbytes for (_, buf), ok in zip(good, written, strict=True) if ok)
        )
        return rest
