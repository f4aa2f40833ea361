"""Shields: hinted keys the watermarks must not demote yet.

A hint shields its keys for ``hint_ttl_s`` from the earlier of its time and the moment the
daemon reads it (a hint dated in the future gets no longer). At most ``max_protected_keys``
keys are shielded at once (about 220 bytes of memory each); past that the oldest shields go
first, counted in ``kvstrata_daemon_protection_evicted_total`` and warned about at most once a
minute. Used by the main loop only (no lock).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from .metrics import DaemonMetrics

log = logging.getLogger("kvstrata.daemon")

PRUNE_EVERY_S = 10.0
WARN_EVERY_S = 60.0


class Shields:
    def __init__(self, metrics: DaemonMetrics, max_keys: int) -> None:
        self.metrics = metrics
        self.max_keys = max_keys
        # (namespace, key) -> shielded until (wall clock), oldest first
        self._until: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._pruned_at = 0.0
        self._warned_at = -WARN_EVERY_S

    def __len__(self) -> int:
        return len(self._until)

    def until(self, fingerprint: str, key: bytes) -> float:
        return self._until.get((fingerprint, key), 0.0)

    def protects(self, fingerprint: str, key: bytes) -> bool:
        return self.until(fingerprint, key) > time.time()

    def protect(self, fingerprint: str, keys: Sequence[bytes], until: float) -> None:
        shields = self._until
        for key in keys:
            entry = (fingerprint, key)
            if entry in shields:
                shields.move_to_end(entry)
            shields[entry] = until
        over = len(shields) - self.max_keys
        if over > 0:
            for _ in range(over):
                shields.popitem(last=False)
            self.metrics.protection_evicted.inc(over)
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "more than max_protected_keys = %d hinted keys: the oldest shields from demotion were "
                    "dropped early (warned at most once a minute)",
                    self.max_keys,
                    extra={"event": "protection_evicted", "dropped": over},
                )
        self.metrics.protected_keys.set(len(shields))

    def expire(self) -> None:
        """Forget shields that have run out (at most every ``PRUNE_EVERY_S``)."""
        now = time.time()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        self._until = OrderedDict((k, until) for k, until in self._until.items() if until > now)
        self.metrics.protected_keys.set(len(self._until))
