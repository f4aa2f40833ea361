"""Eviction policies: they order victims, nothing more.

The tier index calls ``insert``/``access``/``remove`` and iterates ``victims()``
skipping pinned entries itself.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from kvstrata.core.native import untracked


class PolicyKey(Protocol):
    """What an eviction policy needs of a key: hashable (dict and set membership) and ordered
    (:class:`PrefixAwarePolicy` breaks ties between equally old parents by key).

    The engine's keys are :data:`kvstrata.core.keys.Key` (``bytes``); the planner's simulators
    feed the same policy classes ``int`` keys.
    """

    def __hash__(self) -> int: ...

    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=PolicyKey)


class EvictionPolicy(ABC, Generic[K]):
    """Orders the keys (of type ``K``) of one tier for eviction."""

    @abstractmethod
    def insert(self, key: K, parent: K | None) -> None:
        """A key entered the tier (``parent``: the previous block of its chain, if known)."""

    @abstractmethod
    def access(self, key: K) -> None:
        """A key was read or stored again."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """A key left the tier."""

    @abstractmethod
    def victims(self) -> Iterator[K]:
        """Keys in eviction order (best victim first). Must tolerate no mutation while iterating."""

    def cold(self, key: K) -> None:  # optional hook, a no-op by default (not abstract)
        """``key`` became useless (its chain is broken): make it an early victim."""

    def __len__(self) -> int:  # pragma: no cover - overridden
        return 0


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = untracked(OrderedDict())  # (bytes or int keys)

    def insert(self, key: K, parent: K | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def cold(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def victims(self) -> Iterator[K]:
        return iter(self._order)  # callers do not mutate while iterating (engine lock held)

    def __len__(self) -> int:
        return len(self._order)


class PrefixAwarePolicy(EvictionPolicy[K]):
    """LRU among chain tails, so a parent never leaves before its children.

    A cached block is useful only if all its predecessors are cached too. Keys with
    no cached child (tails) are kept in one LRU list, keys with children in another.
    Victims are tails, oldest first; once every child of a key has been offered, the
    key itself becomes a candidate, ordered by its own last use. So a multi-block
    eviction eats cold chains from their ends. When the last child of a key leaves,
    the key becomes a tail at the cold end: the chain behind it was just found cold.
    """

    def __init__(self) -> None:
        self._tails: OrderedDict[K, None] = untracked(OrderedDict())  # (bytes or int keys)
        self._inner: OrderedDict[K, None] = untracked(OrderedDict())
        self._parent: dict[K, K] = {}
        self._children: dict[K, int] = {}
        self._tick: dict[K, int] = {}
        self._clock = itertools.count()

    def insert(self, key: K, parent: K | None) -> None:
        if key in self._tails or key in self._inner:
            self.access(key)
            return
        self._tick[key] = next(self._clock)
        if self._children.get(key, 0) > 0:
            self._inner[key] = None
        else:
            self._tails[key] = None
        if parent is not None:
            self._parent[key] = parent
            self._children[parent] = self._children.get(parent, 0) + 1
            if parent in self._tails:
                del self._tails[parent]
                self._inner[parent] = None

    def access(self, key: K) -> None:
        if key in self._tails:
            self._tails.move_to_end(key)
        elif key in self._inner:
            self._inner.move_to_end(key)
        else:
            return
        self._tick[key] = next(self._clock)

    def remove(self, key: K) -> None:
        if self._tails.pop(key, 0) == 0:
            self._inner.pop(key, None)
        self._tick.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        n = self._children.get(parent, 0) - 1
        if n > 0:
            self._children[parent] = n
            return
        self._children.pop(parent, None)
        if parent in self._inner:
            del self._inner[parent]
            self._tails[parent] = None
            self._tails.move_to_end(parent, last=False)

    def cold(self, key: K) -> None:
        """A tail goes to the cold end of the tails; an inner key gets the oldest use, so it is
        offered as soon as its children have been."""
        if key in self._tails:
            self._tails.move_to_end(key, last=False)
        elif key in self._inner:
            self._inner.move_to_end(key, last=False)
        else:
            return
        self._tick[key] = -1

    def victims(self) -> Iterator[K]:
        """Lazy: an eviction that needs a few blocks looks at a few keys, not the whole tier."""
        offered: dict[K, int] = {}
        seen: set[K] = set()
        freed: list[tuple[int, K]] = []  # heap of parents whose children were all offered
        tails = iter(self._tails)
        nxt = next(tails, None)
        while nxt is not None or freed:
            if freed and (nxt is None or freed[0][0] < self._tick.get(nxt, 0)):
                key = heapq.heappop(freed)[1]
            elif nxt is not None:
                key, nxt = nxt, next(tails, None)
            else:  # pragma: no cover - the loop condition rules this out
                break
            if key in seen:
                continue
            seen.add(key)
            yield key
            parent = self._parent.get(key)
            if parent is not None and parent in self._inner:
                offered[parent] = offered.get(parent, 0) + 1
                if offered[parent] >= self._children.get(parent, 0):
                    heapq.heappush(freed, (self._tick.get(parent, 0), parent))
        for key in self._inner:
            if key not in seen:
                yield key

    def __len__(self) -> int:
        return len(self._tails) + len(self._inner)
