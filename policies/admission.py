"""Admission policies: may a block enter a tier at all?"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from kvstrata.core.native import untracked

K = TypeVar("K", bound=Hashable)


class AdmissionPolicy(ABC, Generic[K]):
    """Decides per key (of type ``K``: the engine's ``bytes`` keys, the planner's ``int`` ones)."""

    @abstractmethod
    def admit(self, key: K) -> bool:
        """Called each time ``key`` is offered to the tier (store, write-through or demotion)."""


class AdmitAll(AdmissionPolicy[K]):
    """Admit every block."""

    def admit(self, key: K) -> bool:
        return True


class SecondTouch(AdmissionPolicy[K]):
    """Admit a block the second time it is offered; the first offer is remembered.

    Protects NVMe endurance from one-off prefixes. The ghost set is bounded
    (``ghost_entries``, oldest forgotten first), so memory stays constant.
    """

    def __init__(self, ghost_entries: int = 1_000_000) -> None:
        self._seen: OrderedDict[K, None] = untracked(OrderedDict())  # (bytes or int keys)
        self._limit = ghost_entries

    def admit(self, key: K) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        return False
