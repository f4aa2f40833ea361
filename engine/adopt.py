"""Adoption: blocks that other processes wrote into tiers they share with this engine.

A tier shared with other processes (a directory on disk, a cluster pool) may hold blocks this
engine never wrote. On a miss the engine asks those tiers directly, 1, 4, 16, ... keys at a time
(a cold prompt costs one small probe), and takes what they hold into its index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstrata.core.keys import Key
from kvstrata.core.masks import layers_of
from kvstrata.engine.state import EngineState

log = logging.getLogger("kvstrata.engine")

__all__ = ["Adopter"]

MAX_PROBE_STEP = 256


class Adopter:
    """Probes the shared tiers of an :class:`EngineState` and records what they hold."""

    def __init__(self, state: EngineState) -> None:
        self.s = state
        self.tier_masks: list[int] | None = None  # per tier, the layers it may hold (per-layer placement)

    def adopt(self, keys: Sequence[Key], mask: int, adopt: bool = True) -> list[int]:
        """Tier position serving each key of the longest prefix of ``keys`` the shared tiers hold
        ``mask`` of; with ``adopt``, recorded in the index."""
        layers = list(layers_of(mask))
        served: list[int] = []
        start, step = 0, 1
        while start < len(keys):
            chunk = keys[start : start + step]
            found = self._probe(chunk, layers, adopt)
            served += found
            if len(found) < len(chunk):
                break
            start, step = start + step, min(step * 4, MAX_PROBE_STEP)
        return served

    def _probe(self, keys: Sequence[Key], layers: list[int], adopt: bool) -> list[int]:
        s = self.s
        ids = [(key, layer) for key in keys for layer in layers]
        present = [False] * len(keys)
        where = [0] * len(keys)
        for idx in reversed(s.shared):  # the fastest holder wins
            try:
                got = idx.tier.contains(ids)
            except Exception as exc:
                log.warning("tier %s: contains() failed: %s", idx.name, exc)
                continue
            if got is None:
                continue
            per = len(layers)
            for i in range(len(keys)):
                if all(got[i * per : (i + 1) * per]):
                    present[i], where[i] = True, idx.position
        n = present.index(False) if False in present else len(keys)
        if not adopt:
            return where[:n]
        want = sum(1 << layer for layer in layers)
        with s.lock:
            for key, pos in zip(keys[:n], where[:n], strict=True):
                idx = s.tiers[pos]
                e = idx.entries.get(key)
                missing = want & ~(e.layers if e else 0)
                if missing and key not in idx.evicting:
                    s.record(idx, key, missing, None)
        return where[:n]

    def adopt_restore(self, keys: Sequence[Key], start: int, prefix: int) -> None:
        """Adopt what shared tiers hold of ``keys[start:]`` (the layers each tier may hold), until a
        key lacks a layer of ``prefix`` (full attention) there."""
        s = self.s
        masks = self.tier_masks or [s.all_mask] * len(s.tiers)
        step = 1
        while start < len(keys):
            chunk = keys[start : start + step]
            found = [0] * len(chunk)
            for idx in reversed(s.shared):
                layers = layers_of(masks[idx.position])
                ids = [(key, layer) for key in chunk for layer in layers]
                try:
                    got = idx.tier.contains(ids) if ids else None
                except Exception as exc:
                    log.warning("tier %s: contains() failed: %s", idx.name, exc)
                    continue
                if got is None:
                    continue
                for i, key in enumerate(chunk):
                    have = sum(1 << layer for layer, ok in zip(layers, got[i * len(layers) :], strict=False) if ok)
                    with s.lock:
                        e = idx.entries.get(key)
                        missing = have & ~(e.layers if e is not None else 0)
                        if missing and key not in idx.evicting:
                            idx.add(key, missing, s.mask_bytes(missing), None)
                    found[i] |= have
            if any(f & prefix != prefix for f in found):
                return
            start, step = start + step, min(step * 4, MAX_PROBE_STEP)
