"""Staging slabs: one buffer registered with the Mooncake client, lent out a slab per transfer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvstrata.tiers.mooncake.options import SLABS
from kvstrata.tiers.records import ALIGN, align_up


class Unavailable(Exception):
    """The pool cannot be used now (down, backing off, timed out): answer with misses."""


@dataclass(eq=False)
class Slab:
    owner: Staging
    offset: int
    size: int
    lent: bool = False  # handed to a client call that outlived its deadline: it gives the slab back

    @property
    def ptr(self) -> int:
        return self.owner.ptr + self.offset

    def view(self, at: int, n: int) -> np.ndarray:
        return self.owner.arena[self.offset + at : self.offset + at + n]


class Staging:
    """One arena (registered with every client) cut into equal slabs; a transfer borrows one."""

    def __init__(self, total: int, slab_size: int) -> None:
        self.slab_size = align_up(slab_size, ALIGN)
        count = max(1, min(SLABS, total // self.slab_size))
        self.arena = np.empty(count * self.slab_size, dtype=np.uint8)
        self.count = count
        self._free = [Slab(self, i * self.slab_size, self.slab_size) for i in range(count)]
        self._cond = threading.Condition()

    @property
    def ptr(self) -> int:
        return int(self.arena.ctypes.data)

    def borrow(self, timeout: float) -> Slab | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                return None
            slab = self._free.pop()
            slab.lent = False
            return slab

    def give_back(self, slab: Slab) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every slab is back (calls past their deadline return them when they end)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == self.count, timeout)

    @contextlib.contextmanager
    def slab(self, timeout: float) -> Iterator[Slab]:
        slab = self.borrow(timeout)
        if slab is None:
            raise Unavailable(f"no staging buffer free within {timeout}s")
        try:
            yield slab
        finally:
            if not slab.lent:  # a call past its deadline gives it back when it ends
                self.give_back(slab)
