"""Chain bookkeeping under per-layer policies: which block follows which, snapshot positions, branch points.

A block whose full-attention layers no tier holds any more breaks its chain: every later block
(and state snapshot) of that chain is useless until it is stored again, so they become the first
victims of their tiers (:meth:`Chains.after_drop`). Pure Python; keys may be any hashable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, Protocol, TypeVar

__all__ = ["MAX_COLD_WALK", "MAX_WANTED", "Chains"]

#: Branch points remembered for restore points (keys after which a restore would have paid).
MAX_WANTED = 65536
#: Most descendants one broken chain marks as cold at once.
MAX_COLD_WALK = 100_000

K = TypeVar("K", bound=Hashable)


class _Part(Protocol[K]):  # type: ignore[misc]
    @property
    def layers(self) -> int: ...
    @property
    def parent(self) -> K | None: ...


class Chains(Generic[K]):
    """Children of each block, the block count each state snapshot restores, and branch points."""

    def __init__(self, prefix_mask: int) -> None:
        self.prefix = prefix_mask  # layers every block of a restore needs (full attention, MLA)
        self.children: dict[K, set[K]] = {}
        self.snap_pos: dict[K, int] = {}  # key -> block count its state snapshot restores
        self.wanted: OrderedDict[K, None] = OrderedDict()  # branch points: restore points that would pay

    def note(self, key: K, parent: K | None, snap: int, position: int) -> None:
        """A block was committed: remember its chain link and (``snap``: it has a snapshot) its value."""
        if parent is not None:
            kids = self.children.get(parent)
            if kids is None:
                kids = self.children[parent] = set()
            kids.add(key)
        if snap:
            self.snap_pos[key] = max(position, self.snap_pos.get(key, 0))

    def position(self, key: K) -> int:
        return self.snap_pos.get(key, 0)

    def want(self, key: K) -> None:
        """A lookup's full-attention blocks reached past its restorable prefix, to ``key``: a
        restore point there would pay."""
        self.wanted[key] = None
        if len(self.wanted) > MAX_WANTED:
            self.wanted.popitem(last=False)

    def after_drop(
        self, dropped: Iterable[tuple[K, _Part[K]]], held: Callable[[K], int], cold: Callable[[K], None]
    ) -> None:
        """Parts of blocks left their tiers: forget blocks no tier holds (``held``: layers some tier
        still holds), and mark the descendants of broken chains ``cold``."""
        prefix = self.prefix
        for key, part in dropped:
            have = held(key)
            if not have:
                self.snap_pos.pop(key, None)
                parent = part.parent
                siblings = self.children.get(parent) if parent is not None else None
                if parent is not None and siblings is not None:
                    siblings.discard(key)
                    if not siblings:
                        del self.children[parent]
            if part.layers & prefix and have & prefix != prefix:
                self.cool_descendants(key, cold)
            if not have:
                self.children.pop(key, None)

    def cool_descendants(self, key: K, cold: Callable[[K], None]) -> None:
        stack = list(self.children.get(key, ()))
        seen: set[K] = set()
        while stack and len(seen) < MAX_COLD_WALK:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            cold(k)
            stack.extend(self.children.get(k, ()))
