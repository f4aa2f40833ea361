"""The scheduler's view of the persistent tiers: a light prober, not an engine (no vLLM import).

vLLM's scheduler process holds no KV cache; it only answers "how many blocks can every rank
restore?". When a worker does not answer over the lookup socket, the scheduler asks the
persistent tiers itself, which keep an index shared between processes (the NVMe tier's LMDB, the
``fs`` tier's catalog). :class:`TierProber` opens just those tiers, one set per tensor-parallel
rank (each rank has its own namespace), through the public tier API and asks
``Tier.contains`` directly, caching nothing: no engine index (nothing is scanned at start-up),
no I/O threads, no eviction or admission policies. Its answer is the one ``Engine.probe``
gives over the same tiers: 1, 4, 16, ... 256 keys at a time, the fastest holder of every
requested layer of a block serves it, a tier fault counts as a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstrata.config import KVStrataConfig, TierConfig, resolve_auto_capacity
from kvstrata.core.keys import Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import KVStrataError
from kvstrata.tiers import TIERS, Tier, TierContext

log = logging.getLogger("kvstrata.vllm.prober")

MAX_CHUNK = 256  # keys per contains() call once a prefix keeps hitting


def is_persistent(kind: str) -> bool:
    """Whether tiers of ``kind`` survive the process (and so can be read by the scheduler)."""
    try:
        return bool(TIERS.get(kind).capabilities.persistent)
    except KVStrataError:
        return False


def persistent_tiers(config: KVStrataConfig) -> tuple[TierConfig, ...]:
    return tuple(t for t in config.tiers if is_persistent(t.kind))


class TierProber:
    """``probe(rank, keys, layers)``: the tier serving each block of the longest prefix of
    ``keys`` the persistent tiers hold now. ``namespaces[r]`` is rank ``r``'s namespace."""

    def __init__(self, config: KVStrataConfig, layout: KVLayout, namespaces: Sequence[Namespace]) -> None:
        self.tier_configs = persistent_tiers(config)
        self.tier_names = tuple(t.name for t in self.tier_configs)
        self._tiers: list[list[Tier]] = []  # per rank, in config order (0 = fastest)
        try:
            for ns in namespaces:
                self._tiers.append([])
                ctx = TierContext(layout, ns)
                for tc in self.tier_configs:
                    cls = TIERS.get(tc.kind)
                    self._tiers[-1].append(cls(tc.name, resolve_auto_capacity(tc), tc.options, ctx))
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return len(self._tiers)

    def probe(self, rank: int, keys: Sequence[Key], layers: Sequence[int]) -> list[int]:
        """Position (in :attr:`tier_names`) of the tier serving each block of the found prefix."""
        served: list[int] = []
        start, step = 0, 1
        while start < len(keys):
            chunk = keys[start : start + step]
            found = self._probe_chunk(self._tiers[rank], chunk, list(layers))
            served += found
            if len(found) < len(chunk):
                break
            start, step = start + step, min(step * 4, MAX_CHUNK)
        return served

    def _probe_chunk(self, tiers: list[Tier], keys: Sequence[Key], layers: list[int]) -> list[int]:
        ids = [(key, layer) for key in keys for layer in layers]
        present = [False] * len(keys)
        where = [0] * len(keys)
        per = len(layers)
        for pos in reversed(range(len(tiers))):  # the fastest holder wins
            try:
                got = tiers[pos].contains(ids)
            except Exception as exc:  # a tier fault is a miss, never an error for the scheduler
                log.warning("tier %s: contains() failed: %s", tiers[pos].name, exc)
                continue
            if got is None:
                continue
            for i in range(len(keys)):
                if all(got[i * per : (i + 1) * per]):
                    present[i], where[i] = True, pos
        n = present.index(False) if False in present else len(keys)
        return where[:n]

    def close(self) -> None:
        for tiers in self._tiers:
            for tier in tiers:
                try:
                    tier.close()
                except Exception:  # pragma: no cover - best effort
                    log.exception("closing tier %s failed", tier.name)
        self._tiers = []
